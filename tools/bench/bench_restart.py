"""Benchmark the learner's restart: how long before a killed learner has caught up.

A restarted learner reads the tail of its own log (the records from the last
one's ``records_from_lsn``: the consumed groups it needs and the low-water
LSN, :func:`agentlog.loop.trainer.resume_point`), then
folds the rollout log through a fresh reducer until it reaches the end,
where it can train again. This measures that fold on a run with 100
sessions in flight (25 groups of 4, advanced in a seeded random order, so
groups straddle each other and the low-water mark) after a short log
(10k events) and a long one (1M events; ``--quick``: 100k):

* ours: the restart from the recorded low-water LSN (the in-flight window);
* the anchor, in the same run: the same restart from LSN 0 (every learner
  record read, without ``lsn_low_water`` and ``records_from_lsn``, as an
  older learner wrote them).

Both restarts must release exactly the same groups with the same samples
(checked). Each timing is the best of ``--repeat``. For reference it also
times the engine's restart fold (``SessionEngine.open``), which still reads
the whole log (docs/design.md, "The online loop").

Goal: ``restart_1M_vs_10k_events`` <= 2x (restart time after the long log
over restart time after the short one).

Usage: ``python tools/bench/bench_restart.py [--quick] [--long N] [--short N] [--dir D]``
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from agentlog.events.types import PolicyUpdated, SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.loop import logs
from agentlog.loop.publish import publish, read_learner_records
from agentlog.loop.trainer import RecordsNeeded, read_resume_records, resume_point
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import Reducer
from agentlog.reducers.samples import digest_samples

CONFIG = ReduceConfig(min_valid=2)
GROUP_SIZE = 4
IN_FLIGHT_GROUPS = 25  # 100 sessions
GROUPS_PER_STEP = 16


def _ids(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _session_events(sid: str, gid: str, idx: int, rng: random.Random) -> list:
    """One session's events in order: open, start, two turns, finish."""
    prompt = [rng.randrange(1000) for _ in range(16)]
    out0 = [rng.randrange(1000) for _ in range(8)]
    tool = [rng.randrange(1000) for _ in range(8)]
    out1 = [rng.randrange(1000) for _ in range(8)]
    lps = np.full(8, -0.5, dtype="<f4").tobytes()
    return [
        SessionOpened(group_id=gid, group_size=GROUP_SIZE, sample_index=idx, prompt_ids=_ids(prompt)),
        SessionStarted(harness="bench"),
        TurnRecorded(turn_index=0, prompt_ids=_ids(prompt), output_ids=_ids(out0), output_log_probs=lps),
        TurnRecorded(turn_index=1, prompt_ids=_ids(prompt + out0 + tool), output_ids=_ids(out1), output_log_probs=lps),
        SessionFinished(reward=float(rng.random() < 0.5)),
    ]


def write_rollout(path: Path, events: int, seed: int = 0) -> None:
    """A rollout log of about ``events`` events: 25 groups of 4 in flight at
    all times, each step appending the next event of a random live session;
    a finished group is replaced by a new one. It stops with its 100
    sessions' groups still in flight."""
    rng = random.Random(seed)
    log = logs.open_log(path, "never")
    try:
        live: list[list] = []  # [sid, seq, remaining events]
        unfinished: dict[str, int] = {}  # group in flight -> members not yet finished
        next_group = 0
        batch: list[tuple] = []
        written = 0

        def open_group() -> None:
            nonlocal next_group
            gid = f"g{next_group:07d}"
            next_group += 1
            unfinished[gid] = GROUP_SIZE
            for i in range(GROUP_SIZE):
                sid = f"{gid}-s{i}"
                live.append([sid, 0, _session_events(sid, gid, i, rng)])

        for _ in range(IN_FLIGHT_GROUPS):
            open_group()
        # Stop opening groups once the log is long enough; the last groups stay in flight.
        while written + len(batch) < events:
            k = rng.randrange(len(live))
            s = live[k]
            batch.append((s[0], s[1], s[2].pop(0)))
            s[1] += 1
            if not s[2]:
                live[k] = live[-1]
                live.pop()
                gid = s[0].rsplit("-s", 1)[0]
                unfinished[gid] -= 1
                if unfinished[gid] == 0:
                    del unfinished[gid]
                    open_group()
            if len(batch) >= 4096:
                log.append_batch(batch)
                written += len(batch)
                batch = []
        if batch:
            log.append_batch(batch)
    finally:
        log.close()


def write_learner_log(run: Path) -> int:
    """The learner log a learner that consumed the whole rollout log would
    have written: a step every ``GROUPS_PER_STEP`` released groups, each with
    its low-water LSN (as :class:`agentlog.loop.trainer.LoopLearner` records
    it). Returns the steps."""
    llog = logs.open_log(run / "learner", "never")
    try:
        reducer = Reducer(CONFIG)
        pending: list[str] = []
        step, lsn_next = 1, 0
        needed = RecordsNeeded(stop_window=10)
        for env in logs.read(run / "rollout", 0):
            pending.extend(g.group_id for g in reducer.feed(env).groups)
            if len(pending) < GROUPS_PER_STEP:
                continue
            oldest = reducer.oldest_in_flight_lsn()
            record = PolicyUpdated(step=step, policy_version=step, groups=pending, lsn_start=lsn_next, lsn_end=env.lsn,
                                   lsn_low_water=env.lsn + 1 if oldest is None else oldest)
            record = msgspec.structs.replace(record, records_from_lsn=needed.note(llog.next_lsn, record, record.lsn_low_water))
            publish(llog, record)
            pending, step, lsn_next = [], step + 1, env.lsn + 1
        return step - 1
    finally:
        llog.close()


def restart(run: Path, *, from_zero: bool) -> tuple[float, list[tuple[str, str]], int]:
    """Seconds for a learner restart to catch up with the rollout log, the
    groups it then releases (id, sample digest), and the LSN it read from."""
    t0 = time.perf_counter()
    if from_zero:  # as a learner log from before the two fields reads
        records = [msgspec.structs.replace(r, lsn_low_water=-1, records_from_lsn=-1)
                   for r in read_learner_records(run / "learner")]
    else:
        llog = logs.open_log(run / "learner", "never")
        try:
            records = [r for _, r in read_resume_records(llog)]
        finally:
            llog.close()
    consumed, read_from, window = resume_point(records)
    reducer = Reducer(CONFIG)
    released = []
    for env in logs.read(run / "rollout", read_from):
        if not window.admits(env):
            continue
        for g in reducer.feed(env).groups:
            if g.group_id not in consumed:
                released.append((g.group_id, digest_samples(list(g.samples))))
    return time.perf_counter() - t0, released, read_from


def engine_restart(run: Path) -> float:
    """Seconds for SessionEngine.open on a copy of the rollout log (it aborts the orphans)."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    copy = run / "rollout-engine"
    shutil.copytree(run / "rollout", copy)
    t0 = time.perf_counter()

    async def go() -> None:
        log = FileLog.open(copy, fsync="never")
        try:
            engine = await SessionEngine.open(log, progress=False)
            assert engine.stats["restart_aborted"] > 0
        finally:
            log.close()

    asyncio.run(go())
    took = time.perf_counter() - t0
    shutil.rmtree(copy)
    return took


def measure(base: Path, events: int, repeat: int) -> dict:
    run = base / f"run-{events}"
    run.mkdir(parents=True)
    t0 = time.perf_counter()
    write_rollout(run / "rollout", events)
    steps = write_learner_log(run)
    print(f"  {events:,} events: log and {steps} learner records written in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    ours = min((restart(run, from_zero=False) for _ in range(repeat)), key=lambda r: r[0])
    zero = min((restart(run, from_zero=True) for _ in range(repeat)), key=lambda r: r[0])
    if ours[1] != zero[1]:
        raise AssertionError(f"{events:,} events: the low-water restart released {len(ours[1])} groups, "
                             f"the restart from 0 {len(zero[1])}; they must be the same groups with the same samples")
    if not ours[1]:
        raise AssertionError(f"{events:,} events: no group in flight was released after the restart")
    eng = min(engine_restart(run) for _ in range(repeat))
    return {"events": events, "ours": ours[0], "from_zero": zero[0], "read_from": ours[2], "groups": len(ours[1]),
            "engine": eng}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fast run: 100k events against 10k")
    ap.add_argument("--long", type=int, default=None, help="events in the long log (default 1,000,000)")
    ap.add_argument("--short", type=int, default=10_000, help="events in the short log (default 10,000)")
    ap.add_argument("--repeat", type=int, default=3, help="take the best of this many restarts")
    ap.add_argument("--dir", default=None, help="where to put the runs (default: a temp dir, removed after)")
    args = ap.parse_args(argv)
    # The engine restart warns once per orphan it aborts: expected here.
    logging.getLogger("agentlog").setLevel(logging.ERROR)
    long_n = args.long or (100_000 if args.quick else 1_000_000)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_restart_"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        print(f"bench_restart: learner restart with {IN_FLIGHT_GROUPS * GROUP_SIZE} sessions in flight, "
              f"after {args.short:,} and {long_n:,} events, dir {base}", file=sys.stderr)
        short = measure(base, args.short, args.repeat)
        long = measure(base, long_n, args.repeat)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'log':>12} {'low-water restart':>18} {'replayed from':>14} {'from-0 restart':>15} {'engine restart':>15}")
    for m in (short, long):
        print(f"{m['events']:>12,} {m['ours'] * 1e3:>15.1f} ms {m['read_from']:>14,} {m['from_zero'] * 1e3:>12.1f} ms"
              f" {m['engine'] * 1e3:>12.1f} ms")
    ratio = long["ours"] / short["ours"]
    anchor = long["from_zero"] / short["from_zero"]
    print(f"anchor: the restart from LSN 0 grows {anchor:.1f}x over the same logs; "
          f"the engine's restart fold {long['engine'] / short['engine']:.1f}x")
    label = "1M" if long_n == 1_000_000 else f"{long_n // 1000}k"
    print(f"GOAL restart_{label}_vs_10k_events: {ratio:.2f}x (goal <= 2x) {'PASS' if ratio <= 2 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
