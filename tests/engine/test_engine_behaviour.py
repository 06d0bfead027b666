"""SessionEngine behaviours: idempotent drop, stragglers, duplicates, context
manager outcomes, budgets, draining, restart, shutdown, zero leftover state."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from structlog.testing import capture_logs

from agentlog.engine import (
    DuplicateSession,
    EngineClosed,
    LocalSandbox,
    SessionEngine,
    SessionTimeout,
    StragglerRefused,
)
from agentlog.events.schema.lifecycle import IllegalTransition, SessionClosed, State
from agentlog.events import FileLog
from agentlog.events.log.api import LogClosed, MemoryLog
from agentlog.events.schema.packing import pack_tokens
from agentlog.events.schema.types import (
    CommandRan,
    EventValidationError,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    TurnDelta,
)

from engine_helpers import YieldingLog, check_log_invariants

KW = dict(group_id="g", group_size=2)


def kw(sid):
    """A group of its own for ``sid``: tests that open many sessions must not
    overfill one group (the engine refuses that like the reducers do)."""
    return dict(group_id=f"g-{sid}", group_size=1)


def bodies(log, sid):
    return [e.body for e in log.read(0) if e.session_id == sid]


def test_drop_is_idempotent_and_appends_one_event(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        first = await h.drop("cancelled")
        assert first is not None and isinstance(first.body, SessionDropped)
        for _ in range(3):
            assert await h.drop("again") is None
        assert [type(b).__name__ for b in bodies(log, "s")].count("SessionDropped") == 1
    arun(go())


def test_finish_after_drop_raises_session_closed_naming_session_and_state(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        await h.drop("cancelled")
        with pytest.raises(SessionClosed) as info:
            await h.finish(reward=1.0)
        assert info.value.session_id == "s" and info.value.state is State.DROPPED
        assert "'s'" in str(info.value) and "dropped" in str(info.value)
        with pytest.raises(SessionClosed):
            await h.abort("late")
        assert not any(isinstance(b, (SessionFinished, SessionAborted)) for b in bodies(log, "s"))
    arun(go())


def test_straggler_turn_is_refused_logged_and_never_appended(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        await h.record_turn(prompt_ids=[1], output_ids=[2])
        await h.finish(reward=1.0)
        n = log.next_lsn
        with capture_logs() as logs:
            with pytest.raises(StragglerRefused) as info:
                await h.record_turn(prompt_ids=[1, 2], output_ids=[3])
        assert isinstance(info.value, IllegalTransition) and info.value.state is State.FINISHED
        assert log.next_lsn == n
        refused = [e for e in logs if e["event"] == "session.straggler_refused"]
        assert len(refused) == 1 and refused[0]["session_id"] == "s"
        assert eng.get("s") is None and eng.live_count == 0  # the straggler recreated nothing
        assert [b.turn_index for b in bodies(log, "s") if isinstance(b, TurnDelta)] == [0]
    arun(go())


def test_turn_before_start_is_refused(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        with pytest.raises(StragglerRefused):
            await h.record_turn(output_ids=[1])
        assert log.next_lsn == 1
    arun(go())


def test_duplicate_session_id_is_refused_live_ended_and_long_ended(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log, status_cache=2)
        h = await eng.open_session("live", **kw("live"))
        with pytest.raises(DuplicateSession, match="live"):
            await eng.open_session("live", **kw("live"))
        await h.drop("x")
        with pytest.raises(DuplicateSession, match="already ended"):
            await eng.open_session("live", **kw("live"))
        # Push "live" out of the status cache: only the filter + log scan can know now.
        for i in range(3):
            await (await eng.open_session(f"other{i}", **kw(f"other{i}"))).drop("x")
        assert eng.status("live") is None
        with pytest.raises(DuplicateSession, match="lsn 0"):
            await eng.open_session("live", **kw("live"))
        assert eng.stats["id_scans"] == 1
        # A new engine on the same log knows every id from its fold.
        eng2 = await SessionEngine.open(log, status_cache=0)
        with pytest.raises(DuplicateSession):
            await eng2.open_session("other1", **kw("other1"))
        n = log.next_lsn
        await eng2.open_session("fresh", **kw("fresh"))
        assert log.next_lsn == n + 1
    arun(go())


def test_fresh_ids_never_need_a_log_scan(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        for i in range(3000):
            await (await eng.open_session(f"s{i}", **kw(f"s{i}"))).drop("x")
        assert eng.stats["id_scans"] == 0
    arun(go())


def test_concurrent_opens_of_one_id_admit_exactly_one(arun):
    async def go():
        log = YieldingLog(seed=3)
        eng = await SessionEngine.open(log)
        res = await asyncio.gather(*(eng.open_session("same", **KW) for _ in range(10)), return_exceptions=True)
        ok = [r for r in res if not isinstance(r, BaseException)]
        assert len(ok) == 1 and all(isinstance(r, DuplicateSession) for r in res if r not in ok)
        assert log.next_lsn == 1
    arun(go())


def test_exception_inside_session_block_aborts_with_reason_and_traceback(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        with pytest.raises(ZeroDivisionError):
            async with eng.session("s", **KW) as h:
                await h.start()
                _ = 1 / 0  # raises inside the session block
        last = bodies(log, "s")[-1]
        assert isinstance(last, SessionAborted)
        assert last.reason == "exception:ZeroDivisionError" and "division by zero" in last.error
        assert "ZeroDivisionError" in last.traceback and "test_engine_behaviour.py" in last.traceback
        assert eng.live_count == 0
    arun(go())


def test_cancellation_drops_session_with_reason_cancelled(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        entered = asyncio.Event()

        async def body():
            async with eng.session("s", **KW) as h:
                await h.start()
                entered.set()
                await asyncio.sleep(30)

        t = asyncio.create_task(body())
        await entered.wait()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        last = bodies(log, "s")[-1]
        assert isinstance(last, SessionDropped) and last.reason == "cancelled"
        assert eng.live_count == 0
    arun(go())


def test_leaving_block_without_terminal_event_drops_unfinished_with_warning(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        with capture_logs() as logs:
            async with eng.session("s", **KW) as h:
                await h.start()
        last = bodies(log, "s")[-1]
        assert isinstance(last, SessionDropped) and last.reason == "unfinished"
        warn = [e for e in logs if e["event"] == "session.unfinished"]
        assert warn and warn[0]["log_level"] == "warning" and warn[0]["session_id"] == "s"
    arun(go())


def test_finished_block_appends_nothing_more(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        async with eng.session("s", **KW) as h:
            await h.start()
            await h.finish(reward=1.0)
        assert isinstance(bodies(log, "s")[-1], SessionFinished)
        check_log_invariants(log)
    arun(go())


def test_wall_clock_budget_aborts_and_cancels_inflight_work(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        cancelled = []

        async def worker():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append("worker")
                raise

        with capture_logs() as logs:
            with pytest.raises(SessionTimeout) as info:
                async with eng.session("s", budget_s=0.1, **KW) as h:
                    await h.start()
                    h.spawn(worker())
                    await h.record_turn(output_ids=[1])
                    await asyncio.sleep(30)
        assert info.value.session_id == "s"
        last = bodies(log, "s")[-1]
        assert isinstance(last, SessionAborted) and last.reason == "wall_clock_timeout"
        await asyncio.sleep(0)
        assert cancelled == ["worker"]
        assert eng.live_count == 0
        assert any(e["event"] == "session.aborted" and e.get("reason") == "wall_clock_timeout" and e["session_id"] == "s" for e in logs)
        check_log_invariants(log)
    arun(go())


def test_engine_default_budget_aborts_a_plain_handle(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log, session_budget_s=0.05)
        h = await eng.open_session("s", **KW)
        await h.start()
        await asyncio.sleep(0.3)
        assert h.state is State.ABORTED
        assert bodies(log, "s")[-1].reason == "wall_clock_timeout"
        with pytest.raises(StragglerRefused):
            await h.record_turn(output_ids=[1])
    arun(go())


def test_budget_timer_is_released_when_session_ends_first(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log, session_budget_s=0.05)
        h = await eng.open_session("s", **KW)
        await h.start()
        await h.finish(reward=1.0)
        assert h._timer is None
        await asyncio.sleep(0.15)
        assert len(bodies(log, "s")) == 3  # no abort after the finish
    arun(go())


def test_terminal_transition_drains_inflight_turns_then_cancels_the_rest(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log, drain_s=0.2)
        h = await eng.open_session("s", **KW)
        await h.start()
        stuck_cancelled = asyncio.Event()

        async def quick_turn():
            await asyncio.sleep(0.02)  # a generation that completes within the drain window
            await h.record_turn(output_ids=[7])

        async def stuck():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                stuck_cancelled.set()
                raise

        h.spawn(quick_turn())
        t_stuck = h.spawn(stuck())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await h.finish(reward=1.0)
        elapsed = loop.time() - t0
        kinds = [type(b).__name__ for b in bodies(log, "s")]
        assert kinds[-2:] == ["TurnDelta", "SessionFinished"]
        assert stuck_cancelled.is_set() and t_stuck.cancelled()
        assert 0.15 < elapsed < 5
    arun(go())


@pytest.mark.parametrize("seed", range(5))
def test_concurrent_turns_are_ordered_and_none_lands_after_the_terminal_event(arun, seed):
    async def go():
        log = YieldingLog(seed=seed)
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        ops = [h.record_turn(output_ids=[i]) for i in range(20)]
        ops.insert(10, h.finish(reward=1.0))
        res = await asyncio.gather(*ops, return_exceptions=True)
        per = check_log_invariants(log)
        turns = [e.body for e in per["s"] if isinstance(e.body, TurnDelta)]
        assert [t.turn_index for t in turns] == list(range(len(turns)))
        n_ok = sum(1 for r in res if not isinstance(r, BaseException)) - 1
        assert n_ok == len(turns)
        assert all(isinstance(r, StragglerRefused) for r in res if isinstance(r, BaseException))
    arun(go())


def test_restart_aborts_orphans_with_engine_restart(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        a = await eng.open_session("open-one", **kw("open-one"))
        b = await eng.open_session("running-one", **kw("running-one"))
        await b.start()
        await b.record_turn(output_ids=[1])
        c = await eng.open_session("done", **kw("done"))
        await c.start()
        await c.finish(reward=1.0)
        del a  # the process "dies" here: no terminal events for a and b
        eng2 = await SessionEngine.open(log)
        per = check_log_invariants(log)
        for sid in ("open-one", "running-one"):
            last = per[sid][-1].body
            assert isinstance(last, SessionAborted) and last.reason == "engine_restart"
            assert eng2.status(sid) is State.ABORTED
        assert len(per["done"]) == 3
        assert eng2.stats["restart_aborted"] == 2
        # Restart again: nothing left to abort, nothing appended.
        n = log.next_lsn
        eng3 = await SessionEngine.open(log)
        assert log.next_lsn == n and eng3.stats["restart_aborted"] == 0
    arun(go())


def test_close_drops_live_sessions_with_shutdown_and_refuses_new_ones(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        for i in range(5):
            h = await eng.open_session(f"s{i}", **kw(f"s{i}"))
            if i % 2:
                await h.start()
        await eng.close()
        per = check_log_invariants(log)
        assert all(isinstance(v[-1].body, SessionDropped) and v[-1].body.reason == "shutdown" for v in per.values())
        assert eng.live_count == 0
        with pytest.raises(EngineClosed):
            await eng.open_session("late", **kw("late"))
    arun(go())


def test_non_finite_reward_raises_and_appends_nothing(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        n = log.next_lsn
        with pytest.raises(EventValidationError, match="finite"):
            await h.finish(reward=math.nan)
        with pytest.raises(EventValidationError, match="finite"):
            await h.assign_reward(math.inf)
        assert log.next_lsn == n and h.state is State.RUNNING
        await h.finish(reward=1)
    arun(go())


def test_failed_append_leaves_the_session_state_unchanged(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        log.close()
        with pytest.raises(LogClosed):
            await h.finish(reward=1.0)
        assert h.state is State.RUNNING and eng.get("s") is h
        with pytest.raises(LogClosed):
            await eng.open_session("t", **KW)
        assert eng.get("t") is None
    arun(go())


def test_undelivered_turn_must_name_a_recorded_turn(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        await h.record_turn(output_ids=[1])
        with pytest.raises(ValueError, match=r"expected a recorded turn in \[0, 1\), found 1"):
            await h.record_turn_undelivered(1, "gone")
        env = await h.record_turn_undelivered(0, "client gone")
        assert env.body.turn_index == 0
    arun(go())


def test_run_command_records_command_ran_and_refuses_when_not_running(arun, tmp_path):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        sb = LocalSandbox(tmp_path)
        h = await eng.open_session("s", **KW)
        with pytest.raises(StragglerRefused):
            await h.run_command(sb, "touch should-not-exist", 5)
        assert not (tmp_path / "should-not-exist").exists()
        await h.start()
        res = await h.run_command(sb, "echo out; exit 4", 5)
        assert res.exit_code == 4 and "out" in res.output_tail
        cmd = [b for b in bodies(log, "s") if isinstance(b, CommandRan)]
        assert cmd == [CommandRan(command="echo out; exit 4", exit_code=4, budget_exceeded=False,
                                  duration_s=res.duration_s, output_tail=res.output_tail)]
    arun(go())


def test_finish_cancels_a_running_command_after_the_drain(arun, tmp_path):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log, drain_s=0.1)
        sb = LocalSandbox(tmp_path)
        h = await eng.open_session("s", **KW)
        await h.start()
        cmd = asyncio.create_task(h.run_command(sb, "sleep 30", 60))
        await asyncio.sleep(0.2)
        await h.finish(reward=0.0)
        with pytest.raises(StragglerRefused):
            await cmd
        assert not any(isinstance(b, CommandRan) for b in bodies(log, "s"))
        check_log_invariants(log)
    arun(go())


def test_engine_holds_no_per_session_state_after_sessions_end(arun):
    async def go():
        log = YieldingLog(seed=1)
        eng = await SessionEngine.open(log, session_budget_s=60, status_cache=8)
        loop = asyncio.get_running_loop()

        async def one(i):
            async with eng.session(f"s{i}", **kw(f"s{i}")) as h:
                await h.start()
                h.spawn(asyncio.sleep(0))
                await h.record_turn(output_ids=[i])
                if i % 3 == 0:
                    await h.finish(reward=1.0)
                elif i % 3 == 1:
                    await h.abort("bad")

        await asyncio.gather(*(one(i) for i in range(200)))
        assert eng.live_count == 0 and eng._live == {}
        assert len(eng._groups) == 0  # every group released: no membership held
        assert len(eng._ids.recent) == 8
        assert not [t for t in loop._scheduled if not t.cancelled()]  # no budget timers left
        assert eng._bg == set()
    arun(go())


def test_aborted_event_is_logged_with_session_id_bound(arun):
    async def go():
        eng = await SessionEngine.open(MemoryLog())
        h = await eng.open_session("s", **KW)
        with capture_logs() as logs:
            await h.abort("sandbox_boot", error="no image")
        [e] = [e for e in logs if e["event"] == "session.aborted"]
        assert e["session_id"] == "s" and e["group_id"] == "g" and e["reason"] == "sandbox_boot"
    arun(go())


def test_cancelled_turn_that_the_log_already_staged_keeps_the_session_in_step(arun, tmp_path):
    """FileLog stages a record, then waits for durability: a cancel in that
    wait must not desynchronise the session's sequence from the log."""
    from agentlog.events import FileLog

    async def go():
        log = FileLog.open(tmp_path / "log", fsync="always")
        try:
            eng = await SessionEngine.open(log)
            h = await eng.open_session("s", **KW)
            await h.start()
            t = asyncio.create_task(h.record_turn(output_ids=[1]))
            await asyncio.sleep(0)  # staged, now waiting for its fsync
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            env = await h.record_turn(output_ids=[2])  # no SequenceError
            assert env.body.turn_index == 1 and h.turns == 2
            await h.finish(reward=1.0)
            per = check_log_invariants(log)
            assert [e.body.turn_index for e in per["s"] if isinstance(e.body, TurnDelta)] == [0, 1]
        finally:
            log.close()
    arun(go())


def test_a_cancelled_turn_is_recorded_once_the_engine_took_it_and_never_when_it_waited_for_the_lock(arun):
    """On a log that stages in a task (a YieldingLog: its append gives the loop away before and
    after it stores the record), a turn whose caller is cancelled once ``record_turn`` holds the
    session's lock is recorded anyway and applied when the log acknowledges it (the engine
    decided it; the log records it). A turn cancelled while it waits for the lock behind
    another one is never appended. Either way the session stays in step with the log."""

    async def go():
        log = YieldingLog(seed=1, max_yields=5)
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", **KW)
        await h.start()
        for _ in range(5):
            while h._busy:  # the last cancelled turn not yet acknowledged: its lock still held
                await asyncio.sleep(0)
            taken = asyncio.create_task(h.record_turn(output_ids=[1]))
            await asyncio.sleep(0)  # it holds the lock, its record staged
            queued = asyncio.create_task(h.record_turn(output_ids=[9]))
            await asyncio.sleep(0)  # waiting for the lock
            for t in (taken, queued):
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
        env = await h.record_turn(output_ids=[2])  # waits for the lock: every cancelled turn applied first
        assert env.body.turn_index == 5 and h.turns == 6
        per = check_log_invariants(log)
        turns = [e.body for e in per["s"] if isinstance(e.body, TurnDelta)]
        assert [b.turn_index for b in turns] == list(range(6))
        assert [bytes(b.output_ids) for b in turns] == [pack_tokens([1])] * 5 + [pack_tokens([2])]
    arun(go())


def test_run_command_uses_the_engine_default_sandbox(arun, tmp_path):
    async def go():
        eng = await SessionEngine.open(MemoryLog(), sandbox=LocalSandbox(tmp_path))
        h = await eng.open_session("s", **KW)
        await h.start()
        res = await h.run_command(None, "exit 2", 5)
        assert res.exit_code == 2
        bare = await SessionEngine.open(MemoryLog())
        h2 = await bare.open_session("t", **KW)
        await h2.start()
        with pytest.raises(ValueError, match="needs a sandbox"):
            await h2.run_command(None, "true", 5)
    arun(go())


def test_an_opening_a_log_refuses_a_step_late_refuses_what_queued_on_its_lock_and_appends_nothing(arun):
    """A log that stages in a task (a MemoryLog whose append is its own) checks a session_opened a loop step after
    open_session staged it; meanwhile close's drop (or an admin's start) may queue on the new
    session's lock. Once the log refuses the opening, what waited is refused as after an
    ending: the log holds nothing of the session."""
    from agentlog.events.schema.types import EventValidationError

    async def go():
        log = YieldingLog(max_yields=0)
        eng = await SessionEngine.open(log)
        opening = asyncio.ensure_future(eng.open_session("x", group_id="g", group_size=1, metadata={"bad": object()}))
        await asyncio.sleep(0)  # staged; the log checks it in its own task
        h = eng.get("x")
        start = asyncio.ensure_future(h.start())
        await eng.close()
        with pytest.raises(EventValidationError):
            await opening
        with pytest.raises(IllegalTransition):
            await start
        assert list(log.read(0)) == [] and eng.get("x") is None and not h._busy
    arun(go())


@pytest.mark.parametrize("budget", ["30", -1.0, math.inf, math.nan, True])
def test_a_bad_budget_is_refused_at_open_before_anything_is_decided(arun, budget):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        with pytest.raises(ValueError, match="session 'x': budget_s: expected seconds >= 0"):
            await eng.open_session("x", group_id="g", group_size=1, budget_s=budget)
        h = await eng.open_session("x", group_id="g", group_size=1)  # nothing of the refused one is kept
        assert log.next_lsn == 1 and h.state is State.OPEN
        await eng.close()
    arun(go())


def test_an_acknowledged_record_whose_apply_fails_answers_its_caller_and_the_rest_of_the_flush(arun, tmp_path, monkeypatch):
    """Applying one acknowledged record fails (injected into applying an opening): its caller gets
    RecordNotApplied and health reports it, while the other records the writer acknowledged in the
    same flush are applied and answered, and no session's lock is left held."""
    from agentlog.engine.errors import RecordNotApplied
    from agentlog.events import FileLog

    opened = SessionEngine._opened

    def failing(self, h, *args):
        if h.session_id == "c":
            raise RuntimeError("injected: applying the opening failed")
        return opened(self, h, *args)

    async def go():
        log = FileLog.open(tmp_path / "log", fsync="never")
        try:
            eng = await SessionEngine.open(log, checkpoint_poll_s=3600)
            a = await eng.open_session("a", **KW)
            await a.start()
            monkeypatch.setattr(SessionEngine, "_opened", failing)
            c = asyncio.ensure_future(eng.open_session("c", group_id="gc", group_size=1))
            turn = asyncio.ensure_future(a.record_turn(output_ids=[2]))
            done, pending = await asyncio.wait([c, turn], timeout=10)
            assert not pending
            with pytest.raises(RecordNotApplied, match="injected: applying the opening failed"):
                c.result()
            assert turn.result().body.turn_index == 0 and a.turns == 1 and not a._busy
            assert eng.background_failure is not None and "'c'" in eng.background_failure
        finally:
            log.close()
    arun(go())


async def _play_until_ended_then_finish(eng: SessionEngine, seen: list[str], started: asyncio.Event | None = None,
                                        **session: Any) -> None:
    """Play session "s", then poll every loop step (as a worker between awaits is always due to run)
    until it is no longer running, and finish it; ``seen`` gets what that task met."""
    async with eng.session("s", group_id="g", group_size=1, **session) as h:
        await h.start()
        if started is not None:
            started.set()
        try:
            while h.state is State.RUNNING:
                await asyncio.sleep(0)
            await h.finish(reward=1.0)
            seen.append("finish recorded")
        except SessionClosed:
            seen.append("SessionClosed")
            raise
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise


@pytest.mark.parametrize("use_file_log", [False, True])
def test_a_cancelled_sessions_task_is_cancelled_as_the_drop_is_applied_before_it_runs_again(arun, tmp_path, use_file_log):
    """``cancel`` cancels the task playing the session when its drop is applied, in the same loop
    step, not once the canceller runs again: a task that was already due to run (here one
    polling every loop step, as a worker between awaits is) never records past its session's end
    (a finish after the drop raised SessionClosed and killed an over-sampling worker)."""

    async def go():
        log = FileLog.open(tmp_path / "log", fsync="never") if use_file_log else MemoryLog()
        eng = await SessionEngine.open(log)
        seen: list[str] = []
        started = asyncio.Event()
        try:
            owner = asyncio.ensure_future(_play_until_ended_then_finish(eng, seen, started))
            await asyncio.wait_for(started.wait(), 10)
            env = await asyncio.wait_for(eng.get("s").cancel("oversampled"), 10)
            assert env is not None and env.body.reason == "oversampled"
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(owner, 10)
            assert seen == ["cancelled"]
            assert [e.body.__struct_config__.tag for e in log.read(0)][-1] == "session_dropped"
            await eng.close()
        finally:
            log.close()

    arun(go())


def test_a_spent_budgets_task_is_cancelled_as_the_abort_is_applied_before_it_runs_again(arun):
    """The budget's abort stops the task playing the session as cancel's drop does: as the abort is
    applied, so a task already due to run never goes on to record past the end (the context then
    raises SessionTimeout)."""

    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        seen: list[str] = []
        with pytest.raises(SessionTimeout):
            await asyncio.wait_for(_play_until_ended_then_finish(eng, seen, budget_s=0.05), 10)
        assert seen == ["cancelled"]
        assert [e.body.__struct_config__.tag for e in log.read(0)][-1] == "session_aborted"
        await eng.close()

    arun(go())


class _GatedFinishLog(MemoryLog):
    """A log whose session_finished waits for ``gate`` (a slow disk)."""

    gate: asyncio.Event | None = None

    async def append(self, sid, seq, body):
        if isinstance(body, SessionFinished) and self.gate is not None:
            await self.gate.wait()
        return self.append_batch([(sid, seq, body)])[0]


def test_a_session_that_finished_while_its_budget_ran_out_is_not_reported_as_timed_out(arun):
    """The budget runs out while the owner's finish waits for the disk, with a cleanup drop queued on the
    lock before the budget's abort: the finish is recorded, no abort is, yet ``engine.session`` raised
    SessionTimeout ("aborted with reason wall_clock_timeout") for the finished session."""
    async def go():
        log = _GatedFinishLog()
        eng = await SessionEngine.open(log, checkpoint_every=0)
        log.gate = asyncio.Event()

        async def cleanup(h):
            await asyncio.sleep(0.01)
            await h.drop("cleanup")  # finds it finished: nothing to drop

        async def disk():
            await asyncio.sleep(0.15)  # past the 0.05 s budget
            log.gate.set()

        async with eng.session("s", group_id="g", group_size=1, budget_s=0.05) as h:
            await h.start()
            tasks = [asyncio.create_task(cleanup(h)), asyncio.create_task(disk())]
            await h.finish(reward=1.0)
            assert not h.ended_by_engine
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.05)
        assert [type(e.body).__name__ for e in log.read()][-1] == "SessionFinished" and h.state is State.FINISHED
        await eng.close()

    arun(go())
