"""Reading JetStream logs without writing: JetStreamRun / JetStreamRef, the
ordered-consumer cursor, reads from a late LSN (binary search over the
subject), and the same logs through follow_logs and a LogSource (open_source)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agentlog.events.log.api import LogCorruption, NotALog
from agentlog.events.schema.types import CommandRan, SessionOpened
from event_samples import small_event

pytest.importorskip("nats", reason="the JetStream log needs the nats extra: pip install 'agentlog[nats]'")

from agentlog.events import follow_logs, open_source  # noqa: E402
from agentlog.events.log.jetstream import JetStreamLog  # noqa: E402
from agentlog.events.log.jetstream_read import JetStreamRun  # noqa: E402
from agentlog.events.log.jetstream_url import is_nats_url, parse_nats_url  # noqa: E402

_names = itertools.count()


@pytest.fixture
def stream():
    return f"rd{next(_names)}"


def opened() -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1)


def write(url, stream, partition, sessions, per=3):
    """Append ``per`` events for each of ``sessions`` to one partition; its envelopes."""
    with JetStreamLog.open(url, stream, partition) as lg:
        out = lg.append_batch([(s, 0, opened()) for s in sessions])
        for k in range(1, per):
            out += lg.append_batch([(s, k, small_event(k)) for s in sessions])
        return out


def test_nats_urls_parse_and_bad_ones_are_named():
    assert parse_nats_url("nats://127.0.0.1:4222/run7") == ("nats://127.0.0.1:4222", "run7", None)
    assert parse_nats_url("nats://a:1,b:2/run7/p0003") == ("nats://a:1,nats://b:2", "run7", "p0003")
    assert parse_nats_url("nats://a:1/run7/learner")[2] == "learner"
    assert is_nats_url("nats://x:1/s") and not is_nats_url("/tmp/run") and not is_nats_url(None)
    for bad, part in [("nats://a:1", "stream"), ("nats://a/run", "host:port"), ("nats://a:1/r.x", "stream"),
                      ("nats://a:1/r/P3", "log"), ("nats://a:1/r/p/q", "stream"), ("/tmp/r", "nats://")]:
        with pytest.raises(ValueError, match=part):
            parse_nats_url(bad)


def test_a_missing_stream_is_not_a_log(nats_server):
    with pytest.raises(NotALog, match="no such stream"):
        JetStreamRun.open(nats_server.url, "nothing_here")


def test_a_reader_lists_reads_and_merges_partitions(nats_server, stream):
    a = write(nats_server.url, stream, 0, ["a", "b"])
    b = write(nats_server.url, stream, 2, ["c"])
    write(nats_server.url, stream, "learner", ["L"], per=1)
    with JetStreamRun.open_url(f"{nats_server.url}/{stream}") as run:
        assert run.names() == ["learner", "p0000", "p0002"]
        assert run.partitions() == [0, 2]
        assert list(run.log(0).read()) == a
        assert list(run.log(2).read()) == b
        raw = list(run.log(0).read(raw=True))
        assert [r.decode() for r in raw] == a
        with open_source(f"{nats_server.url}/{stream}") as merged_source:
            merged = list(merged_source.read_tagged())
        assert sorted((pid, env.lsn) for pid, env in merged) == sorted([(0, e.lsn) for e in a] + [(2, e.lsn) for e in b])
        assert [env.ts_ns for _, env in merged] == sorted(env.ts_ns for _, env in merged)


@pytest.mark.parametrize("from_lsn", [0, 1, 5, 6, 11, 12, 17, 40])
def test_a_read_from_any_lsn_starts_exactly_there(nats_server, stream, from_lsn):
    """Reopens (fence messages between records) and a chunked record do not
    mislead the binary search from LSN to stream sequence."""
    envs = write(nats_server.url, stream, 0, ["a", "b"])  # lsn 0..5
    envs += write(nats_server.url, stream, 0, ["c", "d"])  # a new epoch: a fence, lsn 6..11
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg._max_payload = 8192  # small chunks, so that a modest record is split
        envs += lg.append_batch([("e", 0, opened()), ("e", 1, CommandRan(command="x" * 20000, exit_code=0, duration_s=1.0))])  # lsn 12, 13 (chunked)
        envs += lg.append_batch([("e", k, small_event(k)) for k in range(2, 6)])  # lsn 14..17
    with JetStreamRun.open(nats_server.url, stream) as run:
        assert list(run.log(0).read(from_lsn)) == [e for e in envs if e.lsn >= from_lsn]


def test_corruption_mid_subject_is_named_by_sequence_after_the_records_before_it(nats_server, stream):
    good = write(nats_server.url, stream, 0, ["a"])

    async def scribble():
        import nats

        nc = await nats.connect(nats_server.url)
        try:
            return (await nc.jetstream().publish(f"{stream}.p0000", b"x" * 64)).seq
        finally:
            await nc.close()

    seq = asyncio.run(scribble())
    with JetStreamRun.open(nats_server.url, stream) as run:
        got = []
        with pytest.raises(LogCorruption, match=rf"seq {seq}: type byte"):
            for env in run.log(0).read():
                got.append(env)
        assert got == good  # the records before the damage are read first, as from a segment


def test_follow_logs_tails_jetstream_partitions_as_it_tails_directories(nats_server, stream):
    """follow_logs takes JetStreamRefs beside paths: every record of every
    partition, each in LSN order, from each partition's own start, including
    records appended while it follows and a partition created after it began."""
    first = write(nats_server.url, stream, 0, ["a"])

    async def main():
        with JetStreamRun.open(nats_server.url, stream) as run:
            refs = {0: run.log(0), 1: run.log(1)}
            got: dict[int, list] = {0: [], 1: []}
            later: list = []
            agen = follow_logs(refs, {0: 1}, poll_s=0.01)
            try:
                async for pid, env in agen:
                    got[pid].append(env)
                    if pid == 0 and env.lsn == first[-1].lsn and not later:
                        later.extend(await asyncio.to_thread(write, nats_server.url, stream, 1, ["z"]))
                    if got[1] == later and later:
                        break
            finally:
                await agen.aclose()
            return got, later

    got, later = asyncio.run(asyncio.wait_for(main(), 60))
    assert got[0] == first[1:]
    assert got[1] == later

