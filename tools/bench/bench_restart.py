"""Benchmark the learner's restart: how long before a killed learner has caught up.

A restarted learner reads the tail of its own log (the records from the last
one's ``records_from_lsn``: the consumed groups it needs and the low-water
LSN, :func:`agentlog.loop.learner_restart.resume_point`), then
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
(checked). Each timing is the best of ``--repeat``.

The engine's restart, on a log of the same shape and length written
through the engine itself in a child process that is then SIGKILLed (no
clean close), each restart in a fresh process that imports only the engine
and the log (``restart_child.py``; its import heap collected once before the
clock starts), timed from nothing to an engine ready to open sessions:
``FileLog.open`` (the log's own crash recovery, which rescans what was
appended since its last periodic INDEX checkpoint) then ``SessionEngine.open``. Ours resumes from the engine's last
periodic checkpoint (:mod:`agentlog.engine.restart`); the anchor folds the
whole log (``checkpoint_every=0``). Both must append the same aborts and
count the same violations (checked). The child is killed exactly
:data:`PAST_CHECKPOINT` records after its last periodic checkpoint, after
the short log and the long one alike: a restart's fold runs from that
checkpoint, so a kill at a random point of the checkpoint cycle would
compare folds of 0 and ~4,000 records, not log lengths.

Goals: ``restart_1M_vs_10k_events`` and ``engine_restart_1M_vs_10k_events``
(the total: FileLog.open + SessionEngine.open), each <= 2x (restart time
after the long log over restart time after the short one).

Usage: ``python tools/bench/bench_restart.py [--quick] [--long N] [--short N] [--repeat N] [--checkpoint-every N] [--dir D]``
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import msgspec
import numpy as np

from agentlog.events.schema.types import PolicyUpdated, SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.engine.checkpointer import RECORDS_PER_SESSION_IN_FLIGHT
from agentlog.engine.core import DEFAULT_CHECKPOINT_EVERY
from agentlog.events import FileLog, read_log
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import InFlightWindow, Reducer
from agentlog.reducers.samples import digest_samples
from agentlog.tools.bench.child import json_from_child
from agentlog.tools.bench.goals import goal_line, meets

CONFIG = ReduceConfig(min_valid=2)
GROUP_SIZE = 4
IN_FLIGHT_GROUPS = 25  # 100 sessions
GROUPS_PER_STEP = 16
#: A session's steps: open, start, two turns, finish.
STEPS = 5


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


def schedule(rng: random.Random) -> Iterator[tuple[str, str, int, int]]:
    """The workload's steps, forever: ``(session, group, sample_index, step)``
    with step 0..4 (open, start, two turns, finish). 25 groups of 4 are in
    flight at all times and each step is the next one of a random live
    session; a finished group is replaced by a new one, so whenever the caller
    stops, its 100 sessions' groups are still in flight."""
    live: list[list] = []  # [sid, gid, idx, next step]
    unfinished: dict[str, int] = {}  # group in flight -> members not yet finished
    next_group = 0

    def open_group() -> None:
        nonlocal next_group
        gid = f"g{next_group:07d}"
        next_group += 1
        unfinished[gid] = GROUP_SIZE
        live.extend([f"{gid}-s{i}", gid, i, 0] for i in range(GROUP_SIZE))

    for _ in range(IN_FLIGHT_GROUPS):
        open_group()
    while True:
        k = rng.randrange(len(live))
        s = live[k]
        yield s[0], s[1], s[2], s[3]
        s[3] += 1
        if s[3] == STEPS:
            live[k] = live[-1]
            live.pop()
            unfinished[s[1]] -= 1
            if unfinished[s[1]] == 0:
                del unfinished[s[1]]
                open_group()


def write_rollout(path: Path, events: int, seed: int = 0) -> None:
    """A rollout log of ``events`` events appended straight to the log, in
    :func:`schedule`'s order."""
    rng = random.Random(seed)
    log = FileLog.open(path, fsync="never")
    try:
        bodies: dict[str, list] = {}
        batch: list[tuple] = []
        for n, (sid, gid, idx, step) in enumerate(schedule(rng)):
            if n == events:
                break
            if step == 0:
                bodies[sid] = _session_events(sid, gid, idx, rng)
            batch.append((sid, step, bodies[sid][step]))
            if step == STEPS - 1:
                del bodies[sid]
            if len(batch) >= 4096:
                log.append_batch(batch)
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
    # The learner's modules (torch among them) are imported here, not at the top: the engine child
    # imports this module for drive_engine and would take a second or more to import them for nothing.
    from agentlog.loop.publish import publish
    from agentlog.loop.learner_restart import RecordsNeeded

    llog = FileLog.open(run / "learner", fsync="never")
    try:
        reducer = Reducer(CONFIG)
        pending: list[str] = []
        step, lsn_next = 1, 0
        needed = RecordsNeeded(stop_window=10)
        for env in read_log(run / "rollout", 0):
            pending.extend(g.group_id for g in reducer.feed(env).groups)
            if len(pending) < GROUPS_PER_STEP:
                continue
            oldest = reducer.oldest_in_flight_lsn()
            record = PolicyUpdated(step=step, policy_version=step, groups=pending, lsn_start=lsn_next, lsn_end=env.lsn,
                                   lsn_low_water=env.lsn + 1 if oldest is None else oldest)
            record = msgspec.structs.replace(record, records_from_lsn=needed.note(llog.next_lsn, record, {0: record.lsn_low_water}))
            publish(llog, record)
            pending, step, lsn_next = [], step + 1, env.lsn + 1
        return step - 1
    finally:
        llog.close()


def restart(run: Path, *, from_zero: bool) -> tuple[float, list[tuple[str, str]], int]:
    """Seconds for a learner restart to catch up with the rollout log, the
    groups it then releases (id, sample digest), and the LSN it read from."""
    # Before the clock; imported already by write_learner_log (see there why not at the top).
    from agentlog.loop.learner_records import read_learner_records
    from agentlog.loop.learner_restart import read_resume_records, resume_point

    t0 = time.perf_counter()
    if from_zero:  # as a learner log from before the two fields reads
        records = [msgspec.structs.replace(r, lsn_low_water=-1, records_from_lsn=-1)
                   for r in read_learner_records(run / "learner")]
    else:
        llog = FileLog.open(run / "learner", fsync="never")
        try:
            records = [r for _, r in read_resume_records(llog)]
        finally:
            llog.close()
    consumed, starts, windows, _ = resume_point(records)
    read_from = starts.get(0, 0)
    window = windows.get(0) or InFlightWindow(-1, set())
    reducer = Reducer(CONFIG)
    released = []
    for env in read_log(run / "rollout", read_from):
        if not window.admits(env):
            continue
        for g in reducer.feed(env).groups:
            if (0, g.group_id) not in consumed:
                released.append((g.group_id, digest_samples(list(g.samples))))
    return time.perf_counter() - t0, released, read_from


#: Records the engine child appends after its last periodic checkpoint before it is killed.
PAST_CHECKPOINT = 2_048
#: The smallest ``--checkpoint-every``. Below 400 the engine's interval is its sessions in flight's
#: (RECORDS_PER_SESSION_IN_FLIGHT each), not this; and its checkpoint loop looks every 0.2 s, a few hundred
#: records at this workload's pace, so a much shorter interval would trip drive_engine's stall check.
MIN_CHECKPOINT_EVERY = 1024
assert MIN_CHECKPOINT_EVERY >= RECORDS_PER_SESSION_IN_FLIGHT * IN_FLIGHT_GROUPS * GROUP_SIZE


def past_checkpoint(every: int) -> int:
    """Records appended after the last checkpoint before the kill: :data:`PAST_CHECKPOINT`, or half
    the interval when checkpoints come more often (a tiny run), so that no checkpoint falls due after."""
    return min(PAST_CHECKPOINT, every // 2)


ENGINE_CHILD = """
import asyncio, sys
sys.path.insert(0, {here!r})
import bench_restart
asyncio.run(bench_restart.drive_engine({path!r}, {events}, {seed}, {every}))
"""


async def drive_engine(path: str, events: int, seed: int, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> None:
    """The engine's workload, in a child process the parent then SIGKILLs:
    :func:`schedule`'s steps through ``SessionEngine`` on a FileLog,
    with its periodic restart checkpoints on (every ``checkpoint_every`` records:
    the engine's default unless a tiny run asks for fewer). Prints ``DONE``
    and waits to be killed: no clean close, no last checkpoint."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    logging.getLogger("agentlog").setLevel(logging.ERROR)
    rng = random.Random(seed)
    log = FileLog.open(path, fsync="never")
    eng = await SessionEngine.open(log, checkpoint_every=checkpoint_every)
    past = past_checkpoint(checkpoint_every)
    handles: dict[str, Any] = {}
    lps = np.full(8, -0.5, dtype="<f4").tobytes()
    ckpt = eng._checkpointer
    for sid, gid, idx, step in schedule(rng):
        # Past ``events``, on to exactly ``past`` records after the last checkpoint tried (written, or
        # being written: the sleep below lets it land); fewer than checkpoint_every, so none falls due after.
        if log.next_lsn >= events and log.next_lsn - ckpt._tried == past:
            break
        # 8,192 at the least: a tiny run's interval is a fraction of a checkpoint poll's (0.2 s) worth of records.
        if eng.background_failure is not None or log.next_lsn - ckpt._tried > max(2 * ckpt.every, 8192):
            raise RuntimeError(f"the engine's checkpoints stopped (lsn {log.next_lsn}, last tried at {ckpt._tried}): "
                               f"{eng.background_failure or 'no checkpoint falls due'}")
        if step == 0:
            handles[sid] = await eng.open_session(sid, group_id=gid, group_size=GROUP_SIZE, sample_index=idx)
        elif step == 1:
            await handles[sid].start()
        elif step in (2, 3):
            ids = [rng.randrange(1000) for _ in range(8 * step)]
            await handles[sid].record_turn(prompt_ids=ids, output_ids=ids[:8], output_log_probs=lps)
        else:
            await handles.pop(sid).finish(reward=float(rng.random() < 0.5))
    await asyncio.sleep(0.5)  # the checkpointer's last regular turn
    print("DONE", log.next_lsn, eng._checkpointer.lsn, flush=True)
    await asyncio.sleep(3600)


def write_engine_log(path: Path, events: int, seed: int = 0, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> tuple[int, int]:
    """Run :func:`drive_engine` in a child and SIGKILL it once done; returns
    (the log's end, the LSN of its last checkpoint)."""
    child = ENGINE_CHILD.format(here=str(Path(__file__).parent), path=str(path), events=events, seed=seed, every=checkpoint_every)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("DONE"):
            raise RuntimeError(f"the engine child stopped before its workload was done: {line!r} (exit {proc.poll()})")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    _, end, ckpt = line.split()
    return int(end), int(ckpt)


RESTART_CHILD = """
import sys
sys.path.insert(0, {here!r})
import restart_child
restart_child.restart_engine_here({path!r}, {from_zero!r})
"""


def engine_restart(path: Path, *, from_zero: bool) -> dict:
    """A restart, in a fresh process (as a restart is), of a copy of the
    killed engine's log: from the engine's last checkpoint, or folding the
    whole log (``checkpoint_every=0``: the anchor). ``took``: SessionEngine.open;
    ``log_open``: FileLog.open before it (the log's own crash recovery, which
    rescans what was appended since its last INDEX checkpoint); ``total``: both."""
    copy = path.with_name(path.name + "-restart")
    shutil.copytree(path, copy)
    try:
        child = RESTART_CHILD.format(here=str(Path(__file__).parent), path=str(copy), from_zero=from_zero)
        out = json_from_child(["-c", child], timeout=600)
    finally:
        shutil.rmtree(copy)
    if not out["aborted"]:
        raise AssertionError(f"{path}: the restart aborted no orphans; 100 sessions were in flight")
    return out


def measure(base: Path, events: int, repeat: int, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> dict:
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
    t0 = time.perf_counter()
    end, ckpt_lsn = write_engine_log(run / "engine-log", events, checkpoint_every=checkpoint_every)
    print(f"  {events:,} events: the engine's log written in {time.perf_counter() - t0:.1f} s, killed at lsn {end:,}"
          f" (last checkpoint at lsn {ckpt_lsn:,})", file=sys.stderr)
    past = past_checkpoint(checkpoint_every)
    if end - ckpt_lsn != past:  # the last one tried was not written (a warning in the child's log)
        print(f"  NOTE: killed {end - ckpt_lsn:,} records after the last checkpoint written, not {past:,}: "
              "the two restarts fold different amounts", file=sys.stderr)
    eng = min((engine_restart(run / "engine-log", from_zero=False) for _ in range(repeat)), key=lambda r: r["total"])
    eng_zero = min((engine_restart(run / "engine-log", from_zero=True) for _ in range(repeat)), key=lambda r: r["total"])
    same = ("aborted", "digest", "violations")
    if [eng[k] for k in same] != [eng_zero[k] for k in same]:
        raise AssertionError(f"{events:,} events: the engine's restart from its checkpoint decided {eng}, "
                             f"from lsn 0 {eng_zero}; the aborts and violations must be the same")
    return {"events": events, "ours": ours[0], "from_zero": zero[0], "read_from": ours[2], "groups": len(ours[1]),
            "engine": eng["took"], "engine_folded": eng["folded"], "engine_zero": eng_zero["took"], "engine_end": end,
            "log_open": eng["log_open"], "engine_total": eng["total"], "rescanned": eng["rescanned"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fast run: 100k events against 10k")
    ap.add_argument("--long", type=int, default=None, help="events in the long log (default 1,000,000)")
    ap.add_argument("--short", type=int, default=10_000, help="events in the short log (default 10,000)")
    ap.add_argument("--repeat", type=int, default=3, help="take the best of this many restarts")
    ap.add_argument("--checkpoint-every", type=int, default=DEFAULT_CHECKPOINT_EVERY,
                    help=f"the engine child's checkpoint interval in records (default the engine's, {DEFAULT_CHECKPOINT_EVERY:,}); "
                         f"at least {MIN_CHECKPOINT_EVERY}; a tiny run's logs can then be short")
    ap.add_argument("--dir", default=None, help="where to put the runs (default: a temp dir, removed after)")
    args = ap.parse_args(argv)
    if args.checkpoint_every < MIN_CHECKPOINT_EVERY:
        ap.error(f"--checkpoint-every: at least {MIN_CHECKPOINT_EVERY} (see MIN_CHECKPOINT_EVERY), found {args.checkpoint_every}")
    # The engine restart warns once per orphan it aborts: expected here.
    logging.getLogger("agentlog").setLevel(logging.ERROR)
    long_n = args.long or (100_000 if args.quick else 1_000_000)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_restart_"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        print(f"bench_restart: learner restart with {IN_FLIGHT_GROUPS * GROUP_SIZE} sessions in flight, "
              f"after {args.short:,} and {long_n:,} events, dir {base}", file=sys.stderr)
        short = measure(base, args.short, args.repeat, args.checkpoint_every)
        long = measure(base, long_n, args.repeat, args.checkpoint_every)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print("learner:")
    print(f"{'log':>12} {'low-water restart':>18} {'replayed from':>14} {'from-0 restart':>15}")
    for m in (short, long):
        print(f"{m['events']:>12,} {m['ours'] * 1e3:>15.1f} ms {m['read_from']:>14,} {m['from_zero'] * 1e3:>12.1f} ms")
    print("engine (killed with 100 sessions in flight):")
    print(f"{'log':>12} {'total restart':>14} {'FileLog.open':>13} {'rescanned':>11} {'SessionEngine.open':>19} {'folded':>8}"
          f" {'from-0 engine':>14}")
    for m in (short, long):
        print(f"{m['engine_end']:>12,} {m['engine_total'] * 1e3:>11.1f} ms {m['log_open'] * 1e3:>10.1f} ms {m['rescanned'] / 2**20:>7.1f} MiB"
              f" {m['engine'] * 1e3:>16.1f} ms {m['engine_folded']:>8,} {m['engine_zero'] * 1e3:>11.1f} ms")
    ratio = long["ours"] / short["ours"]
    eng_ratio = long["engine_total"] / short["engine_total"]
    print(f"anchor: the restart from LSN 0 grows {long['from_zero'] / short['from_zero']:.1f}x over the same logs "
          f"(learner), {long['engine_zero'] / short['engine_zero']:.1f}x (engine)")
    def label(n: int) -> str:
        return "1M" if n == 1_000_000 else f"{n // 1000}k" if n % 1000 == 0 else str(n)

    label = f"{label(long_n)}_vs_{label(args.short)}"
    print(goal_line(f"restart_{label}_events", f"{ratio:.2f}x", "<=", "2x", meets(ratio, "<=", 2)))
    print(goal_line(f"engine_restart_{label}_events", f"{eng_ratio:.2f}x", "<=", "2x; FileLog.open + SessionEngine.open",
                    meets(eng_ratio, "<=", 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
