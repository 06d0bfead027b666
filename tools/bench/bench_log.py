"""Benchmark of the event log against its performance goals, each figure against an anchor
measured in the same run on the same disk:

1. durable append of 2048-token ``turn_recorded`` events (batch fsync) vs a raw
   sequential write + fdatasync of the same bytes in the same batches (the
   append calls are timed; opening and closing the log are printed beside it);
2. the same events as a JSONL log (json.dumps with token lists, flush + fsync
   per batch, as trainers dump rollouts today): write time, full read time, size;
3. small events (<= 200 bytes framed) through the synchronous batch API and
   the asyncio API, both durable per batch;
4. full replay of the token-event log vs a raw read of the same files.

    .venv/bin/python tools/bench/bench_log.py [--quick] [--dir DIR] [--turn-events N] [--batch N] [--reps N]
        [--small-events N] [--async-events N] [--small-batch N] [--sessions N]

Every measurement runs under both frame codecs (events.log.framecodec): the
compiled one, when it is built, and the pure-Python fallback. Prints a table
with both side by side, the fallback's figures against the goals (not
judged), then one ``GOAL`` line per goal for the compiled codec. Exits 0
even on a MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import structlog  # noqa: E402

from agentlog.events import FileLog, read_log  # noqa: E402
from agentlog.events.log import framecodec, segmap  # noqa: E402
from agentlog.events.log.format import list_segments, segment_name  # noqa: E402
from agentlog.events.schema.types import CommandRan, TurnRecorded  # noqa: E402
from agentlog.tools.bench.goals import goal  # noqa: E402

TOKENS = 2048


def turn_events(n: int, seed: int = 0) -> list[TurnRecorded]:
    """n turn_recorded events with 2048 prompt and 2048 output tokens (+ log-probs)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append(
            TurnRecorded(
                turn_index=i % 16,
                messages=[{"role": "user", "content": "fix the failing test"}],
                prompt_ids=rng.integers(0, 151_000, TOKENS, dtype=np.int32),
                output_ids=rng.integers(0, 151_000, TOKENS, dtype=np.int32),
                output_log_probs=(-rng.exponential(0.5, TOKENS)).astype(np.float32),
                finish_reason="stop",
                policy_version=3,
            )
        )
    return out


def as_json(sid: str, seq: int, ev: TurnRecorded) -> str:
    """How a trainer typically dumps a rollout turn: token lists in JSON."""
    return json.dumps(
        {
            "session_id": sid,
            "seq": seq,
            "turn_index": ev.turn_index,
            "messages": ev.messages,
            "prompt_ids": ev.prompt_tokens.tolist(),
            "output_ids": ev.output_tokens.tolist(),
            "output_log_probs": ev.log_probs.tolist(),
            "finish_reason": ev.finish_reason,
            "policy_version": ev.policy_version,
        }
    )


def dir_bytes(d: Path) -> int:
    return sum((d / segment_name(s)).stat().st_size for s in list_segments(d))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best(fn, reps: int) -> float:
    return min(timed(fn) for _ in range(reps))


def drop_dir(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- 1 + 2: token events


def bench_tokens(root: Path, n: int, batch: int, reps: int) -> dict:
    events = turn_events(n)
    sids = [f"s{i % 64}" for i in range(n)]
    seqs = []
    counter: dict[str, int] = {}
    for s in sids:
        seqs.append(counter.get(s, 0))
        counter[s] = seqs[-1] + 1
    recs = list(zip(sids, seqs, events))
    batches = [recs[i : i + batch] for i in range(0, n, batch)]

    open_close: list[float] = []

    def ours() -> float:
        # Only the appends are timed, as the anchor times only its writes: opening a
        # log (its directory, first segment and checkpoint, each synced) and closing
        # it (the final checkpoint) are once per writer, reported beside it.
        d = root / "tok"
        drop_dir(d)
        t = time.perf_counter()
        lg = FileLog.open(d, fsync="batch")
        t_open = time.perf_counter() - t
        t = time.perf_counter()
        for b in batches:
            lg.append_batch(b)
        appended = time.perf_counter() - t
        t = time.perf_counter()
        lg.close()
        open_close.append(t_open + time.perf_counter() - t)
        return appended

    t_ours = min(ours() for _ in range(reps))
    d = root / "tok"
    total = dir_bytes(d)
    per_batch = [total * len(b) // n for b in batches]

    def raw_write():
        p = root / "raw.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        blob = os.urandom(max(per_batch))
        try:
            for nb in per_batch:
                view = memoryview(blob)[:nb]
                while view:
                    view = view[os.write(fd, view) :]
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.unlink(p)

    t_raw = best(raw_write, reps)

    jsonl = root / "rollouts.jsonl"

    def json_write():
        with open(jsonl, "w") as f:
            for b in batches:
                for sid, seq, ev in b:
                    f.write(as_json(sid, seq, ev))
                    f.write("\n")
                f.flush()
                os.fsync(f.fileno())

    t_json_w = best(json_write, reps)
    json_size = jsonl.stat().st_size

    def json_read():
        with open(jsonl) as f:
            for line in f:
                json.loads(line)

    def our_read():
        for _ in read_log(d):
            pass

    def our_read_raw():  # CRC-checked frames, payload left undecoded (zero-copy views)
        for _ in read_log(d, raw=True):
            pass

    def raw_read():
        for s in list_segments(d):
            with open(d / segment_name(s), "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass

    raw_read()  # warm the page cache for every reader alike
    t_json_r = best(json_read, reps)
    t_our_r = best(our_read, reps)
    t_our_raw = best(our_read_raw, reps)
    t_raw_r = best(raw_read, reps)
    assert sum(1 for _ in read_log(d)) == n
    return dict(
        n=n,
        batch=batch,
        bytes=total,
        json_bytes=json_size,
        t_ours=t_ours,
        t_open_close=min(open_close),
        t_raw=t_raw,
        t_json_w=t_json_w,
        t_json_r=t_json_r,
        t_our_r=t_our_r,
        t_our_raw=t_our_raw,
        t_raw_r=t_raw_r,
    )


# ---------------------------------------------------------------- 3: small events


def small(i: int) -> CommandRan:
    return CommandRan(command=f"ls -la /w/{i % 1000}", exit_code=i % 2, duration_s=0.01)


def bench_small_sync(root: Path, n: int, batch: int, sessions: int) -> tuple[float, int]:
    d = root / "small_sync"
    drop_dir(d)
    lg = FileLog.open(d, fsync="batch")
    recs = [(f"s{i % sessions}", i // sessions, small(i)) for i in range(n)]
    batches = [recs[i : i + batch] for i in range(0, n, batch)]
    # The prepared input (n records built just now) is moved out of the cyclic
    # GC's view, so that the collections the appends trigger walk the log's own
    # objects, not the benchmark's input, as in a process that built its events
    # one at a time.
    gc.collect()
    gc.freeze()
    try:
        t = time.perf_counter()
        for b in batches:
            lg.append_batch(b)
        el = time.perf_counter() - t
    finally:
        gc.unfreeze()
    lg.close()
    frame = dir_bytes(d) // n
    return n / el, frame


def bench_small_async(root: Path, n: int, sessions: int) -> float:
    d = root / "small_async"
    drop_dir(d)
    lg = FileLog.open(d, fsync="batch")
    per = n // sessions

    async def session(k: int):
        sid = f"a{k}"
        for seq in range(per):
            await lg.append(sid, seq, small(seq))

    async def main():
        await asyncio.gather(*(session(k) for k in range(sessions)))

    t = time.perf_counter()
    asyncio.run(main())
    el = time.perf_counter() - t
    lg.close()
    return per * sessions / el


def bench_small_raw(root: Path, n: int, frame: int, batch: int) -> float:
    """Anchor: the same bytes written and fdatasync'd per batch."""
    p = root / "raw_small.bin"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    blob = os.urandom(frame * batch)
    t = time.perf_counter()
    for _ in range(0, n, batch):
        os.write(fd, blob)
        os.fdatasync(fd)
    el = time.perf_counter() - t
    os.close(fd)
    os.unlink(p)
    return n / el


# ---------------------------------------------------------------- main


def measure_all(root: Path, sizes: argparse.Namespace) -> dict:
    """Every measurement, with the codec currently selected (events.log.framecodec), at the resolved ``sizes``."""
    tok = bench_tokens(root, n=sizes.turn_events, batch=sizes.batch, reps=sizes.reps)
    n_small, n_async = sizes.small_events, sizes.async_events
    sync_rate, frame = bench_small_sync(root, n_small, batch=sizes.small_batch, sessions=sizes.sessions)
    raw_small = bench_small_raw(root, n_small, frame, sizes.small_batch)
    async_rate = bench_small_async(root, n_async, sessions=sizes.sessions)
    return dict(tok=tok, n_small=n_small, n_async=n_async, sessions=sizes.sessions, sync_rate=sync_rate, frame=frame,
                raw_small=raw_small, async_rate=async_rate)


def resolve_sizes(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the sizes left unset: the full run's, or ``--quick``'s."""
    quick_or_full = {
        "turn_events": (256, 2048), "batch": (32, 64), "reps": (1, 3),
        "small_events": (100_000, 1_000_000), "async_events": (20_000, 200_000),
    }
    for name, (quick, full) in quick_or_full.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def rows_of(r: dict) -> list[tuple[str, float, str]]:
    """The table's rows for one codec's measurements: (name, seconds, rate)."""
    tok, n_small, n_async = r["tok"], r["n_small"], r["n_async"]
    sync_rate, raw_small, async_rate = r["sync_rate"], r["raw_small"], r["async_rate"]
    mb = tok["bytes"] / 1e6
    return [
        ("token events: durable append (ours)", tok["t_ours"], f"{tok['n'] / tok['t_ours']:,.0f} ev/s, {mb / tok['t_ours']:,.0f} MB/s"),
        ("token events: opening + closing the log (not in the goal)", tok["t_open_close"], "once per writer"),
        ("token events: raw write+fdatasync", tok["t_raw"], f"{mb / tok['t_raw']:,.0f} MB/s"),
        ("token events: JSONL write+fsync", tok["t_json_w"], f"{tok['n'] / tok['t_json_w']:,.0f} ev/s"),
        ("token events: full replay (ours)", tok["t_our_r"], f"{tok['n'] / tok['t_our_r']:,.0f} ev/s, {mb / tok['t_our_r']:,.0f} MB/s"),
        ("token events: replay, frames only (raw=True)", tok["t_our_raw"], f"{tok['n'] / tok['t_our_raw']:,.0f} ev/s, {mb / tok['t_our_raw']:,.0f} MB/s"),
        ("token events: raw read of the files", tok["t_raw_r"], f"{mb / tok['t_raw_r']:,.0f} MB/s"),
        ("token events: JSONL read (json.loads)", tok["t_json_r"], f"{tok['n'] / tok['t_json_r']:,.0f} ev/s"),
        (f"small events ({r['frame']} B framed): sync batch", n_small / sync_rate, f"{sync_rate:,.0f} ev/s"),
        ("small events: raw write+fdatasync", n_small / raw_small, f"{raw_small:,.0f} ev/s"),
        (f"small events: asyncio append, {r['sessions']} sessions", n_async / async_rate, f"{async_rate:,.0f} ev/s"),
    ]


def goals_of(r: dict) -> list[str]:
    """The GOAL lines for one codec's measurements."""
    tok = r["tok"]
    return [
        goal("durable_append_vs_raw_fdatasync", tok["t_raw"] / tok["t_ours"], ">=", 0.8),
        goal("jsonl_write_speedup", tok["t_json_w"] / tok["t_ours"], ">=", 10),
        goal("jsonl_read_speedup", tok["t_json_r"] / tok["t_our_r"], ">=", 20),
        goal("size_vs_jsonl", tok["bytes"] / tok["json_bytes"], "<=", 0.6),
        goal("small_events_sync_batch", r["sync_rate"], ">=", 500_000, " ev/s"),
        goal("small_events_asyncio", r["async_rate"], ">=", 80_000, " ev/s"),
        goal("replay_vs_raw_read", tok["t_raw_r"] / tok["t_our_r"], ">=", 0.5),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds)")
    ap.add_argument("--dir", help="where to write (default: a temp dir on the default disk)")
    ap.add_argument("--turn-events", type=int, default=None, help="token events written (default 2048; --quick 256)")
    ap.add_argument("--batch", type=int, default=None, help="token events per durable batch (default 64; --quick 32)")
    ap.add_argument("--reps", type=int, default=None, help="runs of each token-event measure, best kept (default 3; --quick 1)")
    ap.add_argument("--small-events", type=int, default=None, help="small events through the sync batch API (default 1,000,000; --quick 100,000)")
    ap.add_argument("--async-events", type=int, default=None, help="small events through the asyncio API (default 200,000; --quick 20,000)")
    ap.add_argument("--small-batch", type=int, default=10_000, help="small events per durable batch (default 10,000)")
    ap.add_argument("--sessions", type=int, default=1000, help="sessions the small events are spread over (default 1000)")
    args = resolve_sizes(ap.parse_args(argv))
    # Keep the table readable: the log's own info lines go nowhere here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))

    # Both frame codecs, side by side: the compiled one (when built) and the pure-Python fallback.
    codecs = ["compiled", "pure"] if framecodec.available() else ["pure"]
    results = {}
    root = Path(tempfile.mkdtemp(prefix="bench_log-", dir=args.dir))
    saved = framecodec.native
    try:
        for name in codecs:
            framecodec.use_native(name == "compiled")
            results[name] = measure_all(root, args)
    finally:
        framecodec.native = saved
        shutil.rmtree(root, ignore_errors=True)

    tok = results[codecs[0]]["tok"]
    print(f"bench_log: {tok['n']} x {TOKENS}-token turn events in batches of {tok['batch']}; log {tok['bytes']:,} B, JSONL {tok['json_bytes']:,} B")
    print(f"codecs: {', '.join(codecs)} (compiled: {'built' if framecodec.available() else 'NOT BUILT'}); anchors are measured in each pass")
    # The compiled replay checks a large segment's frames in a second thread: it needs a free second core.
    walk = "in a second thread" if segmap.CPUS > 1 else "in the reading thread (one CPU)"
    print(f"compiled replay: CRC walk {walk}; {segmap.CPUS} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    table = {name: rows_of(r) for name, r in results.items()}
    head = "".join(f" {name + ' s':>10}" for name in codecs)
    print(f"{'measurement':<46}{head}  rate ({codecs[0]})")
    for i, (label, _, rate) in enumerate(table[codecs[0]]):
        secs = "".join(f" {table[name][i][1]:>10.4f}" for name in codecs)
        print(f"{label:<46}{secs}  {rate}")
    for name in codecs[1:]:
        print(f"-- {name} codec (not judged):")
        for line in goals_of(results[name]):
            print("   " + line.replace("GOAL ", "", 1))
    # The goals are judged on the first codec: the compiled one when it is built.
    for line in goals_of(results[codecs[0]]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
