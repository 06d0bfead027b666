"""Benchmark the SessionEngine against appending the same events straight to the log.

One run measures, on a FileLog with fsync policy ``batch``:

* the engine: N sessions (open, start, 3 turns of 512 tokens, finish) with C
  sessions in flight at once: sessions/s, cost per transition;
* the anchor: the same events, built the same way, appended straight to the
  log with the same concurrency (goal: engine <= 1.5x the anchor's time);
  beside it, the two arms' CPU time (every thread of the process, over the
  same span): on a shared VM the rounds' wall clock spreads by more than the
  changes it judges, while the CPU a round needs moves much less;
* peak memory per open session (tracemalloc, engine code only);
* resident memory per live session at an 8k-token context, 10,000 live
  sessions (1,000 with ``--quick``), in a fresh process
  (``bench_engine_memory.py``, which also gives the table against context
  size; goal: <= 64 kB);
* scaling: the engine's per-session cost at 1,000 and at 50,000 concurrent
  sessions over a MemoryLog, in a fresh process (goal: within 1.3x, i.e. no
  O(n) step per operation); beside it the same with the garbage collector off, and plain
  appends at the same concurrency (the interpreter's own scaling: each full
  collection walks every object of every session in flight); then the same
  end to end on the FileLog for engine and anchor;
* for reference, what deciding with per-session ``transitions`` models on a
  shared Machine would cost at those sizes (add_model/remove_model are O(n)),
  versus the immutable table the engine uses.

Usage: ``python tools/bench/bench_engine.py [--quick] [--sessions N] [--concurrency C]`` (the sizes of every
other part have options too: ``--scale-low``, ``--scale-high``, ``--scale-sessions``, ``--live-sessions``,
``--live-wave``, ``--decide-ops``; see ``--help``)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import structlog

import agentlog.engine as engine_pkg
from agentlog.engine import SessionEngine
from agentlog.events.schema.lifecycle import LIFECYCLE_SPEC, State, next_state
from agentlog.events import FileLog
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded

from agentlog.tools.bench.child import json_from_child
from agentlog.tools.bench.bench_engine_memory import GOAL_CONTEXT, WAVE, measure_in_child, rss_goal_line
from agentlog.tools.bench.goals import goal_line, meets



def _payload(tokens: int) -> tuple[bytes, bytes]:
    toks = np.arange(tokens, dtype=np.int32).tobytes()
    lps = np.full(tokens, -0.5, dtype=np.float32).tobytes()
    return toks, lps


async def _workers(n_sessions: int, concurrency: int, one, cpu: list[float] | None) -> float:
    """Keep ``concurrency`` sessions in flight until ``n_sessions`` ran; returns the seconds that took,
    and appends the process's CPU seconds over the same span (every thread) to ``cpu`` when given."""
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n_sessions:
            i = next_i
            next_i += 1
            await one(i)

    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_sessions))))
    elapsed = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return elapsed


def _open_log(path: Path | None):
    """A FileLog (fsync batch) at ``path``, or a MemoryLog when ``path`` is None
    (that isolates the engine's CPU overhead from the disk)."""
    return MemoryLog() if path is None else FileLog.open(path, fsync="batch")


async def run_engine(path: Path | None, n: int, conc: int, turns: int, toks: bytes, lps: bytes,
                     cpu: list[float] | None = None, **engine_options) -> float:
    """Seconds for n sessions through the engine (``engine_options``: SessionEngine's keywords; its defaults here).
    ``cpu``: when given, the process's CPU seconds over the same span (every thread: the log's
    writer and the checkpoint's worker too) are appended to it."""
    log = _open_log(path)
    try:
        eng = await SessionEngine.open(log, **engine_options)

        async def one(i: int) -> None:
            h = await eng.open_session(f"s{i}", group_id=f"g{i // 8}", group_size=8)
            await h.start(harness="bench")
            for _ in range(turns):
                await h.record_turn(prompt_ids=toks, output_ids=toks, output_log_probs=lps, finish_reason="stop")
            await h.finish(reward=1.0)

        elapsed = await _workers(n, conc, one, cpu)
        assert eng.live_count == 0 and log.next_lsn == n * (turns + 3)
        await eng.close()
        return elapsed
    finally:
        log.close()


async def reopen(path: Path) -> tuple[float, int]:
    """Seconds for SessionEngine.open on an existing log folded from LSN 0
    (``checkpoint_every=0``: the restart fold without a checkpoint), and its events."""
    log = FileLog.open(path, fsync="batch")
    try:
        gc.collect()
        t0 = time.perf_counter()
        eng = await SessionEngine.open(log, checkpoint_every=0)
        elapsed = time.perf_counter() - t0
        assert eng.stats["restart_aborted"] == 0
        return elapsed, log.next_lsn
    finally:
        log.close()


async def run_raw(path: Path | None, n: int, conc: int, turns: int, toks: bytes, lps: bytes,
                  cpu: list[float] | None = None) -> float:
    """Seconds for the same events appended straight to the log (the anchor); ``cpu`` as :func:`run_engine`'s.

    Over a MemoryLog the anchor awaits ``submit``, which answers a loop step later, as the engine's records
    are answered: ``append`` there never suspends, so the anchor's sessions would run one after another
    and hold nothing in flight (the scaling measured that way until 2026-12-06, and so did the engine's)."""
    log = _open_log(path)
    put = log.append if path is not None else log.submit
    try:
        async def one(i: int) -> None:
            sid = f"s{i}"
            await put(sid, 0, SessionOpened(group_id=f"g{i // 8}", group_size=8))
            await put(sid, 1, SessionStarted(harness="bench"))
            for t in range(turns):
                await put(sid, 2 + t, TurnRecorded(turn_index=t, prompt_ids=toks, output_ids=toks,
                                                   output_log_probs=lps, finish_reason="stop"))
            await put(sid, 2 + turns, SessionFinished(reward=1.0))

        elapsed = await _workers(n, conc, one, cpu)
        assert log.next_lsn == n * (turns + 3)
        return elapsed
    finally:
        log.close()


async def open_session_bytes(path: Path, n: int) -> float:
    """Engine-held bytes per open (running) session, measured with tracemalloc."""
    log = FileLog.open(path, fsync="never")
    try:
        eng = await SessionEngine.open(log)
        engine_dir = os.path.join(os.path.dirname(engine_pkg.__file__), "*")
        flt = [tracemalloc.Filter(True, engine_dir)]
        tracemalloc.start()
        try:
            gc.collect()
            before = sum(s.size for s in tracemalloc.take_snapshot().filter_traces(flt).statistics("filename"))
            handles = []
            for i in range(n):
                h = await eng.open_session(f"m{i}", group_id=f"g{i // 8}", group_size=8, budget_s=3600)
                await h.start()
                handles.append(h)
            gc.collect()
            after = sum(s.size for s in tracemalloc.take_snapshot().filter_traces(flt).statistics("filename"))
        finally:
            tracemalloc.stop()
        await eng.close()
        return (after - before) / n
    finally:
        log.close()


def decide_cost(n_live: int, ops: int = 2000) -> tuple[float, float]:
    """Microseconds per session lifecycle (add, 2 triggers, remove) deciding with
    (a) the shared table and (b) per-session models on one transitions.Machine,
    with ``n_live`` other sessions alive."""
    from transitions import Machine

    # (a) the table: a dict lookup per trigger, no per-session registration.
    t0 = time.perf_counter()
    for _ in range(ops * 50):
        s = State.OPEN
        s = next_state("x", s, "start")
        s = next_state("x", s, "finish")
    table_us = (time.perf_counter() - t0) / (ops * 50) * 1e6

    # (b) a shared Machine with n_live registered models.
    class M:
        pass

    m = Machine(model=None, states=[s.value for s in State],
                transitions=[{k: v for k, v in t.items() if k != "event"} for t in LIFECYCLE_SPEC],
                initial="open", auto_transitions=False)
    live = [M() for _ in range(n_live)]
    m.add_model(live)
    k = max(50, min(ops, 200_000 // max(1, n_live // 100)))
    t0 = time.perf_counter()
    for _ in range(k):
        x = M()
        m.add_model(x)
        x.start()
        x.finish()
        m.remove_model(x)
    machine_us = (time.perf_counter() - t0) / k * 1e6
    return table_us, machine_us


def scaling_rows(n_sessions: int, lo: int, hi: int, turns: int, tokens: int) -> dict[str, dict[int, float]]:
    """Seconds of ``n_sessions`` sessions over a MemoryLog (no disk, so an O(n) step in the engine is not
    hidden by fsync noise) at ``lo`` and at ``hi`` in flight, summed over two runs each (lo, hi, hi, lo):
    the engine (``"engine"``), plain appends the same way (``"raw"``: what the interpreter's heap adds by
    itself), and the engine with the garbage collector off (``"engine_no_gc"``: what is left when its
    collections, which walk every session's objects in flight, are not counted)."""
    toks, lps = _payload(tokens)
    out: dict[str, dict[int, float]] = {k: {lo: 0.0, hi: 0.0} for k in ("engine", "raw", "engine_no_gc")}
    for c in (lo, hi, hi, lo):
        out["engine"][c] += asyncio.run(run_engine(None, n_sessions, c, turns, toks, lps))
        out["raw"][c] += asyncio.run(run_raw(None, n_sessions, c, turns, toks, lps))
        gc.disable()
        try:
            out["engine_no_gc"][c] += asyncio.run(run_engine(None, n_sessions, c, turns, toks, lps))
        finally:
            gc.enable()
    return out


def scaling_in_child(n_sessions: int, lo: int, hi: int, turns: int, tokens: int) -> dict[str, dict[int, float]]:
    """:func:`scaling_rows` in a fresh interpreter. In the process of the main run the collector walks
    what its 100,000 sessions left behind, and the scaling measured that heap (1.83x in the full run of
    2026-12-07 13:33 UTC, where the same rows alone gave 1.40-1.46x), not the engine."""
    got = json_from_child([__file__, "--scaling-child", "--scale-sessions", str(n_sessions), "--scale-low", str(lo),
                           "--scale-high", str(hi), "--turns", str(turns), "--tokens", str(tokens)])
    return {arm: {int(c): float(t) for c, t in by_c.items()} for arm, by_c in got.items()}


def thousands(n: int) -> str:
    """A concurrency as the GOAL name shows it: 50000 -> "50k", 200 -> "0.2k"."""
    return f"{n / 1000:g}k"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds): 5,000 sessions, scaling 200 vs 5,000")
    ap.add_argument("--sessions", type=int, default=None, help="sessions in the main run (default 100,000)")
    ap.add_argument("--concurrency", type=int, default=None, help="sessions in flight in the main run (default 10,000)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="split the main run into alternating engine/anchor rounds")
    ap.add_argument("--dir", default=None, help="where to put the logs (default: a temp dir, removed after)")
    ap.add_argument("--scale-low", type=int, default=None, help="the scaling's low concurrency (default 1,000; --quick 200)")
    ap.add_argument("--scale-high", type=int, default=None, help="the scaling's high concurrency (default 50,000; --quick 5,000)")
    ap.add_argument("--scale-sessions", type=int, default=None,
                    help="sessions per scaling run (default 50,000; --quick the larger of --scale-high and half of --sessions)")
    ap.add_argument("--live-sessions", type=int, default=None, help="live sessions for the resident memory (default 10,000; --quick 1,000)")
    ap.add_argument("--live-wave", type=int, default=WAVE, help=f"sessions set up at once for the resident memory, and its warm-up (default {WAVE})")
    ap.add_argument("--decide-ops", type=int, default=2000, help="session lifecycles timed per decide measure (default 2000)")
    ap.add_argument("--scaling-child", action="store_true", help=argparse.SUPPRESS)  # the child: scaling_rows alone
    args = ap.parse_args(argv)

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.scaling_child:
        rows = scaling_rows(args.scale_sessions, args.scale_low, args.scale_high, args.turns, args.tokens)
        print(json.dumps(rows), flush=True)
        return 0
    quick = args.quick
    n = args.sessions or (5_000 if quick else 100_000)
    conc = args.concurrency or (1_000 if quick else 10_000)
    lo = args.scale_low or (200 if quick else 1_000)
    hi = args.scale_high or (5_000 if quick else 50_000)
    n_scale = args.scale_sessions or (max(hi, n // 2) if quick else 50_000)
    n_live = args.live_sessions or (1_000 if quick else 10_000)
    toks, lps = _payload(args.tokens)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_engine_"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        print(f"bench_engine: {n:,} sessions x (open, start, {args.turns} turns x {args.tokens} tokens, finish), "
              f"{conc:,} concurrent, FileLog fsync=batch, dir {base}", file=sys.stderr)
        # Alternate engine and anchor in rounds (order swapped each round): on a
        # shared machine fsync latency drifts, and a back-to-back pair would
        # charge the drift to whichever ran second.
        rounds = max(1, args.rounds)
        per = n // rounds
        t_raw = t_eng = 0.0
        round_ratios = []
        cpu: dict[str, list[float]] = {"raw": [], "engine": []}
        for r in range(rounds):
            pair = [("raw", run_raw), ("engine", run_engine)]
            if r % 2:
                pair.reverse()
            took = {}
            for name, fn in pair:
                took[name] = asyncio.run(fn(base / f"{name}{r}", per, conc, args.turns, toks, lps, cpu=cpu[name]))
                if name == "raw" or r > 0:  # keep one engine log for the restart fold
                    shutil.rmtree(base / f"{name}{r}", ignore_errors=True)
            t_raw += took["raw"]
            t_eng += took["engine"]
            round_ratios.append(took["engine"] / took["raw"])
            print(f"  round {r + 1}/{rounds}: raw {took['raw']:.2f} s ({cpu['raw'][-1]:.2f} s CPU), "
                  f"engine {took['engine']:.2f} s ({cpu['engine'][-1]:.2f} s CPU)", file=sys.stderr)
        n = per * rounds
        events = n * (args.turns + 3)
        t_fold, fold_events = asyncio.run(reopen(base / "engine0"))
        n_mem = min(n, 20_000)
        m_raw = asyncio.run(run_raw(None, n_mem, conc, args.turns, toks, lps))
        m_eng = asyncio.run(run_engine(None, n_mem, conc, args.turns, toks, lps))
        per_open = asyncio.run(open_session_bytes(base / "mem", min(conc, 10_000)))
        # Scaling over a MemoryLog, in a fresh interpreter (see scaling_in_child); then end to end on the
        # FileLog, engine and anchor, to show what the log and the interpreter add at high concurrency.
        scaling = scaling_in_child(n_scale, lo, hi, args.turns, args.tokens)
        mem, mem_raw, mem_no_gc = scaling["engine"], scaling["raw"], scaling["engine_no_gc"]
        disk = {}
        for c in (lo, hi):
            for name, fn in (("engine", run_engine), ("raw", run_raw)):
                disk[(name, c)] = asyncio.run(fn(base / f"{name}-c{c}", n_scale, c, args.turns, toks, lps))
                shutil.rmtree(base / f"{name}-c{c}", ignore_errors=True)
        # The child's log goes in a temp dir of its own under ``base`` (removed after), so --dir holds it too.
        live = measure_in_child(n_live, GOAL_CONTEXT, args.live_wave, base)
        tab_lo, mach_lo = decide_cost(lo, args.decide_ops)
        tab_hi, mach_hi = decide_cost(hi, args.decide_ops)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)

    ratio = t_eng / t_raw
    scale = mem[hi] / mem[lo]
    us = lambda t, k=1: t / (n_scale * k) * 1e6  # noqa: E731 - per-session microseconds
    rows = [
        ("engine over FileLog", f"{n / t_eng:,.0f} sessions/s", f"{t_eng / events * 1e6:.1f} us/transition", f"{t_eng:.2f} s"),
        ("engine / raw, per round", " ".join(f"{x:.2f}" for x in round_ratios), f"median {sorted(round_ratios)[len(round_ratios) // 2]:.2f}x", ""),
        ("raw appends (anchor)", f"{n / t_raw:,.0f} sessions/s", f"{t_raw / events * 1e6:.1f} us/event", f"{t_raw:.2f} s"),
        ("engine / raw, CPU of every thread", f"{sum(cpu['engine']) / sum(cpu['raw']):.2f}x",
         " ".join(f"{e / r:.2f}" for e, r in zip(cpu["engine"], cpu["raw"])) + " per round",
         f"{sum(cpu['engine']):.2f} / {sum(cpu['raw']):.2f} s"),
        ("engine / raw over MemoryLog (CPU only)", f"{m_eng / m_raw:.2f}x", f"{(m_eng - m_raw) / (n_mem * (args.turns + 3)) * 1e6:.1f} us/transition added", f"{n_mem:,} sessions"),
        (f"engine over MemoryLog, {lo:,} / {hi:,} concurrent", f"{us(mem[lo], 2):.1f} / {us(mem[hi], 2):.1f} us/session", f"{scale:.2f}x", f"{n_scale:,} sessions x 2 each"),
        (f"engine over MemoryLog, collector off, {lo:,} / {hi:,}", f"{us(mem_no_gc[lo], 2):.1f} / {us(mem_no_gc[hi], 2):.1f} us/session",
         f"{mem_no_gc[hi] / mem_no_gc[lo]:.2f}x", f"{n_scale:,} sessions x 2 each"),
        (f"raw appends over MemoryLog, {lo:,} / {hi:,}", f"{us(mem_raw[lo], 2):.1f} / {us(mem_raw[hi], 2):.1f} us/session",
         f"{mem_raw[hi] / mem_raw[lo]:.2f}x", "(the anchor's own scaling: the collector walks a larger heap)"),
        # The goal below is on the engine's scaling alone, as its text was written; this row is what the
        # engine adds to the interpreter's own (an O(n) step per operation in the engine would show here).
        ("engine's scaling over the anchor's, over MemoryLog", f"{scale / (mem_raw[hi] / mem_raw[lo]):.2f}x",
         "(information: per_session_cost below divided by the row above)", ""),
        (f"engine over FileLog, {lo:,} / {hi:,} concurrent", f"{us(disk[('engine', lo)]):.1f} / {us(disk[('engine', hi)]):.1f} us/session", f"{disk[('engine', hi)] / disk[('engine', lo)]:.2f}x", f"{n_scale:,} sessions each"),
        (f"raw appends over FileLog, {lo:,} / {hi:,}", f"{us(disk[('raw', lo)]):.1f} / {us(disk[('raw', hi)]):.1f} us/session", f"{disk[('raw', hi)] / disk[('raw', lo)]:.2f}x", "(the anchor's own scaling)"),
        ("restart fold from lsn 0 (SessionEngine.open)", f"{fold_events / t_fold:,.0f} events/s", f"{fold_events:,} events", f"{t_fold:.2f} s"),
        ("memory per open session", f"{per_open:,.0f} B", "(engine code, tracemalloc)", ""),
        (f"resident memory per live session, {GOAL_CONTEXT:,}-token context", f"{live['kb_per_session']:.1f} kB",
         f"{live['sessions']:,} live sessions", "(FileLog, fresh process)"),
        (f"decide: table, {lo:,} / {hi:,} live", f"{tab_lo:.2f} / {tab_hi:.2f} us", "per add+start+finish+remove", ""),
        (f"decide: transitions models, {lo:,} / {hi:,} live", f"{mach_lo:.1f} / {mach_hi:.1f} us", "(shared Machine; O(n))", ""),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    print(goal_line("engine_vs_raw_append", f"{ratio:.2f}x", "<=", "1.5x", meets(ratio, "<=", 1.5)))
    print(rss_goal_line(live["kb_per_session"]))
    print(goal_line(f"per_session_cost_{thousands(hi)}_vs_{thousands(lo)}_concurrent", f"{scale:.2f}x", "<=", "1.3x",
                    meets(scale, "<=", 1.3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
