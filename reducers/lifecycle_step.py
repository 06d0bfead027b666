"""One session's lifecycle and sequence, checked in one place: :func:`evolve`.

Every fold over the log composes this step: the reducer pipeline
(``reconstruct``, the online loop), the lifecycle reducer (``replay``,
``tail``, ``report``, the engine's restart fold), the run statistics
(``stats``) and the check behind ``agentlog verify``
(:class:`reducers.lifecycle.LifecycleCheck`). They differ only in what they
do with a :class:`Violation`: the pipeline raises it, replay shows it, stats
counts it, verify exits 1 on it. So they agree, by construction, on which
records are illegal and why. The machinery around the step (the live map,
the ended window, the id filter, the LSN check, learner records, resync) is
written once too: the fold driver, :class:`reducers.fold.SessionFold`.

The step takes the few fields it needs (LSN, session id, ``session_seq``,
event tag), never a decoded body, so a fold over projections or raw frames
can use it as well as one over full envelopes. It is pure and allocates one
small tuple per legal event.

What counts as a violation (one per record, checked in this order):

* ``after_terminal``: any event for a session that already reached its
  terminal event (nothing may follow one);
* ``reused_id``: ``session_opened`` for an id in flight or already ended
  (ids are never reused);
* ``never_opened``: an event for a session with no ``session_opened``;
* ``seq_gap`` / ``seq_repeat``: ``session_seq`` is not the session's
  ``last + 1`` (0 for ``session_opened``);
* ``illegal_transition``: the lifecycle table (:mod:`events.schema.lifecycle`) has
  no such move from the session's state (in-session events need ``running``);
* ``lsn_order``: an LSN that does not increase (a fold-level check,
  :func:`lsn_violation`);
* ``group_conflict``: a ``session_opened`` whose group membership conflicts
  with its group's (checked by :class:`reducers.groups.GroupTracker` in the
  folds that track groups, not by the step).

A record that violates is not applied; a fold that carries on continues from
:func:`resync` (the state unchanged, the sequence moved past a gap, never
back), so one lost record yields one violation, not one per later record.
Events of tags this version does not know (a newer writer's) are checked
for sequence only; their effect on the state is unknown, so it is kept.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum
from typing import NamedTuple, final

import msgspec

from agentlog.events.schema.lifecycle import (
    IN_SESSION_EVENTS,
    OPENED_TAG,
    SESSION_TAGS,
    TERMINAL_STATES,
    TRANSITIONS,
    TRIGGER_OF_TAG,
    IllegalTransition,
    State,
)

__all__ = [
    "EndedWindow",
    "SessionLife",
    "Violation",
    "ViolationKind",
    "evolve",
    "lsn_violation",
    "resync",
]

class ViolationKind(StrEnum):
    """What was wrong with a record (the ``kind`` of a :class:`Violation`);
    a StrEnum, so it prints and compares as its value (``"seq_gap"``)."""

    AFTER_TERMINAL = "after_terminal"
    REUSED_ID = "reused_id"
    NEVER_OPENED = "never_opened"
    SEQ_GAP = "seq_gap"
    SEQ_REPEAT = "seq_repeat"
    ILLEGAL_TRANSITION = "illegal_transition"
    LSN_ORDER = "lsn_order"
    GROUP_CONFLICT = "group_conflict"


@final  # no subclasses: the fold driver tells a violation from a state by its exact type
class Violation(msgspec.Struct, frozen=True):
    """An illegal record: where it is, which session, what kind, and what was wrong."""

    lsn: int
    session_id: str
    kind: ViolationKind
    message: str

    def describe(self) -> str:
        """``kind: message`` (the LSN and session are shown by the caller)."""
        return f"{self.kind.value}: {self.message}"

    def __str__(self) -> str:
        return f"lsn {self.lsn}, session {self.session_id!r}: {self.describe()}"


class SessionLife(NamedTuple):
    """A session's lifecycle state and the ``session_seq`` its next event must carry."""

    state: State
    next_seq: int


#: ``(state, tag) -> state after it`` for every legal move of a session in
#: flight: the transition events by the lifecycle table, the in-session events
#: (legal only while running, leaving the state as it is).
#: A plain dict, never mutated: looked up once per event, and a MappingProxyType
#: would double the cost of that lookup.
_MOVES: dict[tuple[State, str], State] = {
    **{(state, tag): TRANSITIONS[(state, trigger)] for tag, trigger in TRIGGER_OF_TAG.items() for state in State if (state, trigger) in TRANSITIONS},
    **{(State.RUNNING, tag): State.RUNNING for tag in IN_SESSION_EVENTS},
}
_OPENED = SessionLife(State.OPEN, 1)
#: ``SessionLife(a, b)`` runs the NamedTuple's Python-level ``__new__``; on the
#: per-event path the C constructor, at half the cost, builds the same tuple.
_new_life = tuple.__new__


def evolve(
    life: SessionLife | None, lsn: int, session_id: str, seq: int, tag: str, ended: str | None = None
) -> SessionLife | Violation | None:
    """One record of a session, checked and applied.

    ``life`` is the session's lifecycle before the record (None: not in
    flight); ``ended`` says how the fold knows the session already ended (for
    example ``"it ended finished at lsn 7"``), None when it does not know of
    one. Returns the session's life after the record, a :class:`Violation`
    (the record must not be applied; see :func:`resync`), or None for a
    record that belongs to no tracked session (an event of an unknown tag for
    a session not in flight). Folds pass over learner progress
    (``policy_updated``) before the step: it is no session event.
    """
    if life is not None:
        if seq == life.next_seq:
            dest = _MOVES.get((life.state, tag))
            if dest is not None:
                return _new_life(SessionLife, (dest, seq + 1))
        return _refuse_in_flight(life, lsn, session_id, seq, tag)
    if tag == OPENED_TAG:
        if ended is not None:
            return Violation(lsn, session_id, ViolationKind.REUSED_ID, f"session_opened for an id already used: {ended}; ids are never reused")
        if seq != 0:
            return Violation(lsn, session_id, ViolationKind.SEQ_GAP, f"session_seq {seq} on session_opened, expected 0 (a gap)")
        return _OPENED
    if tag not in SESSION_TAGS:
        return None  # a newer writer's event outside any session we track
    if ended is not None:
        return Violation(lsn, session_id, ViolationKind.AFTER_TERMINAL, f"{tag} after the session's terminal event ({ended}); nothing may follow a terminal event")
    return Violation(lsn, session_id, ViolationKind.NEVER_OPENED, f"{tag} for a session that was never opened (expected session_opened first)")


def _refuse_in_flight(life: SessionLife, lsn: int, session_id: str, seq: int, tag: str) -> SessionLife | Violation | None:
    """The slow path of :func:`evolve` for a session in flight: classify what is wrong."""
    if life.state in TERMINAL_STATES:
        return Violation(lsn, session_id, ViolationKind.AFTER_TERMINAL, f"{tag} after the session's terminal event (it ended {life.state}); nothing may follow a terminal event")
    if tag == OPENED_TAG:
        return Violation(lsn, session_id, ViolationKind.REUSED_ID, f"session_opened for a session already in flight ({life.state}); ids are never reused")
    if seq != life.next_seq:
        gap = seq > life.next_seq
        return Violation(
            lsn,
            session_id,
            ViolationKind.SEQ_GAP if gap else ViolationKind.SEQ_REPEAT,
            f"session_seq {seq} on {tag}, expected {life.next_seq}" + (f" (a gap: {seq - life.next_seq} missing)" if gap else " (a repeat)"),
        )
    if tag not in SESSION_TAGS:
        return SessionLife(life.state, seq + 1)  # a newer writer's event: in sequence, meaning unknown
    trigger = TRIGGER_OF_TAG.get(tag, tag)
    detail = "only a running session takes this event" if tag in IN_SESSION_EVENTS else ""
    return Violation(lsn, session_id, ViolationKind.ILLEGAL_TRANSITION, str(IllegalTransition(session_id, trigger, life.state, detail)))


def resync(life: SessionLife | None, seq: int) -> SessionLife | None:
    """The life a fold that carries on continues from after a violation at
    ``seq``: the state unchanged, the sequence moved past the record (never
    back, so a repeat leaves it where it was)."""
    if life is None or seq < life.next_seq:
        return life
    return SessionLife(life.state, seq + 1)


def lsn_violation(min_lsn: int, lsn: int, session_id: str) -> Violation | None:
    """A Violation when ``lsn`` is below ``min_lsn`` (the previous LSN + 1), else None."""
    if lsn >= min_lsn:
        return None
    return Violation(lsn, session_id, ViolationKind.LSN_ORDER, f"lsn {lsn} does not increase (expected >= {min_lsn})")


class EndedWindowSnapshot(msgspec.Struct, frozen=True):
    """:class:`EndedWindow` as plain data: its size and ``(session_id, state, lsn)``, oldest first."""

    size: int
    #: The states as their values on the wire (msgspec encodes and checks the enum in C).
    ended: list[tuple[str, State, int]]


class EndedWindow:
    """The most recently ended sessions (:meth:`get`: ``session_id -> (state, lsn)``), bounded,
    so a fold can tell "after its terminal event" from "never opened" without
    remembering every session ever run."""

    __slots__ = ("_ended", "size")

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"EndedWindow size: expected >= 0, found {size}")
        self.size = size
        # Each entry is held as the very tuple a checkpoint stores, ``(session_id, state, lsn)``, so
        # :meth:`to_snapshot` copies one list of pointers instead of building a tuple an entry: it runs
        # in the event loop's thread at every checkpoint, over the whole window.
        self._ended: OrderedDict[str, tuple[str, State, int]] = OrderedDict()

    def note(self, session_id: str, state: State, lsn: int) -> None:
        """Remember that ``session_id`` ended in ``state`` at ``lsn``."""
        if self.size == 0:
            return
        self._ended[session_id] = (session_id, state, lsn)
        if len(self._ended) > self.size:
            self._ended.popitem(last=False)

    def get(self, session_id: str) -> tuple[State, int] | None:
        """``(terminal state, lsn)`` of a recently ended session, else None."""
        r = self._ended.get(session_id)
        return None if r is None else r[1:]

    def describe(self, session_id: str) -> str | None:
        """How the session ended, for :func:`evolve`'s ``ended``; None if not in the window."""
        r = self._ended.get(session_id)
        return None if r is None else f"it ended {r[1]} at lsn {r[2]}"

    def entries(self) -> list[tuple[str, State, int]]:
        """``(session_id, state, lsn)`` of each session in the window, oldest first."""
        return list(self._ended.values())

    def to_snapshot(self) -> "EndedWindowSnapshot":
        """The window as plain data (oldest first), for a checkpoint."""
        return EndedWindowSnapshot(self.size, self.entries())

    @classmethod
    def from_snapshot(cls, snap: "EndedWindowSnapshot") -> "EndedWindow":
        """The window :meth:`to_snapshot` saw."""
        w = cls(snap.size)
        w._ended = OrderedDict((entry[0], entry) for entry in snap.ended)
        return w

    def __len__(self) -> int:
        return len(self._ended)
