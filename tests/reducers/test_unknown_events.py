"""Events of a type this version does not know (a newer writer's
UnknownEvent): folds that must interpret them raise UnknownEventError (upgrade
agentlog); folds that only show the log pass over them and count them."""

from __future__ import annotations

import pytest

from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import Envelope, SessionFinished, SessionOpened, SessionStarted, UnknownEvent
from agentlog.reducers.errors import ReduceError, UnknownEventError
from agentlog.reducers.lifecycle import LifecycleReducer, SessionSummary, Violation, replay
from agentlog.reducers.pipeline import Reducer, reduce_log, session_trajectory
from agentlog.reducers.runstats import RunStats

SCORED = UnknownEvent("turn_scored", {"score": 0.5})


def stream(*, unknown_at: int = 2) -> list[Envelope]:
    """Session s: opened, started, finished, with ``SCORED`` at position
    ``unknown_at`` (its session_seq in order); session t: opened."""
    bodies = [SessionOpened(group_id="g", group_size=1), SessionStarted(), SessionFinished(reward=1.0)]
    bodies.insert(unknown_at, SCORED)
    envs = [Envelope(lsn, "s", lsn, 100 + lsn, b) for lsn, b in enumerate(bodies)]
    envs.append(Envelope(len(envs), "t", 0, 200, SessionOpened(group_id="h", group_size=1)))
    return envs


def test_the_sample_reducer_refuses_an_unknown_event_naming_tag_lsn_session_and_upgrade():
    reducer = Reducer()
    envs = stream()
    reducer.feed_many(envs[:2])
    with pytest.raises(UnknownEventError) as info:
        reducer.feed(envs[2])
    err = info.value
    assert isinstance(err, ReduceError) and (err.lsn, err.session_id, err.tag) == (2, "s", "turn_scored")
    assert str(err) == (
        "lsn 2, session 's': event type 'turn_scored' is unknown to this version of agentlog "
        "(the log was written by a newer one); upgrade agentlog to reduce this log"
    )
    # Left as before the refused envelope.
    assert reducer.last_lsn == 1 and reducer.open_sessions() == {"s": "running"}
    with pytest.raises(UnknownEventError, match="turn_scored"):
        reduce_log(envs)


def test_show_refuses_only_the_session_that_holds_the_unknown_event():
    envs = stream()
    with pytest.raises(UnknownEventError, match=r"lsn 2, session 's'"):
        session_trajectory(envs, "s")
    assert session_trajectory(envs, "t").rows == ()


def test_the_lifecycle_fold_raises_unless_told_to_pass_over_unknown_events():
    envs = stream()
    strict = LifecycleReducer()
    strict.feed_many(envs[:2])
    with pytest.raises(UnknownEventError, match=r"lsn 2, session 's': event type 'turn_scored'.*upgrade agentlog"):
        strict.feed(envs[2])
    assert strict.state.events == 2  # untouched by the refused envelope

    tolerant = LifecycleReducer(tolerate_unknown=True)
    out = tolerant.feed_many(envs)
    assert not [o for o in out if isinstance(o, Violation)]  # the sequence stays in step
    (summary,) = [o for o in out if isinstance(o, SessionSummary)]
    assert summary.status == "finished" and summary.reward == 1.0
    assert tolerant.state.unknown_events == {"turn_scored": 1}


def test_replay_shows_an_unknown_event_with_the_state_unchanged():
    steps = list(replay(stream()))
    assert [s.event for s in steps] == ["session_opened", "session_started", "turn_scored", "session_finished", "session_opened"]
    scored = steps[2]
    assert (scored.state_before, scored.state_after, scored.violations) == (State.RUNNING, State.RUNNING, ())
    # An unknown event on a session that is not open (a new learner-side event, say) is shown too.
    lone = Envelope(0, "learner", 0, 1, UnknownEvent("checkpoint_pruned", {}))
    (step,) = replay([lone])
    assert (step.event, step.state_before, step.state_after, step.violations) == ("checkpoint_pruned", None, None, ())


def test_stats_count_unknown_events_per_tag_and_interpret_the_rest():
    stats = RunStats()
    for env in stream() + [Envelope(9, "learner", 0, 300, UnknownEvent("checkpoint_pruned", {}))]:
        stats.feed(env)
    snap = stats.snapshot()
    assert snap["unknown_events"] == {"checkpoint_pruned": 1, "turn_scored": 1}
    assert snap["events"] == 6 and snap["sessions"]["finished"] == 1 and snap["violations"]["count"] == 0
