"""Adopting and resuming the sessions a killed engine left running (engine.adopt).

A "crash" here is an engine abandoned mid-session on a FileLog (the log closed
under it, nothing of the engine closed), as a killed worker leaves it; a new
engine opens the same log with ``adopt_orphans=True``. The kill -9 of a real
worker process is tests/loop/test_resume_worker.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentlog.engine import RESTART_REASON, SessionEngine
from agentlog.engine.handle import TURN_SCORE
from agentlog.events import FileLog
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.lifecycle import IllegalTransition, State
from agentlog.events.schema.types import EventValidationError, SessionAborted, SessionResumed, TurnDelta
from agentlog.reducers.pipeline import reduce_log

D0, D1, D2, D2B = ("0a" * 32), ("1b" * 32), ("2c" * 32), ("3d" * 32)
PROMPT = [{"role": "user", "content": "fix it"}]


def _turn(k: int) -> dict:
    """Turn k of the scripted session: each prompt extends the last context by a tool answer."""
    prompt = list(range(1, 4))
    for j in range(k):
        prompt += [100 + 10 * j, 101 + 10 * j, 50 + j]  # output of turn j, then its tool result
    out = [100 + 10 * k, 101 + 10 * k]
    messages = PROMPT + [m for j in range(k) for m in ({"role": "assistant", "content": f"a{j}"}, {"role": "tool", "content": f"t{j}"})]
    return dict(messages=messages, prompt_ids=prompt, output_ids=out, output_log_probs=[-0.25 - k, -0.5 - k],
                response_message={"role": "assistant", "content": f"a{k}"})


async def _play(h, turns: range, snapshots: dict[int, str]) -> None:
    for k in turns:
        await h.record_snapshot(k, snapshots[k], files=3, bytes=30)
        await h.record_turn(**_turn(k))
        await h.record_command(f"echo {k}", 0, False, 0.01, f"t{k}")


def _samples(path) -> list:
    log = FileLog.open(path)
    try:
        return reduce_log(log).samples
    finally:
        log.close()


def test_a_resumed_session_trains_as_the_uninterrupted_one_and_ends_once(arun, tmp_path):
    async def crashed() -> None:
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=2, sample_index=0, prompt=PROMPT)
        await h.start(harness="python-agent")
        await _play(h, range(2), {0: D0, 1: D1})
        await h.record_snapshot(2, D2)  # turn 2's request arrived; the worker died while it generated
        other = await eng.open_session("never-started", group_id="g", group_size=2, sample_index=1)
        assert other.state is State.OPEN
        log.close()  # killed: nothing of the engine is closed

    async def resumed() -> None:
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log, adopt_orphans=True)
        assert sorted(eng.orphans) == ["never-started", "s"]
        point = eng.orphans["s"]
        assert (point.durable_turns, point.harness, point.snapshot_to_resume()) == (2, "python-agent", D1)
        assert point.conversation()[-1] == {"role": "assistant", "content": "a1"}
        assert eng.orphans["never-started"].why_not_resumable().startswith("it never started")
        await eng.abort_orphan("never-started", eng.orphans["never-started"].why_not_resumable())
        h = await eng.resume("s", D1, worker="w1")
        assert (h.turns, h.state) == (2, State.RUNNING)
        await h.record_command("echo 1", 0, False, 0.01, "t1")  # the last durable turn's tool call, run again
        await _play(h, range(2, 4), {2: D2B, 3: D2B})
        await h.finish(reward=1.0)
        await eng.close()
        envs = [e for e in log.read(0) if e.session_id == "s"]
        log.close()
        resumes = [e.body for e in envs if isinstance(e.body, SessionResumed)]
        assert resumes == [SessionResumed(incarnation=1, durable_turns=2, snapshot=D1, snapshot_turn=1, worker="w1")]
        # The first turn after the resume is a delta against the last durable one, not a full turn.
        after = [e.body for e in envs if isinstance(e.body, TurnDelta) and e.body.turn_index == 2]
        assert len(after) == 1 and after[0].shared_tokens == len(_turn(1)["prompt_ids"]) + 2

    async def reference() -> None:
        log = FileLog.open(tmp_path / "ref")
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=2, sample_index=0, prompt=PROMPT)
        await h.start(harness="python-agent")
        await _play(h, range(4), {0: D0, 1: D1, 2: D2B, 3: D2B})
        await h.finish(reward=1.0)
        other = await eng.open_session("never-started", group_id="g", group_size=2, sample_index=1)
        await other.abort(RESTART_REASON)
        await eng.close()
        log.close()

    arun(crashed())
    arun(resumed())
    arun(reference())
    got = {s.session_id: s for s in _samples(tmp_path / "run")}
    want = {s.session_id: s for s in _samples(tmp_path / "ref")}
    assert set(got) == set(want) == {"s", "never-started"}
    a, b = got["s"], want["s"]
    assert a.turns == b.turns == 4 and a.response_length == b.response_length
    for name in ("tokens", "loss_mask", "rollout_log_probs"):
        assert getattr(a, name) == getattr(b, name), f"{name} differs across the resume point"
    # The tokens, masks and log-probs line up with the turns as they were generated.
    lp = np.frombuffer(a.rollout_log_probs, dtype="<f4")
    mask = np.frombuffer(a.loss_mask, dtype=np.uint8)
    assert np.allclose(lp[mask == 1], [x for k in range(4) for x in _turn(k)["output_log_probs"]])
    assert got["never-started"].status == "aborted"


def test_adopted_orphans_end_once_whatever_the_caller_decides(arun, tmp_path):
    async def go() -> None:
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log)
        for sid in ("a", "b", "c"):
            h = await eng.open_session(sid, group_id=f"g-{sid}", group_size=1)
            await h.start(harness="python-agent")
            await h.record_snapshot(0, D0)
        log.close()
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log, adopt_orphans=True)
        h = await eng.resume("a", D0)
        with pytest.raises(KeyError, match="'a': not an adopted orphan"):
            await eng.resume("a", D0)
        await eng.abort_orphan("b", "no snapshot store")
        await h.finish(reward=0.0)
        await eng.close()  # "c", left undecided, is dropped at shutdown
        ends = [(e.session_id, type(e.body).__name__) for e in log.read(0) if type(e.body).__name__ in
                ("SessionFinished", "SessionAborted", "SessionDropped")]
        aborted = [e.body for e in log.read(0) if isinstance(e.body, SessionAborted)]
        log.close()
        assert sorted(ends) == [("a", "SessionFinished"), ("b", "SessionAborted"), ("c", "SessionDropped")]
        assert aborted[0].reason == RESTART_REASON and aborted[0].error == "no snapshot store"
        # Reopened with the default, nothing is left to abort: each session ended exactly once.
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log)
        assert eng.stats["restart_aborted"] == 0
        await eng.close()
        log.close()

    arun(go())


def test_a_session_never_resumes_after_its_terminal_event(arun, tmp_path):
    async def go() -> None:
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        await h.finish(reward=1.0)
        with pytest.raises(IllegalTransition, match="illegal 'resume' in state 'finished'"):
            await h._engine._transition(h, "resume", SessionResumed(incarnation=1, durable_turns=0, snapshot=D0, snapshot_turn=0))
        await eng.close()
        log.close()

    arun(go())


def test_the_budget_a_resumed_session_used_leaves_out_each_crash_downtime(arun):
    now = [0]
    log = MemoryLog(clock=lambda: now[0])

    async def at(t: float, coro):
        now[0] = int(t * 1e9)
        return await coro

    async def go() -> None:
        eng = await SessionEngine.open(log)
        h = await at(0, eng.open_session("s", group_id="g", group_size=1, prompt=PROMPT))
        await at(1, h.start(harness="python-agent"))
        await at(2, h.record_snapshot(0, D0))
        await at(10, h.record_turn(**_turn(0)))  # killed at 50 s, its last record at 10 s
        eng = await at(100, SessionEngine.open(log, adopt_orphans=True))
        assert eng.orphans["s"].spent_s == 10.0
        h = await at(100, eng.resume("s", D0))
        await at(103, h.record_command("echo 0", 0, False, 0.01, "t0"))
        await at(105, h.record_snapshot(1, D1))  # killed again
        eng = await at(1000, SessionEngine.open(log, adopt_orphans=True))
        assert eng.orphans["s"].spent_s == 10.0 + 5.0  # not the 105 s from its opening to its last record
        await eng.abort_orphan("s", "the test is over")
        await eng.close()

    arun(go())


def test_an_orphan_whose_resume_is_refused_can_still_be_aborted(arun, tmp_path):
    async def go() -> None:
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log)
        await eng.open_session("s", group_id="g", group_size=1)  # opened, never started
        log.close()
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log, adopt_orphans=True)
        with pytest.raises(IllegalTransition, match="illegal 'resume' in state 'open'"):
            await eng.resume("s", D0)
        await eng.abort_orphan("s", "it never started")
        await eng.close()
        ends = [e.body for e in log.read(0) if isinstance(e.body, SessionAborted)]
        log.close()
        assert [(b.reason, b.error) for b in ends] == [(RESTART_REASON, "it never started")]

    arun(go())


def _resume_point_after(arun, play):
    """The resume point of session ``s`` (running, on a memory log) after ``play(h)`` recorded its turns."""
    from agentlog.events.log.api import MemoryLog
    from agentlog.reducers.resume import resume_points

    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        await play(h)
        (point,) = resume_points(log.read(), ["s"]).values()
        await eng.close()
        return point
    return arun(go())


def test_the_conversation_a_resume_continues_is_the_main_lineages_not_a_later_subagents(arun):
    from agentlog.events.schema.lineage import turn_lineage

    main = [{"role": "system", "content": "you fix bugs"}, {"role": "user", "content": "fix the parser"}]

    async def play(h):
        call = {"id": "c1", "name": "Agent", "arguments": {"prompt": "find where the parser fails on empty input"}}
        await h.record_turn(messages=main, prompt_ids=[1, 2], output_ids=[3], finish_reason="stop",
                            response_message={"role": "assistant", "content": "delegating", "tool_calls": [call]})
        sub = [{"role": "system", "content": "you search code"}, {"role": "user", "content": "find where the parser fails on empty input"}]
        env = await h.record_turn(messages=sub, prompt_ids=[4, 5], output_ids=[6], finish_reason="stop",
                                  response_message={"role": "assistant", "content": "in parse_header"})
        assert turn_lineage(env.body) != "main"  # the subagent's own lineage, recorded last

    point = _resume_point_after(arun, play)
    assert point.last_turn is not None and point.last_turn.turn_index == 1
    conv = point.conversation()
    assert conv[:2] == main and conv[-1]["content"] == "delegating"


def test_a_root_lineage_its_agent_named_is_the_conversation_a_resume_continues(arun):
    from agentlog.engine.lineages import Declared

    async def play(h):
        msgs = [{"role": "user", "content": "fix the parser"}]
        for k in range(3):
            answer = {"role": "assistant", "content": f"step {k}"}
            await h.record_turn(messages=list(msgs), prompt_ids=[1, 2 + k], output_ids=[3], finish_reason="stop",
                                response_message=answer, declared_lineage=Declared(id="orchestrator"))
            msgs += [answer, {"role": "user", "content": f"go on {k}"}]

    point = _resume_point_after(arun, play)
    assert point.root_lineage == "orchestrator" and point.durable_turns == 3
    assert point.conversation()[-1] == {"role": "assistant", "content": "step 2"}


async def _crashed_with_two_turns(path) -> None:
    """A running session 's' with two turns, its engine abandoned (a killed worker)."""
    log = FileLog.open(path)
    eng = await SessionEngine.open(log)
    h = await eng.open_session("s", group_id="g", group_size=1)
    await h.start()
    for _ in range(2):
        await h.record_turn(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_log_probs=[-0.1, -0.2],
                            sampling={"temperature": 1.0})
    log.close()


def test_a_refused_resume_then_a_retry_leaves_the_handle_as_one_resume_would(arun, tmp_path):
    """A resume the log refuses (a bad snapshot digest) changes nothing of the adopted handle: its retry
    once doubled the turns' outputs, so a teacher score of turn 2, never recorded, was accepted and
    the reducers then refused the log."""
    async def go():
        await _crashed_with_two_turns(tmp_path / "run")
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log, adopt_orphans=True)
        with pytest.raises(EventValidationError, match="snapshot"):
            await eng.resume("s", "not-a-digest")
        h = await eng.resume("s", D0)
        assert (h.turns, [n for n, _ in TURN_SCORE.iter_unpack(h._turn_scores)]) == (2, [2, 2])
        with pytest.raises(ValueError, match="teacher_scored.turn_index: expected a recorded turn in \\[0, 2\\)"):
            await h.record_teacher_scores(2, teacher="t", teacher_version="1", temperature=1.0, log_probs=[-0.1])
        await h.record_turn(prompt_ids=[1, 2, 3, 4, 5, 9], output_ids=[6], output_log_probs=[-0.3], sampling={"temperature": 1.0})
        await h.finish(reward=1.0)
        await eng.close()
        reduce_log(log)  # the log reduces
        log.close()

    arun(go())


@pytest.mark.parametrize("budget", [float("nan"), -1.0, "60"])
def test_a_bad_resume_budget_is_refused_before_anything_is_appended(arun, tmp_path, budget):
    """open_session refused such a budget_s; resume took it: NaN or -1 aborted the session at once
    (wall_clock_timeout), "60" raised TypeError after session_resumed was durable, and its retry
    appended a second session_resumed of the same incarnation."""
    async def go():
        await _crashed_with_two_turns(tmp_path / "run")
        log = FileLog.open(tmp_path / "run")
        eng = await SessionEngine.open(log, adopt_orphans=True)
        before = log.next_lsn
        with pytest.raises(ValueError, match="session 's': budget_s"):
            await eng.resume("s", D0, budget_s=budget)
        assert log.next_lsn == before
        h = await eng.resume("s", D0)  # still undecided: the retry resumes it
        assert h.state is State.RUNNING
        await eng.close()
        incarnations = [e.body.incarnation for e in log.read(0) if isinstance(e.body, SessionResumed)]
        log.close()
        assert incarnations == [1]

    arun(go())
