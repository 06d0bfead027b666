"""The file-backed event log: one writer with group commit, crash recovery,
readers and live followers in any process, and verification.

The on-disk format is described in :mod:`events.log_format`. In short: a
directory of segment files named by their first LSN; CRC32C-framed records;
a ``DURABLE`` watermark that readers in other processes trust; an ``INDEX``
checkpoint (sequence state of open sessions + sparse offset index) so that
opening a log does not rescan it; and the one writer's flock on the directory
itself (and on its ``LOCK`` file, which names its pid).

Durability and visibility (the follower contract):

* A record is acknowledged (``append``/``append_batch`` return) only after
  its batch is durable under the fsync policy: ``always`` (each append call
  is written and fdatasync'd on its own), ``batch`` (default: concurrent
  appends are coalesced into one write + fdatasync), ``interval`` (written at
  once, fdatasync at most every ``interval_s``; a machine crash can lose that
  window) or ``never`` (written, the OS decides when it reaches disk;
  segment seals and close still sync).
* The writer rewrites ``DURABLE`` only after the records below it are
  synced (written, under ``never``: then it is marked unsynced, and recovery
  takes it as a hint, not as proof that those records reached the disk).
  Readers and followers never yield a record at or past it, so a follower in
  another process only ever sees durable records even though it can see
  bytes still in flight; a reader that finds records below it missing raises
  :class:`LogCorruption` naming the file and the LSN range.
* A new segment's file is opened ahead of need, so a rotation never needs a
  new descriptor; an append that would need one when none is free (EMFILE)
  is refused with :class:`LogError` and the log stays healthy.
* Each writer open starts a new segment (lazily, at its first append) whose
  header carries the new writer epoch, so a segment's records all come from
  one writer and recovery only ever truncates a segment nobody writes to.

Any ``OSError`` from write or fsync, and any unexpected exception in the
writer thread, makes the writer fatal: every pending and later append raises
:class:`LogClosed` naming the cause, and ``fatal_reason`` reports it. Nothing
is retried in place (after a failed fsync the page cache may no longer hold
the data).
Reopening recovers: it keeps the longest valid prefix and truncates a torn
tail. A damaged frame followed by valid ones, or one below the durable
watermark, is corruption: :class:`LogCorruption` names segment, offset and
last good LSN, unless ``salvage=True`` moves the damaged rest aside.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import errno
import fcntl
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, NamedTuple

import msgspec
import structlog

from .log_api import EventLog, LogClosed, LogError, PendingRecord, SchemaError
from .log_format import (
    _MASK_DELTA,
    DEFAULT_MAX_RECORD_BYTES,
    FRAME_CRC,
    HEAD,
    TYPE_RECORD,
    Watermark,
    _crc_extend,
    _crc_value,
    DURABLE_NAME,
    ENV_HDR,
    FLAG_TERMINAL,
    FRAME_OVERHEAD,
    INDEX_EVERY_BYTES,
    INDEX_NAME,
    LOCK_NAME,
    SEG_HDR_SIZE,
    BadFrame,
    Checkpoint,
    Frame,
    LogCorruption,
    SegmentScanner,
    find_later_frame,
    fsync_dir,
    is_log_dir,
    list_segments,
    load_checkpoint,
    pack_checkpoint,
    pack_durable,
    pack_segment_header,
    parse_segment_header,
    read_watermark,
    segment_name,
    write_atomic,
)
from .types import TERMINAL_EVENT_TYPES, Envelope, UnknownEvent, decode_body

__all__ = [
    "FSYNC_POLICIES",
    "FileLog",
    "LogCorruption",
    "LogLocked",
    "NotALog",
    "OsOps",
    "RawRecord",
    "VerifyReport",
    "follow_log",
    "read_log",
    "verify_log",
]

log = structlog.get_logger("agentlog.events.log")

FSYNC_POLICIES = ("always", "batch", "interval", "never")
_TERMINAL_SET = frozenset(TERMINAL_EVENT_TYPES)
_IOV_MAX = 1024
#: Payloads from this size on are written as their own iovec (never copied in Python).
_BIG_PAYLOAD = 4096


class LogLocked(LogError):
    """Another writer holds the log directory's lock."""


class NotALog(LogError):
    """The path is not a log directory."""


class OsOps:
    """The OS calls the writer makes for data and syncs. Tests substitute a
    subclass to inject faults (EIO, ENOSPC, short writes) into a real writer."""

    def writev(self, fd: int, buffers: list) -> int:
        """``os.writev``: may write fewer bytes than given (the writer completes it)."""
        return os.writev(fd, buffers)

    def fdatasync(self, fd: int) -> None:
        """``os.fdatasync``: makes a batch of frames durable."""
        os.fdatasync(fd)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        """``os.pwrite``: writes at an offset without moving the file position."""
        return os.pwrite(fd, data, offset)


class RawRecord(NamedTuple):
    """A record with its payload undecoded: a zero-copy view into the read
    buffer. ``decode()`` gives the Envelope."""

    lsn: int
    session_id: str
    session_seq: int
    ts_ns: int
    terminal: bool
    payload: memoryview

    def decode(self) -> Envelope:
        """Decode the payload into an Envelope (an unknown tag gives an
        UnknownEvent body). Raises SchemaError for a known tag whose fields do
        not decode, msgspec.DecodeError for a payload that is no event."""
        try:
            body = decode_body(self.payload)
        except msgspec.DecodeError as exc:
            err = SchemaError.of_payload(exc, self.payload, lsn=self.lsn, session_id=self.session_id)
            if err is not None:
                raise err from exc
            raise
        return Envelope(self.lsn, self.session_id, self.session_seq, self.ts_ns, body)


class _NewSegment(NamedTuple):
    first_lsn: int
    checkpoint: Checkpoint | None
    spare: "_Spare | None"  # the file opened for it ahead of need


class _Spare(NamedTuple):
    """A segment file opened ahead of need under a temporary name, so that a
    rotation never needs a new descriptor at a bad moment (EMFILE)."""

    fd: int
    tmp: str


#: Temporary names of spare segment files (readers ignore dot files).
_SPARE_PREFIX = ".spare-segment-"
#: Open the next segment's file once the current one is this full.
_SPARE_AHEAD_FILL = 0.75
_NOFILE_RAISED = False
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def _raise_nofile_limit() -> None:
    """Once per process: raise the soft RLIMIT_NOFILE to the hard limit, so a
    burst of connections does not starve the writer of descriptors."""
    global _NOFILE_RAISED
    if _NOFILE_RAISED:
        return
    _NOFILE_RAISED = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:  # Linux caps the descriptor table at fs.nr_open; "infinity" is refused
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = soft
    if soft == resource.RLIM_INFINITY or target <= soft:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.debug("log.nofile_limit.unchanged", soft=soft, hard=hard, error=repr(exc))
        return
    log.debug("log.nofile_limit.raised", soft_was=soft, soft=target, hard=hard)


class _Submission(NamedTuple):
    ops: list  # frames (bytes) and _NewSegment markers, in order
    end: int  # exclusive LSN bound of this submission


# ---------------------------------------------------------------- classification


def _classify_bad(
    fd: int,
    name: str,
    size: int,
    bad: BadFrame,
    expected: int,
    watermark: int | None,
    later_segments: bool,
    cap: int,
) -> LogCorruption | None:
    """A stop in the middle of a segment: corruption (returned) or a torn tail (None).

    It is corruption when valid records follow (later segments, or a valid
    frame further on in this one) or when the damaged record was already
    durable per the DURABLE watermark. Otherwise it is the tail of a write
    that never completed, which was never acknowledged.
    """
    where = f"segment {name}, offset {bad.offset}, last good lsn {expected - 1}: {bad.reason}"
    if later_segments:
        why = "later segments exist, so this is not a torn tail"
    elif watermark is not None and expected < watermark:
        why = f"lsn {expected} is below the durable watermark {watermark}, so it was acknowledged"
    else:
        later = find_later_frame(fd, bad.offset, size, expected, cap)
        if later is None:
            return None
        why = f"a valid frame follows at offset {later}, so this is not a torn tail"
    return LogCorruption(f"{where}; {why}", segment=name, offset=bad.offset, last_good_lsn=expected - 1)


def _proof(durable: Watermark | None) -> int | None:
    """The watermark recovery and verify may hold the log to: only one whose
    records were synced (under fsync="never" a power loss can keep the
    watermark and drop the data it covers)."""
    return durable.lsn if durable is not None and durable.synced else None


def _head(path: Path) -> bytes:
    """The first SEG_HDR_SIZE bytes of a file (a segment may be 64 MiB)."""
    with open(path, "rb") as f:
        return f.read(SEG_HDR_SIZE)


def _missing_acked(name: str, size: int, expected: int, watermark: int) -> LogCorruption:
    """The log ends cleanly, but before records the watermark says were acknowledged."""
    return LogCorruption(
        f"segment {name}, offset {size}, last good lsn {expected - 1}: the log ends here, but the durable "
        f"watermark says lsn {expected}..{watermark - 1} were acknowledged; they are missing",
        segment=name,
        offset=size,
        last_good_lsn=expected - 1,
    )


def _torn_new_segment(size: int, header: bytes, first: int, watermark: int | None) -> bool:
    """Is a last segment with a bad header the remains of a crash while it was
    being created? Yes if it cannot hold an acknowledged record: the watermark
    says nothing from its first LSN on was durable, or (no watermark) the
    header is short or all zeros."""
    if watermark is not None:
        return first >= watermark
    return size < SEG_HDR_SIZE or not any(header)


def _open_segment(directory: Path, first: int, flags: int = os.O_RDONLY) -> tuple[int, int, int]:
    """Open a segment and check its header; returns (fd, epoch, size)."""
    name = segment_name(first)
    fd = os.open(directory / name, flags)
    try:
        raw = os.pread(fd, SEG_HDR_SIZE, 0)
        hdr = parse_segment_header(raw, name, first)
        return fd, hdr.epoch, os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise


def _payload_error(name: str, fr: Frame, exc: Exception) -> LogCorruption | SchemaError:
    """What a CRC-valid frame whose payload does not decode is: a SchemaError
    when it carries a known tag (a newer writer's fields), else damage."""
    schema = SchemaError.of_payload(exc, fr.payload, lsn=fr.lsn, session_id=fr.session_id, where=f"segment {name}, offset {fr.offset}")
    if schema is not None:
        return schema
    return LogCorruption(
        f"segment {name}, offset {fr.offset}, lsn {fr.lsn}: CRC-valid frame whose payload does not decode "
        f"as a schema-v1 event: {exc}",
        segment=name,
        offset=fr.offset,
        last_good_lsn=fr.lsn - 1,
    )


# ---------------------------------------------------------------- cursor (all readers)


class _Cursor:
    """Sequential position in a log directory, shared by ``FileLog.read``,
    :func:`read_log` and :func:`follow_log`. ``fetch(limit)`` returns the next
    records below ``limit`` (an exclusive LSN bound; None = every valid frame),
    following segment rotation by name: the record after the last one in a
    segment is either further on in it or first in the segment named by its LSN.
    """

    def __init__(
        self,
        directory: Path,
        from_lsn: int,
        cap: int,
        index: Callable[[int], list[tuple[int, int]] | None] | None,
        raw: bool,
    ) -> None:
        self.dir = directory
        self.from_lsn = max(0, from_lsn)
        self.cap = cap
        self.index = index
        self.raw = raw
        self.fd: int | None = None
        self.ino = 0
        self.name = ""
        self.scanner: SegmentScanner | None = None
        self.torn: BadFrame | None = None
        #: The limit is a watermark written under fsync="never" (not synced).
        self.unsynced_limit = False

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _switch(self, first: int, offset: int, expected: int) -> bool:
        try:
            fd, _epoch, _size = _open_segment(self.dir, first)
        except FileNotFoundError:
            return False
        except LogCorruption:
            # A segment being created has a short (or not yet written) header;
            # it only counts as damage once records past it are durable.
            head = _head(self.dir / segment_name(first))
            if len(head) < SEG_HDR_SIZE or not any(head):
                return False
            raise
        self.close()
        self.fd = fd
        self.ino = os.fstat(fd).st_ino
        self.name = segment_name(first)
        self.scanner = SegmentScanner(fd, self.name, offset, expected, self.cap)
        return True

    def _position(self) -> bool:
        segs = list_segments(self.dir)
        if not segs:
            return False
        i = bisect.bisect_right(segs, self.from_lsn) - 1
        first = segs[max(i, 0)]
        offset, expected = SEG_HDR_SIZE, first
        entries = self.index(first) if self.index else None
        if entries:
            j = bisect.bisect_right(entries, (self.from_lsn, 1 << 62)) - 1
            if j >= 0:
                expected, offset = entries[j]
        if not self._switch(first, offset, expected):
            self.name = segment_name(first)  # named if the records it should hold are missing
            return False
        if offset != SEG_HDR_SIZE:
            # Trust but verify an index hint: the frame there must carry the LSN.
            probe = SegmentScanner(self.fd, self.name, offset, expected, self.cap)
            if next(probe.frames(limit=expected + 1), None) is None:
                self.scanner = SegmentScanner(self.fd, self.name, SEG_HDR_SIZE, first, self.cap)
        return True

    @property
    def next_lsn(self) -> int:
        return self.scanner.expected if self.scanner else self.from_lsn

    def _check_reached(self, limit: int | None) -> None:
        """The readable log ends here: raise LogCorruption if that is below
        ``limit`` (the durable watermark), whose records were acknowledged
        and so must exist (an emptied, cut or deleted segment)."""
        nxt = self.next_lsn
        if limit is None or max(nxt, self.from_lsn) >= limit:
            return
        if self.scanner is not None:
            where, offset = f"segment {self.name} ends at offset {self.scanner.offset}", self.scanner.offset
        elif self.name:
            where, offset = f"segment {self.name} has no complete header", 0
        else:
            where, offset = "no segment files exist", 0
        hint = (
            "; the watermark was written under fsync=\"never\" and never synced, so a power loss explains "
            "this: reopening the log as its writer keeps what was synced"
            if self.unsynced_limit
            else ""
        )
        raise LogCorruption(
            f"log {self.dir}: {where} (last good lsn {nxt - 1}), but the durable watermark says "
            f"lsn {nxt}..{limit - 1} were acknowledged; they are missing{hint}",
            segment=self.name,
            offset=offset,
            last_good_lsn=nxt - 1,
        )

    def records(self, limit: int | None) -> Iterator:
        """Yield the records available now below ``limit``, then return.
        Records are yielded one by one (not gathered) so that each frame's
        memory is reused as soon as the consumer drops it. Raises
        LogCorruption for damage that is not a torn tail."""
        if self.scanner is None and not self._position():
            self._check_reached(limit)
            return
        from_lsn = self.from_lsn
        raw = self.raw
        while True:
            sc = self.scanner
            if limit is not None and sc.expected >= limit:
                return
            size = os.fstat(self.fd).st_size
            for fr in sc.frames(limit, size):
                if fr.lsn < from_lsn:
                    continue
                if raw:
                    yield RawRecord(fr.lsn, fr.session_id, fr.session_seq, fr.ts_ns, bool(fr.flags & FLAG_TERMINAL), fr.payload)
                else:
                    try:
                        body = decode_body(fr.payload)
                    except msgspec.DecodeError as exc:  # ValidationError included
                        raise _payload_error(self.name, fr, exc) from exc
                    yield Envelope(fr.lsn, fr.session_id, fr.session_seq, fr.ts_ns, body)
            bad = sc.bad
            if bad is None:
                if limit is not None and sc.expected >= limit:
                    return
                nxt = sc.expected
                path = self.dir / segment_name(nxt)
                if segment_name(nxt) == self.name:
                    # An empty segment replaced by a new writer's segment of the same name.
                    try:
                        if os.stat(path).st_ino == self.ino:
                            self._check_reached(limit)
                            return
                    except FileNotFoundError:
                        self._check_reached(limit)
                        return
                if self._switch(nxt, SEG_HDR_SIZE, nxt):
                    continue
                self._check_reached(limit)
                return
            later = any(s > int(self.name[:20]) for s in list_segments(self.dir))
            err = _classify_bad(self.fd, self.name, size, bad, sc.expected, limit, later, self.cap)
            if err is not None:
                raise err
            self.torn = bad
            return


# ---------------------------------------------------------------- the writer


class FileLog(EventLog):
    """The durable, segmented, CRC-framed log. Create with :meth:`open`."""

    def __init__(self, directory: Path, *, _token: object = None, **_: Any) -> None:
        if _token is not _OPEN_TOKEN:
            raise TypeError("use FileLog.open(path, ...) to open a log")
        super().__init__()
        self._dir = directory

    # ------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        fsync: str = "batch",
        segment_bytes: int = 64 << 20,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        salvage: bool = False,
        interval_s: float = 0.05,
        clock: Callable[[], int] = time.time_ns,
        os_ops: OsOps | None = None,
    ) -> "FileLog":
        """Open (creating if needed) the log directory at ``path`` as its one
        writer, recovering from any crash. See the module docstring for the
        fsync policies. ``os_ops`` replaces the OS calls the writer uses for
        data (fault injection in tests)."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync: expected one of {'/'.join(FSYNC_POLICIES)}, found {fsync!r}")
        if segment_bytes < SEG_HDR_SIZE + 64:
            raise ValueError(f"segment_bytes: expected at least {SEG_HDR_SIZE + 64}, found {segment_bytes}")
        if max_record_bytes < 64:
            raise ValueError(f"max_record_bytes: expected at least 64, found {max_record_bytes}")
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise NotALog(f"{directory}: is a file, expected a log directory")
        directory.mkdir(parents=True, exist_ok=True)
        if not is_log_dir(directory):
            strangers = sorted(n for n in os.listdir(directory) if n not in (LOCK_NAME, INDEX_NAME) and not n.startswith("."))
            if strangers:
                raise NotALog(
                    f"{directory}: not an agentlog log directory (no segments, no {DURABLE_NAME}; "
                    f"holds {', '.join(strangers[:3])}{'...' if len(strangers) > 3 else ''})"
                )
        self = cls(directory, _token=_OPEN_TOKEN)
        self._clock = clock
        self._policy = fsync
        self._segment_bytes = segment_bytes
        self._cap = max_record_bytes
        self._interval_s = interval_s
        self._os = os_ops or OsOps()
        self._log = log.bind(log_dir=str(directory))
        _raise_nofile_limit()
        self._lock: _WriterLock | None = _acquire_lock(directory)
        try:
            self._init_state()
            for name in os.listdir(directory):
                if name.startswith(_SPARE_PREFIX):  # left by a writer that crashed
                    os.unlink(directory / name)
            self._recover(salvage)
        except BaseException:
            self._release_fds()
            raise
        self._thread = threading.Thread(target=self._writer_loop, name=f"agentlog-writer:{directory.name}", daemon=True)
        self._thread.start()
        return self

    def _init_state(self) -> None:
        # A plain Lock (not the default RLock): nothing re-enters it, and it is
        # taken once per append.
        self._cv = threading.Condition(threading.Lock())
        self._pending: collections.deque[_Submission] = collections.deque()
        self._waiters: collections.deque[tuple[int, asyncio.Future, Any, asyncio.AbstractEventLoop]] = collections.deque()
        self._flushing = False
        self._thread_idle = False
        self._closing = False
        self._closed = False
        self._fatal: BaseException | None = None
        self._fatal_msg = ""
        self._seg_fd: int | None = None
        self._durable_fd: int | None = None
        self._cur_seg: int | None = None
        self._unsynced = False
        self._last_sync = time.monotonic()
        self._published: tuple[int, bool] | None = None
        # Submission-side state (under _cv).
        self._assigned = 0  # next LSN to hand out
        self._acked = 0  # records below this are acknowledged
        self._seg_first: int | None = None  # segment the next frame goes to; None: start one
        self._seg_size = 0
        self._last_index_off = 0
        self._segments: list[int] = []
        self._index: dict[int, list[tuple[int, int]]] = {}
        self._spares: collections.deque[_Spare] = collections.deque()  # under _cv
        self._spare_count = 0

    def _release_fds(self) -> None:
        self._discard_spares(getattr(self, "_spares", ()))
        for attr in ("_seg_fd", "_durable_fd"):
            fd = getattr(self, attr, None)
            if fd is not None:
                os.close(fd)
                setattr(self, attr, None)
        lock = getattr(self, "_lock", None)
        if lock is not None:
            _release_lock(lock)
            self._lock = None

    # ------------------------------------------------------------ recovery

    def _checkpoint_start(self, ckpt: Checkpoint, segs: list[int]) -> str:
        """Why the checkpoint cannot be trusted ('' when it can)."""
        if not ckpt.segments or ckpt.segments != segs[: len(ckpt.segments)] or ckpt.segment != ckpt.segments[-1]:
            return "its segment list does not match the directory"
        if ckpt.offset < SEG_HDR_SIZE:
            return f"offset {ckpt.offset} is inside the segment header"
        try:
            fd, _, size = _open_segment(self._dir, ckpt.segment)
        except (OSError, LogCorruption) as exc:
            return f"segment {segment_name(ckpt.segment)} unreadable: {exc}"
        try:
            if ckpt.offset > size:
                return f"offset {ckpt.offset} is past the end of {segment_name(ckpt.segment)} ({size} bytes)"
            if ckpt.offset < size:
                sc = SegmentScanner(fd, segment_name(ckpt.segment), ckpt.offset, ckpt.lsn, self._cap)
                if next(sc.frames(limit=ckpt.lsn + 1, size=size), None) is None:
                    return f"no frame with lsn {ckpt.lsn} at offset {ckpt.offset}"
        finally:
            os.close(fd)
        # Spot-check the last index entry of every segment it covers.
        for first, entries in ckpt.index.items():
            if first not in ckpt.segments or not entries:
                return f"index names segment {first} it does not list"
            lsn, off = entries[-1]
            if first == ckpt.segment and lsn >= ckpt.lsn:
                return f"index entry lsn {lsn} is past the checkpoint lsn {ckpt.lsn}"
            try:
                fd, _, size = _open_segment(self._dir, first)
            except (OSError, LogCorruption) as exc:
                return f"segment {segment_name(first)} unreadable: {exc}"
            try:
                sc = SegmentScanner(fd, segment_name(first), off, lsn, self._cap)
                if next(sc.frames(limit=lsn + 1, size=size), None) is None:
                    return f"index entry (lsn {lsn}, offset {off}) of {segment_name(first)} does not match the log"
            finally:
                os.close(fd)
        return ""

    def _recover(self, salvage: bool) -> None:
        d = self._dir
        segs = list_segments(d)
        durable = read_watermark(d)
        watermark = _proof(durable)
        if durable is not None and watermark is None:
            self._log.info(
                "log.recovery.watermark_unsynced", watermark=durable.lsn, reason="written under fsync=never: a hint, not proof"
            )
        ckpt, why = load_checkpoint(d)
        epoch = max(durable.epoch if durable else 0, ckpt.epoch if ckpt else 0)
        state: dict[str, int] = {}
        index: dict[int, list[tuple[int, int]]] = {}
        start_i, offset, expected = 0, SEG_HDR_SIZE, segs[0] if segs else 0
        rebuilt = True
        if ckpt is not None and segs:
            why = self._checkpoint_start(ckpt, segs)
            if not why:
                rebuilt = False
                start_i = segs.index(ckpt.segment)
                offset, expected = ckpt.offset, ckpt.lsn
                state = dict(ckpt.open_sessions)
                index = {k: list(v) for k, v in ckpt.index.items()}
        if rebuilt and segs:
            self._log.info("log.index.rebuilding", reason=why, segments=len(segs))
        scanned = 0
        changed = False
        truncated_at: tuple[int, int] | None = None
        i = start_i
        while i < len(segs):
            first = segs[i]
            name = segment_name(first)
            last = i == len(segs) - 1
            if offset == SEG_HDR_SIZE and first != expected:
                err = LogCorruption(
                    f"segment {name}: starts at lsn {first}, expected {expected} (the previous segment ends at lsn {expected - 1})",
                    segment=name,
                    offset=0,
                    last_good_lsn=expected - 1,
                )
                if not salvage:
                    raise err
                self._salvage(segs[i:], None, 0, err, epoch)
                segs = segs[:i]
                break
            try:
                fd, seg_epoch, size = _open_segment(d, first, os.O_RDWR)
            except LogCorruption as err:
                size = (d / name).stat().st_size
                raw = _head(d / name)
                if last and _torn_new_segment(size, raw, first, watermark):
                    # Torn while being created: it never held an acknowledged record.
                    self._log.warning("log.recovery.removed_torn_segment", segment=name, size=size)
                    os.unlink(d / name)
                    fsync_dir(d)
                    segs = segs[:i]
                    changed = True
                    break
                if not salvage:
                    raise
                self._salvage(segs[i:], None, 0, err, epoch)
                segs = segs[:i]
                break
            epoch = max(epoch, seg_epoch)
            try:
                entries = index.setdefault(first, [(first, SEG_HDR_SIZE)])
                last_off = entries[-1][1]
                sc = SegmentScanner(fd, name, offset, expected, self._cap)
                for fr in sc.frames(size=size):
                    if fr.offset - last_off >= INDEX_EVERY_BYTES:
                        entries.append((fr.lsn, fr.offset))
                        last_off = fr.offset
                    if fr.flags & FLAG_TERMINAL:
                        state.pop(fr.session_id, None)
                    else:
                        state[fr.session_id] = fr.session_seq + 1
                expected = sc.expected
                scanned += 1
                if sc.bad is not None:
                    err = _classify_bad(fd, name, size, sc.bad, expected, watermark, not last, self._cap)
                    if err is not None:
                        if not salvage:
                            raise err
                        self._salvage(segs[i + 1 :], fd, sc.bad.offset, err, epoch, name)
                        segs = segs[: i + 1]
                    else:
                        self._log.warning(
                            "log.recovery.torn_tail",
                            segment=name,
                            offset=sc.bad.offset,
                            cut_bytes=size - sc.bad.offset,
                            last_good_lsn=expected - 1,
                            reason=sc.bad.reason,
                        )
                        os.ftruncate(fd, sc.bad.offset)
                    truncated_at = (first, sc.bad.offset)
                    size = sc.bad.offset
                if i == len(segs) - 1:
                    if watermark is not None and expected < watermark:
                        err = _missing_acked(name, size, expected, watermark)
                        if not salvage:
                            raise err
                        self._log.warning("log.recovery.salvaged", error=str(err), last_good_lsn=expected - 1)
                    # Records a crashed writer wrote but never synced become durable now,
                    # before the watermark claims them.
                    os.fsync(fd)
                    if size <= SEG_HDR_SIZE:
                        # No records: the next writer starts a segment of this very name.
                        os.close(fd)
                        fd = -1
                        os.unlink(d / name)
                        fsync_dir(d)
                        index.pop(first, None)
                        segs = segs[:i]
                        changed = True
            finally:
                if fd >= 0:
                    os.close(fd)
            i += 1
            offset = SEG_HDR_SIZE
        if watermark is not None and expected < watermark and not salvage:
            name = segment_name(segs[-1]) if segs else "(no segments)"
            size = (d / name).stat().st_size if segs else 0
            raise _missing_acked(name, size, expected, watermark)
        self._epoch = epoch + 1
        self._segments = list(segs)
        self._index = {k: v for k, v in index.items() if k in set(segs)}
        self._next_seq = state
        self._assigned = self._acked = expected
        self._seg_first = None
        created = not (d / DURABLE_NAME).exists()
        self._durable_fd = os.open(d / DURABLE_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        self._publish(expected)
        if created:
            fsync_dir(d)
        if rebuilt or changed or scanned > 1 or truncated_at is not None:
            self._write_checkpoint(self._snapshot_at_end())
        self._log.info(
            "log.opened",
            epoch=self._epoch,
            next_lsn=expected,
            segments=len(segs),
            open_sessions=len(state),
            index="rebuilt" if rebuilt else "checkpoint",
            policy=self._policy,
        )

    def _salvage(
        self, later: list[int], fd: int | None, offset: int, err: LogCorruption, epoch: int, name: str = ""
    ) -> None:
        """Move damaged bytes and everything after them into ``salvage-<epoch>/``
        (never deleted), keeping the valid prefix as the log."""
        dest = self._dir / f"salvage-{epoch + 1}"
        dest.mkdir(exist_ok=True)
        if fd is not None:
            size = os.fstat(fd).st_size
            with open(dest / f"{name}.tail@{offset}", "wb") as out:
                pos = offset
                while pos < size:
                    chunk = os.pread(fd, min(1 << 20, size - pos), pos)
                    out.write(chunk)
                    pos += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.ftruncate(fd, offset)
            os.fsync(fd)
        for first in later:
            os.replace(self._dir / segment_name(first), dest / segment_name(first))
        fsync_dir(dest)
        fsync_dir(self._dir)
        self._log.warning(
            "log.recovery.salvaged",
            error=str(err),
            moved_segments=len(later),
            moved_to=str(dest),
            last_good_lsn=err.last_good_lsn,
        )

    # ------------------------------------------------------------ state helpers

    def _snapshot_at_end(self) -> Checkpoint:
        """Checkpoint of the state right after the last assigned record."""
        if self._segments:
            seg = self._segments[-1]
            off = self._seg_size if self._seg_first == seg else (self._dir / segment_name(seg)).stat().st_size
        else:
            seg, off = self._assigned, SEG_HDR_SIZE
        segs = self._segments or []
        return Checkpoint(
            epoch=self._epoch,
            lsn=self._assigned,
            segment=seg,
            offset=off,
            segments=list(segs) if segs else [],
            open_sessions=dict(self._next_seq),
            index={k: list(v) for k, v in self._index.items()},
        )

    def _write_checkpoint(self, ckpt: Checkpoint) -> None:
        if not ckpt.segments:
            # Nothing to index; an old INDEX would be stale.
            try:
                os.unlink(self._dir / INDEX_NAME)
            except FileNotFoundError:
                pass
            return
        write_atomic(self._dir, INDEX_NAME, pack_checkpoint(ckpt))

    def _publish(self, end: int, *, synced: bool = True) -> None:
        """Advance the DURABLE watermark readers in other processes trust.
        ``synced=False`` (fsync="never"): the records below ``end`` were only
        written, so recovery takes the watermark as a hint, not as proof."""
        if (end, synced) != self._published:
            self._os.pwrite(self._durable_fd, pack_durable(end, self._epoch, synced=synced), 0)
            self._published = (end, synced)

    # ------------------------------------------------------------ interface

    @property
    def path(self) -> Path:
        """The log directory."""
        return self._dir

    @property
    def epoch(self) -> int:
        """This writer's epoch (one more than the previous writer's)."""
        return self._epoch

    @property
    def next_lsn(self) -> int:
        return self._assigned

    @property
    def durable_lsn(self) -> int:
        """Records below this LSN are acknowledged (durable per policy)."""
        return self._acked

    @property
    def max_record_bytes(self) -> int:
        """The largest record this log accepts (bytes, envelope included)."""
        return self._cap

    @property
    def fatal_reason(self) -> str | None:
        return self._fatal_msg if self._fatal is not None else None

    def _dead(self) -> LogClosed:
        if self._fatal is not None:
            exc = LogClosed(self._fatal_msg)
            exc.__cause__ = self._fatal
            return exc
        return LogClosed(f"log {self._dir}: closed; no further appends")

    def _submit(self, records: Iterable[PendingRecord | tuple]) -> tuple[list[Envelope], int]:
        """Validate, encode and stage records (caller holds _cv). All or nothing:
        every check that can fail runs before any state changes."""
        if self._fatal is not None or self._closing:
            raise self._dead()
        checked = self._check_batch(records)  # encodes each body once; its payload is stored as is
        cap = self._cap
        sids: list[bytes] = []
        for rec in checked:
            sidb = rec.session_id.encode()
            n = len(rec.payload)
            if ENV_HDR.size + len(sidb) + n > cap:
                raise LogError(
                    f"session {rec.session_id!r} seq {rec.session_seq}: record of {ENV_HDR.size + len(sidb) + n} "
                    f"bytes exceeds max_record_bytes {cap}"
                )
            sids.append(sidb)
        self._reserve_spares(*self._segments_needed(FRAME_OVERHEAD + len(sidb) + len(rec.payload) for sidb, rec in zip(sids, checked)))
        # From here on nothing can fail. The frame layout is inlined (see
        # log_format.encode_frame, which readers' tests use): this loop is the
        # hot path of every append.
        ts = self._clock()
        lsn = self._assigned
        envs = []
        seg_first, seg_size, last_idx = self._seg_first, self._seg_size, self._last_index_off
        run: list = []
        ops: list = [run]
        seg_limit = self._segment_bytes
        next_seq = self._next_seq
        terminal_types = _TERMINAL_SET
        head_pack, crc_pack, crc_value, crc_extend = HEAD.pack, FRAME_CRC.pack, _crc_value, _crc_extend
        env_size = ENV_HDR.size
        for rec, sidb in zip(checked, sids):
            sid, seq, body, payload = rec
            plen = len(payload)
            terminal = type(body) in terminal_types
            head = head_pack(env_size + len(sidb) + plen, TYPE_RECORD, lsn, seq, ts, terminal, len(sidb)) + sidb
            c = crc_extend(crc_value(head), payload)  # C code over the bytes where they lie: no copy
            prefix = crc_pack((((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF) + head
            n = len(prefix) + plen
            if seg_first is None or (seg_size > SEG_HDR_SIZE and seg_size + n > seg_limit):
                run = self._start_segment(lsn, rotating=seg_first is not None, ops=ops)
                seg_first, seg_size, last_idx = lsn, SEG_HDR_SIZE, SEG_HDR_SIZE
            elif seg_size - last_idx >= INDEX_EVERY_BYTES:
                self._index[seg_first].append((lsn, seg_size))
                last_idx = seg_size
            if plen < _BIG_PAYLOAD:
                run.append(prefix + payload)  # one small piece beats two iovecs
            else:
                run.append(prefix)
                run.append(payload)  # written with writev: never copied in Python
            seg_size += n
            envs.append(Envelope(lsn, sid, seq, ts, body))
            if terminal:
                next_seq.pop(sid, None)
            else:
                next_seq[sid] = seq + 1
            lsn += 1
        self._seg_first, self._seg_size, self._last_index_off = seg_first, seg_size, last_idx
        self._assigned = lsn
        if envs:
            self._pending.append(_Submission(ops, lsn))
        return envs, lsn

    def _start_segment(self, lsn: int, *, rotating: bool, ops: list) -> list:
        """Stage a new segment starting at ``lsn``; returns the run its frames go to."""
        self._segments.append(lsn)
        self._index[lsn] = [(lsn, SEG_HDR_SIZE)]
        # A rotation checkpoints the state at the new segment's start, so a
        # crash never makes the next open rescan sealed segments. The writer's
        # first segment needs none: open left a valid checkpoint.
        ckpt = None
        if rotating:
            ckpt = Checkpoint(
                epoch=self._epoch,
                lsn=lsn,
                segment=lsn,
                offset=SEG_HDR_SIZE,
                segments=list(self._segments),
                open_sessions=dict(self._next_seq),
                # Sealed segments' lists never change again; the new one gets its own copy.
                index={k: (v if k != lsn else [(lsn, SEG_HDR_SIZE)]) for k, v in self._index.items()},
            )
        ops.append(_NewSegment(lsn, ckpt, self._spares.popleft() if self._spares else None))
        run: list = []
        ops.append(run)
        return run

    def _segments_needed(self, frame_sizes: Iterable[int]) -> tuple[int, int]:
        """The segment accounting of ``_submit``'s staging loop, run ahead so
        that the files of new segments are opened before any state changes:
        (segments a batch of these frames starts, bytes in the last one after it)."""
        limit = self._segment_bytes
        started, size, rotations = self._seg_first is not None, self._seg_size, 0
        for frame in frame_sizes:
            if not started or (size > SEG_HDR_SIZE and size + frame > limit):
                rotations += 1
                started, size = True, SEG_HDR_SIZE
            size += frame
        return rotations, size

    def _open_spare(self) -> None:
        """Under _cv: open one more spare segment file."""
        self._spare_count += 1
        tmp = f"{_SPARE_PREFIX}{self._spare_count}.tmp"
        fd = os.open(self._dir / tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._spares.append(_Spare(fd, tmp))

    def _reserve_spares(self, needed: int, end_size: int) -> None:
        """Under _cv, before a batch changes any state: make sure the files of
        the ``needed`` segments it starts are open. Out of descriptors
        (EMFILE/ENFILE) the batch is refused with LogError and the log stays
        healthy: the caller may retry once descriptors are freed. One more is
        opened ahead of need once the segment is filling, best effort."""
        while len(self._spares) < needed:
            try:
                self._open_spare()
            except OSError as exc:
                raise LogError(
                    f"log {self._dir}: append refused, nothing was written: cannot open a file for a new "
                    f"segment ({errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror or exc})"
                    + ("; free file descriptors and retry, the log is healthy" if exc.errno in _OUT_OF_FDS else "")
                ) from exc
        if len(self._spares) == needed and end_size >= _SPARE_AHEAD_FILL * self._segment_bytes:
            try:
                self._open_spare()
            except OSError as exc:  # only ahead of need: the batch that needs it reserves it or is refused
                self._log.warning("log.segment.spare_unavailable", error=repr(exc))

    def _discard_spares(self, spares: Iterable[_Spare]) -> None:
        """Close and remove spare segment files that will not be used."""
        for spare in list(spares):
            os.close(spare.fd)
            try:
                os.unlink(self._dir / spare.tmp)
            except FileNotFoundError:
                pass
        if isinstance(spares, collections.deque):
            spares.clear()

    def _unused_spares(self, subs: Iterable[_Submission]) -> list[_Spare]:
        """Spares staged in ``subs`` for segments not started yet."""
        cur = -1 if self._cur_seg is None else self._cur_seg
        return [
            op.spare
            for sub in subs
            for op in sub.ops
            if type(op) is _NewSegment and op.spare is not None and op.first_lsn > cur
        ]

    def append_batch(self, records: Iterable[PendingRecord | tuple]) -> list[Envelope]:
        """Append records atomically in order; returns their envelopes once
        durable. Raises SequenceError / EventValidationError / LogError for bad
        input (nothing is appended) and LogClosed when the writer is closed or fatal."""
        with self._cv:
            envs, end = self._submit(records)
        if envs:
            self._commit(end)
        return envs

    async def append(self, session_id: str, session_seq: int, body: Any) -> Envelope:
        """Append one record; concurrent calls are group-committed by the
        writer thread, so the event loop never waits on disk."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            envs, end = self._submit([PendingRecord(session_id, session_seq, body)])
            self._waiters.append((end, fut, envs[0], loop))
            if self._thread_idle:
                # Wake the writer only when it sleeps; a busy writer picks this
                # up when its flush ends, with everything else that piled up.
                self._thread_idle = False
                self._cv.notify_all()
        return await fut

    # ------------------------------------------------------------ group commit

    def _take(self) -> list[_Submission]:
        if self._policy == "always":
            return [self._pending.popleft()]
        subs = list(self._pending)
        self._pending.clear()
        return subs

    def _commit(self, end: int) -> None:
        """Make every record below ``end`` acknowledged: flush ourselves when no
        one else is flushing (leader), else wait for the flusher (follower)."""
        cv = self._cv
        with cv:
            while self._acked < end:
                if self._fatal is not None or (self._closed and not self._pending):
                    raise self._dead()
                if self._flushing or not self._pending:
                    cv.wait()
                    continue
                subs = self._take()
                self._flushing = True
                cv.release()
                failure: BaseException | None = None
                try:
                    self._flush(subs)
                except BaseException as exc:  # noqa: BLE001 - every failure is fatal, then re-raised
                    failure = exc
                finally:
                    cv.acquire()
                    self._flushing = False
                if failure is not None:
                    self._go_fatal(failure)
                    self._discard_spares(self._unused_spares(subs))
                    cv.notify_all()
                    raise self._dead() from failure
                self._acked = subs[-1].end
                self._resolve_waiters()
                cv.notify_all()

    def _write_all(self, pieces: list) -> None:
        """writev every piece, in order, completing short writes (a short write
        is not an error; an OSError is, and the caller makes it fatal)."""
        fd = self._seg_fd
        writev = self._os.writev
        i = 0
        while i < len(pieces):
            group = pieces[i : i + _IOV_MAX]
            n = writev(fd, group)
            if n <= 0:
                raise OSError(errno.EIO, f"writev returned {n} with {sum(len(p) for p in group)} bytes left")
            for piece in group:
                if n >= len(piece):
                    n -= len(piece)
                    i += 1
                else:
                    pieces[i] = memoryview(piece)[n:]
                    break

    def _flush(self, subs: list[_Submission]) -> None:
        """Write (and sync per policy) staged submissions. Runs without _cv held."""
        buf: list = []
        for sub in subs:
            for op in sub.ops:
                if type(op) is list:
                    buf += op
                else:
                    if buf:
                        self._write_all(buf)
                        buf = []
                    self._roll(op)
        if buf:
            self._write_all(buf)
        end = subs[-1].end
        policy = self._policy
        if policy == "never":
            self._publish(end, synced=False)
        elif policy == "interval" and time.monotonic() - self._last_sync < self._interval_s:
            self._unsynced = True
        else:
            self._os.fdatasync(self._seg_fd)
            self._last_sync = time.monotonic()
            self._unsynced = False
            self._publish(end)

    def _roll(self, op: _NewSegment) -> None:
        """Seal the current segment and start the one named by ``op.first_lsn``."""
        if self._seg_fd is not None:
            self._os.fdatasync(self._seg_fd)
            os.close(self._seg_fd)
            self._seg_fd = None
        name = segment_name(op.first_lsn)
        # The header becomes durable with the batch's fdatasync; the directory
        # entry needs its own fsync before anything in the file is acknowledged.
        # The file was opened ahead of need (no new descriptor now): it gets
        # its header, then its name (link, never overwriting a segment).
        if op.spare is None:  # not reserved: only if the accounting above were wrong
            self._seg_fd = os.open(self._dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._cur_seg = op.first_lsn
            self._write_all([pack_segment_header(self._epoch, op.first_lsn)])
        else:
            self._seg_fd = op.spare.fd
            self._cur_seg = op.first_lsn
            self._write_all([pack_segment_header(self._epoch, op.first_lsn)])
            os.link(self._dir / op.spare.tmp, self._dir / name)
            os.unlink(self._dir / op.spare.tmp)
        os.fsync(self._lock.dir_fd)
        if op.checkpoint is not None:
            try:
                self._write_checkpoint(op.checkpoint)
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    raise
                # Only an optimisation: the previous INDEX stays valid (recovery
                # scans on from it), so a lack of descriptors must not kill the log.
                self._log.warning("log.checkpoint.skipped", segment=name, error=repr(exc))
        self._log.debug("log.segment.created", segment=name, epoch=self._epoch)

    def _go_fatal(self, exc: BaseException) -> None:
        """Under _cv: refuse everything from now on; fail every waiter."""
        if self._fatal is None:
            self._fatal = exc
            seg = segment_name(self._cur_seg) if self._cur_seg is not None else "-"
            what = "an I/O error" if isinstance(exc, OSError) else "an unexpected error in the writer"
            self._fatal_msg = (
                f"log {self._dir}: writer is fatal after {what} in segment {seg} "
                f"({type(exc).__name__}: {exc}); records from lsn {self._acked} on were not acknowledged; "
                f"reopen the log to recover"
            )
            self._log.error("log.writer.fatal", error=repr(exc), segment=seg, acked_lsn=self._acked)
        self._discard_spares(self._unused_spares(self._pending))
        self._pending.clear()
        err = self._dead()
        by_loop: dict[Any, list] = {}
        while self._waiters:
            _end, fut, _env, loop = self._waiters.popleft()
            by_loop.setdefault(loop, []).append((fut, None))
        for loop, items in by_loop.items():
            _call_in_loop(loop, _fail_futures, items, err)

    def _resolve_waiters(self) -> None:
        """Under _cv: acknowledge every async appender whose record is now durable."""
        acked = self._acked
        by_loop: dict[Any, list] = {}
        w = self._waiters
        while w and w[0][0] <= acked:
            _end, fut, env, loop = w.popleft()
            by_loop.setdefault(loop, []).append((fut, env))
        for loop, items in by_loop.items():
            _call_in_loop(loop, _set_futures, items)

    def _writer_loop(self) -> None:
        """The writer thread: group-commits async appends; syncs under ``interval``.
        It never dies silently: anything unexpected makes the log fatal (every
        waiter fails, ``fatal_reason`` says why) and is logged at critical."""
        try:
            self._writer_steps()
        except BaseException as exc:  # noqa: BLE001 - recorded as the log's fatal reason, never swallowed
            with self._cv:
                self._go_fatal(exc)
                self._cv.notify_all()
            self._log.critical("log.writer.crashed", error=repr(exc), reason=self._fatal_msg, exc_info=exc)

    def _writer_steps(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while True:
                    if self._fatal is not None or self._closed:
                        return
                    if self._pending and not self._flushing:
                        break
                    timeout = None
                    if self._unsynced and not self._flushing:
                        timeout = self._last_sync + self._interval_s - time.monotonic()
                        if timeout <= 0:
                            break
                    self._thread_idle = True
                    cv.wait(timeout)
                    self._thread_idle = False
                end = self._assigned
                sync_only = not self._pending
                if sync_only:
                    self._flushing = True
            if sync_only:
                failure = None
                try:
                    self._os.fdatasync(self._seg_fd)
                    self._last_sync = time.monotonic()
                    self._unsynced = False
                    self._publish(self._acked)
                except BaseException as exc:  # noqa: BLE001 - fatal, reported to every appender
                    failure = exc
                with cv:
                    self._flushing = False
                    if failure is not None:
                        self._go_fatal(failure)
                    cv.notify_all()
                continue
            try:
                self._commit(end)
            except LogClosed:
                return  # fatal: already recorded and reported to every waiter

    # ------------------------------------------------------------ reading

    def _index_of(self, first: int) -> list[tuple[int, int]] | None:
        with self._cv:
            entries = self._index.get(first)
            return list(entries) if entries else None

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Envelope]:
        """Acknowledged records with lsn >= from_lsn, in order. Seeks with the
        sparse index. ``raw=True`` yields RawRecords (payload undecoded)."""
        cur = _Cursor(self._dir, from_lsn, self._cap, self._index_of, raw)
        try:
            yield from cur.records(self._acked)
        finally:
            cur.close()

    async def follow(self, from_lsn: int = 0, *, poll_s: float = 0.05) -> AsyncIterator[Envelope]:
        """Tail this log from ``from_lsn``: yields acknowledged records forever."""
        cur = _Cursor(self._dir, from_lsn, self._cap, self._index_of, False)
        try:
            while True:
                n = 0
                for env in cur.records(self._acked):
                    yield env
                    n += 1
                    if n % 1024 == 0:
                        await asyncio.sleep(0)  # a long backlog must not starve the loop
                if n == 0:
                    if self._closed:
                        return
                    await asyncio.sleep(poll_s)
        finally:
            cur.close()

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Flush and sync everything staged, write the checkpoint, release the
        lock. Idempotent. Raises LogClosed if the final flush fails."""
        if getattr(self, "_closed", True):
            return
        failure: BaseException | None = None
        with self._cv:
            self._closing = True  # refuse new appends; flush what is staged
        try:
            if self._fatal is None:
                try:
                    self._commit(self._assigned)
                    with self._cv:
                        while self._flushing:
                            self._cv.wait()
                        self._flushing = True  # keep the writer thread off the fd
                    if self._seg_fd is not None:
                        self._os.fdatasync(self._seg_fd)
                    self._publish(self._acked)
                    self._write_checkpoint(self._snapshot_at_end())
                except BaseException as exc:  # noqa: BLE001 - re-raised below after releasing the lock
                    failure = exc
                    with self._cv:
                        self._go_fatal(exc)
        finally:
            with self._cv:
                self._closing = True
                self._closed = True
                self._cv.notify_all()
            self._thread.join()
            self._release_fds()
            self._log.info("log.closed", next_lsn=self._assigned, fatal=self._fatal is not None)
        if failure is not None:
            if isinstance(failure, LogClosed):
                raise failure
            raise self._dead() from failure

    def __del__(self) -> None:  # a forgotten close must not leave the lock held forever
        if not getattr(self, "_closed", True) and getattr(self, "_lock", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - never raise from a finalizer; the writer logged it
                pass


_OPEN_TOKEN = object()


def _set_futures(items: list) -> None:
    for fut, env in items:
        if not fut.done():
            fut.set_result(env)


def _fail_futures(items: list, err: BaseException) -> None:
    for fut, _ in items:
        if not fut.done():
            fut.set_exception(err)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        # The appender's event loop is gone, so nobody awaits these futures.
        log.warning("log.appender_loop_closed", records=len(args[0]))


class _WriterLock(NamedTuple):
    """The writer's hold on a log directory: flocks on the directory itself and on its LOCK file."""

    dir_fd: int
    file_fd: int


def _acquire_lock(directory: Path) -> _WriterLock:
    """Become the one writer of ``directory`` or raise LogLocked naming the holder.

    The lock is an flock on the directory itself, which nobody can delete or
    swap out from under a live writer (a LOCK file can be deleted and
    re-created, and a lock on the new file would let a second writer in). The
    LOCK file is still locked too (writers of earlier versions lock only it)
    and holds the writer's pid for humans and for the error message."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    file_fd = -1
    try:
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            file_fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(file_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LogLocked(
                f"log {directory}: another writer holds it ({_lock_holder(directory, dir_fd)}); "
                f"one writer per log directory — readers use read_log/follow_log, which need no lock"
            ) from None
        os.ftruncate(file_fd, 0)
        os.pwrite(file_fd, str(os.getpid()).encode(), 0)
    except BaseException:
        if file_fd >= 0:
            os.close(file_fd)
        os.close(dir_fd)
        raise
    return _WriterLock(dir_fd, file_fd)


def _release_lock(lock: _WriterLock) -> None:
    for fd in (lock.file_fd, lock.dir_fd):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _lock_holder(directory: Path, dir_fd: int) -> str:
    """Who holds the writer lock: the pid in LOCK, else the flock's owner per
    /proc/locks (the LOCK file may have been removed under the writer)."""
    try:
        with open(directory / LOCK_NAME, "rb") as f:
            pid = f.read(64).decode("ascii", "replace").strip()
        if pid:
            return f"pid {pid}, per {directory / LOCK_NAME}"
    except FileNotFoundError:
        pass
    st = os.fstat(dir_fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
                    return f"pid {fields[4]}, per /proc/locks; its {LOCK_NAME} file is missing"
    except OSError:
        pass
    return f"holder unknown: no pid in {directory / LOCK_NAME}"


# ---------------------------------------------------------------- readers


def _existing_log_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path; raises FileNotFoundError / NotALog unless it is a log directory."""
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such log directory")
    if not is_log_dir(directory):
        raise NotALog(f"{directory}: not an agentlog log directory (no segment files, no {DURABLE_NAME})")
    return directory


def _load_index_hint(directory: Path) -> Callable[[int], list[tuple[int, int]] | None]:
    ckpt, _ = load_checkpoint(directory)
    idx = ckpt.index if ckpt is not None else {}
    return lambda first: idx.get(first)


def read_log(
    path: str | os.PathLike,
    from_lsn: int = 0,
    *,
    durable_only: bool = True,
    raw: bool = False,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[Envelope]:
    """Records of the log at ``path`` from ``from_lsn`` on, without taking the
    writer's lock (safe beside a live writer in another process).

    With ``durable_only`` (default) it stops at the DURABLE watermark; when
    no watermark file exists (a copied log) it reads every valid frame. A torn
    tail ends the iteration; corruption raises LogCorruption.
    """
    directory = _existing_log_dir(path)
    durable = read_watermark(directory) if durable_only else None
    limit = durable.lsn if durable else None
    cur = _Cursor(directory, from_lsn, max_record_bytes, _load_index_hint(directory), raw)
    cur.unsynced_limit = durable is not None and not durable.synced
    try:
        yield from cur.records(limit)
    finally:
        cur.close()


async def follow_log(
    path: str | os.PathLike,
    from_lsn: int = 0,
    *,
    poll_s: float = 0.05,
    raw: bool = False,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> AsyncIterator[Envelope]:
    """Tail the log at ``path`` (written by any process) forever, across
    segment rotation and writer restarts. Yields only records below the
    DURABLE watermark, so never a record that a crash could take back."""
    directory = Path(path)
    cur = _Cursor(directory, from_lsn, max_record_bytes, None, raw)
    try:
        while True:
            durable = read_watermark(directory)
            limit = durable.lsn if durable else 0
            cur.unsynced_limit = durable is not None and not durable.synced
            n = 0
            if limit > cur.next_lsn:
                for env in cur.records(limit):
                    yield env
                    n += 1
                    if n % 1024 == 0:
                        await asyncio.sleep(0)  # a long backlog must not starve the loop
            if n == 0:
                await asyncio.sleep(poll_s)
    finally:
        cur.close()


# ---------------------------------------------------------------- verify


class VerifyReport(msgspec.Struct):
    """What :func:`verify_log` found. ``status``: ok, torn, corrupt, repaired,
    or schema (sound frames, but records of known types this version cannot
    decode: a newer writer's; upgrade)."""

    path: str
    status: str
    segments: int = 0
    records: int = 0
    next_lsn: int = 0
    bytes: int = 0
    open_sessions: int = 0
    problem: str = ""
    segment: str = ""
    offset: int = -1
    last_good_lsn: int = -1
    torn_bytes: int = 0
    #: Records whose tag this version does not know (a newer writer's), by tag.
    unknown_types: dict[str, int] = {}
    #: Records of known types whose fields do not decode here, and the first one's message.
    schema_errors: int = 0
    schema_problem: str = ""

    @property
    def ok(self) -> bool:
        """True when the log is sound (or was repaired to soundness)."""
        return self.status in ("ok", "repaired")

    def summary(self) -> str:
        """One line for humans."""
        body = f"{self.records} records (lsn 0..{self.next_lsn - 1}) in {self.segments} segments, {self.bytes} bytes, {self.open_sessions} open sessions"
        if self.unknown_types:
            n = sum(self.unknown_types.values())
            body += f"; note: {n} records of unknown types (newer writer): tags {', '.join(sorted(self.unknown_types))}"
        if self.status == "ok":
            return f"{self.path}: ok, {body}"
        if self.status == "schema":
            return (
                f"{self.path}: SCHEMA MISMATCH: {self.schema_errors} records this version cannot decode "
                f"(upgrade agentlog); first: {self.schema_problem}; {body}"
            )
        if self.status == "repaired":
            return f"{self.path}: repaired, truncated a torn tail of {self.torn_bytes} bytes at segment {self.segment} offset {self.offset}; {body}"
        if self.status == "torn":
            return (
                f"{self.path}: torn tail at segment {self.segment} offset {self.offset} ({self.torn_bytes} bytes) "
                f"after lsn {self.last_good_lsn}: {self.problem}; run with --repair to truncate it"
            )
        return f"{self.path}: CORRUPT: {self.problem}"


def verify_log(path: str | os.PathLike, repair: bool = False, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> VerifyReport:
    """Check every segment header, frame CRC, LSN and payload of the log at
    ``path`` (the frame check; each session's sequence and lifecycle are
    checked by ``reducers.lifecycle.LifecycleCheck``, which ``agentlog
    verify`` runs next). ``repair=True`` truncates a torn tail
    (taking the writer lock); it never touches mid-log corruption.
    Raises FileNotFoundError / NotALog for a path that is not a log."""
    directory = _existing_log_dir(path)
    rep = _scan(directory, max_record_bytes)
    if rep.status == "torn" and repair:
        # Cut only from a scan taken under the writer lock: since the unlocked
        # scan a writer may have opened (recovering the tail itself), appended
        # and acknowledged records, which a cut at the stale position destroys.
        lock = _acquire_lock(directory)
        try:
            rep = _scan(directory, max_record_bytes)
            if rep.status == "torn":
                _repair_tail(directory, rep)
        finally:
            _release_lock(lock)
    return rep


def _scan(directory: Path, max_record_bytes: int) -> VerifyReport:
    """The checks of :func:`verify_log`, changing nothing."""
    from tqdm import tqdm

    watermark = _proof(read_watermark(directory))
    segs = list_segments(directory)
    rep = VerifyReport(path=str(directory), status="ok", segments=len(segs))
    expected = segs[0] if segs else 0
    live: set[str] = set()
    total = sum((directory / segment_name(s)).stat().st_size for s in segs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=None, leave=False)

    def corrupt(msg: str, name: str, offset: int) -> VerifyReport:
        rep.status, rep.problem, rep.segment, rep.offset, rep.last_good_lsn = "corrupt", msg, name, offset, expected - 1
        return rep

    try:
        for i, first in enumerate(segs):
            name = segment_name(first)
            last = i == len(segs) - 1
            if first != expected:
                return corrupt(f"segment {name}: starts at lsn {first}, expected {expected}", name, 0)
            try:
                fd, _epoch, size = _open_segment(directory, first)
            except LogCorruption as exc:
                size = (directory / name).stat().st_size
                raw = _head(directory / name)
                if last and _torn_new_segment(size, raw, first, watermark):
                    rep.status, rep.problem, rep.segment, rep.offset = "torn", f"segment header torn ({size} bytes)", name, 0
                    rep.last_good_lsn, rep.torn_bytes = expected - 1, size
                    break
                return corrupt(str(exc), name, 0)
            try:
                sc = SegmentScanner(fd, name, SEG_HDR_SIZE, expected, max_record_bytes)
                for fr in sc.frames(size=size):
                    try:
                        body = decode_body(fr.payload)
                    except msgspec.DecodeError as exc:  # ValidationError included
                        err = _payload_error(name, fr, exc)
                        if not isinstance(err, SchemaError):
                            return corrupt(str(err), name, fr.offset)
                        # Sound on disk, only newer than this reader: keep checking the rest.
                        rep.schema_errors += 1
                        rep.schema_problem = rep.schema_problem or str(err)
                    else:
                        if type(body) is UnknownEvent:
                            rep.unknown_types[body.tag] = rep.unknown_types.get(body.tag, 0) + 1
                    # Sequence and lifecycle are the reducers' one check (agentlog verify runs it
                    # after this frame check); here only which sessions are still open.
                    if fr.flags & FLAG_TERMINAL:
                        live.discard(fr.session_id)
                    else:
                        live.add(fr.session_id)
                    rep.records += 1
                expected = sc.expected
                bar.update(size)
                if sc.bad is not None:
                    err = _classify_bad(fd, name, size, sc.bad, expected, watermark, not last, max_record_bytes)
                    if err is not None:
                        return corrupt(str(err), name, sc.bad.offset)
                    rep.status, rep.problem, rep.segment, rep.offset = "torn", sc.bad.reason, name, sc.bad.offset
                    rep.last_good_lsn, rep.torn_bytes = expected - 1, size - sc.bad.offset
                    rep.bytes += sc.bad.offset
                else:
                    rep.bytes += size
            finally:
                os.close(fd)
        if rep.status == "ok" and watermark is not None and expected < watermark:
            if not segs:
                return corrupt(
                    f"no segment files exist, but the durable watermark says lsn {expected}..{watermark - 1} "
                    f"were acknowledged; they are missing",
                    "",
                    0,
                )
            name = segment_name(segs[-1])
            size = (directory / name).stat().st_size
            return corrupt(str(_missing_acked(name, size, expected, watermark)), name, size)
        if rep.status == "ok" and rep.schema_errors:
            rep.status = "schema"
    finally:
        bar.close()
        rep.next_lsn = expected
        rep.open_sessions = len(live)
    return rep


def _repair_tail(directory: Path, rep: VerifyReport) -> None:
    """Cut the torn tail ``rep`` found; the caller holds the writer lock."""
    path = directory / rep.segment
    if rep.offset <= SEG_HDR_SIZE:
        os.unlink(path)
        rep.segments -= 1
    else:
        fd = os.open(path, os.O_RDWR)
        try:
            os.ftruncate(fd, rep.offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)
    # Reported through the returned VerifyReport (the CLI prints it as its one line).
    rep.status = "repaired"
