"""The gateway's turn path without tasks of its own: SessionHandle.begin_turn
(a turn staged before the call returns, applied when the log acknowledges it)
and SessionHandle.in_flight (the current task's work counted as the session's
in-flight work, as spawn's task is)."""

from __future__ import annotations

import asyncio
import errno
import traceback

import pytest

from agentlog.engine import SessionEngine, StragglerRefused
from agentlog.engine.handle import TURN_SCORE
from agentlog.engine.session_lock import release
from agentlog.events import FileLog, read_log
from agentlog.events.log.api import LogClosed, MemoryLog
from agentlog.events.log.osops import OsOps
from agentlog.events.log.lazy import LazyEnvelope
from agentlog.events.schema.lineage import ROOT_LINEAGE, turn_lineage
from agentlog.events.schema.turn import turn_temperature
from agentlog.events.schema.types import EventValidationError, SessionOpened
from engine_helpers import YieldingLog

TURN = dict(messages=[{"role": "user", "content": "fix the bug"}], prompt_ids=[5, 6, 7], output_ids=[8, 9],
            output_log_probs=[-0.5, -0.25], finish_reason="stop", response_message={"role": "assistant", "content": "ok"})


async def _running(log, sid="s"):
    eng = await SessionEngine.open(log)
    h = await eng.open_session(sid, group_id="g", group_size=1)
    await h.start()
    return eng, h


def test_the_record_is_staged_before_begin_turn_returns_and_applied_once_durable(tmp_path, arun):
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        seq = log.next_seq("s")
        pending = h.begin_turn(**TURN)
        # No await yet: the log holds the record staged, the session has not applied it.
        assert log.next_seq("s") == seq + 1
        assert h.turns == 0 and h._busy
        env = await pending.durable
        assert env.body.turn_index == 0 and h.turns == 1 and not h._busy
        assert env.lsn < log.next_lsn
        second = await h.record_turn(**{**TURN, "messages": TURN["messages"] + [TURN["response_message"], {"role": "user", "content": "more"}]})
        assert second.body.turn_index == 1
        await h.finish(reward=1.0)
        await eng.close()
        log.close()
    arun(go())


def test_begin_turn_records_the_bytes_record_turn_records(tmp_path, arun):
    async def one(path, begin):
        log = FileLog.open(path)
        eng, h = await _running(log)
        for i in range(3):
            msgs = TURN["messages"] + [TURN["response_message"], {"role": "user", "content": f"step {i}"}] * i
            kw = {**TURN, "messages": msgs, "prompt_ids": list(range(3 + 4 * i))}
            await (h.begin_turn(**kw).durable if begin else h.record_turn(**kw))
        await h.finish(reward=1.0)
        await eng.close()
        log.close()
        return [(r.session_id, r.session_seq, bytes(r.payload)) for r in read_log(path, raw=True)]

    async def go():
        assert await one(tmp_path / "a", True) == await one(tmp_path / "b", False)
    arun(go())


def test_a_staged_turns_envelope_keeps_the_stored_bytes_and_its_pending_turn_says_its_index_and_lineage(tmp_path, arun):
    """On the file log a turn is acknowledged with the bytes it stored, not with the body decoded
    back when the log checked it: that copy (its messages, its response) is not held while the turn
    waits for the disk. What the gateway needs, the turn's index and lineage, the pending turn
    says; the body, when used, is what a reader of the log gets."""
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        main = h.begin_turn(**_turn(0))
        env = await main.durable
        assert type(env) is LazyEnvelope and not env.decoded and env.tag == "turn_delta"
        # A turn that does not extend the conversation is another lineage's (a subagent's).
        sub = h.begin_turn(**{**TURN, "messages": [{"role": "user", "content": "a subagent's task"}]})
        sub_env = await sub.durable
        assert not sub_env.decoded
        assert (main.turn_index, main.lineage) == (0, ROOT_LINEAGE) and sub.turn_index == 1 and sub.lineage != ROOT_LINEAGE
        await h.finish(reward=1.0)
        await eng.close()
        log.close()
        stored = [e for e in read_log(tmp_path / "log") if e.tag == "turn_delta"]
        assert [env, sub_env] == stored
        assert [turn_lineage(e.body) for e in stored] == [main.lineage, sub.lineage]
    arun(go())


def test_a_refused_turn_raises_from_begin_turn_and_frees_the_lock(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        h = await eng.open_session("s", group_id="g", group_size=1)  # open, not running
        with pytest.raises(StragglerRefused):
            h.begin_turn(**TURN)
        assert not h._busy
        await h.start()
        with pytest.raises(TypeError, match="no_such_field"):
            h.begin_turn(**TURN, no_such_field=1)
        assert not h._busy and h.turns == 0
        env = await h.begin_turn(**TURN).durable  # the default stage (a task around append) on a memory log
        assert env.body.turn_index == 0 and h.turns == 1
        await eng.close()
    arun(go())


def test_a_cancelled_wait_still_records_and_applies_the_turn(tmp_path, arun):
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        pending = h.begin_turn(**TURN)

        async def handler():
            return await pending.durable

        waiter = asyncio.create_task(handler())
        await asyncio.sleep(0)
        waiter.cancel()  # the client left: the handler's wait (pending.durable) is cancelled with it
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pending.durable.cancelled()
        env = await pending.settled()
        assert env.body.turn_index == 0 and h.turns == 1 and not h._busy
        await h.finish(reward=0.0)
        await eng.close()
        log.close()
        assert [e.body.turn_index for e in read_log(tmp_path / "log") if hasattr(e.body, "turn_index")] == [0]
    arun(go())


def test_a_contended_session_falls_back_to_a_task_in_lock_order(tmp_path, arun):
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        seq = log.next_seq("s")
        h._busy = True  # someone else holds the session's lock (an in-session event in flight)
        pending = h.begin_turn(**TURN)
        assert log.next_seq("s") == seq  # nothing staged: it waits for the lock
        await asyncio.sleep(0.01)
        assert not pending.durable.done()
        release(h)
        env = await pending.durable
        assert env.body.turn_index == 0 and h.turns == 1 and not h._busy
        await eng.close()
        log.close()
    arun(go())


def _turn(i: int, **over) -> dict:
    msgs = TURN["messages"] + [TURN["response_message"], {"role": "user", "content": f"step {i}"}] * i
    return {**TURN, "messages": msgs, "prompt_ids": list(range(3 + 4 * i)), **over}


@pytest.mark.parametrize("kind", ["file", "memory", "task"])
def test_a_contended_begin_turn_keeps_its_place_in_the_lock_queue_from_the_call(tmp_path, arun, kind):
    """Queued at the call, not when its task first runs: a finish or a record_turn the caller
    issues after it comes after it (the finish refused it as a straggler, the record_turn took
    its turn index)."""
    async def go():
        log = {"file": lambda: FileLog.open(tmp_path / "log"), "memory": MemoryLog, "task": lambda: YieldingLog(max_yields=0)}[kind]()
        assert log.stages_synchronously == (kind != "task")
        eng, h = await _running(log)
        first = h.begin_turn(**_turn(0))  # holds the lock
        second = h.begin_turn(**_turn(1, output_ids=[1, 1], output_log_probs=[]))  # contended
        third = await h.record_turn(**_turn(2, output_ids=[3, 3], output_log_probs=[]))
        fourth = h.begin_turn(**_turn(3))  # contended again, then a finish issued after it
        await h.finish(reward=1.0)
        envs = [await first.settled(), await second.settled(), third, await fourth.settled()]
        assert [e.body.turn_index for e in envs] == [0, 1, 2, 3]
        # The engine's own index and lineage of each, queued or not: what the gateway reads.
        assert [(p.turn_index, p.lineage) for p in (first, second, fourth)] == [(0, ROOT_LINEAGE), (1, ROOT_LINEAGE), (3, ROOT_LINEAGE)]
        await eng.close()
        log.close()
    arun(go())


def test_a_contended_begin_turn_records_the_arguments_as_they_were_at_the_call(tmp_path, arun):
    """As uncontended: an agent loop that extends its conversation (or reuses its sampling dict)
    once begin_turn returned records what it passed (it recorded the later lists)."""
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        other = asyncio.create_task(h.assign_reward(0.5))  # an in-session event in flight holds the lock
        await asyncio.sleep(0)
        msgs, sampling = [{"role": "user", "content": "fix the bug"}], {"temperature": 0.7}
        pending = h.begin_turn(messages=msgs, prompt_ids=[5, 6, 7], output_ids=[8, 9], sampling=sampling,
                               response_message={"role": "assistant", "content": "ok"})
        msgs.append({"role": "assistant", "content": "ok"})
        sampling["temperature"] = 1.0
        env = await pending.durable
        await other
        assert [m["role"] for m in env.body.new_messages] == ["user"] and env.body.sampling["temperature"] == 0.7
        await eng.close()
        log.close()
    arun(go())


def test_what_a_live_session_keeps_between_turns_is_never_walked_by_the_cyclic_collector(tmp_path, arun):
    """Thousands of sessions in flight keep their state past every batch's fsync, into the collector's old
    generation, where each full collection would walk it: the previous turn's context, the lineages and the
    turns' scores are untracked (their handle itself, which holds tasks and futures, stays tracked)."""
    import gc

    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        for i in range(3):
            await h.record_turn(**_turn(i), frozen_messages=True)
        threads = list(h._lineages._threads.values())
        assert threads and h._turn_scores
        gc.collect()  # the first collection that finds a tuple holding only untracked objects untracks it
        lineages = h._lineages
        for kept in (h._context, lineages, lineages._threads, lineages._recent, *threads, *(t.context for t in threads), h._turn_scores):
            assert not gc.is_tracked(kept), kept
        await eng.close()
        log.close()
    arun(go())


def test_a_staged_turn_is_applied_as_the_log_stored_it(tmp_path, arun):
    """The engine applies the body the log acknowledged, not the caller's objects: a sampling
    dict changed once begin_turn returned left the engine's temperature of the turn (what
    teacher scores are checked against) other than the log's."""
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        sampling = {"temperature": 0.7}
        pending = h.begin_turn(**_turn(0), sampling=sampling)
        sampling["temperature"] = 1.0
        await pending.durable
        assert [t for _, t in TURN_SCORE.iter_unpack(h._turn_scores)] == [0.7]
        await h.record_teacher_scores(0, teacher="t", teacher_version="v", temperature=0.7, log_probs=[-0.1, -0.2])
        with pytest.raises(ValueError, match="sampled at temperature 0.7"):
            await h.record_teacher_scores(0, teacher="t", teacher_version="v", temperature=1.0, log_probs=[-0.1, -0.2])
        await eng.close()
        log.close()
    arun(go())


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_a_turns_temperature_as_the_engine_reads_it_is_the_one_a_reader_of_the_log_reads(tmp_path, arun, kind):
    """Read as the turn is staged, from the caller's values, and by a reader from what was stored: the
    same, whatever the sampling's form (a set of ignored settings is stored as an array)."""
    async def go():
        log = FileLog.open(tmp_path / "log") if kind == "file" else MemoryLog()
        eng, h = await _running(log)
        samplings = [{"temperature": 0.5, "ignored": {"temperature"}}, {"temperature": 0.5, "ignored": ("top_p",)},
                     {"temperature": 0.5, "ignored": frozenset({"temperature", "top_p"})}]
        for i, sampling in enumerate(samplings):
            await h.begin_turn(**_turn(i), sampling=sampling).durable
        stored = [turn_temperature(e.body.sampling) for e in log.read() if e.tag == "turn_delta"]
        assert [t for _, t in TURN_SCORE.iter_unpack(h._turn_scores)] == stored == [1.0, 0.5, 1.0]
        await eng.close()
        log.close()
    arun(go())


def test_a_turn_whose_sampling_is_no_dict_is_refused_by_the_log_naming_the_field(tmp_path, arun):
    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        with pytest.raises(EventValidationError, match=r"sampling: expected `object`, got `array`"):
            h.begin_turn(**_turn(0), sampling=["temperature"])
        assert not h._busy and h.turns == 0
        await eng.close()
        log.close()
    arun(go())


@pytest.mark.parametrize("path", ["begin_turn", "record_turn"])
def test_a_record_the_engine_fails_to_apply_is_reported_in_health_as_in_the_log(tmp_path, arun, path, monkeypatch):
    """A bug while applying an acknowledged turn (injected in the lineage commit) is never quiet:
    the waiter learns the record is in the log at its LSN, the engine's health says so, and the
    turn tables stay whole (the failure came after them)."""
    from agentlog.engine import lineages
    from agentlog.engine.errors import RecordNotApplied

    commit, armed = lineages.LineageTracker.commit, [False]

    def failing_commit(self, *a, **k):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected bug in the apply")
        return commit(self, *a, **k)

    monkeypatch.setattr(lineages.LineageTracker, "commit", failing_commit)

    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        await h.record_turn(**_turn(0))
        armed[0] = True
        with pytest.raises(RecordNotApplied, match=r"the record at lsn \d+ is in the log, but the engine failed to apply it"):
            await (h.begin_turn(**_turn(1)).durable if path == "begin_turn" else h.record_turn(**_turn(1)))
        assert eng.background_failure is not None and "is in the log" in eng.background_failure
        assert h.turns == 2 and [n for n, _ in TURN_SCORE.iter_unpack(h._turn_scores)] == [2, 2] and not h._busy
        await eng.close()
        log.close()
    arun(go())


class _FailingSync(OsOps):
    def __init__(self) -> None:
        self.fail = False

    def fdatasync(self, fd: int) -> None:
        if self.fail:
            raise OSError(errno.EIO, "injected Input/output error")
        super().fdatasync(fd)


def test_a_failed_flush_reaches_the_waiter_and_frees_the_lock_without_applying(tmp_path, arun):
    async def go():
        ops = _FailingSync()
        log = FileLog.open(tmp_path / "log", os_ops=ops)
        eng, h = await _running(log)
        ops.fail = True
        pending = h.begin_turn(**TURN)
        early = asyncio.create_task(pending.settled())  # waits before the failure arrives
        await asyncio.sleep(0)
        with pytest.raises(LogClosed, match="Input/output error"):
            await pending.durable
        depths = []
        for waited in (early, pending.settled(), pending.settled()):  # before it came, after it, and again
            with pytest.raises(LogClosed) as failure:
                await waited
            depths.append(len(traceback.extract_tb(failure.value.__traceback__)))
        assert depths[1] == depths[2], depths  # raised with its traceback as it settled, not grown with each call
        assert h.turns == 0 and not h._busy
        assert "Input/output error" in log.fatal_reason
    arun(go())


async def _generating(h, started, release_after=None):
    """A stand-in for the gateway's handler: generation inside ``h.in_flight()``."""
    work = h.in_flight()
    try:
        with work:
            started.set()
            await asyncio.sleep(release_after if release_after is not None else 3600)
        return "generated"
    except asyncio.CancelledError:
        if work.cancelled_by_session and asyncio.current_task().uncancel() == 0:
            return "cancelled by the session"
        raise


async def _generating_session(eng, sid="s", **open_kw):
    """A running session of ``eng`` and a task generating inside its ``in_flight()`` scope, once it is inside."""
    h = await eng.open_session(sid, group_id=f"g-{sid}", group_size=1, **open_kw)
    await h.start()
    started = asyncio.Event()
    task = asyncio.create_task(_generating(h, started))
    await started.wait()
    return h, task


def test_a_terminal_transition_waits_for_the_work_in_flight_then_cancels_it(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog(), drain_s=0.2)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        started = asyncio.Event()
        quick = asyncio.create_task(_generating(h, started, release_after=0.05))
        await started.wait()
        t0 = asyncio.get_running_loop().time()
        await h.finish(reward=1.0)  # drains: the work ends on its own within drain_s
        assert await quick == "generated"
        assert asyncio.get_running_loop().time() - t0 >= 0.04

        h2, stuck = await _generating_session(eng, "s2")
        await h2.abort("test")
        assert await stuck == "cancelled by the session"
        with pytest.raises(StragglerRefused):
            h2.in_flight()
        await eng.close()
    arun(go())


def test_a_cancel_from_elsewhere_is_not_the_sessions(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        h, task = await _generating_session(eng)
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not h._inflight  # the marker left with the work
        await h.finish(reward=0.0)  # nothing to drain
        await eng.close()
    arun(go())


def test_the_budget_cancels_the_work_in_flight_at_once(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        h, task = await _generating_session(eng, budget_s=0.1)
        assert await asyncio.wait_for(task, 5) == "cancelled by the session"
        for _ in range(100):
            if h.state.name == "ABORTED":
                break
            await asyncio.sleep(0.01)
        assert h.state.name == "ABORTED"
        await eng.close()
    arun(go())


def test_a_client_cancel_landing_just_before_the_sessions_is_still_the_clients(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        h, task = await _generating_session(eng)
        task.cancel()  # the client left ...
        for marker in list(h._inflight):
            marker.cancel()  # ... and in the same loop step the session cancels its work
        with pytest.raises(asyncio.CancelledError):
            await task  # the client's cancel is not swallowed into a 409
        await eng.close()
    arun(go())


def test_a_drain_waits_for_the_cancelled_work_to_finish_as_for_a_task(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog(), drain_s=0.05)
        order = []

        async def work(h, started):
            with h.in_flight():  # as the gateway's generation: its cleanup runs inside the scope
                try:
                    started.set()
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    await asyncio.sleep(0.03)  # cleanup after the cancel (an upstream abort)
                    order.append("cleanup done")
                    raise

        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        started = asyncio.Event()
        task = asyncio.create_task(work(h, started))
        await started.wait()
        await h.finish(reward=1.0)
        order.append("finish returned")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert order == ["cleanup done", "finish returned"]
        await eng.close()
    arun(go())


def test_a_transition_from_inside_the_scope_is_not_its_own_drain(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog(), drain_s=5)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        with h.in_flight() as work:
            t0 = asyncio.get_running_loop().time()
            env = await h.finish(reward=1.0)  # neither waits for (drain_s) nor cancels itself
            assert asyncio.get_running_loop().time() - t0 < 1
        assert env is not None and h.state.name == "FINISHED" and not work.cancelled_by_session
        await eng.close()
    arun(go())


def test_a_callback_that_raises_leaves_the_flushs_other_waiters_answered(tmp_path, arun):
    async def go():
        log = FileLog.open(tmp_path / "log")
        reported = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        got = []

        def bad(env, exc):
            raise RuntimeError("callback bug")

        log.stage("a", 0, SessionOpened(group_id="g", group_size=1), bad)
        log.stage("b", 0, SessionOpened(group_id="g", group_size=1), lambda env, exc: got.append((env.session_id, exc)))
        other = await log.append("c", 0, SessionOpened(group_id="g", group_size=1))
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [("b", None)] and other.session_id == "c"
        assert len(reported) == 1 and isinstance(reported[0]["exception"], RuntimeError)
        log.close()
    arun(go())


async def _two_turns(h, path: str) -> None:
    for _ in range(2):
        if path == "record_turn":
            await h.record_turn(**TURN)
        else:
            await h.begin_turn(**TURN).durable


@pytest.mark.parametrize("path", ["record_turn", "begin_turn"])
@pytest.mark.parametrize("kind", ["file", "memory", "task"])
def test_a_turn_the_engine_built_runs_its_value_checks_once(tmp_path, arun, path, kind):
    """The caller's values are checked when the TurnRecorded is built; the log's
    write-time check of what the engine derived from it decodes it strictly but
    does not run the turn's value checks a second time, where the log checks it
    before begin_turn returns (the file log and a MemoryLog; a log whose stage
    runs its own append as a task checks a loop step later, so it checks in full). Each run of a turn's value checks hands its log-probs to
    DEFERRED_FINITE_SCANS when that is set. The stored turns are ones a check of
    each would accept."""
    from agentlog.events.schema.turn import TurnDelta, TurnRecorded
    from agentlog.events.schema.validation import DEFERRED_FINITE_SCANS

    async def go():
        log = {"file": lambda: FileLog.open(tmp_path / "log"), "memory": MemoryLog, "task": lambda: YieldingLog(max_yields=0)}[kind]()
        assert log.stages_synchronously == (kind != "task")
        eng, h = await _running(log)
        scans: list[bytes] = []
        token = DEFERRED_FINITE_SCANS.set(scans)
        try:
            await _two_turns(h, path)
        finally:
            DEFERRED_FINITE_SCANS.reset(token)
        await h.finish(reward=1.0)
        await eng.close()
        return log, len(scans)

    log, checks = arun(go())
    assert checks == (4 if kind == "task" and path == "begin_turn" else 2)
    stored = [e.body for e in log.read(0) if isinstance(e.body, (TurnRecorded, TurnDelta))]
    log.close()
    assert [b.turn_index for b in stored] == [0, 1]
    for body in stored:  # each would pass its own checks: rebuilt through its constructor, checks on
        type(body)(**{f: getattr(body, f) for f in body.__struct_fields__})


@pytest.mark.parametrize("path", ["record_turn", "begin_turn"])
def test_a_turn_the_engine_built_with_a_field_of_the_wrong_type_is_refused_by_the_log(tmp_path, arun, path):
    """The value checks are not run twice, but the write-time decode still checks
    every field's type: a turn whose policy_version is a string (no value check
    looks at it) is refused naming the field, nothing is stored, and the session
    records its next turn as turn 0."""
    from agentlog.events.schema.types import EventValidationError

    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        n = log.next_lsn
        with pytest.raises(EventValidationError, match=r"policy_version: expected `int`"):
            if path == "record_turn":
                await h.record_turn(**TURN, policy_version="v3")
            else:
                await h.begin_turn(**TURN, policy_version="v3").durable
        assert log.next_lsn == n and h.turns == 0 and not h._busy
        env = await h.record_turn(**TURN)
        assert env.body.turn_index == 0
        await eng.close()
        log.close()

    arun(go())


def test_a_log_that_stages_a_loop_step_later_checks_a_built_turn_in_full(arun, monkeypatch):
    """A log whose stage() runs the append as a task (the default; here a MemoryLog whose
    append is its own) checks the turn a loop step after begin_turn returned, when the caller may
    have changed a value it handed over: that log checks every value again,
    and the engine's code after the turn runs with no check switched off."""
    from agentlog.engine import core
    from agentlog.events.schema.types import EventValidationError
    from agentlog.events.schema.validation import READING_STORED

    seen: list[bool] = []
    apply = core.SessionEngine._apply

    def spying_apply(self, *args, **kwargs):
        seen.append(READING_STORED.get())
        return apply(self, *args, **kwargs)

    async def go():
        log = YieldingLog(max_yields=0)
        assert not log.stages_synchronously
        eng, h = await _running(log)
        spans = [[0, 1], [1, 2]]
        pending = h.begin_turn(**TURN, policy_version=1, version_spans=spans)
        spans[1][0] = 7  # past the turn's two output tokens, changed after it was handed over
        with pytest.raises(EventValidationError, match=r"version_spans\[1\]"):
            await pending.durable
        sampling = {"temperature": 1.0}
        pending = h.begin_turn(**TURN, sampling=sampling)
        sampling["lineage"] = {"id": "not a valid id!"}
        with pytest.raises(EventValidationError, match="sampling.lineage: expected a lineage map"):
            await pending.durable
        await h.begin_turn(**TURN).durable
        await h.record_turn(**TURN)
        assert h.turns == 2 and not READING_STORED.get()
        await eng.close()

    monkeypatch.setattr(core.SessionEngine, "_apply", spying_apply)
    arun(go())
    assert seen and not any(seen), seen


def test_the_delta_the_engine_makes_is_checked_where_it_is_made(monkeypatch):
    """The log takes a turn the engine built as checked, so the delta's own
    fields (which no check of the caller's values sees) are checked when the
    delta is made: a bad shared count is refused naming the field."""
    from agentlog.events.schema import turn_delta
    from agentlog.events.schema.turn import TurnRecorded
    from agentlog.events.schema.types import EventValidationError

    make = turn_delta._delta_from
    monkeypatch.setattr(turn_delta, "_delta_from", lambda turn, shared, new, _messages, msgs: make(turn, shared, new, -1, msgs))
    context = turn_delta.EncodingContext(b"", b"", b"", ())
    with pytest.raises(EventValidationError, match=r"turn_delta.shared_messages: expected an int >= 0, found -1"):
        context.encode(TurnRecorded(turn_index=0, prompt_ids=[1, 2], output_ids=[3]))


def _agent_turn(i: int) -> dict:
    """Turn ``i`` of an agent session: its prompt answers turn ``i - 1``'s tool call, and its answer makes one."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fix the bug"}]
    for k in range(i):
        msgs += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"c{k}", "name": "bash", "arguments": {"command": f"ls {k}"}}]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": f"out {k}"}]
    response = {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "name": "bash", "arguments": {"command": f"ls {i}"}}]}
    return {**TURN, "messages": msgs, "prompt_ids": list(range(3 + 4 * i)), "response_message": response}


def test_an_agent_sessions_pending_tool_calls_are_never_walked_by_the_cyclic_collector(tmp_path, arun):
    """Every answer of an agent makes a tool call, which its lineage keeps pending until the next prompt
    answers it: kept as tuples of strings, which the collections that see them untrack, a level of nesting
    each (a list never is), so thousands of sessions in flight leave nothing of it in the old generation."""
    import gc

    async def go():
        log = FileLog.open(tmp_path / "log")
        eng, h = await _running(log)
        for i in range(3):
            await h.record_turn(**_agent_turn(i), frozen_messages=True)
        (thread,) = h._lineages._threads.values()
        assert [c[0] for c in thread.pending] == ["c2"]  # c0 and c1 answered
        for _level in range(3):  # the argument strings, the call, the calls
            gc.collect()
        assert not gc.is_tracked(thread.pending), thread.pending
        await eng.close()
        log.close()
    arun(go())


async def _tracked_objects_a_staged_agent_turn_holds(path) -> tuple[float, dict[str, int]]:
    """The fewest tracked objects a staged agent turn holds until durable (over four rounds of 16 sessions
    staging a turn each), with the types of the round's new objects: see the test below."""
    import collections
    import gc

    log = FileLog.open(path)
    eng = await SessionEngine.open(log)
    handles = []
    for s in range(16):
        h = await eng.open_session(f"s{s}", group_id="g", group_size=16)
        await h.start()
        await h.record_turn(**_agent_turn(0), frozen_messages=True)
        handles.append(h)
    counts, kinds = [], {}
    for i in range(1, 5):
        turns = [_agent_turn(i) for _ in handles]
        gc.collect()
        gc.disable()
        with log._cv:
            # The writer, idle since the last round was durable, is not woken until the round is counted: on a
            # loaded machine it flushed the first turns meanwhile, and the loop's callbacks answering them
            # (its Handles and Contexts) were counted as if the turns held them.
            log._thread_idle = False
        try:
            before = {id(o) for o in gc.get_objects()}
            pending = [h.begin_turn(**t, frozen_messages=True) for h, t in zip(handles, turns)]
            new = [o for o in gc.get_objects() if id(o) not in before]
        finally:
            gc.enable()
            with log._cv:
                log._cv.notify_all()
        counts.append(len(new))
        kinds = dict(collections.Counter(type(o).__name__ for o in new))
        del new
        await asyncio.gather(*(p.durable for p in pending))
    await eng.close()
    log.close()
    return min(counts) / len(handles), kinds


def test_a_staged_agent_turn_holds_few_objects_the_collector_counts_until_it_is_durable(tmp_path):
    """A node's turns wait for their batch's fsync together, and each object the collector tracks that a
    staged turn holds until then counts toward the next collection (700 objects by default): staging an
    agent turn holds its pending turn and future, the engine's record of it, the messages it adds and
    its tool call, and nothing more (no tuple a record in the log's queue, no bound method, no set of
    answered calls, no tuple of what the lineage staged: 12 objects a turn before they went). Counted in
    a process of its own: any other thread of the test run (Ray's, a NATS client's) allocates meanwhile."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    child = ("import asyncio, json, sys; sys.path.insert(0, sys.argv[1]); "
             "from test_turn_fast_path import _tracked_objects_a_staged_agent_turn_holds as measure; "
             "print(json.dumps(asyncio.run(measure(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", child, str(Path(__file__).parent), str(tmp_path / "log")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    per_turn, kinds = json.loads(done.stdout.strip().splitlines()[-1])
    assert per_turn <= 9, f"{per_turn} tracked objects a staged turn (the last round's: {kinds})"
