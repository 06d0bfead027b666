"""The engine's restart checkpoint, kept up to date while it runs: :class:`Checkpointer`.

The fold behind a restart and the checkpoint file itself (its format, how it
is written, loaded and proven to belong to the log) are :mod:`engine.restart`'s;
this module keeps a live engine's fold caught up with the records it saw
acknowledged, reads the log where it saw none, and writes the file when one
falls due.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from agentlog._logging import get_logger
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import KNOWN_TAGS

# The fold's own record shapes, shared with the restart fold that reads them (same package).
from .restart import (
    _ABORTED, _OPENED, CheckpointError, EngineCheckpoint, RestartFold, _AbortRefill, _GroupJoin, _Record, anchor_at,
    write_checkpoint,
)

_log = get_logger("agentlog.engine.checkpointer")

#: ``_Record(...)`` runs the NamedTuple's Python-level ``__new__``; a note per record takes the C constructor.
_new_record = tuple.__new__


#: A checkpoint comes at most every this many records per session in flight (see :meth:`Checkpointer.interval`).
RECORDS_PER_SESSION_IN_FLIGHT = 4


class Checkpointer:
    """Keeps a :class:`RestartFold` caught up with a live log and writes its checkpoint.

    The fold takes the records the engine saw acknowledged (:meth:`note`, in
    the event loop's thread): the engine wrote them, so nothing is read back.
    A record the engine did not see (another writer's ``policy_updated``, an
    append whose caller was cancelled) leaves a gap, and the records after it
    wait; when a checkpoint falls due (:meth:`interval`) with the fold stuck
    there ``every`` records or more behind the log, :meth:`checkpoint` reads
    the log from the gap on in a worker thread, as a restart would, and the
    waiting records it already folded are dropped. Either way the fold
    holds the log's records in LSN order, each once: what it would hold from
    reading the whole log. The fold itself never leaves the loop's thread,
    except for that read (noted records wait meanwhile) and :meth:`advance`
    before the engine takes records."""

    #: Records noted ahead of a gap that are kept (beyond it, the log is read instead).
    AHEAD_MAX = 1 << 16
    #: Noted records folded together once this many wait: in a run of their own the fold's code and
    #: data stay in the CPU's caches, where a record folded as it comes finds them evicted by the engine's
    #: work between two records (about half the cost per record in ``bench_engine``).
    PENDING_MAX = 256

    def __init__(self, log: EventLog, fold: RestartFold, path: Path, every: int) -> None:
        if every < 1:
            raise ValueError(f"checkpoint_every: expected >= 1 record, found {every}")
        self.log, self._fold, self.path, self.every = log, fold, path, every
        #: Records noted and not folded yet, oldest first (see :meth:`note`).
        self._pending: list[_Record] = []
        self._lock = threading.Lock()
        #: Checkpoints written, and the LSN the last one folded up to.
        self.written = 0
        self.lsn = -1
        #: Why the last checkpoint could not be written (one line), or None once one was.
        self.write_error: str | None = None
        #: Records noted above the fold's end, by LSN, until the records before them are folded.
        self._ahead: dict[int, _Record] = {}
        #: Reads of the log by worker threads, running or waiting for the lock: while any is, noted records wait in _ahead.
        self._reading: set[asyncio.Future] = set()
        #: The fold's end at the last checkpoint tried (written or not).
        self._tried = -1
        #: Records folded as noted (:attr:`noted`), and read from the log after a gap (for tests and benchmarks).
        self._noted = self.read_back = 0
        #: Why the fold can no longer be trusted (a failed read of the log, an error folding a noted record), or None.
        self._broken: str | None = None

    @property
    def fold(self) -> RestartFold:
        """The fold, with every record noted so far folded in (or waiting behind a gap).
        In the event loop's thread only, as :meth:`note`."""
        if self._pending:
            self._fold_pending()
        return self._fold

    @property
    def noted(self) -> int:
        """Records folded as noted (the rest of the fold's records were read from the log)."""
        if self._pending:
            self._fold_pending()
        return self._noted

    def note(self, env: Any) -> None:
        """Fold one record of the log that the engine saw acknowledged
        (an :class:`~agentlog.events.schema.types.Envelope`); in the event
        loop's thread, never reading the log. Folded with the records noted
        after it, :data:`PENDING_MAX` at a time or when the fold is next used
        (:attr:`fold`); a record ahead of the fold's end waits for the ones
        before it; one behind it was already read from the log."""
        body = env.body
        tag = type(body).__struct_config__.tag
        if tag not in KNOWN_TAGS:
            return  # left to the log read, which refuses it by name (UnknownEventError)
        # What the fold reads of an open or an abort, not the body: a prompt, a teacher's scores or a
        # traceback held while it waits could be large.
        if tag == _OPENED:
            body = _GroupJoin(body.group_id, body.group_size, body.sample_index, body.replaces)
        elif tag == _ABORTED:
            body = _AbortRefill(refill=body.refill)
        else:
            body = None
        pending = self._pending
        pending.append(_new_record(_Record, (env.lsn, env.session_id, env.session_seq, env.ts_ns, tag, None, body)))
        if len(pending) >= self.PENDING_MAX:
            self._fold_pending()

    def _fold_pending(self) -> None:
        """Fold the noted records in the order they came (see :meth:`note`).
        Whatever the fold raises breaks it (no checkpoint is written from it:
        :meth:`checkpoint` raises, naming the record) instead of failing the
        unrelated record whose note or read of the fold came next."""
        pending, self._pending = self._pending, []
        if self._broken is not None:
            return
        fold, ahead = self._fold, self._ahead
        for rec in pending:
            lsn = rec.lsn
            if lsn < fold.next_lsn:
                continue  # already read from the log
            if self._reading or lsn != fold.next_lsn:
                if len(ahead) < self.AHEAD_MAX:
                    ahead[lsn] = rec
                continue
            try:
                fold.fold_noted(rec)
            except Exception as exc:
                self._break(rec, exc)
                return
            self._noted += 1
            if ahead and not self._fold_ahead():
                return

    def _fold_ahead(self) -> bool:
        """Fold the waiting records that now follow the fold's end; drop those it already holds.
        False when the fold broke on one (:meth:`_break`)."""
        fold, ahead = self._fold, self._ahead
        for lsn in [k for k in ahead if k < fold.next_lsn]:
            del ahead[lsn]
        while self._broken is None and (rec := ahead.pop(fold.next_lsn, None)) is not None:
            try:
                fold.fold_noted(rec)
            except Exception as exc:
                self._break(rec, exc)
            else:
                self._noted += 1
        return self._broken is None

    def _break(self, rec: _Record, exc: Exception) -> None:
        """The fold raised on a noted record: it is no longer trusted (no checkpoint is written
        from it: :meth:`checkpoint` raises, naming the record), and it takes nothing more."""
        self._broken = f"folding the noted record at lsn {rec.lsn} (session {rec.session_id!r}) failed: {type(exc).__name__}: {exc}"
        _log.error("engine.checkpoint_fold_failed", path=str(self.path), lsn=rec.lsn, session_id=rec.session_id,
                   error=f"{type(exc).__name__}: {exc}", effect="no checkpoint is written until the engine reopens the log")

    def interval(self) -> int:
        """Records between checkpoints: ``every``, or :data:`RECORDS_PER_SESSION_IN_FLIGHT`
        times the sessions in flight when that is more. A checkpoint snapshots each
        session in flight in the event loop's thread (about 1.5 µs each), so this keeps
        its cost per record bounded however many run at once; a restart then folds at
        most that many records, a few per session it has to abort anyway."""
        return max(self.every, RECORDS_PER_SESSION_IN_FLIGHT * len(self.fold.in_groups))

    def due(self) -> bool:
        """Whether :meth:`interval` records or more were appended since the last checkpoint was tried."""
        return self.log.next_lsn - max(self._tried, 0) >= self.interval()

    async def checkpoint(self, *, final: bool = False, cache_only: bool = True) -> int:
        """Write the checkpoint of the fold as it stands, after reading the log
        from the fold's end when the fold is stuck at a gap ``every`` records or
        more behind the log, or always with ``final`` (the engine closes: every
        record, noted or not, to the log's end). Returns the LSN of the last
        checkpoint written; errors as :meth:`advance`'s."""
        fold, ahead = self._checked_fold(), self._ahead
        if final:
            # Every record, noted or not, to the log's end; after any read a cancelled caller left running.
            if self._reading:
                await asyncio.wait(list(self._reading))
                if self._broken is not None:
                    raise CheckpointError(self.path, f"not written: {self._broken}")
            await self._read_in_thread(None)
        elif self.log.next_lsn - fold.next_lsn >= self.every and (ahead or fold.next_lsn == self._tried):
            # Stuck at a gap (records wait behind it, or the fold has not moved since the last try): read the gap.
            # One gap, then the records waiting after it; several, the log to its end (the waiting ones are dropped).
            first = min(ahead) if ahead else None
            one_gap = first is not None and max(ahead) - first + 1 == len(ahead)
            await self._read_in_thread(first if one_gap else None)
        fold = self._checked_fold()  # with what was noted during a read
        if self._reading or fold.next_lsn == (self.lsn if final else self._tried):
            return self.lsn  # a cancelled caller's read still runs, or nothing new since the last try
        self._tried = fold.next_lsn
        ckpt = fold.to_checkpoint()  # in the loop's thread, where the fold changes: a consistent state
        return await asyncio.to_thread(self._write, ckpt, cache_only)

    def _checked_fold(self) -> RestartFold:
        """:attr:`fold`, or CheckpointError when it can no longer be trusted."""
        fold = self.fold
        if self._broken is not None:
            raise CheckpointError(self.path, f"not written: {self._broken}")
        return fold

    async def _read_in_thread(self, until: int | None) -> None:
        """Fold the log's records from the fold's end (to ``until``, exclusive, or its
        end) in a worker thread; noted records wait until every such read ended."""
        done = asyncio.get_running_loop().run_in_executor(None, self._read_log, until)
        self._reading.add(done)
        done.add_done_callback(self._read_done)
        # Shielded: a cancelled caller leaves the read running, and noted records keep waiting until it ends.
        await asyncio.shield(done)

    def _read_log(self, until: int | None = None) -> None:
        with self._lock:
            self.read_back += self._fold.catch_up(self.log, until=until)  # a worker thread: never drains the pending notes

    def _read_done(self, done: asyncio.Future) -> None:
        self._reading.discard(done)
        exc = asyncio.CancelledError() if done.cancelled() else done.exception()
        if exc is None:
            if not self._reading and self._broken is None:
                self._fold_ahead()  # a record it breaks on is reported as _broken, as in _fold_pending
        else:
            # The fold may hold part of what it read: it takes nothing more, and no checkpoint is written from it.
            self._broken = f"reading the log failed: {type(exc).__name__}: {exc}"

    def advance(self, *, cache_only: bool = False) -> int:
        """Fold the log's records from the fold's end and write the
        checkpoint (unless nothing changed), in the caller's thread, before
        the engine notes records; returns the LSN of the last checkpoint
        written. Errors propagate, except with ``cache_only``: then a
        checkpoint that cannot be written (a full disk, a directory in its
        place: any OSError) is only logged, as the warning
        ``engine.checkpoint_failed`` naming the file and the error, and kept in
        :attr:`write_error`. A checkpoint is a cache: without it a restart
        folds from the last one written, or from lsn 0. Reading the log
        (the fold) still raises."""
        self._read_log()
        if self.fold.next_lsn == self.lsn:
            return self.lsn
        self._tried = self.fold.next_lsn
        return self._write(self.fold.to_checkpoint(), cache_only)

    def _write(self, ckpt: EngineCheckpoint, cache_only: bool) -> int:
        """Write ``ckpt`` with the anchor of its last record: the fold's, when its last
        record was read from the log (``catch_up`` hashed it), else read back now (a
        noted record carries no stored bytes); returns the LSN of the last checkpoint written."""
        with self._lock:
            if ckpt.next_lsn <= self.lsn:
                return self.lsn  # a newer one is already written (a cancelled caller's write came late)
            t0 = time.perf_counter()
            try:
                if ckpt.next_lsn > 0 and not ckpt.anchor:
                    anchor = anchor_at(self.log, ckpt.next_lsn - 1)
                    if anchor is None:
                        raise CheckpointError(self.path, f"the log's record at lsn {ckpt.next_lsn - 1} was folded but cannot be read back")
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
