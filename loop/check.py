"""Offline check of a run: rebuild every step's samples from the rollout logs alone.

The learner recorded, per step, the groups it trained (by partition, with
their members) and the digest of their samples. Here every rollout
partition is reduced offline with the same reducers and configuration; for
every ``policy_updated`` the digest of the listed groups' samples is
recomputed and compared with the recorded one.
The same pass checks exactly-once consumption: every released group that
the learner reached appears in exactly one record (trained or skipped), and
none appears twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from agentlog.events.log.partitions import partition_name
from agentlog.events.schema.types import GroupRef, MemberRef, PolicyUpdated
from agentlog.reducers.groups import ABORTED
from agentlog.reducers.partitioned import ReleasedGroup, rebuild_batches, reduce_partitions
from agentlog.reducers.samples import SampleDigest

from .run_folder import Run
from .config import LoopConfig
from .learner_records import read_learner_records, record_frontier, step_digest


@dataclass
class RunCheck:
    """The outcome of :func:`check_run`."""

    steps: int = 0
    digests_equal: int = 0
    mismatches: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    groups_released: int = 0
    groups_consumed: int = 0
    sample_digest: str = ""

    @property
    def ok(self) -> bool:
        """Every digest equal, every reached group consumed exactly once."""
        return not (self.mismatches or self.duplicates or self.missing or self.unknown)


def check_run(run_dir: Path, cfg: LoopConfig | None = None) -> RunCheck:
    """Compare the learner's online per-step digests with an offline reconstruction.

    Each rollout partition is reduced on its own (a run with one worker has
    one, ``<run>/rollout``); each learner record is then replayed against
    them (:func:`rebuild_batches`): the groups it names, taken from the
    partitions it names, in its order, must hash to the digest it recorded."""
    run_dir = Path(run_dir)
    with Run.open(run_dir, cfg) as run:
        return _check(run, run.config)


def _check(run: Run, cfg: LoopConfig) -> RunCheck:
    sources = run.existing_rollout_logs()
    released = reduce_partitions({pid: src.read() for pid, src in sources.items()}, cfg.reduce_config())
    out = RunCheck(groups_released=sum(len(r) for r in released.values()))
    digest = SampleDigest()
    for pid in sorted(released):
        for r in released[pid].values():
            for sample in r.group.samples:
                digest.update(sample)
    out.sample_digest = digest.hexdigest()
    seen: dict[tuple[int, str], int] = {}
    frontier: dict[int, int] = {}
    for rec in read_learner_records(run.learner):
        if rec.step == 0:
            continue  # the warm-up: no rollout data
        out.steps += 1
        for pid, end in record_frontier(rec).items():
            frontier[pid] = max(frontier.get(pid, 0), end)
        rec = with_batch(rec, released)
        for ref in rec.batch:
            key = (ref.partition, ref.group_id)
            if key in seen:
                out.duplicates.append(f"group {_name(key)} consumed by step {seen[key]} and again by step {rec.step}")
            seen[key] = rec.step
        digest, problems = check_step(rec, released)
        unknown = [p for p in problems if "is not released" in p]
        out.unknown.extend(unknown)
        if unknown:
            continue
        out.mismatches.extend(problems)
        if digest == rec.sample_digest and not problems:
            out.digests_equal += 1
        elif digest != rec.sample_digest:
            out.mismatches.append(f"step {rec.step}: online {rec.sample_digest} != offline {digest}")
    out.groups_consumed = len(seen)
    for pid, groups in released.items():
        for r in groups.values():
            if r.group.lsn_released < frontier.get(pid, 0) and (pid, r.group.group_id) not in seen:
                out.missing.append(f"group {_name((pid, r.group.group_id))} released at lsn {r.group.lsn_released} was never consumed")
    return out


def _name(key: tuple[int, str]) -> str:
    pid, gid = key
    return f"{partition_name(pid)}/{gid}"


def with_batch(rec: PolicyUpdated, released: dict[int, dict[str, ReleasedGroup]]) -> PolicyUpdated:
    """``rec`` with its ``batch`` (the groups it consumed, in order, with their members); a
    record from before partitions names its groups only, and they are the single log's."""
    if rec.batch:
        return rec
    return msgspec.structs.replace(rec, batch=[
        GroupRef(0, gid, [MemberRef(sid, lsn) for sid, lsn in _members(released.get(0, {}).get(gid))], rec.skipped.get(gid, ""))
        for gid in _consumed_order(rec)])


def check_step(rec: PolicyUpdated, released: dict[int, dict[str, ReleasedGroup]]) -> tuple[str, list[str]]:
    """``(offline digest, problems)`` of one learner step: its trained samples rebuilt from
    the released groups and hashed as the learner hashed them (equal to ``rec.sample_digest``
    when the step reconstructs)."""
    rebuilt = next(rebuild_batches([with_batch(rec, released)], released))
    return step_digest(rebuilt.trained), rebuilt.problems


def _consumed_order(rec: PolicyUpdated) -> list[str]:
    """The groups of a record without ``batch``: trained ones in order, then skipped ones."""
    return list(rec.groups) + [g for g in rec.skipped if g not in rec.groups]


def _members(r: ReleasedGroup | None) -> list[tuple[str, int]]:
    return [] if r is None else [(m.session_id, m.terminal_lsn) for m in r.members]


def untrainable_cause(run_dir: Path, cfg: LoopConfig | None = None) -> str:
    """Why a run's last batches trained nothing (the learner stopped it after
    ``max_untrainable_batches`` of them), in one line that names the main reason and
    one session to inspect, e.g. ``every session aborted: verifier_failed:ZeroDivisionError
    (agentlog show RUN b00000-g00-s0)``.

    The reasons come from the rollout log through the reducers, as the learner saw
    them: the groups the learner's trailing untrainable records consumed are
    rebuilt with the run's reduce settings, and their members' abort reasons (or,
    where none aborted, the groups' skip reasons) are counted."""
    run_dir = Path(run_dir)
    with Run.open(run_dir, cfg) as run:
        cfg = run.config
        window: list[PolicyUpdated] = []
        for rec in read_learner_records(run.learner):
            window = [] if rec.step == 0 or rec.groups else window + [rec]
        wanted = {(ref.partition, ref.group_id): rec.skipped.get(ref.group_id, ref.skip_reason) for rec in window for ref in rec.batch}
        sources = run.existing_rollout_logs()
        released = reduce_partitions({pid: src.read() for pid, src in sources.items() if pid in {p for p, _ in wanted}},
                                     cfg.reduce_config())
    groups = [(released[pid][gid].group, why) for (pid, gid), why in sorted(wanted.items())
              if gid in released.get(pid, {})]
    show = f"agentlog show {run_dir}"
    members = [m for g, _ in groups for m in g.members]
    sessions = len(members) + sum(len(g.dropped) for g, _ in groups)
    aborted = Counter(m.reason for m in members if m.status == ABORTED)
    if aborted:
        reason, n = aborted.most_common(1)[0]
        sid = min(m.session_id for m in members if m.status == ABORTED and m.reason == reason)
        head = "every session aborted" if n == sessions else f"{sum(aborted.values())} of {sessions} sessions aborted, {n} of them"
        return f"{head}: {reason} ({show} {sid})"
    skips = Counter(why for _, why in groups)
    if skips:
        why, _ = skips.most_common(1)[0]
        group = next(g for g, w in groups if w == why)
        sids = [m.session_id for m in group.members] + list(group.dropped)
        example = f" ({show} {min(sids)})" if sids else ""
        head = "every group skipped" if len(skips) == 1 else f"{skips[why]} of {len(groups)} groups skipped"
        return f"{head}: {why}{example}"
    return f"no group was trainable in the last {len(window)} batches (their learner records name no group)"
