"""Run the loop: start the learner and rollout-worker processes, watch, summarise.

The processes are plain ``python -m agentlog.loop.trainer RUN_DIR`` and
``python -m agentlog.loop.worker RUN_DIR``; they share nothing but the run
folder (``config.json``, the two logs, the checkpoints). This module only
starts them, reports progress by reading the learner log (to a :class:`RunProgress`
the caller passes; the CLI draws it), and stops them.

Run folder layout::

    config.json        the LoopConfig both processes read
    rollout/           the rollout log (worker writes, learner reads); with several
                       workers a folder of partitions rollout/pNNNN, one per worker
    learner/           the learner log (learner writes, worker reads)
    checkpoints/       policy-vNNNNN.pt (weights, optimiser, version)
    logs/*.jsonl       structlog JSON of each process; logs/*.stderr their stderr
    sandbox/           LocalSandbox working directories of the workers

With ``[log] backend = "nats"`` there is no ``rollout/`` or ``learner/``: the
logs are the subjects ``<stream>.pNNNN`` and ``<stream>.learner`` of the
run's JetStream stream (:class:`agentlog.loop.run_folder.Run` owns the layout).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from agentlog.events.errors import AgentlogError
from agentlog.events.log.partitions import partition_name
from agentlog.events.log.source import LogTail
from agentlog.events.schema.types import PolicyUpdated, SessionAborted, SessionDropped, SessionFinished, SessionOpened, TurnDelta, TurnRecorded

from .config import LoopConfig
from .learner_records import STOPPED_UNTRAINABLE, mismatch_summary, read_learner_records
from .run_folder import Run
from .run_marker import INCOMPLETE_MARKER, mark_incomplete


class LoopError(AgentlogError, RuntimeError):
    """A loop process failed; the message names it and its stderr file."""


class NothingTrainable(LoopError):
    """The learner stopped the run: ``max_untrainable_batches`` batches in a row had
    nothing to train. The message names the main reason and a session to inspect."""


def new_run_id(seed: int) -> str:
    """``YYYYmmdd-HHMMSS-s<seed>`` (UTC)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-s{seed}"


def process_name(kind: str, *args: str) -> str:
    """The name of a loop process in ``logs/``: ``trainer``, ``worker``, ``worker-partition-3``."""
    return kind if not args else f"{kind}{'-'.join([''] + [a.lstrip('-') for a in args])}"


def start_process(kind: str, run_dir: Path, *args: str) -> subprocess.Popen:
    """Start ``loop.<kind>`` (``trainer`` or ``worker``) for ``run_dir``; stderr goes to ``logs/``."""
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    name = process_name(kind, *args)
    err = open(run_dir / "logs" / f"{name}.stderr", "ab")
    env = dict(os.environ)
    cfg = Run.load_config(run_dir)
    # One BLAS/OpenMP pool per process, sized like torch's: the two processes share the cores.
    env.setdefault("OMP_NUM_THREADS", str(cfg.torch_threads))
    env.setdefault("MKL_NUM_THREADS", str(cfg.torch_threads))
    try:
        return subprocess.Popen(
            [sys.executable, "-m", f"agentlog.loop.{kind}", str(run_dir), *args],
            stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
        )
    finally:
        err.close()


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


class LocalRollouts:
    """The rollout workers of a run as local processes: one, or one per partition.

    The interface every rollout backend offers :func:`run_loop` (the Ray one
    is :class:`agentlog.loop.ray_rollout.RayRollouts`): ``start()``,
    ``poll()`` (None while running, 0 once every worker stopped; raises
    :class:`LoopError` naming the worker that failed) and ``stop()``."""

    def __init__(self, cfg: LoopConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        """Start the worker processes."""
        if not self.cfg.rollout.partitioned:
            self.procs["worker"] = start_process("worker", self.run_dir)
            return
        for pid in self.cfg.rollout.partitions():
            args = ("--partition", str(pid))
            self.procs[process_name("worker", *args)] = start_process("worker", self.run_dir, *args)

    def poll(self) -> int | None:
        """None while a worker runs, 0 once all stopped; LoopError when one failed."""
        for name, proc in self.procs.items():
            rc = proc.poll()
            if rc is not None and rc != 0:
                err = self.run_dir / "logs" / f"{name}.stderr"
                raise LoopError(f"the rollout worker {name} exited with status {rc}; see {err}:\n" + _tail(err))
        return 0 if all(p.poll() == 0 for p in self.procs.values()) else None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every worker to stop by itself; whether they did."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self) -> None:
        """Kill the workers still running."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def rollout_backend(cfg: LoopConfig, run_dir: Path):
    """The rollout workers of ``cfg.rollout.backend``: local processes or Ray actors."""
    if cfg.rollout.backend == "ray":
        from .ray_rollout import RayRollouts  # ray: only when asked for

        return RayRollouts(cfg, run_dir)
    return LocalRollouts(cfg, run_dir)


class PartitionProgress:
    """Per-partition throughput and lag for the progress display: events each
    partition wrote per second since the last look, and how many of them the
    learner has not yet consumed into a step (its frontier in the last record)."""

    def __init__(self, run: Run) -> None:
        self.sources = run.rollout_logs() if run.partitions else {}
        self.last: dict[int, tuple[float, int]] = {}
        self.rate: dict[int, float] = {}

    def line(self, frontier: dict[int, int]) -> str:
        """``p0000 412 ev/s lag 37 | p0001 ...`` ("" for a single log)."""
        now = time.monotonic()
        parts = []
        for pid, source in self.sources.items():
            end = source.next_lsn()
            t, before = self.last.get(pid, (now, end))
            if now - t >= 1.0 or pid not in self.rate:
                self.rate[pid] = (end - before) / (now - t) if now > t else 0.0
                self.last[pid] = (now, end)
            parts.append(f"{partition_name(pid)} {self.rate[pid]:.0f} ev/s lag {max(0, end - frontier.get(pid, 0))}")
        return " | ".join(parts)


class RunProgress(Protocol):
    """What :func:`run_loop` reports its progress to (the CLI draws it as a bar:
    ``agentlog.tools.progress.LoopProgress``); the library itself draws nothing."""

    def policy(self, rec: PolicyUpdated, stats: str) -> None:
        """A new learner record, with a one-line summary of the rollouts so far."""

    def tick(self) -> None:
        """A poll of the loop (about ten a second): redraw what changed."""

    def close(self) -> None:
        """The loop ended (normally or not)."""


@dataclass
class RunResult:
    """What a finished run left behind (read back from its logs)."""

    run_dir: Path
    records: list[PolicyUpdated]
    wall_s: float
    outcomes: Counter = field(default_factory=Counter)
    sessions: int = 0
    turns: int = 0
    tokens: int = 0
    rollout_events: int = 0
    #: The first finished session whose reward was 0 ("" when none): one to inspect with `agentlog show`.
    zero_reward_session: str = ""


def summarise_rollout(run_dir: Path) -> tuple[Counter, int, int, int, int]:
    """Outcome counts by status and reason, sessions, turns, generated tokens, events."""
    with Run.open(run_dir) as run:
        return _summarise(run)[:5]


def _summarise(run: Run) -> tuple[Counter, int, int, int, int, str]:
    """What :func:`summarise_rollout` gives, and the first finished session that scored 0 ("" when none)."""
    outcomes: Counter = Counter()
    zero = ""
    sessions = turns = tokens = events = 0
    sources = run.existing_rollout_logs().values()
    for env in (env for src in sources for env in src.read()):
        events += 1
        b = env.body
        if isinstance(b, SessionOpened):
            sessions += 1
        elif isinstance(b, (TurnRecorded, TurnDelta)):
            turns += 1
            tokens += len(b.output_ids) // 4
        elif isinstance(b, SessionFinished):
            outcomes["finished"] += 1
            if not zero and b.reward == 0:
                zero = env.session_id
        elif isinstance(b, SessionAborted):
            outcomes[f"aborted: {b.reason}"] += 1
        elif isinstance(b, SessionDropped):
            outcomes[f"dropped: {b.reason}"] += 1
    return outcomes, sessions, turns, tokens, events, zero


def refuse_another_runs_stream(run: Run) -> None:
    """Raise LoopError when the new run folder ``run`` would take over another
    run's logs: a stream outlives run folders, so a learner log on it belongs to
    an earlier run. A learner log inside a new folder was put there on purpose
    (a caller that publishes version 0 before the loop, as
    ``tools/bench/bench_distill.py`` does), and is resumed from."""
    if run.logs_elsewhere and run.learner.exists():
        raise LoopError(f"{run.learner} already holds a run's learner log, and {run.dir} is a new run folder; "
                        f"set [log] stream to a new name (or resume in the run's own folder)")


def refuse_another_config(run_dir: Path, cfg: LoopConfig) -> None:
    """Raise LoopError when ``run_dir`` already holds a run whose ``config.json`` is not
    ``cfg``: its logs and checkpoints were made with that config, which every reading
    command folds them with; it is never replaced (nor the run marked) by another run's."""
    def plain(c: LoopConfig) -> dict:
        return json.loads(json.dumps(c.to_dict(), sort_keys=True))

    saved, given = plain(Run.load_config(run_dir)), plain(cfg)
    if saved != given:
        changed = sorted(k for k in set(saved) | set(given) if saved.get(k) != given.get(k))
        raise LoopError(f"{Run.config_file(run_dir)}: {run_dir} already holds a run made with another config (it differs in "
                        f"{', '.join(changed)}); its config is kept: choose a new run folder")


def run_loop(cfg: LoopConfig, run_dir: Path, *, progress: Callable[[LoopConfig, Path], RunProgress] | None = None,
             timeout_s: float | None = None) -> RunResult:
    """Run the learner and the rollout workers (``cfg.rollout``) on ``run_dir`` until
    version ``cfg.steps``. ``progress``: called with the run's config and folder once the
    processes start, it returns the :class:`RunProgress` the loop reports to (None: quiet)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Both processes read the HF model: build a tiny one once, here, and pin a
    # local directory to an absolute path (the processes may not share a cwd).
    if cfg.hf_model:  # the built-in GPT needs nothing here, and this process no torch
        from agentlog.learner.hf_tiny import TINY_MODELS

        from .policy import resolve_hf_model

        hf_dir = resolve_hf_model(cfg, run_dir)
        if cfg.hf_model not in TINY_MODELS:
            cfg = dataclasses.replace(cfg, hf_model=str(hf_dir))
    fresh = not Run.has_config(run_dir)
    if cfg.log.backend == "nats" and not cfg.log.stream:
        # Pinned in config.json: the stream stays the run's if the folder is renamed.
        cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, stream=cfg.log.stream_for(run_dir)))
    if not fresh:
        refuse_another_config(run_dir, cfg)
    run = Run.open(run_dir, cfg)
    try:
        if fresh:
            refuse_another_runs_stream(run)
        Run.save_config(run_dir, cfg)
        mark_incomplete(run_dir, "running: the loop started and has not ended (or its process was killed)")
        try:
            result = _run(cfg, run_dir, run, progress, timeout_s)
        except KeyboardInterrupt:
            mark_incomplete(run_dir, "interrupted (SIGINT, Ctrl-C) before the loop's end")
            raise
        except LoopError as exc:
            mark_incomplete(run_dir, f"failed: {str(exc).splitlines()[0]}")
            raise
        except Exception as exc:  # the marker says what stopped the run, not "running"
            first = (str(exc).splitlines() or [""])[0]
            mark_incomplete(run_dir, f"failed: {type(exc).__name__}: {first}")
            raise
        (run_dir / INCOMPLETE_MARKER).unlink()
        return result
    finally:
        run.close()


def _run(cfg: LoopConfig, run_dir: Path, run: Run, progress: Callable[[LoopConfig, Path], RunProgress] | None,
         timeout_s: float | None) -> RunResult:
    t0 = time.monotonic()
    learner = start_process("trainer", run_dir)
    rollouts = bar = None
    try:  # from here on, whatever fails stops the learner's process (it would train on, orphaned)
        rollouts = rollout_backend(cfg, run_dir)
        progress_of_partitions = PartitionProgress(run)
        bar = progress(cfg, run_dir) if progress is not None else None
        rollouts.start()
        seen = 0
        aborted = dropped = 0
        last_version = 0
        # The learner log is tailed, not re-read from LSN 0 each round: on JetStream a read
        # creates (and drops) a consumer, ten times a second for the whole run.
        learner_tail: LogTail | None = None
        records: list[PolicyUpdated] = []
        while True:
            if learner_tail is None and run.learner.exists():
                learner_tail = run.learner_tail()
            if learner_tail is not None:
                records.extend(env.body for env in learner_tail.poll() if isinstance(env.body, PolicyUpdated))
            for rec in records[seen:]:
                if rec.step > 0:
                    aborted += int(rec.metrics.get("rollout/aborted", 0))
                    dropped += int(rec.metrics.get("rollout/dropped", 0))
                    last_version = rec.policy_version
                if bar is not None:
                    partitions = progress_of_partitions.line(dict(rec.frontier)) if rec.step > 0 else ""
                    bar.policy(rec, f"reward {_fmt(rec.metrics.get('rollout/reward_mean'))} "
                                    f"solve {_fmt(rec.metrics.get('rollout/solve_rate'))} aborts {aborted} drops {dropped} "
                                    f"stale {_fmt(rec.metrics.get('rollout/staleness_mean'), 2)}"
                                    + (f" | {partitions}" if partitions else ""))
            if bar is not None:
                bar.tick()
            seen = len(records)
            lrc = learner.poll()
            if lrc is not None and lrc != 0:
                raise LoopError(f"the learner process exited with status {lrc}; see {run_dir / 'logs' / 'trainer.stderr'}:\n"
                                + _tail(run_dir / "logs" / "trainer.stderr"))
            wrc = rollouts.poll()  # raises LoopError when a worker failed
            if lrc == 0 and wrc == 0:
                break
            if lrc == 0 and wrc is None:
                # The workers stop once they read the final version; give them a moment.
                if not rollouts.wait(30):
                    raise LoopError("the rollout workers did not stop within 30 s after the learner's final version")
                continue
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise LoopError(f"the loop did not reach version {cfg.steps} within {timeout_s} s (at v{last_version})")
            time.sleep(0.1)
    finally:
        if bar is not None:
            bar.close()
        try:
            if rollouts is not None:
                rollouts.stop()
        finally:
            if learner.poll() is None:
                learner.kill()
                learner.wait()
    wall = time.monotonic() - t0
    if records and records[-1].metrics.get(STOPPED_UNTRAINABLE, 0.0) >= 1.0:
        from .check import untrainable_cause

        raise NothingTrainable(f"{untrainable_cause(run_dir, cfg)}; stopped after {cfg.max_untrainable_batches} batches in a row "
                               f"with nothing to train (max_untrainable_batches)")
    outcomes, sessions, turns, tokens, events, zero = _summarise(run)
    return RunResult(run_dir, read_learner_records(run.learner), wall, outcomes, sessions, turns, tokens, events,
                     zero)


def _fmt(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{digits}f}"


def reward_curve(records: list[PolicyUpdated]) -> list[tuple[int, float, float]]:
    """(policy version, reward mean, solve rate) of every training step."""
    out = []
    for r in records:
        if r.step == 0 or not r.groups:
            continue
        out.append((r.policy_version, r.metrics.get("rollout/reward_mean", math.nan), r.metrics.get("rollout/solve_rate", math.nan)))
    return out


def plot_reward(records: list[PolicyUpdated], path: Path) -> Path:
    """``reward.png``: mean reward and solve rate against step (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = reward_curve(records)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if curve:
        xs = [c[0] for c in curve]
        ax.plot(xs, [c[1] for c in curve], label="mean reward", color="tab:blue", linewidth=1.5)
        ax.plot(xs, [c[2] for c in curve], label="solve rate", color="tab:orange", linewidth=1.2, linestyle="--")
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("reward / solve rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("agentlog demo: lookup task, GRPO with injected faults")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def summary_table(res: RunResult, cfg: LoopConfig, rows: int = 10) -> str:
    """The human summary printed at the end of a run."""
    curve = reward_curve(res.records)
    lines = ["", "reward by step", f"  {'step':>5} {'version':>7} {'reward':>7} {'solve':>6} {'aborted':>7} {'dropped':>7} {'stale':>6}"]
    trained = [r for r in res.records if r.step > 0]
    if trained:
        idx = sorted({round(i * (len(trained) - 1) / max(1, rows - 1)) for i in range(rows)})
        for i in idx:
            r = trained[i]
            m = r.metrics
            lines.append(
                f"  {r.step:>5} {r.policy_version:>7} {_fmt(m.get('rollout/reward_mean')):>7} {_fmt(m.get('rollout/solve_rate')):>6} "
                f"{int(m.get('rollout/aborted', 0)):>7} {int(m.get('rollout/dropped', 0)):>7} {_fmt(m.get('rollout/staleness_mean'), 2):>6}"
            )
    lines += ["", "outcomes by reason"]
    for k, v in sorted(res.outcomes.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {k:<36} {v:>8}")
    skipped: Counter[str] = Counter()
    for r in trained:
        for reason in r.skipped.values():
            skipped[reason.split(":")[0]] += 1
    if skipped:
        lines += ["", "groups skipped by the learner"]
        for k, v in skipped.most_common():
            lines.append(f"  {k:<36} {v:>8}")
    wall = max(res.wall_s, 1e-9)
    lines += [
        "",
        "totals",
        f"  sessions {res.sessions}, turns {res.turns}, generated tokens {res.tokens}, rollout events {res.rollout_events}",
        f"  wall {res.wall_s:.1f} s: {res.sessions / wall:.1f} sessions/s, {res.turns / wall:.1f} turns/s, "
        f"{res.rollout_events / wall:.0f} events/s, {len(trained) / wall:.2f} steps/s",
    ]
    if trained:
        m = trained[-1].metrics
        why = ("the reward target (stop_reward)" if m.get("loop/stopped_by_reward") else
               "the time budget (time_budget_s)" if m.get("loop/stopped_by_time") else "the step limit (steps)")
        lines.append(f"  stopped at version {trained[-1].policy_version} by {why}")
    if curve:
        k = max(1, min(10, len(curve) // 4))
        first = [c[1] for c in curve[:k] if not math.isnan(c[1])]
        last = [c[1] for c in curve[-k:] if not math.isnan(c[1])]
        if first and last:
            lines.append(f"  mean reward: first {k} steps {sum(first) / len(first):.3f} -> last {k} steps {sum(last) / len(last):.3f}")
    mismatch = mismatch_summary(trained)
    if mismatch is not None:
        lines.append(f"  learner vs rollout log-probs at the same version: max |diff| {mismatch.abs_diff_max:.3g}, mean "
                     f"{mismatch.abs_diff_mean:.3g} over {mismatch.tokens} trained tokens ({mismatch.steps} steps)")
    return "\n".join(lines)
