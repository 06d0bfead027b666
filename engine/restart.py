"""The engine's restart state: a fold of the log it can resume, and its checkpoint file.

:meth:`engine.core.SessionEngine.open` needs four things from the log before
it can open a session again: (a) every session id the log holds (the id
filter), so a reused id is refused; (b) the membership of the groups still
in flight, whose members that already ended still count toward the group;
(c) the lifecycle state of the sessions in flight and the count of records
the lifecycle step refuses; (d) the recently ended sessions' statuses. All
four are a fold over the whole log: :class:`RestartFold`, the lifecycle
check (:class:`reducers.lifecycle.LifecycleCheck`, tags only) and the
reducers' group rule (:class:`reducers.groups.GroupTracker`).

Folding from LSN 0 on every restart costs O(log). So the engine keeps the
fold running beside it and writes its whole state to a checkpoint file
(``engine.checkpoint`` in the log's directory) every ``checkpoint_every``
records and when it closes. A restart loads the checkpoint and folds only
the records after it: O(records since the last checkpoint), whatever the
log's length (``tools/bench/bench_restart.py``).

A checkpoint is a cache, never the truth. It is used only when it proves it
belongs to this log at this point: its own SHA-256 matches, its format is
this version's, the log still reaches its LSN, and the log's record just
before that LSN hashes to the anchor the checkpoint saw (a log replaced,
truncated or repaired below it fails the check). Anything else is logged as
``engine.checkpoint_unusable``, with the file and the reason, and the
engine folds from LSN 0 as before: slower, never wrong. The orphans the
restart aborts always come from the log's own exact open-session map
(:func:`abort_orphans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Generator, NamedTuple

import msgspec

from agentlog.events.errors import AgentlogError
from agentlog._logging import get_logger
from agentlog.events.log.api import EventLog
from agentlog.events.fs import write_atomic
from agentlog.events.schema.types import (
    KNOWN_TAGS, SessionAborted, SessionDropped, SessionFinished, SessionOpened, payload_tag,
)
from agentlog.reducers.errors import UnknownEventError
from agentlog.reducers.groups import GroupError, GroupTracker, GroupTrackerSnapshot
from agentlog.reducers.lifecycle import IdFilter, LifecycleCheck, LifecycleCheckSnapshot
from agentlog.reducers.lifecycle_step import EndedWindow, ViolationKind

_log = get_logger("agentlog.engine.restart")

#: The checkpoint's file name inside a FileLog's directory.
CHECKPOINT_NAME = "engine.checkpoint"
#: First bytes of a checkpoint file; then the SHA-256 of the payload, then the payload.
CHECKPOINT_MAGIC = b"agentlog engine checkpoint\n"
#: Bumped when :class:`EngineCheckpoint` changes incompatibly (an older one is then unusable, not misread).
CHECKPOINT_FORMAT = 1
#: Violations kept verbatim (the rest are counted).
FIRST_VIOLATIONS = 20

_OPENED = SessionOpened.__struct_config__.tag
_ABORTED = SessionAborted.__struct_config__.tag


class _AbortRefill(msgspec.Struct, tag="session_aborted"):
    """What the fold reads of a ``session_aborted``: whether it owes its group a replacement
    (its reason, error and traceback are delimited, never decoded)."""

    refill: bool | msgspec.UnsetType = msgspec.UNSET


_abort_refill_decoder = msgspec.msgpack.Decoder(_AbortRefill)


class _GroupJoin(NamedTuple):
    """What the fold reads of a ``session_opened`` (a noted one waiting for its turn holds only this)."""

    group_id: str
    group_size: int
    sample_index: int
    replaces: Any


def _abort_refill(payload: Any) -> _AbortRefill:
    """The refill flag of a stored ``session_aborted`` payload."""
    return _abort_refill_decoder.decode(payload)


_TERMINAL_TAGS = frozenset(b.__struct_config__.tag for b in (SessionFinished, SessionAborted, SessionDropped))


class CheckpointError(AgentlogError):
    """A checkpoint file that cannot be used here: names the file and what was wrong."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"engine checkpoint {path}: {problem}")


class LoggedViolation(msgspec.Struct, frozen=True):
    """One record the restart fold refused: where and why (for the warning at restart)."""

    lsn: int
    session_id: str
    kind: str
    message: str


class EngineCheckpoint(msgspec.Struct, frozen=True):
    """:class:`RestartFold`'s whole state after the records below ``next_lsn``."""

    format: int
    #: Every record below this LSN is folded in.
    next_lsn: int
    #: :func:`record_anchor` of the record at ``next_lsn - 1`` (b"" when ``next_lsn`` is 0).
    anchor: bytes
    lifecycle: LifecycleCheckSnapshot
    groups: GroupTrackerSnapshot
    #: Sessions in flight -> their group.
    in_groups: list[tuple[str, str]]
    #: Ids of session_opened records the lifecycle step refused (their ids are in the log all the same).
    refused_opens: list[str]
    violations: int
    first_violations: list[LoggedViolation]
    written_ns: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineCheckpoint)


def record_anchor(lsn: int, session_id: str, session_seq: int, ts_ns: int, payload: bytes | memoryview) -> bytes:
    """SHA-256 over one stored record (position, session, sequence, time and body bytes)."""
    h = hashlib.sha256(_encoder.encode((lsn, session_id, session_seq, ts_ns)))
    h.update(payload)
    return h.digest()


class _Record(NamedTuple):
    lsn: int
    session_id: str
    session_seq: int
    ts_ns: int
    tag: str
    #: The stored body bytes (a view valid until the next record); None for a record the engine noted.
    payload: memoryview | None
    body: Any  # decoded only where the fold needs it (session_opened, session_aborted), else None


def _records(log: EventLog, from_lsn: int) -> Generator[_Record, None, None]:
    """The log's acknowledged records from ``from_lsn``, with their tags; the
    bodies are not decoded except ``session_opened``."""
    for rec in log.read(from_lsn, raw=True):
        tag = payload_tag(rec.payload)
        yield _Record(rec.lsn, rec.session_id, rec.session_seq, rec.ts_ns, tag, rec.payload,
                      rec.decode().body if tag == _OPENED else _abort_refill(rec.payload) if tag == _ABORTED else None)


def anchor_at(log: EventLog, lsn: int) -> bytes | None:
    """:func:`record_anchor` of the log's record at ``lsn`` (its body bytes
    as stored), or None when the log has no such record."""
    with contextlib.closing(_records(log, lsn)) as records:
        rec = next(records, None)
        if rec is None or rec.lsn != lsn:
            return None
        assert rec.payload is not None, "a record read from the log carries its stored bytes"
        return record_anchor(rec.lsn, rec.session_id, rec.session_seq, rec.ts_ns, rec.payload)


class RestartFold:
    """The fold behind the engine's restart, resumable from a checkpoint.

    Not thread-safe: one owner at a time (``SessionEngine.open``, then the
    engine's checkpointer)."""

    def __init__(self, *, recent_window: int = 4096, id_capacity: int = 1 << 18) -> None:
        self.check = LifecycleCheck(recent_window=recent_window, id_capacity=id_capacity)
        self.groups = GroupTracker(min_valid=0)
        self.in_groups: dict[str, str] = {}
        self.refused_opens: list[str] = []
        self.violations = 0
        self.first_violations: list[LoggedViolation] = []
        #: The next LSN to fold, and the anchor of the record before it.
        self.next_lsn = 0
        self.anchor = b""
        self.resumed_from = 0

    # -- folding -------------------------------------------------------------------

    def catch_up(self, log: EventLog, *, until: int | None = None, progress: Callable[[int], None] | None = None) -> int:
        """Fold the log's records from :attr:`next_lsn` to its acknowledged
        end (or up to ``until``, exclusive); returns how many. ``progress``:
        called now and then with how many records were folded so far, or None.
        Raises UnknownEventError for an event type this version does not know
        (its effect on the session cannot be known: upgrade agentlog)."""
        n = 0
        last = -1
        with contextlib.closing(_records(log, self.next_lsn)) as records:  # closes the cursor on a break too
            for rec in records:
                if until is not None and rec.lsn >= until:
                    break
                if rec.tag not in KNOWN_TAGS:
                    raise UnknownEventError(rec.lsn, rec.session_id, rec.tag)
                self._feed(rec)
                last = rec.lsn
                n += 1
                if progress is not None and n & 0x3FFF == 0:
                    progress(n)
        if n:
            # Read back, not kept from the loop: a record's payload view is only valid until the next one.
            anchor = anchor_at(log, last)
            if anchor is None:
                raise CheckpointError(Path("<fold>"), f"the log's record at lsn {last} was folded but cannot be read back")
            self.next_lsn, self.anchor = last + 1, anchor
        return n

    def fold_noted(self, rec: _Record) -> None:
        """Fold the record at :attr:`next_lsn` as the engine saw it acknowledged,
        not read from the log (:meth:`Checkpointer.note`). Its stored bytes are
        not at hand, so :attr:`anchor` is unknown (b"") until a read: a
        checkpoint reads its anchor from the log when it is written."""
        self._feed(rec)
        self.next_lsn, self.anchor = rec.lsn + 1, b""

    def _feed(self, rec: _Record) -> None:
        refused = False
        for v in self.check.feed(rec.lsn, rec.session_id, rec.session_seq, rec.tag):
            self._note(v.lsn, v.session_id, v.kind.value, v.message)
            refused = refused or v.kind is not ViolationKind.LSN_ORDER
        if refused:  # a record the lifecycle step refused is not applied to the groups either
            if rec.tag == _OPENED:
                self.refused_opens.append(rec.session_id)
            return
        sid = rec.session_id
        if rec.tag == _OPENED:
            body = rec.body
            try:
                self.groups.open(body.group_id, sid, body.group_size, body.sample_index, rec.lsn, body.replaces or "")
            except GroupError as exc:
                # Already in the log: the reducers refuse it too; the engine
                # counts it and keeps the membership the log first declared.
                self._note(rec.lsn, sid, "group", str(exc))
                return
            self.in_groups[sid] = body.group_id
        elif rec.tag in _TERMINAL_TAGS:
            gid = self.in_groups.pop(sid, None)
            if gid is not None:
                self.groups.close(gid, None, sid, rec.lsn, refill=rec.tag == _ABORTED and rec.body.refill is True)

    def _note(self, lsn: int, session_id: str, kind: str, message: str) -> None:
        self.violations += 1
        if len(self.first_violations) < FIRST_VIOLATIONS:
            self.first_violations.append(LoggedViolation(lsn, session_id, kind, message))

    # -- what the engine takes -------------------------------------------------------

    def id_filter(self) -> IdFilter:
        """A copy of the id filter, with the ids of refused opens: duplicate
        refusals stay exact only if the filter holds every id the log does."""
        ids = IdFilter.from_snapshot(self.check.ids.to_snapshot())
        for sid in self.refused_opens:
            ids.add(sid)
        return ids

    def group_tracker(self) -> GroupTracker:
        """A copy of the groups in flight."""
        return GroupTracker.from_snapshot(self.groups.to_snapshot())

    # -- checkpoints -------------------------------------------------------------------

    def to_checkpoint(self) -> EngineCheckpoint:
        """The fold's state as an :class:`EngineCheckpoint`."""
        return EngineCheckpoint(
            format=CHECKPOINT_FORMAT, next_lsn=self.next_lsn, anchor=self.anchor,
            lifecycle=self.check.to_snapshot(), groups=self.groups.to_snapshot(),
            in_groups=list(self.in_groups.items()), refused_opens=list(self.refused_opens),
            violations=self.violations, first_violations=list(self.first_violations), written_ns=time.time_ns(),
        )

    @classmethod
    def from_checkpoint(cls, ckpt: EngineCheckpoint, *, recent_window: int = 4096) -> "RestartFold":
        """The fold a checkpoint saved, ready to fold the records after it
        (the recent window resized to ``recent_window``)."""
        fold = cls(recent_window=recent_window, id_capacity=1)
        fold.check = LifecycleCheck.from_snapshot(ckpt.lifecycle)
        if fold.check.recent.size != recent_window:
            window = EndedWindow(recent_window)
            for sid, (state, lsn) in fold.check.recent.items():
                window.note(sid, state, lsn)
            fold.check.recent = window
        fold.groups = GroupTracker.from_snapshot(ckpt.groups)
        fold.in_groups = dict(ckpt.in_groups)
        fold.refused_opens = list(ckpt.refused_opens)
        fold.violations = ckpt.violations
        fold.first_violations = list(ckpt.first_violations)
        fold.next_lsn = fold.resumed_from = ckpt.next_lsn
        fold.anchor = ckpt.anchor
        return fold


def checkpoint_path_of(log: EventLog) -> Path | None:
    """Where the engine keeps the checkpoint of ``log``: in a FileLog's
    directory; None for a log without one (MemoryLog)."""
    path = getattr(log, "path", None)
    return None if path is None else Path(path) / CHECKPOINT_NAME


def write_checkpoint(path: Path, ckpt: EngineCheckpoint) -> int:
    """Write ``ckpt`` atomically (temp file, fsync, rename, directory fsync); returns its size."""
    payload = _encoder.encode(ckpt)
    data = CHECKPOINT_MAGIC + hashlib.sha256(payload).digest() + payload
    write_atomic(path.parent, path.name, data)
    return len(data)


def load_checkpoint(path: Path, log: EventLog) -> EngineCheckpoint:
    """The checkpoint at ``path``, verified against ``log``; raises
    FileNotFoundError when there is none and :class:`CheckpointError` naming
    what is wrong when it cannot be used."""
    data = path.read_bytes()
    head = len(CHECKPOINT_MAGIC)
    if data[:head] != CHECKPOINT_MAGIC:
        raise CheckpointError(path, f"expected the magic {CHECKPOINT_MAGIC!r} at offset 0, found {data[:head]!r}")
    digest, payload = data[head:head + 32], data[head + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(path, f"the SHA-256 at offset {head} does not match the {len(payload)}-byte payload (torn or damaged)")
    try:
        ckpt = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise CheckpointError(path, f"payload at offset {head + 32} does not decode as format {CHECKPOINT_FORMAT}: {exc}") from None
    if ckpt.format != CHECKPOINT_FORMAT:
        raise CheckpointError(path, f"format {ckpt.format}; this version reads format {CHECKPOINT_FORMAT}")
    end = log.next_lsn
    if ckpt.next_lsn > end:
        raise CheckpointError(path, f"folded the log up to lsn {ckpt.next_lsn}, but the log ends at lsn {end} (truncated or replaced)")
    if ckpt.next_lsn > 0:
        anchor = anchor_at(log, ckpt.next_lsn - 1)
        if anchor is None:
            raise CheckpointError(path, f"the log has no record at lsn {ckpt.next_lsn - 1} to check the anchor against")
        if anchor != ckpt.anchor:
            raise CheckpointError(path, f"the log's record at lsn {ckpt.next_lsn - 1} is not the one the checkpoint folded (another log, or rewritten)")
    try:
        IdFilter.from_snapshot(ckpt.lifecycle.ids)  # the layer sizes; a bad one would fail much later
    except ValueError as exc:
        raise CheckpointError(path, str(exc)) from None
    return ckpt


def resume_fold(log: EventLog, path: Path | None, *, recent_window: int, id_capacity: int) -> RestartFold:
    """The fold to restart from: the checkpoint at ``path`` when it proves
    it belongs to ``log`` (see the module docstring), else a fold from LSN 0."""
    if path is not None:
        try:
            ckpt = load_checkpoint(path, log)
        except FileNotFoundError:
            pass  # a log never checkpointed: fold it from the start
        except (CheckpointError, OSError) as exc:
            _log.warning("engine.checkpoint_unusable", path=str(path), problem=str(exc), fallback="fold the log from lsn 0")
        else:
            return RestartFold.from_checkpoint(ckpt, recent_window=recent_window)
    return RestartFold(recent_window=recent_window, id_capacity=id_capacity)


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
        #: Why the fold can no longer be trusted (a failed read of the log), or None.
        self._broken: str | None = None

    #: Noted records folded together once this many wait: in a run of their own the fold's code and
    #: data stay in the CPU's caches, where a record folded as it comes finds them evicted by the engine's
    #: work between two records (about half the cost per record in ``bench_engine``).
    PENDING_MAX = 256

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
        # What the fold reads of an open or an abort, not the body: a prompt or a traceback held while it
        # waits could be large.
        if tag == _OPENED:
            body = _GroupJoin(body.group_id, body.group_size, body.sample_index, body.replaces)
        elif tag == _ABORTED:
            body = _AbortRefill(refill=body.refill)
        else:
            body = None
        pending = self._pending
        pending.append(_Record(env.lsn, env.session_id, env.session_seq, env.ts_ns, tag, None, body))
        if len(pending) >= self.PENDING_MAX:
            self._fold_pending()

    def _fold_pending(self) -> None:
        """Fold the noted records in the order they came (see :meth:`note`).
        Whatever the fold raises breaks it (no checkpoint is written from it:
        :meth:`checkpoint` raises, naming the record) instead of failing the
        unrelated record whose note or read of the fold came next."""
        pending, self._pending = self._pending, []
        fold, ahead = self._fold, self._ahead
        for rec in pending:
            lsn = rec.lsn
            if lsn < fold.next_lsn or self._broken is not None:
                continue
            if self._reading or lsn != fold.next_lsn:
                if len(ahead) < self.AHEAD_MAX:
                    ahead[lsn] = rec
                continue
            try:
                fold.fold_noted(rec)
                self._noted += 1
                if ahead:
                    self._fold_ahead()
            except Exception as exc:
                self._broken = f"folding the noted record at lsn {lsn} (session {rec.session_id!r}) failed: {type(exc).__name__}: {exc}"
                _log.error("engine.checkpoint_fold_failed", path=str(self.path), lsn=lsn, session_id=rec.session_id,
                           error=f"{type(exc).__name__}: {exc}", effect="no checkpoint is written until the engine reopens the log")

    def _fold_ahead(self) -> None:
        """Fold the waiting records that now follow the fold's end; drop those it already holds."""
        fold, ahead = self._fold, self._ahead
        for lsn in [k for k in ahead if k < fold.next_lsn]:
            del ahead[lsn]
        while (rec := ahead.pop(fold.next_lsn, None)) is not None:
            fold.fold_noted(rec)
            self._noted += 1

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
            if not self._reading:
                self._fold_ahead()
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


#: Reason recorded for sessions a crashed engine left open or running.
RESTART_REASON = "engine_restart"


def abort_orphans(log: EventLog, fold: RestartFold, keep: set[str] | frozenset[str] = frozenset()) -> int:
    """Abort, in one batch, every session ``log`` still holds open or running
    (a previous engine process left it so), reason :data:`RESTART_REASON`,
    and fold the aborts into ``fold`` (they end the orphans there too: their
    groups, the recent window). Returns how many sessions were aborted.

    The orphans come from the log's exact open-session map, not from the
    fold: the fold skips a session whose id is a Bloom-filter false
    positive (it reports it as a reused id), and such a session, left
    open here, would never be aborted and its group never released.
    ``keep``: sessions adopted to resume (:mod:`engine.adopt`), left as they are."""
    folded = fold.check.open_sessions()
    orphans = {sid: seq for sid, seq in log.open_sessions().items() if sid not in keep}
    if not orphans:
        return 0
    records = []
    was: dict[str, str] = {}
    for sid, seq in sorted(orphans.items()):
        state, fold_seq = folded.get(sid, ("open (untracked by the lifecycle fold)", seq))
        was[sid] = str(state)
        if fold_seq != seq:
            # The log enforces its own sequence; a mismatch means the fold saw a violation here.
            _log.warning("engine.restart_seq_mismatch", session_id=sid, reducer_seq=fold_seq, log_seq=seq)
        body = SessionAborted(
            reason=RESTART_REASON,
            error=f"left {state} by a previous engine process; aborted when a new engine opened the log",
        )
        records.append((sid, seq, body))
    log.append_batch(records)
    fold.catch_up(log)
    for sid in sorted(orphans):
        _log.warning("session.aborted", session_id=sid, reason=RESTART_REASON, was=was[sid])
    return len(orphans)
