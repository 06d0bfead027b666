"""Counterfactual re-reduction of a recorded run: what the learner would have trained under
other group settings, without re-running anything.

The run's rollout partitions are reduced again with the other configuration's reduce
settings (``min_valid``, train-once, abort classes, untrainable health flags), and every recorded step is replayed with the same groups in the
same order (the batches the learner cut: a policy changes what is trained, not when
rollouts arrived), each group decided again by the learner's own rule
(:func:`agentlog.loop.trainer.decide_group`: the reducer's skip, sampling and
distillation refusals, the staleness bound and mode) at the policy version the step was
taken at. Each group's outcome: trained or not (and why), its trained tokens, its
members' advantages (the learner's estimator, :func:`agentlog.learner.advantages.compute_advantages`)
and the digest of its samples. :func:`diff_outcomes` compares two runs of it, and
``agentlog reconstruct RUN --policy FILE --diff [--json]`` prints the comparison of the
recorded settings against FILE's.

With the run's own settings every trained step's samples hash to the digest the learner
recorded (``steps_equal``), and the diff is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import msgspec
import torch

from agentlog.events.log.partitions import partition_name
from agentlog.events.schema.types import GroupRef
from agentlog.learner.advantages import compute_advantages
from agentlog.reducers.groups import Group
from agentlog.reducers.partitioned import ReleasedGroup, reduce_partitions

from .config import LoopConfig
from .learner_records import read_learner_records, step_digest
from .run_folder import Run
from .trainer import decide_group

#: Decimal places of the advantages compared and printed (float32 arithmetic in the learner).
ADVANTAGE_DIGITS = 6


class GroupOutcome(msgspec.Struct, frozen=True):
    """What a recorded step did with one group under one configuration."""

    step: int
    group: str  # partition/group id
    trained: bool
    reason: str  # why it trains nothing; "" when trained
    valid_members: int
    trained_tokens: int
    advantages: tuple[float, ...]  # per member, in member order (0 for a member out of the baseline)
    digest: str  # the digest of its samples


@dataclass
class Replay:
    """Every recorded step's groups replayed under one configuration."""

    outcomes: dict[str, GroupOutcome] = field(default_factory=dict)
    steps: int = 0
    steps_equal: int = 0  # steps whose trained samples hash to the learner's recorded digest
    missing: list[str] = field(default_factory=list)  # groups a record names that the rollout never released


def released_groups(run_dir: Path, cfg: LoopConfig) -> dict[int, dict[str, ReleasedGroup]]:
    """The run's rollout partitions reduced with ``cfg``'s reduce settings: per partition,
    the released groups by id (what :func:`replay_run` decides on)."""
    with Run.open(Path(run_dir)) as run:
        sources = run.existing_rollout_logs()
        return reduce_partitions({pid: src.read() for pid, src in sources.items()}, cfg.reduce_config())


def replay_run(run_dir: Path, cfg: LoopConfig, released: Mapping[int, Mapping[str, ReleasedGroup]] | None = None) -> Replay:
    """Replay the run at ``run_dir`` under ``cfg`` (see the module docstring). ``released``:
    :func:`released_groups` for ``cfg``'s reduce settings, when the caller has it (two
    configurations that reduce alike share one reduction)."""
    if released is None:
        released = released_groups(run_dir, cfg)
    with Run.open(Path(run_dir)) as run:
        records = read_learner_records(run.learner)
    out = Replay()
    distills = cfg.learner_config().distills
    version = 0
    for rec in records:
        if rec.step == 0:  # the warm-up: no rollout data
            version = rec.policy_version
            continue
        out.steps += 1
        trained: list[Group] = []
        for ref in _refs(rec, released):
            name = f"{partition_name(ref.partition)}/{ref.group_id}"
            found = released.get(ref.partition, {}).get(ref.group_id)
            if found is None:
                out.missing.append(f"step {rec.step}: {name}")
                continue
            outcome = _decide(rec.step, name, found.group, version, cfg, distills)
            out.outcomes[name] = outcome
            if outcome.trained:
                trained.append(found.group)
        out.steps_equal += step_digest(trained) == rec.sample_digest
        version = rec.policy_version
    return out


def _refs(rec: Any, released: Mapping[int, Mapping[str, ReleasedGroup]]) -> Iterator[GroupRef]:
    """The groups a record consumed, in its order (a record from before partitions: the
    single log's, trained ones first, as :func:`agentlog.loop.check.check_run` reads them)."""
    if rec.batch:
        yield from rec.batch
        return
    for gid in list(rec.groups) + [g for g in rec.skipped if g not in rec.groups]:
        r = released.get(0, {}).get(gid)
        members = [] if r is None else list(r.members)
        yield GroupRef(0, gid, members, rec.skipped.get(gid, ""))


def _decide(step: int, name: str, group: Group, version: int, cfg: LoopConfig, distills: bool) -> GroupOutcome:
    reason, _verdict = decide_group(group, version, cfg, distills=distills)
    members = group.members
    rewards = torch.tensor([m.reward if m.valid and m.reward is not None else 0.0 for m in members], dtype=torch.float32)
    valid = torch.tensor([m.valid for m in members], dtype=torch.bool)
    adv = compute_advantages(rewards, torch.zeros(len(members), dtype=torch.long), valid, cfg.learner_config().estimator)
    advantages = tuple(round(float(a), ADVANTAGE_DIGITS) if v else 0.0 for a, v in zip(adv.tolist(), valid.tolist()))
    tokens = sum(int(s.mask.sum()) for m in members if m.valid for s in m.samples if not s.remove_sample)
    return GroupOutcome(step, name, not reason, reason, group.n_valid, tokens if not reason else 0, advantages,
                        step_digest([group]))


class GroupChange(msgspec.Struct, frozen=True):
    """One group whose outcome differs between two configurations."""

    group: str
    step: int
    before: GroupOutcome | None  # None: the group is not in that replay
    after: GroupOutcome | None
    changed: tuple[str, ...]  # which of: trained, reason, trained_tokens, advantages, samples


class Diff(msgspec.Struct, frozen=True):
    """:func:`diff_outcomes`' answer: the counts on each side and every group that changed."""

    groups: int
    trained_before: int
    trained_after: int
    tokens_before: int
    tokens_after: int
    steps: int
    steps_equal_before: int
    steps_equal_after: int
    changes: tuple[GroupChange, ...]


def diff_outcomes(before: Replay, after: Replay) -> Diff:
    """Every group whose outcome differs between ``before`` and ``after``, with the totals."""
    changes = []
    for name in sorted(set(before.outcomes) | set(after.outcomes)):
        a, b = before.outcomes.get(name), after.outcomes.get(name)
        if a is None or b is None:
            step = (a or b).step  # type: ignore[union-attr]
            changes.append(GroupChange(name, step, a, b, ("released",)))
            continue
        what = tuple(k for k, differs in (("trained", a.trained != b.trained), ("reason", a.reason != b.reason),
                                          ("trained_tokens", a.trained_tokens != b.trained_tokens),
                                          ("advantages", a.advantages != b.advantages),
                                          ("samples", a.digest != b.digest)) if differs)
        if what:
            changes.append(GroupChange(name, a.step, a, b, what))
    return Diff(
        groups=len(set(before.outcomes) | set(after.outcomes)),
        trained_before=sum(o.trained for o in before.outcomes.values()),
        trained_after=sum(o.trained for o in after.outcomes.values()),
        tokens_before=sum(o.trained_tokens for o in before.outcomes.values()),
        tokens_after=sum(o.trained_tokens for o in after.outcomes.values()),
        steps=before.steps,
        steps_equal_before=before.steps_equal,
        steps_equal_after=after.steps_equal,
        changes=tuple(changes),
    )


def compare(run_dir: Path, before: LoopConfig, after: LoopConfig) -> Diff:
    """:func:`diff_outcomes` of the run replayed under ``before`` and under ``after``, reducing
    the rollout once when both reduce alike."""
    reduced = released_groups(run_dir, before)
    same = after.reduce_config() == before.reduce_config()
    return diff_outcomes(replay_run(run_dir, before, reduced),
                         replay_run(run_dir, after, reduced if same else None))


def policy_config(run_cfg: LoopConfig, policy: Mapping[str, Any], *, base_dir: Path | None = None) -> LoopConfig:
    """The run's configuration with ``policy``'s settings on top (a policy file's TOML table:
    any LoopConfig field; those that decide what is trained are ``min_valid``,
    ``allow_repeated_targets`` (train-once for shared turns), ``untrainable_flags`` (health flags that make a session
    untrainable), ``max_staleness``, ``staleness_mode``, the learner's ``estimator`` and ``[groups]``: the
    abort classes' outcomes, ``dynamic_sampling`` and ``spread_tolerance``)."""
    values = run_cfg.to_dict()
    for key, value in policy.items():
        if isinstance(value, Mapping) and isinstance(values.get(key), Mapping):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return LoopConfig.from_dict(values, base_dir=base_dir)


def format_diff(diff: Diff, *, limit: int = 50) -> list[str]:
    """The diff as lines for a terminal: the totals, then one line per changed group."""
    lines = [
        f"{diff.groups} groups in {diff.steps} recorded steps: trained {diff.trained_before} -> {diff.trained_after}, "
        f"trained tokens {diff.tokens_before} -> {diff.tokens_after}; steps equal to the online digest: "
        f"{diff.steps_equal_before} -> {diff.steps_equal_after} of {diff.steps}",
        f"{len(diff.changes)} group(s) changed" + (":" if diff.changes else " (the diff is empty)"),
    ]
    for ch in diff.changes[:limit]:
        a, b = ch.before, ch.after
        def state(o: GroupOutcome | None) -> str:
            if o is None:
                return "not released"
            return f"trained ({o.trained_tokens} tokens)" if o.trained else f"dropped ({o.reason})"
        line = f"  step {ch.step} {ch.group}: {state(a)} -> {state(b)}"
        if "advantages" in ch.changed and a is not None and b is not None:
            line += f"; advantages {list(a.advantages)} -> {list(b.advantages)}"
        if "samples" in ch.changed:
            line += "; its samples differ"
        lines.append(line)
    if len(diff.changes) > limit:
        lines.append(f"  ... and {len(diff.changes) - limit} more (--json lists them all)")
    return lines
