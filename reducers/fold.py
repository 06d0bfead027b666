"""The one fold driver over the log's session records: :class:`SessionFold`.

Every fold that checks sessions (the sample reducer, ``agentlog show``, the
lifecycle reducer behind replay, tail, trace and report, the check behind
``verify`` and the engine's restart, the run statistics, replay's selection
index) needs the same machinery around the lifecycle step
(:func:`reducers.lifecycle_step.evolve`): the map of sessions in flight, the
window of recently ended ones, the filter of every id ever opened, the check
that LSNs increase, passing over the learner's records, and resync after a
refused record. The driver owns all of it, once; a fold is what it does with
each outcome, given as hooks:

* ``opened(lsn, session_id, record, life)``: a legal ``session_opened``.
  Returns the fold's state for the session (any object with a settable
  ``life`` attribute: the driver keeps the session's :class:`SessionLife`
  there), or None to refuse it (the hook reports why; nothing is kept).
* ``applied(session, lsn, tag, record)``: a legal event of a session in
  flight, before its new life is stored.
* ``ended(session, lsn, session_id, state, record)``: after ``applied``,
  when the event is the session's terminal one; the session is already
  evicted and noted in the ended window, so this hook must not raise.
* ``refused(violation)``: a record the step refuses, or an LSN that does
  not increase. Raise to stop the fold (the driver is then unchanged), or
  return to carry on: the record is not applied and its session continues
  from :func:`reducers.lifecycle_step.resync`. An LSN that does not increase
  is reported and the record still checked.
* ``learner(record)``: a learner-progress record (``policy_updated``), which
  is no session's event; None passes over it.
* ``unknown(lsn, session_id, tag)``: a record the caller flags as of a type
  this version does not know (a newer writer's); called after the LSN check.
  Raise to refuse it; return and the step checks it for sequence only.

Every hook but ``ended`` may raise to refuse the record: the driver is then
exactly as it was before it (the sample reducer relies on it).

``record`` is whatever the caller fed (an envelope, a body, a projection or
None); the driver never looks inside it. Options: ``ended_window`` (how many
ended sessions are remembered exactly), ``ids`` (a set-like filter of every
opened id, for ids that ended before the window), ``session_id`` (fold only
this session's records, learner records included), ``check_lsn``,
``resync`` and ``evict`` (False: a session stays in the live map after its
terminal event, so anything later is refused as after its end, whatever the
window; for short folds that keep every session).

The driver is pure (no clock, randomness or I/O), like every reducer, and
incremental: feeding a stream whole or in any split gives the same hook
calls in the same order.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Protocol, TypeVar

from agentlog.events.schema.lifecycle import OPENED_TAG, TERMINAL_STATES, State
from agentlog.events.schema.types import Envelope, PolicyUpdated

from .lifecycle_step import EndedWindow, SessionLife, Violation, evolve, lsn_violation, resync

#: ``confirm_used(session_id, lsn)``: whether the log holds ``session_id`` below ``lsn``
#: (:attr:`SessionFold.confirm_used`; ``engine.ids.IdScans`` is the one a tool passes).
ConfirmUsed = Callable[[str, int], bool]

__all__ = ["HasLife", "IdSet", "LEARNER_TAG", "SessionFold", "Tracked"]

#: The tag of the learner's records: learner progress, not a session's event.
LEARNER_TAG = PolicyUpdated.__struct_config__.tag

#: What ``evolve`` is told when only the id filter knows the session ended.
_BY_ID_FILTER = "it ended before the recent window, per the id filter"


class IdSet(Protocol):
    """What the driver needs of an id filter (:class:`reducers.lifecycle.IdFilter`)."""

    def add(self, session_id: str) -> None: ...

    def __contains__(self, session_id: object) -> bool: ...


class Tracked:
    """The state of a session for a fold that keeps nothing but its life."""

    __slots__ = ("life",)

    def __init__(self, life: SessionLife) -> None:
        self.life = life


class HasLife(Protocol):
    """A fold's per-session state: the driver keeps the session's life in it."""

    life: SessionLife


S = TypeVar("S", bound=HasLife)


class SessionFold(Generic[S]):
    """The fold driver: ``feed`` records in LSN order, get hook calls (see the module docstring)."""

    __slots__ = (
        "live", "recent", "ids", "next_lsn", "session_id", "confirm_used", "_check_lsn", "_resync", "_evict",
        "_opened", "_applied", "_ended", "_refused", "_learner", "_unknown",
    )

    def __init__(
        self,
        *,
        opened: Callable[[int, str, Any, SessionLife], S | None],
        refused: Callable[[Violation], None],
        applied: Callable[[S, int, str, Any], None] | None = None,
        ended: Callable[[S, int, str, State, Any], None] | None = None,
        learner: Callable[[Any], None] | None = None,
        unknown: Callable[[int, str, str], None] | None = None,
        ended_window: int = 0,
        ids: IdSet | None = None,
        confirm_used: ConfirmUsed | None = None,
        session_id: str | None = None,
        check_lsn: bool = True,
        resync: bool = True,
        evict: bool = True,
    ) -> None:
        #: Sessions in flight (with ``evict=False``, every session opened), in opening order.
        self.live: dict[str, S] = {}
        #: The most recently ended sessions, exactly.
        self.recent = EndedWindow(ended_window)
        #: Every id whose ``session_opened`` was accepted (None: not kept).
        self.ids = ids
        #: The smallest LSN the next record may carry.
        self.next_lsn = 0
        #: Fold only this session's records (None: every record).
        self.session_id = session_id
        #: ``confirm_used(session_id, lsn)``: whether the log holds ``session_id`` below ``lsn``, asked
        #: when the id filter alone says a ``session_opened`` reuses an id (it has false positives: a
        #: fold that can read its log confirms exactly, as the engine does at open); None trusts the filter.
        self.confirm_used = confirm_used
        self._check_lsn, self._resync, self._evict = check_lsn, resync, evict
        self._opened, self._applied, self._ended = opened, applied, ended
        self._refused, self._learner, self._unknown = refused, learner, unknown

    def ended_how(self, session_id: str) -> str | None:
        """For a session not in flight: how the fold knows it already ended
        (the exact window, else the id filter), or None."""
        how = self.recent.describe(session_id)
        if how is None and self.ids is not None and session_id in self.ids:
            return _BY_ID_FILTER
        return how

    def state_of(self, session_id: str) -> State | None:
        """A session's state: in flight, recently ended, or None (unknown or long ended)."""
        session = self.live.get(session_id)
        if session is not None:
            return session.life.state
        ended = self.recent.get(session_id)
        return None if ended is None else ended[0]

    def feed(self, lsn: int, session_id: str, seq: int, tag: str, record: Any, unknown: bool = False) -> None:
        """Fold one record: its LSN, session, ``session_seq`` and event tag;
        ``record`` is handed to the hooks as it is; ``unknown``: its type is one
        this version does not know. Raises whatever a hook raises, the driver
        then left as it was before the record (``ended`` excepted)."""
        if self.session_id is not None and session_id != self.session_id:
            return
        lsn_rises = lsn >= self.next_lsn
        if not lsn_rises and self._check_lsn:
            self._refused(lsn_violation(self.next_lsn, lsn, session_id))  # type: ignore[arg-type]
        if unknown and self._unknown is not None:
            self._unknown(lsn, session_id, tag)
        if tag == LEARNER_TAG:
            if self._learner is not None:
                self._learner(record)
        else:
            live = self.live
            session = live.get(session_id)
            if session is None:
                ended = self.ended_how(session_id)
                if ended is _BY_ID_FILTER and tag == OPENED_TAG and self.confirm_used is not None \
                        and not self.confirm_used(session_id, lsn):
                    ended = None  # the filter's false positive: a fresh id
                step = evolve(None, lsn, session_id, seq, tag, ended)
            else:
                step = evolve(session.life, lsn, session_id, seq, tag)
            if step is None:
                pass  # a newer writer's event outside any session in flight
            elif type(step) is Violation:
                self._refused(step)
                if session is not None and self._resync:
                    session.life = resync(session.life, seq)  # type: ignore[assignment]
            elif session is None:
                session = self._opened(lsn, session_id, record, step)
                if session is not None:
                    if self.ids is not None:
                        self.ids.add(session_id)
                    live[session_id] = session
            else:
                if self._applied is not None:
                    self._applied(session, lsn, tag, record)
                state = step.state
                if state in TERMINAL_STATES:
                    if self._evict:
                        del live[session_id]  # nothing may follow a terminal event
                        self.recent.note(session_id, state, lsn)
                    else:
                        session.life = step
                    if self._ended is not None:
                        self._ended(session, lsn, session_id, state, record)
                else:
                    session.life = step
        if lsn_rises:
            self.next_lsn = lsn + 1

    def feed_envelope(self, env: Envelope) -> None:
        """Fold one envelope; the hooks get the envelope as ``record``. Only
        its tag is looked at here: a log reader's envelope builds its body
        when a hook first uses it, and another session's record (with
        ``session_id``) is passed over before that."""
        if self.session_id is not None and env.session_id != self.session_id:
            return
        self.feed(env.lsn, env.session_id, env.session_seq, env.tag, env, env.unknown)
