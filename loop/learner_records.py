"""What the learner log records, read without torch: the ``policy_updated``
records of a learner log, the digest of the samples one step trained on, and
the rollout frontier and groups each record names. The learner
(:mod:`.trainer`), the publisher (:mod:`.publish`) and the offline check
(:mod:`.check`, which CLI commands run on a run folder) share them; keeping
them here spares those commands torch's import."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, NamedTuple

from agentlog.events.log.source import LogSource, open_source
from agentlog.events.schema.types import PolicyUpdated
from agentlog.reducers.groups import Group
from agentlog.reducers.samples import SampleDigest

#: The metric of a final learner record that says the run stopped because nothing was
#: trainable for ``max_untrainable_batches`` batches in a row: the run failed.
STOPPED_UNTRAINABLE = "loop/stopped_untrainable"


def read_learner_records(learner: "LogSource | Path") -> list[PolicyUpdated]:
    """Every ``policy_updated`` in a learner log (a LogSource, or a learner log directory), in order."""
    source = learner if isinstance(learner, LogSource) else open_source(learner, check=False, partitioned=False)
    if not source.exists():
        return []
    return [env.body for env in source.read() if isinstance(env.body, PolicyUpdated)]


def step_digest(groups: Iterable[Group]) -> str:
    """``sha256:<hex>`` over the samples of ``groups``, in order (aborted
    placeholders included): what one step trained on. The offline check
    recomputes it from the rollout log."""
    d = SampleDigest()
    for g in groups:
        for s in g.samples:
            d.update(s)
    return d.hexdigest()


def record_frontier(record: PolicyUpdated) -> dict[int, int]:
    """Per partition, the next rollout LSN the learner had not read when it
    cut ``record``'s step; a record written before partitions names only
    the single log (partition 0) through ``lsn_end``."""
    if record.frontier:
        return dict(record.frontier)
    return {0: record.lsn_end + 1} if record.lsn_end >= 0 else {}


def record_consumed(record: PolicyUpdated) -> Iterable[tuple[int, str]]:
    """(partition, group id) of every group ``record``'s step consumed."""
    if record.batch:
        return [(ref.partition, ref.group_id) for ref in record.batch]
    return [(0, gid) for gid in list(record.groups) + list(record.skipped)]


class Mismatch(NamedTuple):
    """The training–inference mismatch over a run's steps (`mismatch_summary`)."""

    abs_diff_max: float
    """The largest |learner - rollout log-prob| of any step."""
    abs_diff_mean: float
    """The mean |learner - rollout log-prob|, over every token the steps measured."""
    tokens: int
    """Trained tokens generated at the learner's version, over all steps."""
    steps: int
    """Steps that measured at least one."""


def mismatch_summary(records: Iterable[PolicyUpdated]) -> Mismatch | None:
    """The mismatch the steps of ``records`` recorded (``stats/train_rollout_*``,
    :mod:`agentlog.learner.mismatch`), or None when none measured any token
    (every step trained stale groups only, or a learner log from before the metric)."""
    top, total, tokens, steps = 0.0, 0.0, 0, 0
    for r in records:
        n = int(r.metrics.get("stats/train_rollout_tokens", 0.0))
        mean, largest = r.metrics.get("stats/train_rollout_logprob_abs_diff"), r.metrics.get("stats/train_rollout_logprob_abs_diff_max")
        if n <= 0 or mean is None or largest is None or not math.isfinite(mean):
            continue
        top, total, tokens, steps = max(top, largest), total + mean * n, tokens + n, steps + 1
    return Mismatch(top, total / tokens, tokens, steps) if tokens else None
