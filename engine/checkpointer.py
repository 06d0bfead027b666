"""The engine's restart checkpoint, served from the engine's own state while it runs: :class:`Checkpointer`.

A checkpoint holds what a fold of the log up to an LSN holds (the fold, the
file's format and the proof that it belongs to the log are
:mod:`engine.restart`'s). A running engine already holds that state: the log
acknowledges records in LSN order and the engine applies each as it comes, so
its id filter and recent window (:mod:`engine.ids`), its groups and its
sessions in flight are the fold of every record it applied. The checkpointer
keeps no second fold. It keeps the *frontier*: the LSN below which every
record is applied. At a moment when nothing past the frontier is applied,
the engine's state is exactly the fold of the log below it, and a checkpoint
due then is a snapshot of that state, taken in the event loop's thread
(decisions whose records are not in the log yet, such as a member joining
its group before its ``session_opened`` is written, are left out, as the
fold would not hold them yet).

The engine applies each of its records as the log acknowledges it, never as
a caller's wait is cancelled (:meth:`SessionEngine._stage`), so it applies
them in the log's order, each at its LSN. One thing leaves records applied
past the frontier, and the snapshot then waits: a record the engine did not
write (another writer's ``policy_updated``), a hole that nothing fills.
When a checkpoint falls due with records waiting, the checkpointer reads
the holes from the log in a worker thread, tags only: a learner record
changes nothing a checkpoint holds.

A session record the engine did not apply (another writer's, one whose
apply failed, or one of a log that stages in a task, applied without its
LSN when that task was cancelled) means the engine's state can no longer be
proven to be the log's: each checkpoint is then folded from the log, from
the last one taken, in a worker thread, as a restart would
(``engine.checkpoint_from_log``), for the rest of the engine's life. Slower,
never wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, TypeVar

import msgspec

from agentlog._logging import get_logger
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import payload_tag
from agentlog.reducers.fold import LEARNER_TAG
from agentlog.reducers.lifecycle import LifecycleCheckSnapshot, live_entry

from .restart import CHECKPOINT_FORMAT, CheckpointError, EngineCheckpoint, RestartFold, anchor_at, write_checkpoint

if TYPE_CHECKING:
    from .core import SessionEngine

_log = get_logger("agentlog.engine.checkpointer")


_T = TypeVar("_T")
_opened_lsn = attrgetter("opened_lsn")


def _tagged(log: EventLog, start: int) -> Generator[tuple[int, str, int, str], None, None]:
    """``(lsn, session_id, session_seq, tag)`` of the log's records from ``start``; no body decoded."""
    for rec in log.read(start, raw=True):
        yield rec.lsn, rec.session_id, rec.session_seq, payload_tag(rec.payload)


#: A checkpoint comes at most every this many records per session in flight (see :meth:`Checkpointer.interval`).
RECORDS_PER_SESSION_IN_FLIGHT = 4


class Checkpointer:
    """Writes the restart checkpoint of a live engine, served from the engine's state (see the module docstring).

    ``fold`` is the restart fold the engine started from (caught up to the
    log's end when the engine opened): the records' violations it counted
    come from it, and a checkpoint folded from the log continues from the
    last checkpoint taken. :meth:`applied` is called by the engine in the
    event loop's thread, for each of its records, as it applies it."""

    #: Records applied past a hole that are tracked; past that, checkpoints are folded from the log.
    AHEAD_MAX = 1 << 16

    def __init__(self, log: EventLog, fold: RestartFold, path: Path, every: int, engine: "SessionEngine") -> None:
        if every < 1:
            raise ValueError(f"checkpoint_every: expected >= 1 record, found {every}")
        self.log, self.path, self.every = log, path, every
        self._engine = engine
        #: The fold the engine started from; once checkpoints are folded from the log, the fold they continue.
        self._fold = fold
        #: Every record below this LSN is applied by the engine, or changes nothing a checkpoint holds.
        self.frontier = fold.next_lsn
        #: LSNs past the frontier whose records the engine applied (waiting for the holes before them).
        self._ahead: set[int] = set()
        #: Why checkpoints are folded from the log instead of served from the engine (one line), or None.
        self.from_log: str | None = None
        #: The lifecycle check counts every record it folds: this many more than the LSNs below its end.
        self._records_offset = fold.check.records - fold.next_lsn
        #: The last checkpoint taken (written or not): where folding from the log starts.
        self._last: EngineCheckpoint | None = None
        self._lock = threading.Lock()
        #: Checkpoints written, and the LSN the last one covers up to.
        self.written = 0
        self.lsn = -1
        #: Why the last checkpoint could not be written (one line), or None once one was.
        self.write_error: str | None = None
        #: The frontier at the last checkpoint tried (written or not).
        self._tried = -1
        #: Checkpoints served from the engine's state, and records read from the log (holes, or folds).
        self.served = self.read_back = 0
        #: A read of the log in a worker thread (holes, or a fold), running or waiting for the lock.
        self._reading: asyncio.Future | None = None
        #: Why the fold can no longer be trusted (a failed read of the log), or None.
        self._broken: str | None = None

    # -- what the engine tells it -----------------------------------------------------

    def applied(self, lsn: int | None, session_id: str, seq: int) -> None:
        """The engine applied its record ``seq`` of ``session_id``, which the log holds at
        ``lsn`` (None: not known, see :meth:`SessionEngine._stage`; checkpoints are then folded
        from the log). In the event loop's thread; a few attribute reads when in order."""
        if lsn == self.frontier:
            self.frontier = lsn + 1
            if self._ahead:
                self._advance()
        elif self.from_log is not None:
            return
        elif lsn is None:
            self._fold_from_log(f"session {session_id!r}: record {seq} was applied with its LSN not known "
                                "(the task of a log that stages in one was cancelled)")
        elif lsn > self.frontier:
            if len(self._ahead) >= self.AHEAD_MAX:
                self._fold_from_log(f"{len(self._ahead)} records applied past a hole at lsn {self.frontier}")
            else:
                self._ahead.add(lsn)

    def _advance(self) -> None:
        """Move the frontier over the applied records that now follow it."""
        ahead, frontier = self._ahead, self.frontier
        while frontier in ahead:
            ahead.remove(frontier)
            frontier += 1
        self.frontier = frontier

    def _fold_from_log(self, why: str) -> None:
        """Fold each checkpoint from the log, from the last one taken, for the rest of the engine's
        life: its state can no longer be proven to be the log's (``why``)."""
        if self.from_log is not None:
            return
        self.from_log = why
        self._ahead.clear()
        if self._last is not None:
            self._fold = RestartFold.from_checkpoint(self._last, recent_window=self._last.lifecycle.recent.size)
        _log.warning("engine.checkpoint_from_log", path=str(self.path), reason=why, since_lsn=self._fold.next_lsn,
                     effect="each checkpoint is folded from the log in a worker thread, for the rest of the "
                            "engine's life (slower, never wrong)")

    # -- when, and what -------------------------------------------------------------------

    def interval(self) -> int:
        """Records between checkpoints: ``every``, or :data:`RECORDS_PER_SESSION_IN_FLIGHT`
        times the sessions in flight when that is more. A checkpoint snapshots each
        session in flight in the event loop's thread (about 1.5 µs each), so this keeps
        its cost per record bounded however many run at once; a restart then folds at
        most that many records, a few per session it has to abort anyway."""
        return max(self.every, RECORDS_PER_SESSION_IN_FLIGHT * self._engine.live_count)

    def due(self) -> bool:
        """Whether :meth:`interval` records or more were appended since the last checkpoint was tried,
        or half of :data:`AHEAD_MAX` records wait past a hole (an interval can be longer than that)."""
        return self.log.next_lsn - max(self._tried, 0) >= self.interval() or len(self._ahead) >= self.AHEAD_MAX // 2

    async def checkpoint(self, *, final: bool = False, cache_only: bool = True) -> int:
        """Write the checkpoint of the log up to the frontier, served from the engine's state;
        with ``final`` (the engine closes) up to the log's end, reading the records the engine
        did not write. Records waiting past a hole make it read the holes first, and wait for
        the next call when they are still not filled. Returns the LSN of the last checkpoint
        written; a write that fails is only logged (:meth:`_write`); a read of the log that
        fails raises, and so does every later call (CheckpointError)."""
        if self._reading is not None:
            if not final:
                return self.lsn  # a cancelled caller's read still runs
            await asyncio.wait([self._reading])
        self._check_fold()
        if self.from_log is None and (final or self._ahead):
            await self._read_holes(final)
        if self.from_log is None and self._ahead:
            if not final:
                return self.lsn  # the holes' records are not all in the log yet: the next call
            self._fold_from_log(f"at close, {len(self._ahead)} applied records wait past a hole at lsn {self.frontier}")
        served = self.from_log is None
        ckpt = self._served(self.frontier) if served else await self._in_thread(self._fold_log)
        if ckpt.next_lsn == (self.lsn if final else self._tried):
            return self.lsn  # nothing new since the last one
        if served:
            self.served += 1
        self._tried = ckpt.next_lsn
        self._last = ckpt
        return await asyncio.to_thread(self._write, ckpt, cache_only)

    def _check_fold(self) -> None:
        if self._broken is not None:
            raise CheckpointError(self.path, f"not written: {self._broken}")

    async def _in_thread(self, work: Callable[..., _T], *args: Any) -> _T:
        """Run ``work`` in a worker thread; shielded: a cancelled caller leaves it running
        (the next call waits for it). A failure breaks the checkpointer (see :meth:`checkpoint`)."""
        done = asyncio.get_running_loop().run_in_executor(None, work, *args)
        self._reading = done
        done.add_done_callback(self._read_done)
        return await asyncio.shield(done)

    def _read_done(self, done: asyncio.Future) -> None:
        if self._reading is done:
            self._reading = None
        exc = asyncio.CancelledError() if done.cancelled() else done.exception()
        if exc is not None and self._broken is None:
            self._broken = f"reading the log failed: {type(exc).__name__}: {exc}"

    async def _read_holes(self, final: bool) -> None:
        """Read the records from the frontier to the last one applied past it (with ``final``,
        to the log's end), tags only, and account for each the engine did not apply."""
        start = self.frontier
        end = self.log.next_lsn if final or not self._ahead else max(self._ahead) + 1
        if end <= start:
            return
        # Below the last record applied past the frontier every record was acknowledged, and the engine
        # applies in LSN order: what it did not apply there, it never will.
        settled = max(self._ahead, default=-1) if not final else end
        records = await self._in_thread(self._tags, start, end)
        for lsn, session_id, seq, tag in records:
            if lsn < self.frontier or lsn in self._ahead:
                continue  # applied meanwhile
            if tag != LEARNER_TAG:
                if lsn < settled:
                    self._fold_from_log(f"the log's record at lsn {lsn} ({tag} of session {session_id!r}, "
                                        f"session_seq {seq}) was not applied by this engine")
                    return
                continue
            self._ahead.add(lsn)
        self._advance()

    def _tags(self, start: int, end: int) -> list[tuple[int, str, int, str]]:
        """``(lsn, session_id, session_seq, tag)`` of the log's records from ``start`` to ``end`` (exclusive)."""
        with self._lock, contextlib.closing(_tagged(self.log, start)) as records:  # closes the cursor at ``end``
            out = list(itertools.takewhile(lambda rec: rec[0] < end, records))
        self.read_back += len(out)
        return out

    def _fold_log(self) -> EngineCheckpoint:
        """The fold of the log from the last checkpoint taken to its end (a worker thread)."""
        with self._lock:
            self.read_back += self._fold.catch_up(self.log)
            return self._fold.to_checkpoint()

    def _served(self, cut: int) -> EngineCheckpoint:
        """The engine's state as the checkpoint of the log below ``cut``, in the event loop's
        thread, where it changes (a consistent state): nothing at or past ``cut`` is applied."""
        eng, base = self._engine, self._fold
        groups = eng._groups
        # A session whose opening is not in the log yet (its seq still 0) is no session of the fold's yet.
        live = sorted((h for h in eng._live.values() if h._seq), key=_opened_lsn)  # a fold holds them as they opened
        ids, recent = eng._ids.snapshots()
        lifecycle = LifecycleCheckSnapshot(
            next_lsn=cut, records=cut + self._records_offset,
            live=[live_entry(h.session_id, h.state, h._seq) for h in live], recent=recent, ids=ids,
        )
        return EngineCheckpoint(
            format=CHECKPOINT_FORMAT, next_lsn=cut, anchor=b"", lifecycle=lifecycle,
            groups=groups.to_snapshot(placed_only=True),
            in_groups=[(h.session_id, h.group_id) for h in live if groups.is_member(h.group_id, h.session_id)],
            refused_opens=list(base.refused_opens), violations=base.violations,
            first_violations=list(base.first_violations), written_ns=time.time_ns(),
        )

    # -- at the engine's start --------------------------------------------------------------

    def advance(self, *, cache_only: bool = False) -> int:
        """Fold the log's records from the fold's end and write the
        checkpoint (unless nothing changed), in the caller's thread, before
        the engine applies records; returns the LSN of the last checkpoint
        written. Errors propagate, except with ``cache_only``: then a
        checkpoint that cannot be written (a full disk, a directory in its
        place: any OSError) is only logged, as the warning
        ``engine.checkpoint_failed`` naming the file and the error, and kept in
        :attr:`write_error`. A checkpoint is a cache: without it a restart
        folds from the last one written, or from lsn 0. Reading the log
        (the fold) still raises."""
        self.read_back += self._fold.catch_up(self.log)
        self.frontier = self._fold.next_lsn
        self._records_offset = self._fold.check.records - self._fold.next_lsn
        if self._fold.next_lsn == self.lsn:
            return self.lsn
        self._tried = self._fold.next_lsn
        return self._write(self._fold.to_checkpoint(), cache_only)

    def _write(self, ckpt: EngineCheckpoint, cache_only: bool) -> int:
        """Write ``ckpt`` with the anchor of its last record: the fold's, when its last
        record was read from the log (``catch_up`` hashed it), else read back now (a
        served checkpoint carries no stored bytes); returns the LSN of the last checkpoint written."""
        with self._lock:
            if ckpt.next_lsn <= self.lsn:
                return self.lsn  # a newer one is already written (a cancelled caller's write came late)
            t0 = time.perf_counter()
            try:
                if ckpt.next_lsn > 0 and not ckpt.anchor:
                    anchor = anchor_at(self.log, ckpt.next_lsn - 1)
                    if anchor is None:
                        raise CheckpointError(self.path, f"the log's record at lsn {ckpt.next_lsn - 1} was applied but cannot be read back")
                    ckpt = msgspec.structs.replace(ckpt, anchor=anchor)
                size = write_checkpoint(self.path, ckpt)
            except OSError as exc:
                if not cache_only:
                    raise
                self.write_error = f"cannot write the engine checkpoint {self.path}: {type(exc).__name__}: {exc}"
                _log.warning("engine.checkpoint_failed", path=str(self.path), error=f"{type(exc).__name__}: {exc}",
                             next_lsn=ckpt.next_lsn, last_written_lsn=self.lsn,
                             effect="the engine goes on; a restart folds from the last checkpoint written, or from lsn 0")
                return self.lsn
            self.write_error = None
            self.written += 1
            self.lsn = ckpt.next_lsn
            _log.debug("engine.checkpoint_written", path=str(self.path), next_lsn=self.lsn, bytes=size,
                       seconds=round(time.perf_counter() - t0, 4))
            return self.lsn


__all__ = ["Checkpointer", "RECORDS_PER_SESSION_IN_FLIGHT"]
