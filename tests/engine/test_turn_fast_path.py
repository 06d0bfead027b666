"""The gateway's turn path without tasks of its own: SessionHandle.begin_turn
(a turn staged before the call returns, applied when the log acknowledges it)
and SessionHandle.in_flight (the current task's work counted as the session's
in-flight work, as spawn's task is)."""

from __future__ import annotations

import asyncio
import errno

import pytest

from agentlog.engine import SessionEngine, StragglerRefused
from agentlog.engine.session_lock import release
from agentlog.events import FileLog, read_log
from agentlog.events.log.api import LogClosed, MemoryLog
from agentlog.events.log.osops import OsOps

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
        waiter = asyncio.ensure_future(pending.durable)
        await asyncio.sleep(0)
        waiter.cancel()
        pending.durable.cancel()
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
        with pytest.raises(LogClosed, match="Input/output error"):
            await pending.durable
        with pytest.raises(LogClosed):
            await pending.settled()
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

        h2 = await eng.open_session("s2", group_id="g2", group_size=1)
        await h2.start()
        started2 = asyncio.Event()
        stuck = asyncio.create_task(_generating(h2, started2))
        await started2.wait()
        await h2.abort("test")
        assert await stuck == "cancelled by the session"
        with pytest.raises(StragglerRefused):
            h2.in_flight()
        await eng.close()
    arun(go())


def test_a_cancel_from_elsewhere_is_not_the_sessions(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        started = asyncio.Event()
        task = asyncio.create_task(_generating(h, started))
        await started.wait()
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
        h = await eng.open_session("s", group_id="g", group_size=1, budget_s=0.1)
        await h.start()
        started = asyncio.Event()
        task = asyncio.create_task(_generating(h, started))
        await started.wait()
        assert await asyncio.wait_for(task, 5) == "cancelled by the session"
        for _ in range(100):
            if h.state.name == "ABORTED":
                break
            await asyncio.sleep(0.01)
        assert h.state.name == "ABORTED"
        await eng.close()
    arun(go())
