"""The fold driver (``reducers.fold.SessionFold``): the live map, the ended
window, the id filter, the LSN check, the learner's records and resync, each
checked on its own, and, over random streams with faults injected, against a
plain reference fold that remembers every session forever."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reduce_streams import RandomStream

from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import event_tag
from agentlog.reducers.fold import SessionFold, Tracked
from agentlog.reducers.lifecycle import LifecycleCheck
from agentlog.reducers.lifecycle_step import SessionLife, Violation, evolve, resync

Record = tuple[int, str, int, str]  # (lsn, session_id, session_seq, tag)


class Recorder:
    """A fold whose hooks write down every call, in order, as plain tuples."""

    def __init__(self, **options: Any) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fold: SessionFold[Tracked] = SessionFold(
            opened=self.opened, applied=self.applied, ended=self.ended, refused=self.refused,
            learner=self.learner, unknown=self.unknown, **options,
        )

    def opened(self, lsn: int, sid: str, record: Any, life: SessionLife) -> Tracked:
        self.calls.append(("opened", lsn, sid))
        return Tracked(life)

    def applied(self, session: Tracked, lsn: int, tag: str, record: Any) -> None:
        self.calls.append(("applied", lsn, tag))

    def ended(self, session: Tracked, lsn: int, sid: str, state: State, record: Any) -> None:
        self.calls.append(("ended", lsn, sid, str(state)))

    def refused(self, v: Violation) -> None:
        self.calls.append(("refused", v.lsn, v.session_id, v.kind.value, v.message))

    def learner(self, record: Any) -> None:
        self.calls.append(("learner", record))

    def unknown(self, lsn: int, sid: str, tag: str) -> None:
        self.calls.append(("unknown", lsn, sid, tag))

    def feed(self, records: list[Record]) -> "Recorder":
        for lsn, sid, seq, tag in records:
            self.fold.feed(lsn, sid, seq, tag, lsn, unknown=tag == "turn_scored")
        return self

    def refusals(self) -> list[tuple[int, str, str]]:
        return [c[1:4] for c in self.calls if c[0] == "refused"]


def reference_refusals(records: list[Record]) -> list[tuple[int, str, str]]:
    """What a fold with unbounded memory refuses: every session's life kept, every
    ended id remembered exactly; the step (``evolve``) decides each record."""
    lives: dict[str, SessionLife] = {}
    ended: set[str] = set()
    next_lsn, out = 0, []
    for lsn, sid, seq, tag in records:
        if lsn < next_lsn:
            out.append((lsn, sid, "lsn_order"))
        else:
            next_lsn = lsn + 1
        if tag == "policy_updated":
            continue
        life = lives.get(sid)
        step = evolve(life, lsn, sid, seq, tag, "ended" if life is None and sid in ended else None)
        if isinstance(step, Violation):
            out.append((lsn, sid, step.kind.value))
            if life is not None:
                lives[sid] = resync(life, seq)  # type: ignore[assignment]
        elif step is not None:
            if step.state in (State.FINISHED, State.ABORTED, State.DROPPED):
                del lives[sid]
                ended.add(sid)
            else:
                lives[sid] = step
    return out


def faulty_stream(seed: int, faults: list[tuple[str, int]]) -> list[Record]:
    """A valid random stream's records, then faults: a record dropped or
    duplicated, its ``session_seq`` moved, its LSN moved back, a learner
    record or an unknown event inserted (on a session's id, in sequence)."""
    records = [(e.lsn, e.session_id, e.session_seq, event_tag(e.body)) for e in RandomStream(seed, max_groups=3, max_turns=3).log().read(0)]
    for fault, pos in faults:
        if not records:
            break
        i = pos % len(records)
        lsn, sid, seq, tag = records[i]
        if fault == "drop":
            del records[i]
        elif fault == "duplicate":
            records.insert(i + 1, records[i])
        elif fault == "seq":
            records[i] = (lsn, sid, max(0, seq + pos % 5 - 2), tag)
        elif fault == "lsn_back":
            records[i] = (lsn - 1 - pos % 3, sid, seq, tag)
        elif fault == "learner":
            records.insert(i, (lsn, sid, seq, "policy_updated"))
        elif fault == "unknown":
            records.insert(i + 1, (lsn, sid, seq + 1, "turn_scored"))
    return records  # LSNs as they were: a duplicate or an insertion repeats one, a move sends one back


FAULTS = st.lists(st.tuples(st.sampled_from(["drop", "duplicate", "seq", "lsn_back", "learner", "unknown"]),
                            st.integers(min_value=0, max_value=10_000)), max_size=5)
PROPERTY = settings(max_examples=120, deadline=None)


@PROPERTY
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), faults=FAULTS, window=st.sampled_from([0, 1, 3, 1000]))
def test_the_driver_refuses_what_a_fold_with_unbounded_memory_refuses(seed, faults, window):
    records = faulty_stream(seed, faults)
    want = reference_refusals(records)
    # The exact window alone (large enough), or a small window with an exact id filter behind it.
    if window == 1000:
        assert Recorder(ended_window=window).feed(records).refusals() == want
    assert Recorder(ended_window=window, ids=set()).feed(records).refusals() == want
    if not faults:
        assert want == []


@PROPERTY
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), faults=FAULTS)
def test_the_lifecycle_check_refuses_what_a_fold_with_unbounded_memory_refuses(seed, faults):
    """The check behind verify and the engine's restart takes a running session's next
    in-session event (most records) on a path of its own: the same refusals, the same
    sessions in flight with the same next sequence numbers."""
    records = faulty_stream(seed, faults)
    check = LifecycleCheck()
    got = [(v.lsn, v.session_id, v.kind.value) for r in records for v in check.feed(*r)]
    assert got == reference_refusals(records)
    driver = Recorder(ended_window=1000, ids=set()).feed(records).fold
    assert check.open_sessions() == {sid: (t.life.state, t.life.next_seq) for sid, t in driver.live.items()}
    assert check.next_lsn == max((r[0] for r in records), default=-1) + 1


@PROPERTY
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), faults=FAULTS,
       cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_folding_any_split_incrementally_equals_folding_in_one_batch(seed, faults, cuts):
    records = faulty_stream(seed, faults)
    whole = Recorder(ended_window=2, ids=set()).feed(records)
    bounds = sorted({0, len(records), *(c % (len(records) + 1) for c in cuts)})
    parts = Recorder(ended_window=2, ids=set())
    for a, b in zip(bounds, bounds[1:]):
        parts.feed(records[a:b])
    assert parts.calls == whole.calls
    assert {s: t.life for s, t in parts.fold.live.items()} == {s: t.life for s, t in whole.fold.live.items()}
    assert list(parts.fold.recent.entries()) == list(whole.fold.recent.entries()) and parts.fold.next_lsn == whole.fold.next_lsn
    # The check behind verify and the engine's restart, resumed from its snapshot at every cut.
    batch = LifecycleCheck(recent_window=2)
    want = [v for r in records for v in batch.feed(*r)]
    got: list[Violation] = []
    check = LifecycleCheck(recent_window=2)
    for a, b in zip(bounds, bounds[1:]):
        check = LifecycleCheck.from_snapshot(check.to_snapshot())
        got += [v for r in records[a:b] for v in check.feed(*r)]
    assert got == want and check.open_sessions() == batch.open_sessions()


# ---------------------------------------------------------------- each duty on its own


def one_session(sid: str = "s", first_lsn: int = 0, end: str = "session_finished") -> list[Record]:
    tags = ["session_opened", "session_started", "turn_recorded", end]
    return [(first_lsn + i, sid, i, tag) for i, tag in enumerate(tags)]


def test_the_ended_window_tells_after_the_end_from_never_opened():
    late = [(8, "a", 4, "reward_assigned")]
    r = Recorder(ended_window=1).feed(one_session("a") + one_session("b", 4)[:1] + late)
    assert r.refusals() == [(8, "a", "after_terminal")]
    assert "it ended finished at lsn 3" in r.calls[-1][-1]
    # Once b has ended too, the window (one entry) no longer holds a.
    r = Recorder(ended_window=1).feed(one_session("a") + one_session("b", 4) + [(9, "a", 4, "reward_assigned")])
    assert r.refusals() == [(9, "a", "never_opened")]


def test_the_id_filter_refuses_an_id_reused_after_the_window_forgot_it():
    reopened = one_session("a") + one_session("b", 4) + [(8, "a", 0, "session_opened")]
    assert Recorder(ended_window=1).feed(reopened).refusals() == []  # the window alone has forgotten a
    r = Recorder(ended_window=1, ids=set()).feed(reopened)
    assert r.refusals() == [(8, "a", "reused_id")] and "per the id filter" in r.calls[-1][-1]
    assert "a" not in r.fold.live


def test_an_lsn_that_does_not_increase_is_reported_and_the_record_still_checked():
    records = one_session()
    records[2] = (0, "s", 2, "turn_recorded")  # lsn 0 again
    r = Recorder().feed(records)
    assert r.refusals() == [(0, "s", "lsn_order")]
    assert ("applied", 0, "turn_recorded") in r.calls and r.fold.next_lsn == 4
    assert Recorder(check_lsn=False).feed(records).refusals() == []


def test_a_refusal_that_raises_leaves_the_driver_unchanged():
    def refuse(v: Violation) -> None:
        raise ValueError(v.kind.value)

    fold = SessionFold(opened=lambda lsn, sid, rec, life: Tracked(life), refused=refuse)
    for lsn, sid, seq, tag in one_session()[:3]:
        fold.feed(lsn, sid, seq, tag, None)
    before = (fold.next_lsn, {s: t.life for s, t in fold.live.items()})
    for bad in [(1, "s", 3, "session_finished"), (3, "s", 5, "session_finished"), (3, "t", 1, "turn_recorded")]:
        with pytest.raises(ValueError):
            fold.feed(*bad, None)
        assert (fold.next_lsn, {s: t.life for s, t in fold.live.items()}) == before


def test_learner_records_pass_the_step_whatever_session_id_they_carry():
    # A learner record on the id of a session in flight, out of its sequence.
    records = one_session()[:2] + [(2, "s", 7, "policy_updated"), (3, "s", 2, "turn_recorded")]
    r = Recorder().feed(records)
    assert r.refusals() == [] and ("learner", 2) in r.calls
    assert r.fold.live["s"].life == SessionLife(State.RUNNING, 3)


def test_after_a_gap_the_session_resyncs_so_one_lost_record_is_one_violation():
    # Lost: a turn (seq 2). The next record is refused (a gap); the ones after it are in sequence again.
    records = [(0, "s", 0, "session_opened"), (1, "s", 1, "session_started"), (2, "s", 3, "turn_recorded"),
               (3, "s", 4, "turn_recorded"), (4, "s", 5, "session_finished")]
    r = Recorder().feed(records)
    assert r.refusals() == [(2, "s", "seq_gap")] and ("ended", 4, "s", "finished") in r.calls
    assert Recorder(resync=False).feed(records).refusals() == [(2, "s", "seq_gap"), (3, "s", "seq_gap"), (4, "s", "seq_gap")]


def test_the_session_filter_keeps_one_sessions_records_only():
    records = one_session("a") + [(4, "b", 5, "turn_recorded"), (5, "a", 9, "turn_recorded"), (6, "b", 0, "policy_updated")]
    r = Recorder(session_id="b").feed(records)
    assert r.calls == [("refused", 4, "b", "never_opened", r.calls[0][-1]), ("learner", 6)]
    assert Recorder(ended_window=4).feed(records).refusals() == [(4, "b", "never_opened"), (5, "a", "after_terminal")]


def test_without_eviction_a_session_stays_in_the_live_map_after_its_end():
    records = one_session("a") + [(4, "a", 4, "reward_assigned"), (5, "a", 0, "session_opened")]
    r = Recorder(evict=False).feed(records)
    assert r.fold.live["a"].life.state is State.FINISHED and ("ended", 3, "a", "finished") in r.calls
    assert r.refusals() == [(4, "a", "after_terminal"), (5, "a", "after_terminal")]


def test_an_unknown_event_goes_to_its_hook_then_is_checked_for_sequence_only():
    records = one_session()[:2] + [(2, "s", 2, "turn_scored"), (3, "s", 3, "session_finished"), (4, "t", 0, "turn_scored")]
    r = Recorder().feed(records)
    assert ("unknown", 2, "s", "turn_scored") in r.calls and ("unknown", 4, "t", "turn_scored") in r.calls
    assert r.refusals() == [] and ("ended", 3, "s", "finished") in r.calls
