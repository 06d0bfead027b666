"""Policy publishing: how the learner hands each new policy version to the rollout workers.

The learner publishes a version in two steps, in this order: it saves the
checkpoint (weights, optimiser, schedule, version) atomically under
``<run>/checkpoints/policy-vNNNNN.pt`` (:func:`checkpoint_path`), then
appends a ``policy_updated`` record naming it to its own log
``<run>/learner`` (:func:`publish`). A reader that sees the record can
therefore always load the checkpoint, unless it was pruned since
(:func:`prune_checkpoints` keeps the newest ``keep_checkpoints`` and every
50th); :class:`PolicyFollower` then falls back to the newest one left. On
JetStream the version is also put into the run's object store before the
record names it (:mod:`agentlog.loop.weight_store`), for workers on hosts
that do not see the run folder.

The learner log is also the learner's memory for exactly-once resume (see
:mod:`agentlog.loop.trainer`) and what the offline check and the progress
display read (:func:`~agentlog.loop.learner_records.read_learner_records`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from agentlog.events.fs import write_dir_atomically
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import PolicyUpdated

from agentlog.events.log.source import LogSource, LogTail

if TYPE_CHECKING:
    from .weight_store import WeightStore


#: Session id under which the learner appends its records to the learner log.
LEARNER_STREAM = "learner"

#: Checkpoints of versions that are multiples of this are never pruned.
KEEP_EVERY = 50


def checkpoint_path(checkpoint_dir: Path, version: int) -> Path:
    """Where the checkpoint of policy ``version`` lives."""
    return Path(checkpoint_dir) / f"policy-v{version:05d}.pt"


def hf_checkpoint_dir(checkpoint: str | os.PathLike) -> Path:
    """The HF directory published beside a learner checkpoint
    (``policy-vNNNNN.pt`` -> ``policy-vNNNNN/``) when the policy is an HF model:
    ``config.json``, ``model.safetensors`` and the tokenizer, which
    ``transformers``, vLLM and SGLang load as is."""
    return Path(checkpoint).with_suffix("")


def save_hf_checkpoint(model: torch.nn.Module, checkpoint: str | os.PathLike) -> Path | None:
    """Write ``model`` (an ``HFCausalLM``) as the HF directory of ``checkpoint``
    (:func:`hf_checkpoint_dir`); None for other models. Written atomically
    (:func:`write_dir_atomically`); call it before :func:`publish` names the version."""
    if not hasattr(model, "save_pretrained"):
        return None
    return write_dir_atomically(hf_checkpoint_dir(checkpoint), model.save_pretrained, replace=True)


def publish(learner_log: EventLog, record: PolicyUpdated, weights: "WeightStore | None" = None) -> None:
    """Append ``record`` to the learner log (after its checkpoint was saved). With
    ``weights`` (``Run.weight_store()``: a run on JetStream) the version is first put
    into the object store and the record names the object and its digest; the object
    that falls out of the kept window is deleted once the record is appended."""
    if weights is not None:
        record = weights.publish(record)
    learner_log.append_batch([(LEARNER_STREAM, learner_log.next_seq(LEARNER_STREAM), record)])
    if weights is not None:
        weights.prune(record.policy_version)  # only now: until the append, the newest record names an older object


def prune_checkpoints(checkpoint_dir: Path, newest_version: int, keep: int) -> None:
    """Delete checkpoints ``keep`` or more versions older than ``newest_version``,
    except every :data:`KEEP_EVERY`-th."""
    for p in sorted(Path(checkpoint_dir).glob("policy-v*.pt")):
        v = int(p.stem.split("-v")[1])
        if v <= newest_version - keep and v % KEEP_EVERY != 0:
            p.unlink(missing_ok=True)
            shutil.rmtree(hf_checkpoint_dir(p), ignore_errors=True)


class PolicyFollower:
    """Tracks the learner log: the newest published version and its checkpoint.

    ``learner``: the learner log (a LogSource), or a
    :class:`~agentlog.events.log.source.LogTail` of it (``Run.learner_tail()``)."""

    def __init__(self, learner: "LogSource | LogTail") -> None:
        self.tail = learner if isinstance(learner, LogTail) else learner.tail()
        self.latest: PolicyUpdated | None = None
        self.history: list[PolicyUpdated] = []
        self.final_version: int | None = None
        #: Newest learner step recorded (-1 before any); a step that trained nothing
        #: (every group skipped) is recorded without a new version.
        self.step = -1

    @property
    def next_lsn(self) -> int:
        """The learner log's next LSN this follower has not read."""
        return self.tail.next_lsn

    def poll(self) -> bool:
        """Read whatever the learner appended since the last poll; True if anything new."""
        new = False
        for env in self.tail.poll():
            if isinstance(env.body, PolicyUpdated):
                self.history.append(env.body)
                self.step = max(self.step, env.body.step)
                if self.latest is None or env.body.policy_version >= self.latest.policy_version:
                    self.latest = env.body
                if env.body.metrics.get("loop/final", 0.0) >= 1.0:
                    self.final_version = env.body.policy_version
                new = True
        return new

    @property
    def version(self) -> int:
        """Newest published policy version (-1 before the learner published any)."""
        return -1 if self.latest is None else self.latest.policy_version
