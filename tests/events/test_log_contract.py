"""One contract suite, run against every EventLog implementation."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import pytest

from agentlog.events import FileLog
from agentlog.events.log.api import DurableCallback, EventLog, LogClosed, MemoryLog, PendingRecord, SequenceError, answer_durable
from agentlog.events.schema.types import EventValidationError, SessionDropped, SessionFinished, SessionOpened, SessionStarted, UnknownEvent
import make_golden_shim
from event_samples import small_event

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")


def opened(group: str = "g") -> SessionOpened:
    return SessionOpened(group_id=group, group_size=2)


class LogContract:
    """Behaviour every log honours. Subclasses provide ``make_log``."""

    def make_log(self, tmp_path, clock) -> EventLog:
        raise NotImplementedError

    @pytest.fixture
    def clock(self):
        ticks = itertools.count(1000)
        return lambda: next(ticks)

    @pytest.fixture
    def log(self, tmp_path, clock):
        lg = self.make_log(tmp_path, clock)
        yield lg
        lg.close()

    def test_append_batch_assigns_gapless_lsns_from_zero(self, log):
        envs = log.append_batch([PendingRecord("a", 0, opened()), ("a", 1, SessionStarted()), ("b", 0, opened())])
        assert [e.lsn for e in envs] == [0, 1, 2]
        assert [(e.session_id, e.session_seq) for e in envs] == [("a", 0), ("a", 1), ("b", 0)]
        more = log.append_batch([("a", 2, small_event(1))])
        assert more[0].lsn == 3 and log.next_lsn == 4

    def test_every_event_type_survives_the_log(self, log):
        golden = make_golden_shim.golden_envelopes()
        log.append_batch([(e.session_id, e.session_seq, e.body) for e in golden])
        stored = list(log.read())
        assert [(e.lsn, e.session_id, e.session_seq, e.body) for e in stored] == [
            (e.lsn, e.session_id, e.session_seq, e.body) for e in golden
        ]

    def test_raw_reads_decode_to_the_records_read(self, log):
        """``read(raw=True)`` is a declared parameter of every log (the engine's id scan and
        restart fold use it without probing): its undecoded records decode to what ``read`` gives."""
        log.append_batch([("a", 0, opened()), ("a", 1, SessionStarted()), ("b", 0, opened())])
        decoded = [(e.lsn, e.session_id, e.session_seq, e.body) for e in log.read(1)]
        raw = list(log.read(1, raw=True))
        assert [(r.lsn, r.session_id, r.session_seq, r.decode().body) for r in raw] == decoded

    def test_read_from_any_lsn_returns_exactly_the_suffix(self, log):
        for i in range(10):
            log.append_batch([(f"s{i}", 0, opened()), (f"s{i}", 1, small_event(i))])
        every = list(log.read())
        assert [e.lsn for e in every] == list(range(20))
        for k in (0, 1, 7, 19, 20, 500):
            assert list(log.read(k)) == every[k:]

    def test_seq_gap_and_repeat_are_refused_naming_session_and_numbers(self, log):
        log.append_batch([("s", 0, opened()), ("s", 1, SessionStarted())])
        with pytest.raises(SequenceError, match=r"'s'.*session_seq 3 refused, expected 2 \(a gap\)"):
            log.append_batch([("s", 3, small_event(0))])
        with pytest.raises(SequenceError, match=r"'s'.*session_seq 1 refused, expected 2 \(a repeat\)"):
            log.append_batch([("s", 1, small_event(0))])
        with pytest.raises(SequenceError, match=r"'new'.*session_seq 1 refused, expected 0"):
            log.append_batch([("new", 1, opened())])

    def test_an_empty_batch_appends_nothing_and_the_log_goes_on(self, log):
        assert log.append_batch([]) == []
        assert log.next_lsn == 0
        assert [e.lsn for e in log.append_batch([("s", 0, opened())])] == [0]
        assert [e.lsn for e in log.read()] == [0]

    def test_a_refused_batch_appends_nothing(self, log):
        log.append_batch([("s", 0, opened())])
        with pytest.raises(SequenceError):
            log.append_batch([("s", 1, small_event(0)), ("t", 0, opened()), ("s", 5, small_event(1))])
        assert log.next_lsn == 1 and log.next_seq("s") == 1 and log.next_seq("t") == 0
        with pytest.raises(EventValidationError):
            log.append_batch([("u", 0, opened()), ("bad/id", 0, opened())])
        assert log.next_lsn == 1 and [e.lsn for e in log.read()] == [0]

    @pytest.mark.parametrize(
        "body, field, expected",
        [
            (SessionOpened(group_id="g", group_size=1, metadata=[1]), "session_opened.metadata", "expected `object`, got `array`"),
            (SessionOpened(group_id="g", group_size=1, prompt="x"), "session_opened.prompt", "expected `array`, got `str`"),
            (SessionOpened(group_id="g", group_size=1, prompt=[1]), "session_opened.prompt[0]", "expected `object`, got `int`"),
            (SessionOpened(group_id="g", group_size=1, prompt={"a": 1}), "session_opened.prompt", "expected `array`, got `object`"),
            (SessionFinished(metadata=["x"]), "session_finished.metadata", "expected `object`, got `array`"),
        ],
        ids=["metadata-list", "prompt-str", "prompt-list-of-int", "prompt-dict", "finish-metadata-list"],
    )
    def test_a_body_readers_could_not_decode_is_refused_before_anything_is_written(self, log, body, field, expected):
        """Validated on write: msgspec constructors do not check field types,
        so these bodies encode; the writer decodes each back and refuses it."""
        log.append_batch([("s", 0, opened()), ("s", 1, SessionStarted())])
        with pytest.raises(EventValidationError) as info:
            log.append_batch([("t", 0, opened()), ("u", 0, body)])
        msg = str(info.value)
        assert "session 'u' seq 0" in msg and f"{field}: {expected}" in msg and "nothing was written" in msg
        assert log.next_lsn == 2 and log.next_seq("t") == 0 and log.next_seq("u") == 0
        # Not fatal: the log takes the next good append, and every record reads back.
        assert log.fatal_reason is None
        log.append_batch([("u", 0, opened())])
        assert [(e.lsn, e.session_id) for e in log.read()] == [(0, "s"), (1, "s"), (2, "u")]

    def test_a_body_whose_checks_were_bypassed_is_refused(self, log):
        bypassed = SessionOpened(group_id="g", group_size=1)
        msgspec.structs.force_setattr(bypassed, "group_size", 0)
        with pytest.raises(EventValidationError, match=r"session 's' seq 0: session_opened\.group_size: expected an int >= 1, found 0"):
            log.append_batch([("s", 0, bypassed)])
        with pytest.raises(EventValidationError, match=r"session 's' seq 0: session_opened: cannot be encoded"):
            log.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1, label=2**70))])
        assert log.next_lsn == 0

    def test_a_body_nested_deeper_than_the_encoder_follows_is_refused_naming_the_record(self, log):
        """msgspec raises RecursionError for such a value: the log says which record and why
        (EventValidationError), as for any body it cannot store, and writes nothing."""
        deep: object = 1
        for _ in range(5000):
            deep = [deep]
        for batch in ([("s", 0, SessionOpened(group_id="g", group_size=1, metadata={"k": deep}))],
                      [("s", 0, opened()), ("t", 0, SessionOpened(group_id="g", group_size=1, metadata={"k": deep}))]):
            with pytest.raises(EventValidationError, match=r"session '[st]' seq 0: session_opened: cannot be encoded: maximum recursion depth"):
                log.append_batch(batch)
        assert log.next_lsn == 0

    def test_only_schema_events_are_appended(self, log):
        for body in ({"type": "session_opened"}, UnknownEvent("turn_scored", {})):
            with pytest.raises(EventValidationError, match=f"body: expected a schema-v1 event, found {type(body).__name__}"):
                log.append_batch([("s", 0, body)])
        assert log.next_lsn == 0

    def test_the_appended_envelope_holds_the_body_as_readers_decode_it(self, log):
        """A tuple of messages is stored as an array: every log hands back the
        list a reader decodes, never the caller's own object."""
        caller = SessionOpened(group_id="g", group_size=1, prompt=({"role": "user", "content": "hi"},), metadata={"k": [1]})
        env = log.append_batch([("s", 0, caller)])[0]
        assert env.body.prompt == [{"role": "user", "content": "hi"}]
        caller.metadata["k"].append(2)  # a later change by the caller does not reach the log
        assert list(log.read()) == [env] and env.body.metadata == {"k": [1]}

    def test_terminal_event_closes_the_session(self, log):
        log.append_batch([("a", 0, opened()), ("b", 0, opened()), ("a", 1, SessionDropped(reason="cancelled"))])
        assert log.open_sessions() == {"b": 1}
        assert log.next_seq("a") == 0 and log.next_seq("b") == 1

    def test_timestamps_come_from_the_injected_clock(self, log):
        envs = log.append_batch([("a", 0, opened())])
        assert 1000 <= envs[0].ts_ns < 2000
        assert list(log.read())[0].ts_ns == envs[0].ts_ns

    def test_concurrent_async_appends_all_ack_with_gapless_lsns(self, log):
        async def session(k):
            sid = f"s{k}"
            out = [await log.append(sid, 0, opened())]
            for seq in range(1, 15):
                out.append(await log.append(sid, seq, small_event(seq)))
            return out

        async def main():
            return await asyncio.gather(*(session(k) for k in range(20)))

        results = asyncio.run(main())
        lsns = sorted(e.lsn for r in results for e in r)
        assert lsns == list(range(300))
        stored = list(log.read())
        assert len(stored) == 300
        for r in results:
            assert [e.session_seq for e in r] == list(range(15))
            assert all(stored[e.lsn] == e for e in r)

    def test_one_durable_callback_staged_for_several_records_answers_each_with_its_own_envelope(self, log):
        """The file log's queue keeps a stage's callback as it is, its record's end and envelope set on it:
        staged again while it waits (or once answered), it must still answer each record with that
        record's envelope, in the log's order, as a future per record would."""
        got = []
        callback = DurableCallback(lambda env, exc: got.append((env.session_id, env.lsn) if env is not None else exc))

        async def main():
            log.stage("a", 0, opened(), callback)
            log.stage("b", 0, opened(), callback)  # while the first still waits for the disk
            for _ in range(500):
                if len(got) == 2:
                    break
                await asyncio.sleep(0.002)
            log.stage("c", 0, opened(), callback)  # once both were answered
            await log.append("d", 0, opened())
            for _ in range(500):
                if len(got) == 3:
                    break
                await asyncio.sleep(0.002)

        asyncio.run(main())
        assert got == [("a", 0), ("b", 1), ("c", 2)]

    def test_async_append_refuses_bad_seq_immediately(self, log):
        async def main():
            await log.append("s", 0, opened())
            with pytest.raises(SequenceError):
                await log.append("s", 0, opened())

        asyncio.run(main())
        assert log.next_lsn == 1

    def test_submit_returns_a_future_of_the_same_envelope_append_gives(self, log):
        """``submit`` is ``append`` as a future; a log that stages synchronously has
        the record staged (its sequence taken, bad input refused with nothing
        staged) before ``submit`` returns, and a cancelled wait still writes it."""
        async def main():
            first = log.submit("s", 0, opened())
            if log.stages_synchronously:
                assert log.next_seq("s") == 1
                with pytest.raises(SequenceError):
                    log.submit("s", 0, opened())
            env = await first
            waited = log.submit("s", 1, small_event(1))
            if log.stages_synchronously:
                waited.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waited
            else:
                await waited  # the default runs append as a task: cancelled before its first step, it appends nothing
            last = await log.append("s", 2, small_event(2))
            return env, last

        env, last = asyncio.run(main())
        stored = list(log.read())
        assert stored[0] == env and env.session_id == "s" and env.session_seq == 0
        assert [e.session_seq for e in stored] == [0, 1, 2] and stored[2] == last

    def test_follow_yields_records_appended_later(self, log):
        async def main():
            got = []

            async def follower():
                async for env in log.follow(0, poll_s=0.005):
                    got.append(env)
                    if len(got) == 6:
                        return

            task = asyncio.create_task(follower())
            for i in range(3):
                await log.append(f"s{i}", 0, opened())
                await asyncio.sleep(0.01)
            log.append_batch([(f"s{i}", 1, small_event(i)) for i in range(3)])
            await asyncio.wait_for(task, 5)
            return got

        got = asyncio.run(main())
        assert got == list(log.read())

    def test_closed_log_refuses_appends(self, log):
        log.append_batch([("s", 0, opened())])
        log.close()
        with pytest.raises(LogClosed):
            log.append_batch([("s", 1, small_event(0))])
        log.close()  # idempotent


class TestMemoryLog(LogContract):
    def make_log(self, tmp_path, clock):
        return MemoryLog(clock=clock)


class TestFileLog(LogContract):
    def make_log(self, tmp_path, clock):
        return FileLog.open(tmp_path / "log", clock=clock, segment_bytes=1024)


class TestFileLogAlwaysFsync(LogContract):
    def make_log(self, tmp_path, clock):
        return FileLog.open(tmp_path / "log", clock=clock, fsync="always")


class TestFileLogIntervalFsync(LogContract):
    def make_log(self, tmp_path, clock):
        return FileLog.open(tmp_path / "log", clock=clock, fsync="interval", interval_s=0.01)


class TestFileLogNoFsync(LogContract):
    def make_log(self, tmp_path, clock):
        return FileLog.open(tmp_path / "log", clock=clock, fsync="never")


@pytest.mark.required
class TestJetStreamLog(LogContract):
    """The same contract on one JetStream partition (a fresh stream per test),
    on one server (R1) and on the 3-node loopback cluster with replicas 3 (R3):
    one server and one cluster per module."""

    streams = itertools.count()

    @pytest.fixture(autouse=True, params=["r1", "r3"])
    def _server(self, request):
        if request.param == "r1":
            self.urls, self.replicas = request.getfixturevalue("nats_server").url, 1
        else:
            self.urls, self.replicas = request.getfixturevalue("nats_cluster").urls, 3

    def make_log(self, tmp_path, clock):
        from agentlog.events.log.jetstream import JetStreamLog

        return JetStreamLog.open(self.urls, f"contract{next(self.streams)}", 3, replicas=self.replicas, clock=clock)


def test_a_memory_log_stages_at_the_call_and_answers_a_loop_step_later_without_a_task():
    """MemoryLog stages synchronously, as the file log does: a refusal raises at the call with
    nothing appended, and on_durable runs a loop step later, unflagged, with no task made."""
    from agentlog.events.schema.validation import READING_STORED

    async def main():
        log = MemoryLog()
        got = []
        tasks = len(asyncio.all_tasks())
        token = READING_STORED.set(True)  # as the engine stages a turn it built
        try:
            log.stage("s", 0, opened(), lambda env, exc: got.append((env, exc, READING_STORED.get())))
        finally:
            READING_STORED.reset(token)
        assert log.next_lsn == 1 and got == [] and len(asyncio.all_tasks()) == tasks
        with pytest.raises(SequenceError):
            log.stage("s", 0, opened(), lambda env, exc: got.append(("refused", exc, None)))
        await asyncio.sleep(0)
        return log, got

    log, got = asyncio.run(main())
    assert log.stages_synchronously and got == [(log._records[0], None, False)]


def test_a_memory_log_answers_one_loop_steps_records_together_in_order_and_reports_a_raising_callback():
    """The records staged in one loop step are answered by one callback, as a file log answers a flush
    (no handle and context a record in flight): a callback scheduled between two stagings runs after
    both answers. A durable callback that raises goes to the loop's exception handler, naming its LSN
    and session, and the records after it are still answered; the next step's records are answered anew."""

    async def main():
        loop = asyncio.get_running_loop()
        reported = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        log = MemoryLog()
        order = []

        def failing(env, exc):
            order.append(("a", env.lsn))
            raise RuntimeError("callback bug")

        log.stage("a", 0, opened(), failing)
        loop.call_soon(order.append, "between")
        log.stage("b", 0, opened(), lambda env, exc: order.append(("b", env.lsn, exc)))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        log.stage("c", 0, opened(), lambda env, exc: order.append(("c", env.lsn, exc)))
        await asyncio.sleep(0)
        return order, reported

    order, reported = asyncio.run(main())
    assert order == [("a", 0), ("b", 1, None), "between", ("c", 2, None)]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], RuntimeError)
    assert "LSN 0" in reported[0]["message"] and "'a'" in reported[0]["message"]


def test_a_memory_log_answers_on_each_loop_it_is_used_from():
    """A batch waiting on a loop that stopped before answering it stays that loop's: records staged
    from another loop meanwhile are batched and answered there, and the first loop answers its own
    when it runs again; once it is closed, the next records still batch."""
    log = MemoryLog()
    got = []

    def stage(sid):
        log.stage(sid, 0, opened(), lambda env, exc: got.append(env.session_id))

    async def stage_and_stop():
        asyncio.get_running_loop().stop()  # the loop stops after this step, before the answer's
        stage("a")

    async def stage_two_around_a_marker(first, second):
        stage(first)
        asyncio.get_running_loop().call_soon(got.append, "marker")
        stage(second)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    stopped = asyncio.new_event_loop()
    stopped.create_task(stage_and_stop())
    stopped.run_forever()
    assert got == []
    asyncio.run(stage_two_around_a_marker("b", "c"))
    assert got == ["b", "c", "marker"]
    stopped.run_until_complete(asyncio.sleep(0))
    assert got == ["b", "c", "marker", "a"]
    stopped.close()
    asyncio.run(stage_two_around_a_marker("d", "e"))
    assert got[4:] == ["d", "e", "marker"]


def test_a_memory_log_answers_the_rest_of_a_batch_whatever_a_callback_raises():
    """A callback raising CancelledError is reported as any other error, and the next record is
    answered; one raising KeyboardInterrupt stops the loop, and the rest are answered when it runs again."""
    log = MemoryLog()
    got = []

    def raising(exc_type):
        def callback(env, exc):
            got.append(env.session_id)
            raise exc_type()
        return callback

    async def stage_three():
        log.stage("a", 0, opened(), raising(asyncio.CancelledError))
        log.stage("b", 0, opened(), raising(KeyboardInterrupt))
        log.stage("c", 0, opened(), lambda env, exc: got.append(env.session_id))

    loop = asyncio.new_event_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(stage_three())
        assert got == ["a", "b"]
        loop.call_soon(loop.stop)  # queued after the rest of the batch
        loop.run_forever()
        assert got == ["a", "b", "c"]
    finally:
        loop.close()
    assert len(reported) == 1 and isinstance(reported[0]["exception"], asyncio.CancelledError)
    assert "LSN 0" in reported[0]["message"]


def test_a_file_log_flush_answers_every_record_when_one_callback_raises_cancelled_error(tmp_path):
    """The file log's writer answers a flush through DurableCallback, which MemoryLog shares: a callback
    raising CancelledError is reported, naming its record, and the flush's other records are answered."""

    async def main():
        loop = asyncio.get_running_loop()
        reported = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        log = FileLog.open(tmp_path / "log")
        got = []
        done = loop.create_future()

        def cancelling(env, exc):
            got.append(env.session_id)
            raise asyncio.CancelledError()

        try:
            log.stage("a", 0, opened(), cancelling)
            log.stage("b", 0, opened(), lambda env, exc: (got.append(env.session_id), done.set_result(None)))
            await asyncio.wait_for(done, 10)
        finally:
            log.close()
        return got, reported

    got, reported = asyncio.run(main())
    assert got == ["a", "b"]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], asyncio.CancelledError)
    assert "LSN 0 (session 'a')" in reported[0]["message"]


def test_a_flush_interrupted_by_a_callback_puts_its_other_records_back_on_the_loop():
    """Both logs answer a batch through answer_durable (the file log's flush: futures of ``append``
    and callbacks of ``stage`` side by side): one raising KeyboardInterrupt stops the loop, and the
    batch's other records are answered when it runs again; a future whose wait was cancelled takes nothing."""
    envs = list(MemoryLog().append_batch([PendingRecord(s, 0, opened()) for s in "abcd"]))
    got = []

    def interrupting(env, exc):
        got.append(env.session_id)
        raise KeyboardInterrupt()

    loop = asyncio.new_event_loop()
    try:
        fut, cancelled = loop.create_future(), loop.create_future()
        cancelled.cancel()
        batch = [(DurableCallback(interrupting), envs[0]), (cancelled, envs[1]), (fut, envs[2]),
                 (DurableCallback(lambda env, exc: got.append(env.session_id)), envs[3])]
        loop.call_soon(answer_durable, batch)
        with pytest.raises(KeyboardInterrupt):
            loop.run_forever()
        assert got == ["a"] and not fut.done()
        loop.call_soon(loop.stop)  # queued after the rest of the batch
        loop.run_forever()
        assert got == ["a", "d"] and fut.result() is envs[2] and cancelled.cancelled()
    finally:
        loop.close()


def test_a_memory_log_whose_append_is_overridden_stages_through_it_as_a_task():
    """A test log that delays or fails its appends overrides ``append``: stage and submit go through it."""
    seen = []

    class Counting(MemoryLog):
        async def append(self, session_id, session_seq, body):
            seen.append(session_id)
            return await super().append(session_id, session_seq, body)

    async def main():
        log = Counting()
        done = []
        log.stage("s", 0, opened(), lambda env, exc: done.append(env))
        assert log.next_lsn == 0  # staged in a task, a loop step later
        await log.submit("t", 0, opened())
        return log, done

    log, done = asyncio.run(main())
    assert not log.stages_synchronously and seen == ["s", "t"] and [e.session_id for e in done] == ["s"]
