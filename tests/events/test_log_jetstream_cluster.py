"""JetStreamLog on the 3-node loopback cluster with replicas 3 (R3): the
stream leader SIGKILLed mid-appends (sync batches and asyncio appends at
once), a writer past its failover deadline, writer fencing, and records over
the max payload never seen partly. One cluster per module (nats_helpers); the
contract suite on R3 is in test_log_contract.py.

A stream leader is re-elected by the server's raft after 4 to 9 s (its
election timeout is a compile-time constant of nats-server, server/raft.go,
with no configuration setting), so the leader-loss test shares one kill
between both writers."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from nats_helpers import nats_client, run

from agentlog.events.log.api import LogClosed, LogError, LogFenced
from agentlog.events.log.jetstream_conn import retried
from agentlog.events.schema.types import SessionOpened
from event_samples import small_event

nats = pytest.importorskip("nats", reason="JetStreamLog needs the nats extra: pip install 'agentlog[nats]'")

from agentlog.events.log.jetstream import JetStreamLog  # noqa: E402

pytestmark = pytest.mark.required

_names = itertools.count()


def opened(**metadata) -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1, metadata=metadata)


@pytest.fixture
def stream():
    return f"jsc{next(_names)}"


def stream_info(cluster, stream: str, within_s: float = 45.0):
    """The stream's info as a fresh client sees it (leader, replicas, state).

    Asked through the log's own ``retried`` while the cluster leaves it unanswered: the
    cluster answers a stream's info and messages only from the stream leader, with the meta
    leader's say. On two loaded cores (the suite's workers, the cluster and the test's own
    writers at full speed) one answer took over 10 s in CI, and around a kill the meta leader
    may itself be in election (4 to 9 s)."""

    async def body():
        async with nats_client(cluster) as nc:
            js = nc.jetstream(timeout=5)
            return await retried(lambda: js.stream_info(stream), "the stream's info", stream, within_s, 5.0, "within_s")

    return run(body())


def stored_messages(cluster, stream: str, within_s: float = 45.0) -> list[tuple[int, dict]]:
    """(sequence, headers) of every message of the stream, asked of the stream leader."""

    async def body():
        async with nats_client(cluster) as nc:
            js = nc.jetstream(timeout=5)
            info = await retried(lambda: js.stream_info(stream), "the stream's info", stream, within_s, 5.0, "within_s")
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                msg = await retried(lambda: js.get_msg(stream, seq), f"message {seq}", stream, within_s, 5.0, "within_s")
                out.append((seq, msg.headers or {}))
            return out

    return run(body())


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.02)


def test_stream_leader_sigkill_mid_appends_acks_every_event_exactly_once(nats_cluster, stream):
    """SIGKILL the R3 stream's leader while a thread appends sync batches and an
    asyncio task appends one event at a time: no append fails, both resume on
    the new leader, and every acknowledged event is stored once, in one
    gapless LSN order, each (session, seq) once."""
    lg = JetStreamLog.open(nats_cluster.urls, stream, 0, replicas=3, publish_timeout_s=1.0, failover_timeout_s=30.0)
    acked: dict[str, list] = {"sync": [], "async": []}
    errors: list[BaseException] = []
    stop = threading.Event()

    def sync_writer() -> None:
        k = 0
        try:
            while not stop.is_set():
                batch = [("sync", k + j, opened() if k + j == 0 else small_event(k + j)) for j in range(3)]
                acked["sync"].extend(lg.append_batch(batch))
                k += 3
        except BaseException as e:  # reported by the test below, never lost
            errors.append(e)

    def async_writer() -> None:
        async def body():
            k = 0
            while not stop.is_set():
                acked["async"].append(await lg.append("async", k, opened() if k == 0 else small_event(k)))
                k += 1

        try:
            asyncio.run(body())
        except BaseException as e:
            errors.append(e)

    writers = [threading.Thread(target=sync_writer), threading.Thread(target=async_writer)]
    try:
        for t in writers:
            t.start()
        wait_until(lambda: len(acked["sync"]) >= 30 and len(acked["async"]) >= 10 or errors, 30, "acks before the kill")
        leader = stream_info(nats_cluster, stream).cluster.leader
        nats_cluster.kill(leader)
        t_kill = time.monotonic()
        at_kill = {k: len(v) for k, v in acked.items()}
        wait_until(
            lambda: all(len(acked[k]) >= at_kill[k] + 10 for k in acked) or errors,
            45,
            f"appends resumed after killing stream leader {leader}",
        )
        resumed_s = time.monotonic() - t_kill
    finally:
        stop.set()
        for t in writers:
            t.join(60)
    assert not errors, errors
    assert lg.fatal_reason is None
    new_leader = stream_info(nats_cluster, stream).cluster.leader
    assert new_leader not in (None, leader)
    lg.close()

    every = [e for k in acked for e in acked[k]]
    assert sorted(e.lsn for e in every) == list(range(len(every)))
    with JetStreamLog.open(nats_cluster.urls, stream, 0, replicas=3) as again:
        stored = list(again.read())
        assert again.next_lsn == len(every) and again.epoch == 1
    assert [e.lsn for e in stored] == list(range(len(every)))
    assert len({(e.session_id, e.session_seq) for e in stored}) == len(stored)
    assert {e.lsn: (e.session_id, e.session_seq, e.body) for e in every} == {
        e.lsn: (e.session_id, e.session_seq, e.body) for e in stored
    }
    # On the server too: one message per record (plus the two epochs' fences), no duplicate id.
    ids = [h.get("Nats-Msg-Id") for _, h in stored_messages(nats_cluster, stream)]
    assert len(ids) == len(every) + 2 and len(set(ids)) == len(ids)
    print(f"\nFIGURE jetstream_failover resumed_s={resumed_s:.2f} events={len(every)} killed={leader} new_leader={new_leader}")


def test_a_fenced_writer_on_r3_is_refused_and_its_batch_is_not_stored(nats_cluster, stream):
    old = JetStreamLog.open(nats_cluster.urls, stream, 1, replicas=3)
    old.append_batch([("a", 0, opened()), ("a", 1, small_event(1))])
    new = JetStreamLog.open(nats_cluster.urls, stream, 1, replicas=3)
    try:
        assert (old.epoch, new.epoch) == (0, 1) and new.next_lsn == 2
        with pytest.raises(LogFenced, match=r"epoch 0 was fenced by a newer writer.*lsn 2 and later were not acknowledged"):
            old.append_batch([("a", 2, small_event(2)), ("b", 0, opened())])
        with pytest.raises(LogClosed, match="fatal"):
            old.append_batch([("b", 0, opened())])
        new.append_batch([("a", 2, small_event(3))])
        assert [(e.lsn, e.session_id, e.session_seq) for e in new.read()] == [(0, "a", 0), (1, "a", 1), (2, "a", 2)]
        assert list(new.read())[2].body == small_event(3)
    finally:
        old.close()
        new.close()


def test_racing_opens_on_r3_take_over_or_are_fenced_never_a_raw_refusal(nats_cluster, stream):
    """Writers opening one R3 partition at the same moment, while its first
    writer appends: the replicated stream refuses a losing fence with either
    "wrong last sequence" code (10164 while the other's message is in
    process), and every open either succeeds or raises LogFenced, never a
    raw BadRequestError. Every append acknowledged is stored, none twice."""
    for i in range(4):
        name = f"{stream}r{i}"
        first = JetStreamLog.open(nats_cluster.urls, name, 0, replicas=3)
        first.append_batch([("a", 0, opened())])
        barrier = threading.Barrier(3)
        logs: list = []
        failures: list = []
        acked: dict[str, int] = {}

        def race() -> None:
            barrier.wait()
            try:
                logs.append(JetStreamLog.open(nats_cluster.urls, name, 0, replicas=3))
            except LogFenced:
                pass  # lost to the other opener: refused, as it may be
            except Exception as exc:  # noqa: BLE001 - checked below
                failures.append(exc)

        def append_meanwhile() -> None:
            barrier.wait()
            try:
                for k in itertools.count(1):
                    acked[f"a{k}"] = first.append_batch([("a", k, small_event(k))])[0].lsn
            except LogError:
                pass  # fenced by an opener

        threads = [threading.Thread(target=race), threading.Thread(target=race), threading.Thread(target=append_meanwhile)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        try:
            assert failures == [], f"race {i}: an open failed other than by LogFenced: {failures!r}"
            assert logs, f"race {i}: neither opener took over"
            for k, lg in enumerate(logs):
                try:
                    acked[f"w{k}"] = lg.append_batch([(f"w{k}", 0, opened())])[0].lsn
                except LogError:
                    pass  # fenced by the other opener
            stored = {f"a{e.session_seq}" if e.session_id == "a" else e.session_id: e.lsn for e in logs[-1].read()}
            assert {key: stored.get(key) for key in acked} == acked, f"race {i}: acknowledged {acked}, stored {stored}"
            assert any(key.startswith("w") for key in acked), f"race {i}: no opener could append"
        finally:
            first.close()
            for lg in logs:
                lg.close()


def test_records_over_the_max_payload_round_trip_whole_and_are_never_seen_partly(nats_cluster, stream):
    """Three 2.5 MiB records (3 chunks each, one atomic batch per append) on R3,
    while a second thread reads the partition over and over: every read is a
    prefix of the final log with whole bodies, never a torn record."""
    size = int(2.5 * (1 << 20))
    bigs = [opened(blob=chr(ord("a") + i) * size) for i in range(3)]
    with JetStreamLog.open(nats_cluster.urls, stream, 0, replicas=3) as lg:
        lg.append_batch([("s", 0, opened())])
        seen: list[list] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    seen.append([(e.lsn, e.session_id, e.body) for e in lg.read()])
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=reader)
        t.start()
        try:
            for i, big in enumerate(bigs):
                lg.append_batch([(f"b{i}", 0, big), ("s", i + 1, small_event(i))])
        finally:
            stop.set()
            t.join(60)
        assert not errors, errors
        final = [(e.lsn, e.session_id, e.body) for e in lg.read()]
        assert [body for _, sid, body in final if sid.startswith("b")] == bigs
        assert seen and all(view == final[: len(view)] for view in seen)
        chunks = [h.get("Agentlog-Chunk") for _, h in stored_messages(nats_cluster, stream) if h.get("Agentlog-Chunk")]
        assert chunks == ["1/3", "2/3", "3/3"] * 3
    with JetStreamLog.open(nats_cluster.urls, stream, 0, replicas=3) as again:
        assert [(e.lsn, e.session_id, e.body) for e in again.read()] == final


def test_a_reader_opened_while_the_leaders_are_lost_waits_for_the_election(nats_cluster, stream):
    """Kill the cluster's meta leader (which consumers are created through),
    then read at once through a read-only JetStreamRun from a later LSN:
    finding the start and creating the ordered consumer are tried again
    until the election is over, and every record is read."""
    from agentlog.events.log.jetstream_read import JetStreamRun

    urls = ",".join(nats_cluster.urls)
    with JetStreamLog.open(urls, stream, 0, replicas=3) as lg:
        envs = lg.append_batch([(f"s{i}", 0, opened()) for i in range(20)])
    nats_cluster.kill(nats_cluster.meta_leader())
    with JetStreamRun.open(urls, stream) as reader:
        assert list(reader.log(0).read(5)) == envs[5:]


def test_an_append_past_the_failover_deadline_makes_the_log_fatal_and_is_not_acked(nats_cluster, stream):
    """With two of three nodes gone the stream has no quorum: the append is
    retried until failover_timeout_s, then fails loudly naming stream,
    subject and LSN; it is never reported as acknowledged, and the log is
    fatal. (Last in the module: the fixture restarts the nodes for any test after it.)"""
    lg = JetStreamLog.open(nats_cluster.urls, stream, 0, replicas=3, publish_timeout_s=0.5, failover_timeout_s=2.0)
    try:
        lg.append_batch([("a", 0, opened())])
        leader = stream_info(nats_cluster, stream).cluster.leader
        for node in [n.name for n in nats_cluster.nodes if n.name != leader]:
            nats_cluster.kill(node)
        t0 = time.monotonic()
        with pytest.raises(LogError, match=rf"stream '{stream}' subject '{stream}.p0000': publish of lsn 1 \(and later\) not acknowledged: no ack from stream '{stream}' within failover_timeout_s=2"):
            lg.append_batch([("a", 1, small_event(1))])
        assert time.monotonic() - t0 < 15
        assert "not acknowledged" in lg.fatal_reason
        with pytest.raises(LogClosed, match="fatal"):
            lg.append_batch([("a", 1, small_event(1))])
    finally:
        lg.close()

