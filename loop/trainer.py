"""The learner process: tails the rollout log, trains on released groups, publishes versions.

It reads the rollout log (``<run>/rollout``) through the incremental
reducers (``follow`` + :class:`reducers.pipeline.Reducer`, the same code as
offline reconstruction) and writes only its own learner log
(``<run>/learner``) and checkpoints (``<run>/checkpoints``).

A step. Released groups are taken in release order; once
``groups_per_step`` have been released the learner cuts a step:

* groups the reducer released as skipped (fewer than ``min_valid`` valid
  members, e.g. all aborted) are recorded with their reason and train nothing;
* groups generated more than ``max_staleness`` versions ago are dropped
  (``staleness_mode = "drop"``, recorded with reason ``stale``) or trained with
  truncated importance sampling against their rollout log-probs
  (``"correct"``, the default; TIS is then on for every group, which leaves
  fresh groups' weights at 1): the staleness policy, :mod:`agentlog.loop.staleness`;
* the rest go to ``Learner.step``; a checkpoint is saved atomically, then a
  ``policy_updated`` record is appended (:mod:`agentlog.loop.publish`) naming the step, the new version, the
  checkpoint, the metrics (``rollout/reward_mean``, ``rollout/solve_rate``,
  staleness, abort counts...), the trained and skipped groups, the digest of
  the samples it trained on (:func:`step_digest`) and the rollout-log LSN
  range the step consumed.

Version 0 is the policy after the supervised warm-up (recorded as step 0;
demo-only, :mod:`agentlog.loop.demo.warmup`; with ``warmup_steps = 0`` it is
the initial model).

Exactly-once. The learner log is the learner's memory. On start it reads its
own log back: the last record names the checkpoint to resume from (weights,
optimiser, schedule, version), and the union of every record's trained and
skipped groups is the set already consumed. It then reduces the rollout log,
skipping consumed groups, so no group is trained twice and none is skipped,
whenever the learner was killed.

Bounded restart. Each record also names the low-water LSN after its step
(``lsn_low_water``: the oldest ``session_opened`` of any member of a group
still pending in the reducer). A restart reads the rollout log from there,
not from 0, and feeds its fresh reducer only the in-flight window
(:class:`agentlog.reducers.pipeline.InFlightWindow`): the groups it then
trains and their sample digests equal those of a restart from 0. Records
without the field (older learner logs) replay from 0.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Mapping

import msgspec
import torch

from agentlog._logging import get_logger
from agentlog.engine.tasks import load_tasks, select_task
from agentlog.events.errors import AgentlogError
from agentlog.events.log.partitions import partition_name
from agentlog.events.log.source import LogSource, follow_sources
from agentlog.events.schema.types import Envelope, PolicyUpdated
from agentlog.learner.learner import Learner
from agentlog.learner.mismatch import warn_past
from agentlog.reducers.groups import Group, reward_mean, row_trains
from agentlog.reducers.partitioned import PartitionFold, ReleasedGroup
from agentlog.reducers.samples import distill_problem

from .config import GroupsConfig, LoopConfig
from .dynamic_sampling import ends_chain, oversampled, zero_spread
from .naming import redraw_of
from .learner_records import STOPPED_UNTRAINABLE, step_digest
from .learner_restart import RecordsNeeded, read_resume_records, resume_point
from .metric_sinks import MetricSinks
from .policy import build_model
from .run_folder import Run
from .publish import checkpoint_path, prune_checkpoints, publish, save_hf_checkpoint
from .staleness import StalenessVerdict, judge_staleness, version_lag_shares

log = get_logger("agentlog.loop.trainer")

def sampling_refusal(group: Group) -> str:
    """Why a released group trains nothing because of how it was sampled, or "".

    When every row of its valid members was removed by the reducers for its
    sampling settings (``sampling_error``: top_p/top_k truncation, mixed
    settings), the group is reported as skipped with the first such reason
    rather than counted as trained."""
    rows = [s for m in group.members if m.valid for s in m.samples]
    if rows and all(s.remove_sample and "sampling_error" in s.metadata for s in rows):
        first = rows[0]
        return f"sampling: session {first.session_id} row {first.row_index}: {first.metadata['sampling_error']}"
    return ""


def decide_group(group: Group, version: int, cfg: LoopConfig, *, distills: bool) -> tuple[str, StalenessVerdict | None]:
    """The learner's decision on one released group in a step taken at policy ``version``:
    why it trains nothing ("" when it trains), and its staleness verdict (None when an
    earlier reason settled it). The one rule, for the online step and for the offline
    counterfactual (:mod:`agentlog.loop.counterfactual`)."""
    leftover = oversampled(group)
    if leftover:
        return leftover, None
    if group.skipped:
        return group.skip_reason or "skipped", None
    refused = sampling_refusal(group) or (distill_refusal(group) if distills else "")
    if refused:
        return refused, None
    if cfg.groups.dynamic_sampling:
        filtered = zero_spread(group, cfg.groups.spread_tolerance)
        if filtered:
            return filtered, None
    verdict = judge_staleness(group, version, cfg.max_staleness, cfg.staleness_mode)
    return verdict.drop_reason, verdict


def _mean_length(groups: list[Group]) -> float:
    """Mean response tokens per member that ended with rows to train (NaN for none)."""
    lengths = [sum(s.response_length for s in m.samples) for g in groups for m in g.members if m.valid]
    return float(sum(lengths) / len(lengths)) if lengths else math.nan


def distill_refusal(group: Group) -> str:
    """Why a released group cannot be distilled, or "" (checked only when the
    learner distills, `LearnerConfig.distills`).

    A group trains whole or not at all: when any trained row of its valid
    members (not removed, with a trained token) has a
    `reducers.samples.distill_problem` (a token no teacher scored, a teacher
    that failed), the group is reported as skipped with the first such reason
    rather than trained partly, or without scores."""
    for m in group.members:
        for s in m.samples:
            if not row_trains(m.valid, s):
                continue
            problem = distill_problem(s)
            if problem:
                return f"distill: {problem}"  # distill_problem names the session and row
    return ""


def step_size(cfg: LoopConfig, lost: Iterable[int] = ()) -> int:
    """How many released groups make a step: ``groups_per_step``, less the
    share of each batch dealt to partitions declared lost (workers deal
    group ``g`` to partition ``g % workers``), so that the live workers' share
    of a batch still completes a step and the pacing by steps goes on."""
    if not cfg.rollout.partitioned:
        return cfg.groups_per_step
    gone = set(lost)
    live = sum(1 for g in range(cfg.groups_per_step) if g % cfg.rollout.workers not in gone)
    return max(1, live)


class StepCutter:
    """Where the learner's steps begin and end: released groups are taken in
    the order they arrive, from whichever partition, and a step is cut once
    ``groups_per_step`` are waiting; with dynamic sampling, once that many
    chains have ended (a filtered group with a redraw left does not count:
    :mod:`agentlog.loop.dynamic_sampling`). Groups already consumed by a recorded
    step (a restart) are passed over. Arrival order across partitions is not
    deterministic; the record of each step names its cut, so the replay never
    depends on it."""

    def __init__(self, fold: PartitionFold, consumed: set[tuple[int, str]], groups_per_step: int,
                 groups: GroupsConfig | None = None) -> None:
        self.fold = fold
        self.consumed = consumed
        self.groups_per_step = groups_per_step
        self.groups = groups or GroupsConfig()
        self.pending: list[ReleasedGroup] = []
        #: (partition, group) -> ts_ns of the terminal event that released it.
        self.released_at: dict[tuple[int, str], int] = {}

    def feed(self, pid: int, env: Envelope) -> list[ReleasedGroup] | None:
        """Fold ``env`` of partition ``pid``; the next step's groups once there are enough."""
        for r in self.fold.feed(pid, env):
            key = (pid, r.group.group_id)
            if key in self.consumed:
                continue
            self.pending.append(r)
            self.released_at[key] = env.ts_ns
        return self.take()

    def take(self) -> list[ReleasedGroup] | None:
        """The next step's groups if enough chains have ended (the step size may have shrunk), else None."""
        if not self.pending or sum(1 for r in self.pending if ends_chain(r.group, self.groups)) < self.groups_per_step:
            return None
        batch, self.pending = self.pending, []
        return batch

    def consumed_batch(self, batch: list[ReleasedGroup]) -> None:
        """The step of ``batch`` is recorded: its groups are consumed for good."""
        for r in batch:
            key = (r.partition, r.group.group_id)
            self.consumed.add(key)
            self.released_at.pop(key, None)


class PartitionWatch:
    """Which partitions have gone silent: a partition that wrote nothing for
    ``lost_after_s`` is declared lost (0 never declares one), except the one
    heard from last: when every worker is silent they may all be waiting on
    the learner, which waits on the lost ones' share. The learner records the
    decision, so a replay never depends on when it was made.

    Silence is what a partition *wrote*, not what the learner has read of it:
    before one is declared, ``durable_end(pid)`` (its log's next durable LSN,
    :meth:`LogSource.next_lsn`) is asked, and a partition whose durable
    records run past what was read is not silent, however long the learner
    took to reach them (a loaded machine, a slow first read)."""

    def __init__(self, lost_after_s: float, partitions: Iterable[int], durable_end: Callable[[int], int]) -> None:
        self.lost_after_s = lost_after_s
        self.durable_end = durable_end
        now = time.monotonic()
        self.last_seen = {pid: now for pid in partitions}
        self._next_check = now + lost_after_s

    @classmethod
    def of_sources(cls, lost_after_s: float, sources: Mapping[int, LogSource]) -> "PartitionWatch":
        """The watch of the partitions ``sources`` (pid -> its log), each asked
        how far it is durable before it is declared lost."""
        return cls(lost_after_s, sources, lambda pid: sources[pid].next_lsn())

    def saw(self, pid: int | None, frontier: dict[int, int]) -> dict[int, str]:
        """Note an event of ``pid`` (None: a heartbeat, nothing new anywhere);
        the partitions now declared lost, with why. ``frontier``: each
        partition's next LSN to read."""
        if self.lost_after_s <= 0:
            return {}
        now = time.monotonic()
        if pid is not None:
            self.last_seen[pid] = now
        if now < self._next_check:
            return {}
        self._next_check = now + min(1.0, self.lost_after_s)
        silent = [p for p, seen in self.last_seen.items() if now - seen >= self.lost_after_s and not self._unread(p, frontier, now)]
        if len(silent) == len(self.last_seen):
            silent.remove(max(silent, key=lambda p: (self.last_seen[p], -p)))
        lost = {}
        for other in silent:
            lost[other] = (f"lost: partition {partition_name(other)} wrote nothing for {now - self.last_seen[other]:.0f} s "
                           f"(lost_after_s {self.lost_after_s:g}) after lsn {frontier.get(other, 0) - 1}")
            del self.last_seen[other]
        return lost

    def _unread(self, pid: int, frontier: dict[int, int], now: float) -> bool:
        """Whether ``pid`` holds durable records past ``frontier`` (then it is
        heard from now). A log that cannot say is taken at its silence, and the
        failure logged: the decision then rests on what was read, as before."""
        try:
            end = self.durable_end(pid)
        except (OSError, TimeoutError, AgentlogError) as exc:
            log.warning("learner.partition_end_unknown", partition=partition_name(pid), error=repr(exc))
            return False
        if end <= frontier.get(pid, 0):
            return False
        self.last_seen[pid] = now
        return True

    def paused(self, seconds: float) -> None:
        """The learner read nothing for ``seconds`` (it trained a step): that
        time is no partition's silence, whose records may sit unread behind it."""
        if self.lost_after_s <= 0 or seconds <= 0:
            return
        for pid in self.last_seen:
            self.last_seen[pid] += seconds
        self._next_check += seconds


class LoopLearner:
    """The learner side of the loop (one process)."""

    def __init__(self, run_dir: Path, cfg: LoopConfig) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        # The user's task modules register their tasks on import, in this process too.
        load_tasks(cfg.task_modules, cfg.task_path)
        self.task = select_task(cfg.task)
        self.model = build_model(cfg, self.task, self.run_dir)
        self.learner = Learner(self.model, cfg.learner_config())
        self.ckpt_dir = Run(self.run_dir, cfg).checkpoints
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.log = log.bind(component="learner")
        self.busy_s = 0.0
        self.t_start = time.perf_counter()
        self.t_rl: float | None = None  # when RL began in this process (time budget)
        self.recent_rewards: list[float] = []
        self.final = False
        #: Partitions declared lost since the last record (written into the next one).
        self.pending_lost: dict[int, str] = {}
        #: Batches in a row, up to the last one, in which no group was trainable.
        self.untrainable_batches = 0

    # -- the loop -------------------------------------------------------------

    async def run(self, *, max_steps: int | None = None) -> int:
        """Train until version ``cfg.steps`` (or ``max_steps`` more steps); returns the final version."""
        cfg = self.cfg
        run = Run.open(self.run_dir, cfg)
        try:
            llog = run.open_learner()
        except BaseException:
            run.close()
            raise
        sinks: MetricSinks | None = None
        try:
            sinks = MetricSinks(self.run_dir, cfg)  # inside the try: the log is closed whatever happens
            history = read_resume_records(llog)
            records = [r for _, r in history]
            consumed, read_from, windows, lost = resume_point(records)
            needed = RecordsNeeded(cfg.stop_window, history)
            for r in records:
                if r.groups:
                    self.recent_rewards.append(r.metrics.get("rollout/reward_mean", math.nan))
                if r.step > 0:
                    self.untrainable_batches = 0 if r.groups else self.untrainable_batches + 1
            if records:
                last = records[-1]
                self.learner.load_checkpoint(last.checkpoint)
                step = last.step + 1
                lsn_next = last.lsn_end + 1
                self.log.info("learner.resumed", step=last.step, policy_version=last.policy_version,
                              checkpoint=last.checkpoint, consumed_groups_read=len(consumed),
                              replay_from_lsn={partition_name(p): lsn for p, lsn in sorted(read_from.items())},
                              lost_partitions=sorted(lost))
            else:
                # Demo-only, imported only here: with warmup_steps 0 it trains nothing.
                from .demo.warmup import supervised_warmup

                metrics = supervised_warmup(self.model, self.task, cfg)
                # The RL optimiser starts fresh after the warm-up.
                self.learner = Learner(self.model, cfg.learner_config())
                path = self.save_checkpoint(0)
                metrics["loop/final"] = 1.0 if cfg.steps == 0 else 0.0
                publish(llog, PolicyUpdated(step=0, policy_version=0, checkpoint=str(path), metrics=metrics), run.weight_store())
                sinks.log(0, metrics)
                self.log.info("learner.warmup_done", **{k.replace("/", "_"): v for k, v in metrics.items()})
                step, lsn_next = 1, 0
            if self.learner.policy_version >= cfg.steps or (records and records[-1].metrics.get("loop/final", 0.0) >= 1.0):
                return self.learner.policy_version
            self.t_rl = time.perf_counter()
            steps_done = 0
            partitions = cfg.rollout.partitions() if cfg.rollout.partitioned else None
            sources = {pid: src for pid, src in run.rollout_logs().items() if pid not in lost}
            fold = PartitionFold(cfg.reduce_config(), sources, windows=windows, start=read_from)
            cutter = StepCutter(fold, consumed, step_size(cfg, lost), cfg.groups)
            watch = PartitionWatch.of_sources(cfg.rollout.lost_after_s, sources)
            idle_s = min(1.0, cfg.rollout.lost_after_s / 4) if cfg.rollout.lost_after_s > 0 else None
            async for pid, env in follow_sources(sources, read_from, poll_s=0.01, idle_s=idle_s):
                if pid is not None and pid not in sources:
                    continue  # declared lost
                # Is a partition silent for too long? Checked as events arrive, and on the
                # follower's heartbeat (pid None) while nothing arrives at all.
                for lost_pid, why in watch.saw(pid, fold.frontier).items():
                    del sources[lost_pid]  # read nothing more from it
                    lost[lost_pid] = why
                    self.pending_lost[lost_pid] = why
                    self.log.error("learner.partition_lost", partition=partition_name(lost_pid), reason=why)
                    # Its share of every batch will never come: a step is what the live workers deliver.
                    cutter.groups_per_step = step_size(cfg, lost)
                batch = cutter.take() if pid is None else cutter.feed(pid, env)
                if batch is None:
                    continue
                t_busy = time.perf_counter()
                legacy_end = fold.frontier[0] - 1 if partitions is None else -1
                record = self.train_step(step, batch, lsn_next if partitions is None else -1, legacy_end, cutter.released_at)
                low_water = fold.low_water()
                record = msgspec.structs.replace(record, frontier=dict(fold.frontier), low_water=low_water,
                                                 lsn_low_water=low_water.get(0, -1) if partitions is None else -1)
                record = msgspec.structs.replace(record, records_from_lsn=needed.note(llog.next_lsn, record, low_water))
                self.pending_lost.clear()
                publish(llog, record, run.weight_store())
                # Older checkpoints go only now that the log names the newest one (the resume point).
                prune_checkpoints(self.ckpt_dir, record.policy_version, cfg.keep_checkpoints)
                sinks.log(record.step, record.metrics)  # after the log: the record is the source of truth
                busy = time.perf_counter() - t_busy
                self.busy_s += busy
                watch.paused(busy)  # training is not waiting: no partition's silence counts it
                self.log.info("learner.policy_updated", step=step, policy_version=record.policy_version,
                              reward_mean=record.metrics.get("rollout/reward_mean"),
                              solve_rate=record.metrics.get("rollout/solve_rate"),
                              frontier={partition_name(p): lsn for p, lsn in sorted(record.frontier.items())},
                              skipped=len(record.skipped))
                cutter.consumed_batch(batch)
                step += 1
                lsn_next = legacy_end + 1
                steps_done += 1
                if self.final or (max_steps is not None and steps_done >= max_steps):
                    break
            return self.learner.policy_version
        finally:
            try:
                if sinks is not None:
                    sinks.close()
            finally:
                try:
                    llog.close()
                finally:
                    run.close()

    def save_checkpoint(self, version: int) -> Path:
        """Save the learner checkpoint of ``version`` (resume) and, for an HF
        policy, its HF directory beside it (what inference servers load)."""
        path = self.learner.save_checkpoint(checkpoint_path(self.ckpt_dir, version))
        save_hf_checkpoint(self.model, path)
        return path

    def stop_reason(self) -> str:
        """Why training ends after this step ("untrainable", "steps", "reward", "time"), or "" to go on."""
        cfg = self.cfg
        if cfg.max_untrainable_batches and self.untrainable_batches >= cfg.max_untrainable_batches:
            return "untrainable"
        if self.learner.policy_version >= cfg.steps:
            return "steps"
        window = self.recent_rewards[-cfg.stop_window:]
        if cfg.stop_reward > 0 and len(window) == cfg.stop_window and not any(math.isnan(r) for r in window):
            if sum(window) / len(window) >= cfg.stop_reward:
                return "reward"
        if cfg.time_budget_s > 0 and self.t_rl is not None and time.perf_counter() - self.t_rl >= cfg.time_budget_s:
            return "time"
        return ""

    def train_step(self, step: int, released: list[ReleasedGroup], lsn_start: int, lsn_end: int,
                   released_at: dict[tuple[int, str], int]) -> PolicyUpdated:
        """Train on one step's released groups (in release order); returns the
        record to append, naming each group by partition and members."""
        cfg = self.cfg
        groups = [r.group for r in released]
        t0 = time.perf_counter()
        version = self.learner.policy_version
        skipped: dict[str, str] = {}
        train: list[Group] = []
        staleness: list[int] = []
        corrected = 0
        for g in groups:
            reason, verdict = decide_group(g, version, cfg, distills=self.learner.config.distills)
            if verdict is not None:
                staleness.append(verdict.staleness)
            if reason:
                skipped[g.group_id] = reason
                continue
            assert verdict is not None  # a group that trains was judged for staleness
            if verdict.stale:
                corrected += 1
            train.append(g)
        members = [m for g in groups for m in g.members]
        valid_rewards = [r for g in train for r in g.valid_rewards]
        solved = [1.0 if r >= 1.0 else 0.0 for r in valid_rewards]
        metrics: dict[str, float] = {
            "rollout/groups_released": float(len(groups)),
            "rollout/groups_trained": float(len(train)),
            "rollout/groups_skipped": float(len(skipped)),
            "rollout/groups_filtered": float(sum(r.startswith("zero spread") for r in skipped.values())),
            "rollout/redraws": float(sum(1 for g in groups if redraw_of(g.group_id) > 0)),
            "rollout/members": float(len(members)),
            "rollout/aborted": float(sum(1 for m in members if m.status == "aborted")),
            "rollout/dropped": float(sum(len(g.dropped) for g in groups)),
            "rollout/staleness_mean": float(sum(staleness) / len(staleness)) if staleness else 0.0,
            "rollout/staleness_max": float(max(staleness)) if staleness else 0.0,
            "rollout/stale_corrected": float(corrected),
        }
        # The share of trained tokens per version lag (per token: a partial rollout's turn spans versions).
        if cfg.groups.oversample:
            # Over-sampling keeps the groups that complete first: shorter episodes. The mean
            # response tokens of a trained member against those of every ended member shows it.
            metrics["rollout/len_trained"] = _mean_length(train)
            metrics["rollout/len_released"] = _mean_length(groups)
            metrics["rollout/groups_oversampled"] = float(sum(1 for g in groups if oversampled(g)))
        if cfg.groups.dynamic_sampling:
            # Chains that ended without a group worth training: what the step is short of.
            metrics["rollout/groups_short"] = float(max(0, sum(1 for g in groups if ends_chain(g, cfg.groups)) - len(train)))
        for lag, share in version_lag_shares(train, version).items():
            metrics[f"rollout/trained_tokens_lag_{lag}"] = share
        checkpoint = str(checkpoint_path(self.ckpt_dir, version))
        if train:
            m = self.learner.step(train)
            metrics.update({k: float(v) for k, v in m.items() if isinstance(v, (int, float))})
            metrics.update(warn_past(metrics, cfg.mismatch_warn_abs_diff, self.log.warning, step=step, backend=cfg.inference.backend))
        else:
            metrics["learner/skipped"] = 1.0
        # Ours, over the groups actually trained (Learner.step's rollout/* count the same members).
        metrics["rollout/reward_mean"] = reward_mean(valid_rewards)
        metrics["rollout/solve_rate"] = float(sum(solved) / len(solved)) if solved else math.nan
        if self.learner.policy_version != version:
            # Pruned only once the record naming it is appended (LoopLearner.run): until then the
            # learner log's newest record names an older checkpoint, the resume point.
            checkpoint = str(self.save_checkpoint(self.learner.policy_version))
        now = time.time_ns()
        lags = sorted((now - released_at[key]) / 1e9 for key in ((r.partition, r.group.group_id) for r in released) if key in released_at)
        if lags:
            metrics["perf/release_to_step_p50_s"] = lags[len(lags) // 2]
            metrics["perf/release_to_step_max_s"] = lags[-1]
        if cfg.rollout.partitioned:
            for r in released:
                key = f"partition/{partition_name(r.partition)}/groups"
                metrics[key] = metrics.get(key, 0.0) + 1.0
        metrics["perf/loop_step_s"] = time.perf_counter() - t0
        elapsed = time.perf_counter() - self.t_start
        metrics["perf/learner_busy_frac"] = min(1.0, (self.busy_s + metrics["perf/loop_step_s"]) / elapsed) if elapsed > 0 else 0.0
        if train:
            self.recent_rewards.append(metrics["rollout/reward_mean"])
        self.untrainable_batches = 0 if train else self.untrainable_batches + 1
        stop = self.stop_reason()
        metrics["loop/final"] = 1.0 if stop else 0.0
        if stop:
            metrics["loop/stopped_by_reward"] = 1.0 if stop == "reward" else 0.0
            metrics["loop/stopped_by_time"] = 1.0 if stop == "time" else 0.0
            metrics[STOPPED_UNTRAINABLE] = 1.0 if stop == "untrainable" else 0.0
            self.final = True
            if stop == "untrainable":
                # The run failed: the loop (run_loop) names the main abort reason from the rollout log.
                self.log.error("learner.nothing_trainable", batches=self.untrainable_batches,
                               skip_reasons=dict(Counter(skipped.values()).most_common(5)))
            self.log.info("learner.final", reason=stop, policy_version=self.learner.policy_version)
        return PolicyUpdated(
            step=step,
            policy_version=self.learner.policy_version,
            checkpoint=checkpoint,
            metrics=metrics,
            sample_digest=step_digest(train),
            lsn_start=lsn_start,
            lsn_end=lsn_end,
            groups=[g.group_id for g in train],
            skipped=skipped,
            batch=[r.ref(skipped.get(r.group.group_id, "")) for r in released],
            lost_partitions=dict(self.pending_lost),
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m agentlog.loop.trainer RUN_DIR``: run the learner for a run folder."""
    p = argparse.ArgumentParser(prog="agentlog-learner", description=main.__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--max-steps", type=int, default=None)
    args = p.parse_args(argv)
    cfg = Run.load_config(args.run_dir)
    from .runlog import configure_process_logging

    configure_process_logging(args.run_dir, "learner")
    torch.set_num_threads(cfg.torch_threads)
    asyncio.run(LoopLearner(args.run_dir, cfg).run(max_steps=args.max_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
