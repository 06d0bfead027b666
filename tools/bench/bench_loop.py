"""Benchmark the online loop: rollout throughput with the learner on and off,
the learner's idle fraction, release-to-gradient latency, and the cost of
logging (engine + log) in the worker's time per turn.

* learner on: the real two-process loop (``loop.run.run_loop``), no
  warm-up, default faults; figures are read back from the two logs.
* learner off: the same worker alone on fixed weights (version 0 only, no
  pacing), in-process.
* logging overhead: the same worker batches driven through the real
  SessionEngine over a FileLog, against the same batches with every event
  discarded (a null engine whose handle methods do nothing). No faults, so
  both do exactly the same work apart from recording.

Usage: ``python tools/bench/bench_loop.py [--quick] [--keep DIR]``; every size has its own
option (``--help``), for a smoke run far below ``--quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import PolicyUpdated, SessionOpened, TurnDelta, TurnRecorded
from agentlog.learner.learner import Learner
from agentlog.events import FileLog
from agentlog.loop.config import FaultConfig, LoopConfig
from agentlog.loop.policy import build_model
from agentlog.loop.run import run_loop
from agentlog.loop.run_folder import Run
from agentlog.loop.worker import RolloutWorker
from agentlog.tools.bench.goals import goal_line, meets


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (NaN when empty); the benchmarks' one definition."""
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def rollout_rates(run_dir: Path) -> dict[str, float]:
    """Sessions/s and turns/s over the span of the rollout log (first open to last event)."""
    sessions = turns = 0
    first = last = None
    for env in Run.open(run_dir).rollout.read():
        if isinstance(env.body, SessionOpened):
            sessions += 1
            first = env.ts_ns if first is None else first
        elif isinstance(env.body, (TurnRecorded, TurnDelta)):
            turns += 1
        last = env.ts_ns
    span = max((last - first) / 1e9, 1e-9) if first is not None else float("nan")
    return {"sessions": sessions, "turns": turns, "span_s": span, "sessions_per_s": sessions / span, "turns_per_s": turns / span}


def learner_figures(run_dir: Path) -> dict[str, Any]:
    """Idle fraction and release-to-step latencies, from the two logs."""
    run = Run.open(run_dir)
    rec_ts: list[tuple[PolicyUpdated, int]] = []
    for env in run.learner.read():
        if isinstance(env.body, PolicyUpdated) and env.body.step > 0:
            rec_ts.append((env.body, env.ts_ns))
    # Which LSN released each group: recompute with the reducer (same as the learner did).
    from agentlog.reducers.pipeline import reduce_log

    res = reduce_log(run.rollout.read(), run.config.reduce_config())
    released = {g.group_id: g.lsn_released for g in res.groups}
    want = set(released.values())
    ts_of: dict[int, int] = {}
    for env in run.rollout.read():
        if env.lsn in want:
            ts_of[env.lsn] = env.ts_ns
    lat = []
    for rec, ts in rec_ts:
        for g in list(rec.groups) + list(rec.skipped):
            if g in released:
                lat.append((ts - ts_of[released[g]]) / 1e9)
    busy = sum(r.metrics.get("perf/loop_step_s", 0.0) for r, _ in rec_ts[1:])
    span = (rec_ts[-1][1] - rec_ts[0][1]) / 1e9 if len(rec_ts) > 1 else float("nan")
    return {
        "steps": len(rec_ts),
        "idle_frac": 1.0 - busy / span if span == span and span > 0 else float("nan"),
        "lat_p50": percentile(lat, 50),
        "lat_p99": percentile(lat, 99),
        "groups": len(lat),
    }


def _fixed_policy_run(run_dir: Path, cfg: LoopConfig) -> None:
    """A run folder whose learner log publishes version 0 only (no learner process)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    Run.save_config(run_dir, cfg)
    run = Run.open(run_dir, cfg)
    from agentlog.engine.tasks import select_task

    model = build_model(cfg, select_task(cfg.task))
    path = Learner(model, cfg.learner_config()).save_checkpoint(run.checkpoints / "policy-v00000.pt")
    llog = run.open_learner()
    try:
        llog.append_batch([("learner", 0, PolicyUpdated(step=0, policy_version=0, checkpoint=str(path)))])
    finally:
        llog.close()


class _NullHandle:
    """A session handle that records nothing (the 'events discarded' anchor)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.state = State.OPEN
        self.turns = 0

    async def start(self, **kw: Any) -> None:
        self.state = State.RUNNING

    async def record_turn(self, **kw: Any) -> None:
        self.turns += 1

    async def record_command(self, *a: Any, **kw: Any) -> None:
        return None

    async def finish(self, **kw: Any) -> None:
        self.state = State.FINISHED

    async def abort(self, *a: Any, **kw: Any) -> None:
        self.state = State.ABORTED

    async def drop(self, *a: Any, **kw: Any) -> None:
        self.state = State.DROPPED


class _NullSession:
    def __init__(self, sid: str) -> None:
        self.h = _NullHandle(sid)

    async def __aenter__(self) -> _NullHandle:
        return self.h

    async def __aexit__(self, *exc: Any) -> bool:
        return False


class NullEngine:
    """Drives the worker's sessions without an engine or a log."""

    def session(self, session_id: str, **kw: Any) -> _NullSession:
        return _NullSession(session_id)

    def owed_replacements(self, group_id: str) -> list[str]:
        """No member is ever aborted here (the overhead runs inject no faults), so no refill is owed."""
        return []


async def _timed_batches(worker: RolloutWorker, engine: Any, first: int, n: int) -> float:
    t0 = time.perf_counter()
    for b in range(first, first + n):
        await worker.run_batch(engine, b)
    return time.perf_counter() - t0


async def overhead(run_dir: Path, cfg: LoopConfig, batches: int, repeats: int) -> dict[str, float]:
    """Worker seconds per turn with the engine + FileLog vs with events discarded (interleaved repeats)."""
    from agentlog.engine import SessionEngine

    worker = RolloutWorker(run_dir, cfg)
    worker.maybe_reload()
    rollout = FileLog.open(run_dir / "rollout-overhead", fsync=cfg.fsync)
    engine = await SessionEngine.open(rollout)
    null = NullEngine()
    t_real: list[float] = []
    t_null: list[float] = []
    b = 0
    try:
        await _timed_batches(worker, null, 10_000, 1)  # warm the model and the allocator
        for _ in range(repeats):
            t_null.append(await _timed_batches(worker, null, 10_000 + b, batches))
            t_real.append(await _timed_batches(worker, engine, b, batches))
            b += batches
    finally:
        await worker.batcher.close()
        await engine.close()
        rollout.close()
    turns = batches * cfg.groups_per_step * cfg.group_size * 2
    real, base = min(t_real) / turns, min(t_null) / turns
    return {"real_s_per_turn": real, "null_s_per_turn": base, "overhead": (real - base) / real, "turns": turns}


def main(argv: list[str] | None = None) -> int:
    """Run every measurement, print a table and the GOAL lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run")
    p.add_argument("--keep", type=Path, default=None, help="keep the run folders under this directory")
    sizes = p.add_argument_group("sizes (each defaults to the full run's, or --quick's)")
    sizes.add_argument("--steps", type=int, default=None, help="learner steps of the learner-on run (default 30, quick 6)")
    sizes.add_argument("--off-batches", type=int, default=None, help="worker batches of the learner-off run (default 12, quick 3)")
    sizes.add_argument("--overhead-batches", type=int, default=None, help="batches per timed overhead repeat (default 3, quick 1)")
    sizes.add_argument("--overhead-repeats", type=int, default=None, help="interleaved overhead repeats (default 3, quick 2)")
    sizes.add_argument("--groups-per-step", type=int, default=LoopConfig.groups_per_step,
                       help=f"groups per step (and per worker batch) of every run (default {LoopConfig.groups_per_step})")
    sizes.add_argument("--group-size", type=int, default=LoopConfig.group_size,
                       help=f"sessions per group of every run (default {LoopConfig.group_size})")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # The table is the output; per-event logs of the in-process worker would drown it.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    def size(given: int | None, quick: int, full: int) -> int:
        """An option's value, else the --quick or the full run's."""
        return given if given is not None else quick if args.quick else full

    steps = size(args.steps, 6, 30)
    off_batches = size(args.off_batches, 3, 12)
    ov_batches, ov_repeats = size(args.overhead_batches, 1, 3), size(args.overhead_repeats, 2, 3)
    shape = dict(steps=steps, warmup_steps=0, groups_per_step=args.groups_per_step, group_size=args.group_size)
    base = Path(tempfile.mkdtemp(prefix="bench_loop_")) if args.keep is None else args.keep
    base.mkdir(parents=True, exist_ok=True)
    try:
        on_cfg = LoopConfig(**shape)
        t0 = time.perf_counter()
        run_loop(on_cfg, base / "on")
        on_wall = time.perf_counter() - t0
        on = rollout_rates(base / "on")
        lf = learner_figures(base / "on")

        off_cfg = LoopConfig(**shape, max_lag=10**6)
        _fixed_policy_run(base / "off", off_cfg)
        worker = RolloutWorker(base / "off", off_cfg)
        asyncio.run(worker.run(max_batches=off_batches))
        off = rollout_rates(base / "off")

        ov_cfg = LoopConfig(**shape, max_lag=10**6, faults=FaultConfig.none())
        _fixed_policy_run(base / "ov", ov_cfg)
        ov = asyncio.run(overhead(base / "ov", ov_cfg, ov_batches, ov_repeats))
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)

    print(f"online loop: lookup task, {on_cfg.groups_per_step} groups x {on_cfg.group_size} sessions per step, "
          f"default faults, 1 thread per process; learner on: {steps} steps in {on_wall:.1f} s wall")
    print(f"{'rollout':<14} {'sessions':>9} {'turns':>8} {'span s':>8} {'sessions/s':>11} {'turns/s':>9}")
    for name, r in (("learner on", on), ("learner off", off)):
        print(f"{name:<14} {r['sessions']:>9} {r['turns']:>8} {r['span_s']:>8.2f} {r['sessions_per_s']:>11.1f} {r['turns_per_s']:>9.1f}")
    print()
    print(f"learner: {lf['steps']} steps, idle fraction {lf['idle_frac']:.1%}; last terminal event of a group -> "
          f"its gradient step: p50 {lf['lat_p50'] * 1e3:.0f} ms, p99 {lf['lat_p99'] * 1e3:.0f} ms over {lf['groups']} groups")
    print()
    print(f"{'worker time per turn':<34} {'us/turn':>9}")
    print(f"{'engine + FileLog (fsync batch)':<34} {ov['real_s_per_turn'] * 1e6:>9.1f}")
    print(f"{'events discarded (null engine)':<34} {ov['null_s_per_turn'] * 1e6:>9.1f}")
    print(f"{'logging overhead':<34} {ov['overhead']:>9.1%}")
    print()
    ratio = on["sessions_per_s"] / off["sessions_per_s"]
    print(f"rollout with the learner on vs off: {ratio:.2f}x sessions/s (the two processes share the cores)")
    print(goal_line("logging_overhead", f"{ov['overhead']:.1%} of worker time per turn", "<", "5%", meets(ov["overhead"], "<", 0.05)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
