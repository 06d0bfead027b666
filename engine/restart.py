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

Folding from LSN 0 on every restart costs O(log). So the engine writes the
fold's whole state to a checkpoint file (``engine.checkpoint`` in the log's
directory) every ``checkpoint_every`` records and when it closes, served from
its own state, which is that fold's (:mod:`engine.checkpointer`). A restart loads the checkpoint and folds only
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

import contextlib
import hashlib
import time
from functools import partial
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

from .ids import IdScans

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

    def comparable(self) -> "EngineCheckpoint":
        """This checkpoint without what differs by how it was reached (the time it was taken,
        an anchor not read back yet): what a served checkpoint and a fold of the log share."""
        return msgspec.structs.replace(self, anchor=b"", written_ns=0)


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
    #: The stored body bytes (a view valid until the next record).
    payload: memoryview
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
        #: Confirms, by a scan of the log, an opening the id filter alone calls a reuse (set by :meth:`catch_up`).
        self.id_scans: IdScans | None = None

    # -- folding -------------------------------------------------------------------

    def catch_up(self, log: EventLog, *, until: int | None = None, progress: Callable[[int], None] | None = None) -> int:
        """Fold the log's records from :attr:`next_lsn` to its acknowledged
        end (or up to ``until``, exclusive); returns how many. ``progress``:
        called now and then with how many records were folded so far, or None.
        Raises UnknownEventError for an event type this version does not know
        (its effect on the session cannot be known: upgrade agentlog)."""
        n = 0
        last = -1
        if self.id_scans is None:  # one cap for the fold's life: a fold catches up with one log
            self.id_scans = IdScans(partial(log.read, 0, raw=True), f"the restart fold of {getattr(log, 'path', log)}")
        self.check.fold.confirm_used = self.id_scans
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

    def _feed(self, rec: _Record) -> None:
        tag = rec.tag
        refused = False
        for v in self.check.feed(rec.lsn, rec.session_id, rec.session_seq, tag):
            self._note(v.lsn, v.session_id, v.kind.value, v.message)
            refused = refused or v.kind is not ViolationKind.LSN_ORDER
        if refused:  # a record the lifecycle step refused is not applied to the groups either
            if tag == _OPENED:
                self.refused_opens.append(rec.session_id)
            return
        sid = rec.session_id
        if tag == _OPENED:
            body = rec.body
            try:
                self.groups.open(body.group_id, sid, body.group_size, body.sample_index, rec.lsn, body.replaces or "")
            except GroupError as exc:
                # Already in the log: the reducers refuse it too; the engine
                # counts it and keeps the membership the log first declared.
                self._note(rec.lsn, sid, "group", str(exc))
                return
            self.in_groups[sid] = body.group_id
        elif tag in _TERMINAL_TAGS:
            gid = self.in_groups.pop(sid, None)
            if gid is not None:
                self.groups.close(gid, None, sid, rec.lsn, refill=tag == _ABORTED and rec.body.refill is True)

    def _note(self, lsn: int, session_id: str, kind: str, message: str) -> None:
        self.violations += 1
        if len(self.first_violations) < FIRST_VIOLATIONS:
            self.first_violations.append(LoggedViolation(lsn, session_id, kind, message))

    # -- what the engine takes -------------------------------------------------------

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
            for sid, state, lsn in fold.check.recent.entries():
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
            recent = ckpt.lifecycle.recent
            if recent.size < recent_window and len(recent.ended) >= recent.size:
                # Full: it may have evicted sessions a window of recent_window would still hold.
                raise CheckpointError(path, f"its recent window holds {recent.size} ended sessions, fewer than the "
                                            f"{recent_window} asked for (status_cache): only the log has the rest")
        except FileNotFoundError:
            pass  # a log never checkpointed: fold it from the start
        except (CheckpointError, OSError) as exc:
            _log.warning("engine.checkpoint_unusable", path=str(path), problem=str(exc), fallback="fold the log from lsn 0")
        else:
            return RestartFold.from_checkpoint(ckpt, recent_window=recent_window)
    return RestartFold(recent_window=recent_window, id_capacity=id_capacity)


#: Reason recorded for sessions a crashed engine left open or running.
RESTART_REASON = "engine_restart"


def abort_orphans(log: EventLog, fold: RestartFold, keep: set[str] | frozenset[str] = frozenset()) -> int:
    """Abort, in one batch, every session ``log`` still holds open or running
    (a previous engine process left it so), reason :data:`RESTART_REASON`,
    and fold the aborts into ``fold`` (they end the orphans there too: their
    groups, the recent window). Returns how many sessions were aborted.

    The orphans come from the log's exact open-session map, not from the
    fold: a session whose opening the fold refused (a reused id, a refused
    membership) is open in the log all the same, and left open here it
    would never be aborted.
    ``keep``: sessions adopted to resume (:mod:`engine.adopt`), left as they are.

    These aborts owe their groups no replacement (``refill`` unset), even where the group
    rules refill infrastructure aborts: nobody plays a replacement for a batch a crash
    interrupted (the loop's ``complete_interrupted`` would open and abort it), so one owed
    would only keep its group from being released."""
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
