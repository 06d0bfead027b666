"""Session ids are never reused: :class:`SessionIds`, the engine's one owner of that rule.

It holds the Bloom filter of every id the log's ``session_opened`` records
carry that the lifecycle step accepted (:class:`reducers.lifecycle.IdFilter`,
the restart fold's own filter, continued), the ids of the opens it refused
(in the log all the same), and the window of recently ended sessions with
their terminal state and LSN. A filter miss proves an id fresh; a hit is
confirmed exactly, first against the window, then by a sparse scan of the
log in a worker thread (expected for ~3.4e-7 of fresh ids).

An id enters the filter when its ``session_opened`` is in the log, not when
the engine decides to open it: the filter then holds exactly what a fold of
the log holds, and the engine's restart checkpoint is served from it
(:mod:`engine.checkpointer`). A caller hashes the id once for both questions
(:meth:`SessionIds.hashes`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable

from agentlog._logging import get_logger
from agentlog.events.log.api import EventLog
from agentlog.events.schema.lifecycle import State
from agentlog.reducers.lifecycle import IdFilter, IdFilterSnapshot
from agentlog.reducers.lifecycle_step import EndedWindow, EndedWindowSnapshot

from .errors import DuplicateSession

_log = get_logger("agentlog.engine")


def first_lsns(records: Iterable[Any], ids: set[str], before: int | None = None) -> dict[str, int]:
    """The LSN of the first of ``records`` (raw records in LSN order, below ``before``) of each of
    ``ids`` that has one: the exact answer where the id filter says an id may be used. Reads ids
    only, and stops once every id is found."""
    first: dict[str, int] = {}
    for rec in records:
        if before is not None and rec.lsn >= before:
            break
        sid = rec.session_id
        if sid in ids and sid not in first:
            first[sid] = rec.lsn
            if len(first) == len(ids):
                break
    return first


def first_lsn_of(log: EventLog, session_id: str, before: int | None = None) -> int | None:
    """The LSN of ``log``'s first record of ``session_id`` (below ``before``), or None (:func:`first_lsns`)."""
    return first_lsns(log.read(0, raw=True), {session_id}, before).get(session_id)


#: Scans of a log one :class:`IdScans` runs; past that its filter answers alone.
ID_SCANS_MAX = 64


class IdScans:
    """A fold's ``confirm_used`` (:attr:`reducers.fold.SessionFold.confirm_used`) for a log it can
    read again: whether the log holds ``session_id`` below ``lsn``, asked for an opening the id filter
    alone calls a reuse, answered by a scan of ``read()`` (the log's raw records from lsn 0), so a
    false positive (~3.4e-7 of fresh ids) is no violation. Past ``cap`` scans it answers True without
    one, with the warning ``engine.id_scans_capped`` naming ``where``: each scan reads the log from lsn 0,
    and only a log another writer filled with reused ids needs that many."""

    __slots__ = ("_read", "cap", "where", "scans", "_last")

    def __init__(self, read: Callable[[], Iterable[Any]], where: str, cap: int | None = None) -> None:
        self._read = read
        self.cap = ID_SCANS_MAX if cap is None else cap
        #: What is folded (a log's path, "the restart fold"): named in the warning.
        self.where = where
        #: Scans run so far.
        self.scans = 0
        # The last question and its answer: two folds of one pass (report's lifecycle and its
        # reducer) ask about the same opening one after the other, and it is scanned once.
        self._last: tuple[str, int, bool] | None = None

    def __call__(self, session_id: str, lsn: int) -> bool:
        last = self._last
        if last is not None and last[0] == session_id and last[1] == lsn:
            return last[2]
        used = self._scan(session_id, lsn)
        self._last = (session_id, lsn, used)
        return used

    def _scan(self, session_id: str, lsn: int) -> bool:
        if self.scans >= self.cap:
            return True
        self.scans += 1
        if self.scans == self.cap:
            _log.warning("engine.id_scans_capped", log=self.where, scans=self.cap, lsn=lsn, session_id=session_id,
                         effect="later openings the id filter calls reuses are reported as reuses without a scan of the log")
        records = self._read()
        try:
            return session_id in first_lsns(records, {session_id}, before=lsn)
        finally:
            close = getattr(records, "close", None)  # a cursor or consumer left early is closed now, not at collection
            if close is not None:
                close()


class SessionIds:
    """Every id the log holds (a filter, confirmed exactly) and the recently ended sessions."""

    __slots__ = ("_log", "_filter", "_refused", "recent", "_stats")

    def __init__(self, log: EventLog, ids: IdFilter, refused: Iterable[str], recent: EndedWindow,
                 stats: dict[str, int]) -> None:
        self._log = log
        self._filter = ids
        #: Ids of session_opened records the lifecycle step refused: in the log, but not in the fold's filter.
        self._refused = frozenset(refused)
        #: The most recently ended sessions: ``session_id -> (terminal state, lsn)``.
        self.recent = recent
        #: The engine's counters: ``id_scans`` counts the exact scans of the log.
        self._stats = stats

    hashes = staticmethod(IdFilter.hashes)

    def maybe_used(self, session_id: str, hashes: tuple[int, int]) -> bool:
        """Whether the filter says ``session_id`` (its :meth:`hashes`) may be in the log."""
        return self._filter.has_hashed(hashes) or session_id in self._refused

    async def confirm_fresh(self, session_id: str) -> None:
        """The filter says the id may be in the log: raise DuplicateSession unless it is not."""
        ended = self.recent.get(session_id)
        if ended is not None:
            raise DuplicateSession(session_id, ended[0], "it already ended in this log")
        self._stats["id_scans"] += 1
        _log.info("engine.id_scan", session_id=session_id)
        found = await asyncio.to_thread(first_lsn_of, self._log, session_id)
        if found is not None:
            raise DuplicateSession(session_id, None, f"the log holds it at lsn {found}")

    def opened(self, hashes: tuple[int, int]) -> None:
        """The ``session_opened`` of the id whose :meth:`hashes` these are is in the log."""
        self._filter.add_hashed(hashes)

    def ended(self, session_id: str, state: State, lsn: int) -> None:
        """``session_id`` ended in ``state`` at ``lsn``."""
        self.recent.note(session_id, state, lsn)

    def state_of(self, session_id: str) -> State | None:
        """The terminal state of a recently ended session, else None."""
        ended = self.recent.get(session_id)
        return None if ended is None else ended[0]

    def snapshots(self) -> tuple[IdFilterSnapshot, EndedWindowSnapshot]:
        """The filter and the window as plain data, as the restart fold's lifecycle check holds them."""
        return self._filter.to_snapshot(), self.recent.to_snapshot()
