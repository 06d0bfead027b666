"""Every (state, trigger) pair, driven through the engine, against the lifecycle table."""

from __future__ import annotations

import itertools

import pytest

from agentlog.engine import SessionEngine, StragglerRefused
from engine_helpers import fire
from agentlog.events.schema.lifecycle import TRANSITIONS, IllegalTransition, SessionClosed, State
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionResumed, SessionStarted, TurnDelta

O, R, F, A, D = State.OPEN, State.RUNNING, State.FINISHED, State.ABORTED, State.DROPPED
NOOP = "noop"

#: DESIGN.md's table, written out by hand: a destination state, or what happens instead.
EXPECTED = {
    (O, "start"): R, (O, "finish"): IllegalTransition, (O, "abort"): A, (O, "drop"): D, (O, "turn"): StragglerRefused,
    (R, "start"): IllegalTransition, (R, "finish"): F, (R, "abort"): A, (R, "drop"): D, (R, "turn"): R,
    (O, "resume"): IllegalTransition, (R, "resume"): R,
}
for _t in (F, A, D):
    EXPECTED.update({
        (_t, "start"): IllegalTransition, (_t, "finish"): SessionClosed, (_t, "abort"): SessionClosed,
        (_t, "drop"): NOOP, (_t, "turn"): StragglerRefused, (_t, "resume"): IllegalTransition,
    })

EVENT_OF = {"start": SessionStarted, "finish": SessionFinished, "abort": SessionAborted, "drop": SessionDropped, "turn": TurnDelta,
            "resume": SessionResumed}


def test_hand_written_table_matches_the_shared_transition_table():
    legal = {k: v for k, v in EXPECTED.items() if isinstance(v, State) and k[1] != "turn"}
    assert legal == dict(TRANSITIONS)


async def _session_in(engine: SessionEngine, sid: str, state: State):
    h = await engine.open_session(sid, group_id="g", group_size=1)
    if state in (R, F):
        await h.start()
    if state is F:
        await h.finish(reward=1.0)
    elif state is A:
        await h.abort("setup")
    elif state is D:
        await h.drop("setup")
    assert h.state is state
    return h


@pytest.mark.parametrize("state, trigger", sorted(EXPECTED, key=lambda k: (k[0].value, k[1])))
def test_every_state_trigger_pair_follows_the_table(arun, state, trigger):
    expected = EXPECTED[(state, trigger)]

    async def go():
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        h = await _session_in(engine, "s", state)
        before = log.next_lsn
        if isinstance(expected, type) and issubclass(expected, Exception):
            with pytest.raises(expected) as info:
                await fire(h, trigger)
            assert type(info.value) is expected  # SessionClosed is not a plain IllegalTransition and vice versa
            assert info.value.session_id == "s" and info.value.state is state
            assert log.next_lsn == before, "a refused trigger appended an event"
            assert h.state is state
        elif expected == NOOP:
            assert await fire(h, trigger) is None
            assert log.next_lsn == before
            assert h.state is state
        else:
            env = await fire(h, trigger)
            assert log.next_lsn == before + 1
            assert isinstance(env.body, EVENT_OF[trigger]) and env.lsn == before
            assert h.state is expected
            assert engine.status("s") is expected
            assert (engine.get("s") is None) == (expected in (F, A, D))
    arun(go())


def test_all_pairs_are_covered():
    assert set(EXPECTED) == set(itertools.product(list(State), ["start", "finish", "abort", "drop", "turn", "resume"]))
