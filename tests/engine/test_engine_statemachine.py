"""A hypothesis RuleBasedStateMachine drives the engine with random operations,
sequential and concurrent, and checks every outcome against the lifecycle
table and every log against the session grammar."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from agentlog.engine import DuplicateSession, SessionEngine, StragglerRefused
from engine_helpers import YieldingLog, check_log_invariants, fire
from agentlog.events.schema.lifecycle import TERMINAL_STATES, TRANSITIONS, IllegalTransition, SessionClosed, State
from agentlog.events.schema.types import CommandRan, Envelope, RewardAssigned, SessionAborted, SessionDropped, SessionFinished, SessionStarted, TurnDelta

TRIGGERS = st.sampled_from(["start", "finish", "abort", "drop", "turn", "reward", "command"])
IN_SESSION = ("turn", "reward", "command")
EVENT_OF = {
    "start": SessionStarted, "finish": SessionFinished, "abort": SessionAborted, "drop": SessionDropped,
    "turn": TurnDelta, "reward": RewardAssigned, "command": CommandRan,
}
TRIGGER_OF = {v: k for k, v in EVENT_OF.items()}


def expected(state: State, trigger: str):
    """What the table says a trigger does: a new state, None (no-op) or an exception type."""
    if trigger in IN_SESSION:
        return state if state is State.RUNNING else StragglerRefused
    dest = TRANSITIONS.get((state, trigger))
    if dest is not None:
        return dest
    if state in TERMINAL_STATES:
        return None if trigger == "drop" else (SessionClosed if trigger in ("finish", "abort") else IllegalTransition)
    return IllegalTransition


class EngineMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.model: dict[str, State] = {}
        self.handles: dict = {}
        self.n = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed):
        self.log = YieldingLog(seed=seed)
        self.engine = self.run(SessionEngine.open(self.log, status_cache=16))

    @rule(target=sessions)
    def open_session(self):
        sid = f"s{self.n}"
        self.n += 1
        self.handles[sid] = self.run(self.engine.open_session(sid, group_id=f"g-{sid}", group_size=1))
        self.model[sid] = State.OPEN
        return sid

    @rule(sid=sessions)
    def reopening_an_id_is_refused(self, sid):
        before = self.log.next_lsn
        try:
            self.run(self.engine.open_session(sid, group_id=f"g-{sid}", group_size=1))
        except DuplicateSession as exc:
            assert exc.session_id == sid
        else:
            raise AssertionError(f"{sid}: duplicate open accepted")
        assert self.log.next_lsn == before

    @rule(sid=sessions, trigger=TRIGGERS)
    def one_trigger(self, sid, trigger):
        state = self.model[sid]
        want = expected(state, trigger)
        before = self.log.next_lsn
        try:
            got = self.run(fire(self.handles[sid], trigger))
        except IllegalTransition as exc:
            assert isinstance(want, type) and type(exc) is want, (sid, state, trigger, exc)
            assert exc.session_id == sid and exc.state is state
            assert self.log.next_lsn == before
            return
        assert not isinstance(want, type), (sid, state, trigger, "expected", want)
        if want is None:
            assert got is None and self.log.next_lsn == before
            return
        assert isinstance(got, Envelope) and isinstance(got.body, EVENT_OF[trigger]) and self.log.next_lsn == before + 1
        self.model[sid] = want

    @rule(ops=st.lists(st.tuples(sessions, TRIGGERS), min_size=2, max_size=10))
    def concurrent_triggers(self, ops):
        before = self.log.next_lsn
        start_states = {sid: self.model[sid] for sid, _ in ops}

        async def go():
            return await asyncio.gather(*(fire(self.handles[sid], t) for sid, t in ops), return_exceptions=True)

        results = self.run(go())
        new = list(self.log.read(before))
        # Replay what was appended through the table: every appended event must be legal.
        passed: dict[str, list[State]] = {sid: [s] for sid, s in start_states.items()}
        for env in new:
            trig = TRIGGER_OF[type(env.body)]
            cur = passed[env.session_id][-1]
            dest = expected(cur, trig)
            assert isinstance(dest, State), f"{env.session_id}: {trig} appended in state {cur}"
            passed[env.session_id].append(dest)
        appended = {e.lsn for e in new}
        got_envs = [r for r in results if isinstance(r, Envelope)]
        assert sorted(e.lsn for e in got_envs) == sorted(appended), "acknowledged events != appended events"
        for (sid, trig), res in zip(ops, results):
            if isinstance(res, Envelope):
                assert res.session_id == sid and isinstance(res.body, EVENT_OF[trig])
            elif res is None:
                assert trig == "drop" and any(s in TERMINAL_STATES for s in passed[sid])
            else:
                assert isinstance(res, IllegalTransition), repr(res)
                # Refused in a state the session really was in, exactly as the table says.
                assert res.state in passed[sid] and type(res) is expected(res.state, trig), (sid, trig, res)
        for sid, states in passed.items():
            self.model[sid] = states[-1]

    @invariant()
    def engine_agrees_with_the_model_and_the_log_is_well_formed(self):
        if not hasattr(self, "engine"):
            return
        for sid, state in self.model.items():
            assert self.handles[sid].state is state
            assert (self.engine.get(sid) is not None) == (state not in TERMINAL_STATES)
        assert self.engine.live_count == sum(s not in TERMINAL_STATES for s in self.model.values())
        check_log_invariants(self.log)

    def teardown(self):
        if hasattr(self, "engine"):
            self.run(self.engine.close())
            per = check_log_invariants(self.log)
            # After close every session has exactly one terminal event.
            for sid, envs in per.items():
                assert isinstance(envs[-1].body, (SessionFinished, SessionAborted, SessionDropped)), sid
        self.loop.close()


EngineMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestEngineStateMachine = EngineMachine.TestCase
