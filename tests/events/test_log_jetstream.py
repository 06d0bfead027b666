"""JetStreamLog beyond the contract: fencing, recovery on reopen, per-event
identity and dedup, refusals. One local nats-server per module (conftest)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from agentlog.events.log.api import LogClosed, LogCorruption, LogError, LogFenced, SequenceError
from agentlog.events.schema.types import SessionFinished, SessionOpened
from event_samples import small_event
from nats_helpers import pause, raw

nats = pytest.importorskip("nats", reason="JetStreamLog needs the nats extra: pip install 'agentlog[nats]'")

from agentlog.events.log.jetstream import JetStreamLog, is_wrong_last_sequence  # noqa: E402

_names = itertools.count()


def opened() -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1)


@pytest.fixture
def stream():
    return f"js{next(_names)}"


def test_a_new_writer_fences_the_old_one_and_continues_its_lsns(nats_server, stream):
    old = JetStreamLog.open(nats_server.url, stream, 1)
    old.append_batch([("a", 0, opened()), ("a", 1, small_event(1)), ("b", 0, opened())])
    new = JetStreamLog.open(nats_server.url, stream, 1)
    try:
        assert (old.epoch, new.epoch) == (0, 1)
        assert new.next_lsn == 3 and new.open_sessions() == {"a": 2, "b": 1}
        with pytest.raises(LogFenced, match=r"epoch 0 was fenced by a newer writer.*lsn 3 and later were not acknowledged"):
            old.append_batch([("a", 2, small_event(2))])
        assert "fenced" in old.fatal_reason
        with pytest.raises(LogClosed, match="fatal"):
            old.append_batch([("b", 1, small_event(3))])
        new.append_batch([("a", 2, small_event(4)), ("b", 1, SessionFinished())])
        stored = [(e.lsn, e.session_id, e.session_seq) for e in new.read()]
        assert stored == [(0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "a", 2), (4, "b", 1)]
        assert stored[3:] and list(new.read())[3].body == small_event(4)
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("round_", range(3))
def test_a_new_writer_takes_over_from_a_writer_still_appending(nats_server, stream, round_):
    """A restarted worker opens the partition while its old writer is still
    appending in a tight loop: the open succeeds (its fence is tried again at
    the subject's new end until it lands), the old writer's next append is
    refused as fenced, and every record acknowledged to the old writer is
    read back by the new one, which goes on after the last of them."""
    import threading

    old = JetStreamLog.open(nats_server.url, stream, 0)
    old.append_batch([("a", 0, opened())])
    acked: list[int] = []
    ended: list[BaseException] = []
    started = threading.Event()

    def append_until_refused() -> None:
        try:
            for k in itertools.count(1):
                acked.append(old.append_batch([("a", k, small_event(k))])[0].lsn)
                if k == 20:
                    started.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, which checks it
            ended.append(exc)
        finally:
            started.set()

    appender = threading.Thread(target=append_until_refused)
    appender.start()
    new = None
    try:
        assert started.wait(30) and not ended, f"the old writer did not get going: {ended}"
        new = JetStreamLog.open(nats_server.url, stream, 0)
        appender.join(30)
        assert not appender.is_alive(), "the old writer was never refused"
        assert len(ended) == 1 and isinstance(ended[0], LogFenced), ended
        assert "fenced by a newer writer" in str(ended[0]) and "fenced" in old.fatal_reason
        assert new.epoch == 1 and len(acked) > 20
        # Nothing acknowledged is lost, and the new writer goes on after it.
        stored = [(e.lsn, e.session_id, e.session_seq) for e in new.read()]
        assert stored == [(lsn, "a", lsn) for lsn in range(len(stored))]
        assert len(stored) - 1 >= acked[-1] and new.next_lsn == len(stored)
        assert new.open_sessions() == {"a": len(stored)}
        assert new.append_batch([("a", len(stored), SessionFinished())])[0].lsn == len(stored)
    finally:
        old.close()
        if new is not None:
            new.close()
        appender.join(5)


def test_both_wrong_last_sequence_refusals_are_recognised_as_the_server_sends_them(nats_server, stream):
    """The server says "wrong last sequence" two ways: 10071 (naming the subject's
    sequence) to a publish expecting another, and 10164 (naming none) to an atomic
    batch, as a replicated stream does while another message on the subject is in
    process. Both, as nats-py raises them, are the one classifier's; other refusals are not."""
    import json

    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])
        subject = lg.subject

    async def refusals(js):
        from nats.js.errors import APIError

        nc = js._nc
        last = (await js.get_msg(stream, subject=subject)).seq
        got = {}
        try:
            await js.publish(subject, b"x", headers={"Nats-Expected-Last-Subject-Sequence": str(last + 5)})
        except APIError as exc:
            got["publish"] = exc
        # An atomic batch that repeats the expectation on a subject it already wrote (what the
        # server refuses as it refuses a clustered publish whose subject is in process).
        await nc.publish(subject, b"y", headers={"Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "1",
                                                 "Nats-Expected-Last-Subject-Sequence": str(last)})
        reply = await nc.request(subject, b"z", timeout=5, headers={
            "Nats-Batch-Id": "b1", "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1",
            "Nats-Expected-Last-Subject-Sequence": str(last)})
        try:
            APIError.from_error(json.loads(reply.data)["error"])  # as JetStreamLog reads a batch's answer
        except APIError as exc:
            got["batch"] = exc
        try:
            await js.get_msg(stream, subject=f"{stream}.nothing")
        except APIError as exc:
            got["not found"] = exc
        try:
            await js.publish(subject, b"w", headers={"Nats-Expected-Stream": "another"})
        except APIError as exc:
            got["wrong stream"] = exc
        return got

    got = raw(nats_server.url, refusals)
    assert {k: (type(e).__name__, e.err_code) for k, e in got.items()} == {
        "publish": ("BadRequestError", 10071), "batch": ("BadRequestError", 10164),
        "not found": ("NotFoundError", 10037), "wrong stream": ("BadRequestError", 10060)}
    assert is_wrong_last_sequence(got["publish"]) and is_wrong_last_sequence(got["batch"])
    assert not is_wrong_last_sequence(got["not found"]) and not is_wrong_last_sequence(got["wrong stream"])
    assert not is_wrong_last_sequence(LogFenced("x", epoch=0))


def test_reopen_recovers_lsn_sessions_and_bumps_the_epoch(nats_server, stream):
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened()), ("b", 0, opened()), ("b", 1, SessionFinished())])
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        assert lg.epoch == 1 and lg.next_lsn == 3 and lg.open_sessions() == {"a": 1}
        with pytest.raises(SequenceError, match=r"'a'.*session_seq 0 refused, expected 1"):
            lg.append_batch([("a", 0, opened())])
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        assert lg.epoch == 2 and [e.lsn for e in lg.read()] == [0, 1, 2]


def test_partitions_are_separate_subjects_of_one_stream(nats_server, stream):
    with JetStreamLog.open(nats_server.url, stream, 0) as p0, JetStreamLog.open(nats_server.url, stream, 7) as p7:
        p0.append_batch([("a", 0, opened())])
        p7.append_batch([("x", 0, opened()), ("y", 0, opened())])
        assert [e.session_id for e in p0.read()] == ["a"] and [e.session_id for e in p7.read()] == ["x", "y"]
        assert p7.subject == f"{stream}.p0007"

    async def info(js):
        return await js.stream_info(stream)

    si = raw(nats_server.url, info)
    assert si.config.subjects == [f"{stream}.>"] and si.config.storage == "file"
    assert si.config.duplicate_window == 120.0 and si.config.num_replicas == 1


def test_a_retried_publish_with_the_same_msg_id_is_deduplicated(nats_server, stream):
    with JetStreamLog.open(nats_server.url, stream, 2) as lg:
        lg.append_batch([("a", 0, opened())])

        async def retry(js):
            first = await js.get_msg(stream, seq=1, subject=lg.subject, next=True, direct=True)
            while first.headers.get("Agentlog-Kind") == "fence":
                first = await js.get_msg(stream, seq=first.seq + 1, subject=lg.subject, next=True, direct=True)
            assert first.headers["Nats-Msg-Id"] == "2:0:0"
            ack = await js.publish(lg.subject, first.data, headers={"Nats-Msg-Id": "2:0:0"})
            return first.seq, ack

        seq, ack = raw(nats_server.url, retry)
        assert ack.duplicate and ack.seq == seq
        assert [e.lsn for e in lg.read()] == [0]


def big_opened(n_bytes: int) -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1, metadata={"blob": "x" * n_bytes})


def test_a_record_over_the_max_payload_round_trips_whole(nats_server, stream):
    big = big_opened(int(2.5 * (1 << 20)))
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])
        envs = lg.append_batch([("c", 0, opened()), ("b", 0, big), ("b", 1, small_event(1))])
        assert [e.lsn for e in envs] == [1, 2, 3]

        async def follow():
            got = []
            async for env in lg.follow(0, poll_s=0.005):
                got.append(env)
                if len(got) == 4:
                    return got

        assert asyncio.run(asyncio.wait_for(follow(), 10)) == list(lg.read())
        assert list(lg.read(2))[0].body == big

        async def chunks(js):
            heads = []
            seq = 1
            while True:
                try:
                    m = await js.get_msg(stream, seq=seq, subject=lg.subject, next=True, direct=True)
                except nats.js.errors.NotFoundError:
                    return heads
                heads.append(m.headers.get("Agentlog-Chunk"))
                seq = m.seq + 1

        assert [h for h in raw(nats_server.url, chunks) if h] == ["1/3", "2/3", "3/3"]
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        assert lg.next_lsn == 4 and lg.open_sessions() == {"a": 1, "c": 1, "b": 2}
        assert [e.body for e in lg.read()][2] == big


def test_a_reader_never_sees_part_of_a_chunked_record(nats_server, stream):
    """Chunks that stop short at the subject's end (a torn batch, written
    here by a foreign client) are not yielded; the records before them are."""
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])

        async def torn(js):
            for i in (1, 2):
                await js.publish(lg.subject, b"x" * 100, headers={"Agentlog-Chunk": f"{i}/3"})

        raw(nats_server.url, torn)
        assert [e.lsn for e in lg.read()] == [0]


def test_a_foreign_message_on_the_subject_is_corruption_naming_its_sequence(nats_server, stream):
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])

        async def scribble(js):
            return (await js.publish(lg.subject, b"not a frame at all, but long enough to parse")).seq

        seq = raw(nats_server.url, scribble)
        with pytest.raises(LogCorruption, match=rf"subject '{stream}.p0000' seq {seq}: type byte"):
            list(lg.read())
        # The writer's own chain was broken by the foreign message: its next append is refused, not interleaved.
        with pytest.raises(LogFenced):
            lg.append_batch([("a", 1, small_event(0))])


def test_bad_arguments_are_refused_naming_them(nats_server):
    with pytest.raises(ValueError, match=r"stream name: expected letters.*found 'a.b'"):
        JetStreamLog.open(nats_server.url, "a.b")
    with pytest.raises(ValueError, match=r"replicas: expected an int in 1..5, found 0"):
        JetStreamLog.open(nats_server.url, "ok", replicas=0)
    with pytest.raises(LogError, match=r"the stream has 1 replicas, expected 3"):
        JetStreamLog.open(nats_server.url, "rep", 0).close()
        JetStreamLog.open(nats_server.url, "rep", 0, replicas=3)


def test_a_stale_writers_batch_is_refused_whole(nats_server, stream):
    old = JetStreamLog.open(nats_server.url, stream, 0)
    old.append_batch([("a", 0, opened())])
    new = JetStreamLog.open(nats_server.url, stream, 0)
    try:
        with pytest.raises(LogFenced):
            old.append_batch([("a", 1, small_event(1)), ("b", 0, opened()), ("b", 1, small_event(2))])
        new.append_batch([("c", 0, opened()), ("c", 1, small_event(3))])
        assert [(e.lsn, e.session_id) for e in new.read()] == [(0, "a"), (1, "c"), (2, "c")]
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("n", [1, 3])
def test_a_publish_that_timed_out_but_landed_is_acknowledged_once(nats_server, stream, n):
    """The server is paused (SIGSTOP) past the publish timeout, then resumed:
    the first try lands late, the writer's retry finds its message id at the
    subject's end, and the record is acknowledged once, stored once."""
    import os
    import signal
    import threading

    with JetStreamLog.open(nats_server.url, stream, 0, publish_timeout_s=0.3) as lg:
        lg.append_batch([("a", 0, opened())])
        pause(nats_server.pid)
        try:
            out: list = []
            t = threading.Thread(target=lambda: out.append(lg.append_batch([("a", k, small_event(k)) for k in range(1, n + 1)])))
            t.start()
            t.join(0.5)
            assert t.is_alive(), "the append must wait for the paused server"
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        t.join(10)
        assert [e.lsn for e in out[0]] == list(range(1, n + 1)) and lg.fatal_reason is None
        lg.append_batch([("a", n + 1, small_event(9))])
        assert [e.lsn for e in lg.read()] == list(range(n + 2))


def test_close_while_a_publish_is_retried_fails_the_pending_append_instead_of_hanging(nats_server, stream):
    """close() during a publish that cannot be acknowledged (the server paused)
    gives up after its wait, and the append that was waiting raises naming its
    LSN: it is neither acknowledged nor left waiting forever."""
    import concurrent.futures
    import os
    import signal

    lg = JetStreamLog.open(nats_server.url, stream, 0, publish_timeout_s=0.3, failover_timeout_s=120)
    lg._close_wait_s = 0.5  # close's own wait, short for the test
    lg.append_batch([("a", 0, opened())])
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pause(nats_server.pid)
    try:
        pending = pool.submit(lg.append_batch, [("a", 1, small_event(1))])
        with pytest.raises(concurrent.futures.TimeoutError):
            pending.result(0.5)  # waiting for the paused server
        lg.close()
        with pytest.raises(LogClosed, match=r"closed while publishing.*lsn 1 and later were not acknowledged"):
            pending.result(10)
    finally:
        os.kill(nats_server.pid, signal.SIGCONT)
        pool.shutdown()
    with JetStreamLog.open(nats_server.url, stream, 0) as again:  # the server is usable again
        assert again.next_lsn in (1, 2)


def test_two_writers_racing_to_open_never_both_ack_the_same_lsn(nats_server, stream):
    """Two writers open one partition at the same moment (a restarted worker
    and its double): they may recover the same end and take the same epoch,
    but only one fence may win; every append acknowledged is stored, and no
    two acknowledged appends share an LSN. Raced a dozen times (the two
    recover the same end in about half of them)."""
    import threading

    for i in range(12):
        name = f"{stream}r{i}"
        with JetStreamLog.open(nats_server.url, name, 0) as first:
            first.append_batch([("a", 0, opened())])
        barrier = threading.Barrier(2)
        opened_logs: list = []

        def race() -> None:
            barrier.wait()
            try:
                opened_logs.append(JetStreamLog.open(nats_server.url, name, 0))
            except LogFenced:
                pass  # lost the race to the other writer: refused, as it must be

        threads = [threading.Thread(target=race) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        acked: dict[str, int] = {}
        try:
            for k, lg in enumerate(opened_logs):
                try:
                    acked[f"w{k}"] = lg.append_batch([(f"w{k}", 0, opened())])[0].lsn
                except LogError:
                    pass  # fenced by the other: not acknowledged
            stored = {e.session_id: e.lsn for e in opened_logs[-1].read()}
        finally:
            for lg in opened_logs:
                lg.close()
        assert opened_logs and acked, f"race {i}: neither writer could open and append"
        assert {sid: stored.get(sid) for sid in acked} == acked, f"race {i}: acknowledged {acked}, stored {stored}"


def test_an_append_cancelled_by_its_caller_does_not_break_the_log(nats_server, stream):
    """A caller that stops waiting (a session task cancelled by its timeout)
    cancels its await, not the publish: the writer settles the others, the
    cancelled record is still written (its LSN was given), and the log goes on."""

    async def main(lg):
        await lg.append("a", 0, opened())
        cancelled = asyncio.ensure_future(lg.append("a", 1, small_event(1)))
        others = [asyncio.ensure_future(lg.append(f"s{k}", 0, opened())) for k in range(3)]
        await asyncio.sleep(0)  # each submitted, none acknowledged yet
        cancelled.cancel()
        done = await asyncio.gather(*others)
        await asyncio.sleep(0.2)
        return [e.lsn for e in done]

    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        assert asyncio.run(main(lg)) == [2, 3, 4]
        assert lg.fatal_reason is None
        lg.append_batch([("a", 2, small_event(2))])
        assert [(e.lsn, e.session_id) for e in lg.read()] == [(0, "a"), (1, "a"), (2, "s0"), (3, "s1"), (4, "s2"), (5, "a")]


def test_a_stale_writer_whose_batch_landed_unacknowledged_is_fenced_by_name(nats_server, stream):
    """A writer's batch lands but its ack is lost (the writer was frozen, as
    SIGSTOP does to a worker), and meanwhile a new writer takes the partition
    over. The stale writer's retry of the same batch meets its own message ids
    in the duplicate window (10201), while the subject ends in the new writer's
    fence: it is refused as fenced by a newer writer (LogFenced), not as a raw
    server refusal, and the new writer holds every record that landed."""
    import threading

    old = JetStreamLog.open(nats_server.url, stream, 0)
    old.append_batch([("a", 0, opened())])
    landed, taken_over = threading.Event(), threading.Event()
    real = old._publish_once

    async def ack_lost_once(msgs, attempt, timeout):
        seq = await real(msgs, attempt, timeout)
        if len(msgs) > 1 and not landed.is_set():
            landed.set()  # the batch is stored; its writer "freezes" before it sees the ack
            await asyncio.to_thread(taken_over.wait, 30)
            raise asyncio.TimeoutError("ack lost while the writer was frozen")
        return seq

    old._publish_once = ack_lost_once
    outcome: list[BaseException] = []

    def append() -> None:
        try:
            old.append_batch([("a", k, small_event(k)) for k in (1, 2, 3)])
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, which checks it
            outcome.append(exc)

    appender = threading.Thread(target=append)
    appender.start()
    new = None
    try:
        assert landed.wait(30), "the batch never reached the server"
        new = JetStreamLog.open(nats_server.url, stream, 0)
        taken_over.set()
        appender.join(30)
        assert not appender.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], LogFenced), outcome
        assert "fenced by a newer writer" in str(outcome[0])
        assert [e.lsn for e in new.read()] == [0, 1, 2, 3] and new.next_lsn == 4
    finally:
        taken_over.set()
        old.close()
        if new is not None:
            new.close()
        appender.join(5)


def test_stage_checks_and_stages_before_it_returns_and_calls_back_without_a_task(nats_server, stream):
    """JetStreamLog stages synchronously, as the file log does: a refused record raises at
    the call with nothing staged (not a loop step later, through the callback), and a
    staged one takes its LSN at once and is acknowledged to ``on_durable`` on the loop,
    with no task made for it."""

    async def main(lg):
        got = []
        tasks = len(asyncio.all_tasks())
        lg.stage("s", 0, opened(), lambda env, exc: got.append((env, exc)))
        assert lg.next_seq("s") == 1 and lg.next_lsn == 1  # staged before stage returned
        assert len(asyncio.all_tasks()) == tasks  # no task per record
        with pytest.raises(SequenceError, match="'s'"):
            lg.stage("s", 0, opened(), lambda env, exc: got.append(("refused", exc)))
        assert lg.next_lsn == 1
        waited = lg.submit("s", 1, small_event(1))
        assert lg.next_seq("s") == 2 and len(asyncio.all_tasks()) == tasks
        second = await waited
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        return got, second

    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        assert lg.stages_synchronously
        got, second = asyncio.run(main(lg))
        stored = list(lg.read())
        assert got == [(stored[0], None)] and second == stored[1]


def test_the_engine_stages_a_turn_on_jetstream_before_begin_turn_returns(nats_server, stream, monkeypatch):
    """The engine's turn path on a JetStream partition: begin_turn stages its record
    before it returns (no task per turn), and the turn is applied at its acknowledgement,
    without the flag under which the log checked the turn the engine built."""
    from agentlog.engine import SessionEngine, core
    from agentlog.events.schema.validation import READING_STORED

    flagged: list[bool] = []
    apply = core.SessionEngine._apply

    def spying_apply(self, *args, **kwargs):
        flagged.append(READING_STORED.get())
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(core.SessionEngine, "_apply", spying_apply)

    async def main(lg):
        eng = await SessionEngine.open(lg)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        tasks = len(asyncio.all_tasks())
        before = lg.next_lsn
        pending = h.begin_turn(messages=[{"role": "user", "content": "fix it"}], prompt_ids=[5, 6, 7], output_ids=[8, 9],
                               output_log_probs=[-0.5, -0.25], response_message={"role": "assistant", "content": "ok"})
        assert lg.next_lsn == before + 1 and len(asyncio.all_tasks()) == tasks
        env = await pending.durable
        assert h.turns == 1 and env.lsn == before
        await h.finish(reward=1.0)
        await eng.close()
        return env

    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        env = asyncio.run(main(lg))
        assert list(lg.read())[env.lsn] == env
    assert len(flagged) == 3 and not any(flagged), flagged  # started, the turn, finished (an opening has its own path)
