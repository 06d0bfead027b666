"""Offline check of a run: rebuild every step's samples from the rollout log alone.

The learner recorded, per step, the groups it trained and the digest of their
samples. Here the whole rollout log is reduced offline with the same
reducers and configuration; for every ``policy_updated`` the digest of the
listed groups' samples is recomputed and compared with the recorded one.
The same pass checks exactly-once consumption: every released group that
the learner reached appears in exactly one record (trained or skipped), and
none appears twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentlog.reducers.pipeline import reduce_log

from . import logs
from .config import LoopConfig
from .publish import read_learner_records
from .trainer import reduce_config, step_digest


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
    """Compare the learner's online per-step digests with an offline reconstruction."""
    run_dir = Path(run_dir)
    cfg = cfg or LoopConfig.load(run_dir / "config.json")
    result = reduce_log(logs.read(run_dir / "rollout", 0), reduce_config(cfg))
    groups = {g.group_id: g for g in result.groups}
    out = RunCheck(groups_released=len(groups), sample_digest=result.digest)
    seen: dict[str, int] = {}
    last_lsn_end = -1
    for rec in read_learner_records(run_dir / "learner"):
        if rec.step == 0:
            continue  # the warm-up: no rollout data
        out.steps += 1
        last_lsn_end = max(last_lsn_end, rec.lsn_end)
        for gid in list(rec.groups) + list(rec.skipped):
            if gid in seen:
                out.duplicates.append(f"group {gid} consumed by step {seen[gid]} and again by step {rec.step}")
            seen[gid] = rec.step
            if gid not in groups:
                out.unknown.append(f"step {rec.step}: group {gid} is not released in the rollout log")
        trained = [groups[g] for g in rec.groups if g in groups]
        if len(trained) != len(rec.groups):
            continue
        digest = step_digest(trained)
        if digest == rec.sample_digest:
            out.digests_equal += 1
        else:
            out.mismatches.append(f"step {rec.step}: online {rec.sample_digest} != offline {digest}")
    out.groups_consumed = len(seen)
    for g in result.groups:
        if g.lsn_released <= last_lsn_end and g.group_id not in seen:
            out.missing.append(f"group {g.group_id} released at lsn {g.lsn_released} was never consumed")
    return out
