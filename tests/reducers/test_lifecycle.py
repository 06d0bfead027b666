"""The lifecycle reducer: violations with their LSN, summaries, eviction, replay, chunking."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import (
    CommandRan,
    Envelope,
    PolicyUpdated,
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TurnRecorded,
    TurnUndelivered,
)
from agentlog.reducers.lifecycle import (
    IdFilter,
    LifecycleReducer,
    LifecycleState,
    SessionSummary,
    Violation,
    reduce_lifecycle,
    reduce_lifecycle_many,
    replay,
)


class Stream:
    """Builds envelopes by hand (no log), so illegal sequences can be written."""

    def __init__(self) -> None:
        self.envs: list[Envelope] = []
        self.seq: dict[str, int] = {}

    def add(self, sid: str, body, *, seq: int | None = None, ts_ns: int | None = None) -> Envelope:
        s = self.seq.get(sid, 0) if seq is None else seq
        self.seq[sid] = s + 1
        lsn = len(self.envs)
        env = Envelope(lsn, sid, s, ts_ns if ts_ns is not None else 1_000_000_000 * (lsn + 1), body)
        self.envs.append(env)
        return env


def opened(group="g", size=2):
    return SessionOpened(group_id=group, group_size=size)


def turn(i, n_in=3, n_out=2, finish="stop"):
    return TurnRecorded(turn_index=i, prompt_ids=list(range(n_in)), output_ids=list(range(n_out)),
                        output_log_probs=[-0.5] * n_out, finish_reason=finish)


def full_session(s: Stream, sid: str, end=SessionFinished(reward=1.0), turns=2) -> None:
    s.add(sid, opened())
    s.add(sid, SessionStarted())
    for i in range(turns):
        s.add(sid, turn(i))
    s.add(sid, end)


def violations(out):
    return [o for o in out if isinstance(o, Violation)]


def summaries(out):
    return [o for o in out if isinstance(o, SessionSummary)]


def test_finished_session_is_summarised_then_evicted():
    s = Stream()
    s.add("a", opened("g1", 4))
    s.add("a", SessionStarted())
    s.add("a", turn(0, 10, 4))
    s.add("a", TurnUndelivered(turn_index=0, reason="client gone"))
    s.add("a", turn(1, 20, 6))
    s.add("a", CommandRan(command="ls", exit_code=0))
    s.add("a", SessionFinished(reward=0.5))
    r = LifecycleReducer()
    out = r.feed_many(s.envs)
    assert violations(out) == []
    [summ] = summaries(out)
    assert (summ.session_id, summ.group_id, summ.group_size, summ.status) == ("a", "g1", 4, "finished")
    assert (summ.turns, summ.undelivered, summ.commands) == (2, 1, 1)
    assert (summ.tokens_in, summ.tokens_out) == (30, 10)
    assert summ.reward == 0.5
    assert (summ.opened_lsn, summ.ended_lsn) == (0, 6)
    assert summ.duration_s == pytest.approx(6.0)
    assert r.state.live == {}
    assert r.open_sessions() == {}


def test_finish_without_reward_takes_last_assigned_reward():
    s = Stream()
    s.add("a", opened())
    s.add("a", SessionStarted())
    s.add("a", RewardAssigned(reward=0.25))
    s.add("a", RewardAssigned(reward={"pass": 1.0}))
    s.add("a", SessionFinished())
    [summ] = summaries(LifecycleReducer().feed_many(s.envs))
    assert summ.reward == {"pass": 1.0}


def test_aborted_and_dropped_summaries_carry_reason():
    s = Stream()
    full_session(s, "a", SessionAborted(reason="sandbox_boot", error="no image"))
    s.add("b", opened())
    s.add("b", SessionDropped(reason="duplicate"))
    out = summaries(LifecycleReducer().feed_many(s.envs))
    assert [(o.session_id, o.status, o.reason, o.reward) for o in out] == [
        ("a", "aborted", "sandbox_boot", None),
        ("b", "dropped", "duplicate", None),
    ]
    assert out[0].error == "no image"


def test_turn_after_terminal_event_is_reported_with_its_lsn():
    s = Stream()
    full_session(s, "a")
    bad = s.add("a", turn(5))
    out = LifecycleReducer().feed_many(s.envs)
    [v] = violations(out)
    assert (v.lsn, v.session_id) == (bad.lsn, "a")
    assert "after the session's terminal event" in v.message and "finished" in v.message


def test_second_terminal_event_is_reported():
    s = Stream()
    full_session(s, "a")
    bad = s.add("a", SessionAborted(reason="late"))
    [v] = violations(LifecycleReducer().feed_many(s.envs))
    assert v.lsn == bad.lsn and "terminal" in v.message


def test_event_after_terminal_outside_recent_window_still_reported():
    """With no exact window, the id filter still tells 'after terminal' from 'never opened'."""
    s = Stream()
    full_session(s, "a")
    bad = s.add("a", SessionDropped(reason="late"))
    r = LifecycleReducer(recent_window=0)
    [v] = violations(r.feed_many(s.envs))
    assert v.lsn == bad.lsn and "after the session's terminal event" in v.message


@pytest.mark.parametrize("delta, kind", [(1, "a gap"), (-1, "a repeat")])
def test_session_seq_gap_or_repeat_is_reported(delta, kind):
    s = Stream()
    s.add("a", opened())
    s.add("a", SessionStarted())
    bad = s.add("a", turn(0), seq=2 + delta)
    [v] = violations(LifecycleReducer().feed_many(s.envs))
    assert v.lsn == bad.lsn and kind in v.message and "expected 2" in v.message


def test_event_for_never_opened_session_is_reported_and_creates_nothing():
    s = Stream()
    bad = s.add("ghost", SessionStarted())
    r = LifecycleReducer()
    [v] = violations(r.feed_many(s.envs))
    assert (v.lsn, v.session_id) == (bad.lsn, "ghost") and "never opened" in v.message
    assert r.state.live == {}


def test_turn_on_open_session_is_reported_and_not_applied():
    s = Stream()
    s.add("a", opened())
    bad = s.add("a", turn(0))
    r = LifecycleReducer()
    [v] = violations(r.feed_many(s.envs))
    assert v.lsn == bad.lsn and "'turn_recorded' in state 'open'" in v.message
    assert r.state.live["a"].turns == 0


@pytest.mark.parametrize("window", [4096, 0])
def test_reused_session_id_is_reported(window):
    s = Stream()
    full_session(s, "a")
    bad = s.add("a", opened(), seq=0)
    r = LifecycleReducer(recent_window=window)
    [v] = violations(r.feed_many(s.envs))
    assert v.lsn == bad.lsn and "reused" in v.message
    assert "a" not in r.state.live


def test_lsn_that_does_not_increase_is_reported():
    s = Stream()
    s.add("a", opened())
    e = s.add("a", SessionStarted())
    r = LifecycleReducer()
    r.feed_many(s.envs)
    dup = Envelope(e.lsn, "b", 0, 0, opened())
    [v] = violations(r.feed(dup))
    assert "lsn 1 does not increase" in v.message


def test_learner_events_are_not_session_events():
    s = Stream()
    s.add("learner", PolicyUpdated(step=1, policy_version=1))
    s.add("learner", PolicyUpdated(step=2, policy_version=2))
    r = LifecycleReducer()
    assert r.feed_many(s.envs) == []
    assert r.state.live == {}


def test_open_sessions_lists_open_and_running_with_next_seq():
    s = Stream()
    s.add("a", opened())
    s.add("b", opened())
    s.add("b", SessionStarted())
    s.add("b", turn(0))
    full_session(s, "c")
    r = LifecycleReducer()
    r.feed_many(s.envs)
    assert r.open_sessions() == {"a": (State.OPEN, 1), "b": (State.RUNNING, 3)}


def test_memory_stays_bounded_by_open_sessions():
    """50k sequential sessions: nothing kept per ended session beyond the window."""
    r = LifecycleReducer(recent_window=100)
    lsn = 0
    for i in range(50_000):
        sid = f"s{i}"
        for seq, body in enumerate((opened(), SessionStarted(), SessionFinished(reward=1.0))):
            r.feed(Envelope(lsn, sid, seq, lsn, body))
            lsn += 1
    assert r.state.live == {}
    assert len(r.state.recent) == 100
    assert r.state.ended == 50_000
    assert r.state.ids.nbytes == IdFilter().nbytes  # preallocated; did not grow


def test_id_filter_has_no_false_negatives_and_grows_past_capacity():
    f = IdFilter(capacity=500)
    ids = [f"session-{i}" for i in range(2_000)]
    for x in ids:
        f.add(x)
    assert all(x in f for x in ids)
    assert len(f._layers) > 1
    false_pos = sum(f"fresh-{i}" in f for i in range(50_000))
    assert false_pos <= 2  # expected ~0.02 at 3.4e-7 per layer


def test_replay_reports_state_before_and_after_each_event():
    s = Stream()
    full_session(s, "a", turns=1)
    s.add("b", opened())
    s.add("a", turn(9))
    steps = list(replay(s.envs))
    got = [(st.envelope.session_id, st.event, st.state_before, st.state_after, len(st.violations)) for st in steps]
    assert got == [
        ("a", "session_opened", None, State.OPEN, 0),
        ("a", "session_started", State.OPEN, State.RUNNING, 0),
        ("a", "turn_recorded", State.RUNNING, State.RUNNING, 0),
        ("a", "session_finished", State.RUNNING, State.FINISHED, 0),
        ("b", "session_opened", None, State.OPEN, 0),
        ("a", "turn_recorded", State.FINISHED, State.FINISHED, 1),
    ]
    assert steps[3].summary is not None and steps[3].summary.status == "finished"


def test_replay_filters_one_session_and_stops_at_until_lsn():
    s = Stream()
    full_session(s, "a", turns=1)
    full_session(s, "b", turns=1)
    steps = list(replay(s.envs, session_id="b", until_lsn=6))
    assert [(st.envelope.lsn, st.state_after) for st in steps] == [(4, State.OPEN), (5, State.RUNNING), (6, State.RUNNING)]


# ------------------------------------------------------------------ properties

_IN_SESSION = st.sampled_from(["turn", "undelivered", "command", "reward"])
_END = st.sampled_from(["finish", "abort", "drop", "drop_open", "abort_open", "none"])
_CORRUPT = st.sampled_from(["none", "after_terminal", "second_terminal", "gap", "never_opened", "reuse"])


@st.composite
def event_streams(draw):
    """Interleaved sessions with random outcomes, optionally with illegal records."""
    n = draw(st.integers(1, 6))
    scripts = []
    for i in range(n):
        sid = f"s{i}"
        end = draw(_END)
        body = [opened(f"g{i % 2}")]
        if end in ("drop_open", "abort_open"):
            body.append(SessionDropped(reason="x") if end == "drop_open" else SessionAborted(reason="y"))
        else:
            body.append(SessionStarted())
            for k, kind in enumerate(draw(st.lists(_IN_SESSION, max_size=5))):
                body.append(
                    {"turn": turn(k), "undelivered": TurnUndelivered(turn_index=0), "command": CommandRan(command="c"),
                     "reward": RewardAssigned(reward=float(k))}[kind]
                )
            if end == "finish":
                body.append(SessionFinished(reward=draw(st.sampled_from([None, 0.0, 1.0]))))
            elif end == "abort":
                body.append(SessionAborted(reason="timeout"))
            elif end == "drop":
                body.append(SessionDropped(reason="cancelled"))
        scripts.append((sid, body))
    order = draw(st.permutations([i for i, (_, b) in enumerate(scripts) for _ in b]))
    s = Stream()
    pos = [0] * n
    for i in order:
        sid, body = scripts[i]
        s.add(sid, body[pos[i]])
        pos[i] += 1
    corrupt = draw(_CORRUPT)
    if corrupt == "after_terminal":
        s.add("s0", turn(99))
    elif corrupt == "second_terminal":
        s.add("s0", SessionDropped(reason="again"))
    elif corrupt == "gap":
        s.add("s0", CommandRan(command="gap"), seq=s.seq["s0"] + 3)
    elif corrupt == "never_opened":
        s.add("nobody", turn(0))
    elif corrupt == "reuse":
        s.add("s0", opened(), seq=0)
    return s.envs, corrupt


@settings(max_examples=150, deadline=None)
@given(data=event_streams(), cuts=st.lists(st.integers(0, 60), max_size=6))
def test_feeding_arbitrary_chunks_equals_one_by_one(data, cuts):
    envs, _ = data
    one = LifecycleState()
    out_one = []
    for env in envs:
        one, o = reduce_lifecycle(one, env)
        out_one.extend(o)
    chunked = LifecycleState()
    out_chunked = []
    bounds = sorted({0, len(envs), *[c % (len(envs) + 1) for c in cuts]})
    for a, b in zip(bounds, bounds[1:]):
        chunked, o = reduce_lifecycle_many(chunked, envs[a:b])
        out_chunked.extend(o)
    assert out_chunked == out_one
    assert chunked.open_sessions() == one.open_sessions()


@settings(max_examples=150, deadline=None)
@given(data=event_streams())
def test_every_illegal_record_is_reported_and_legal_streams_are_clean(data):
    envs, corrupt = data
    out = LifecycleReducer().feed_many(envs)
    v = violations(out)
    if corrupt == "none":
        assert v == []
        ended = {e.session_id for e in envs if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped))}
        assert sorted(o.session_id for o in summaries(out)) == sorted(ended)
    elif corrupt == "after_terminal" or corrupt == "second_terminal":
        # s0 may still be running; then the turn is legal but a drop is a legal terminal.
        last = envs[-1]
        s0_ended = any(e.session_id == "s0" and isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped)) for e in envs[:-1])
        started = any(e.session_id == "s0" and isinstance(e.body, SessionStarted) for e in envs[:-1])
        if s0_ended or (corrupt == "after_terminal" and not started):
            assert [x.lsn for x in v] == [last.lsn]
        else:
            assert v == []
    else:
        # Only the corrupt record is flagged (a reuse of a live id is also a seq repeat).
        assert v and {x.lsn for x in v} == {envs[-1].lsn}


@settings(max_examples=80, deadline=None)
@given(data=event_streams(), k=st.integers(0, 80))
def test_outputs_of_a_prefix_are_a_prefix_of_the_outputs(data, k):
    envs, _ = data
    full = LifecycleReducer().feed_many(envs)
    part = LifecycleReducer().feed_many(envs[: k % (len(envs) + 1)])
    assert full[: len(part)] == part


def test_summary_token_counts_match_numpy_views():
    s = Stream()
    s.add("a", opened())
    s.add("a", SessionStarted())
    t = TurnRecorded(turn_index=0, prompt_ids=np.arange(7, dtype=np.int64), output_ids=np.arange(5, dtype=np.int32))
    s.add("a", t)
    s.add("a", SessionFinished(reward=1))
    [summ] = summaries(LifecycleReducer().feed_many(s.envs))
    assert (summ.tokens_in, summ.tokens_out) == (len(t.prompt_tokens), len(t.output_tokens)) == (7, 5)


def test_reopening_a_live_id_is_reported_and_does_not_disturb_the_session():
    s = Stream()
    s.add("a", opened())
    s.add("a", SessionStarted())
    bad = s.add("a", opened(), seq=0)
    s.add("a", turn(0), seq=2)
    s.add("a", SessionFinished(reward=1.0), seq=3)
    out = LifecycleReducer().feed_many(s.envs)
    assert {v.lsn for v in violations(out)} == {bad.lsn}
    [summ] = summaries(out)
    assert summ.turns == 1 and summ.status == "finished"


@given(ends=st.lists(st.tuples(st.sampled_from("abcdefgh"), st.sampled_from([State.FINISHED, State.ABORTED, State.DROPPED])),
                     max_size=8, unique_by=lambda end: end[0]),  # a session ends once
       size=st.integers(min_value=0, max_value=6))
def test_the_ended_window_snapshots_its_own_entries_oldest_first_and_reads_back_equal(ends, size):
    """A checkpoint snapshots the window in the event loop's thread, over the whole window: the
    snapshot is the window's entries themselves (no tuple built an entry), oldest first, and a
    window read back from it answers as the original."""
    from agentlog.reducers.lifecycle_step import EndedWindow, EndedWindowSnapshot
    import msgspec

    window = EndedWindow(size)
    for lsn, (sid, state) in enumerate(ends):
        window.note(sid, state, lsn)
    snap = window.to_snapshot()
    kept = [(sid, state, lsn) for lsn, (sid, state) in enumerate(ends)][-size:] if size else []
    assert snap.ended == kept
    assert all(a is b for a, b in zip(snap.ended, window.entries()))  # the window's own tuples
    back = EndedWindow.from_snapshot(msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=EndedWindowSnapshot))
    assert back.entries() == window.entries() and len(back) == len(window)
    for sid in "abcdefghz":
        assert back.get(sid) == window.get(sid) and back.describe(sid) == window.describe(sid)
        assert window.get(sid) == next(((st_, lsn) for s, st_, lsn in kept if s == sid), None)
