"""The file-backed event log's writer: :class:`FileLog`, one writer per log
directory, with group commit.

Its neighbours, one concept each: the on-disk format in
:mod:`agentlog.events.log_format`, the scanner in :mod:`~agentlog.events.log_scan`,
crash recovery in :mod:`~agentlog.events.log_recovery`, readers and followers
in :mod:`~agentlog.events.log_read`, verification in
:mod:`~agentlog.events.log_verify`, the writer lock in
:mod:`~agentlog.events.log_lock`. The format in short: a
directory of segment files named by their first LSN; CRC32C-framed records;
a ``DURABLE`` watermark that readers in other processes trust; an ``INDEX``
checkpoint (sequence state of open sessions + sparse offset index) so that
opening a log does not rescan it, rewritten every ``checkpoint_bytes`` of a
segment (once the records it describes are synced) so that recovery after a
crash rescans at most about that much; and the one writer's flock on the directory
itself (and on its ``LOCK`` file, which names its pid).

Durability and visibility (the follower contract):

* A record is acknowledged (``append``/``append_batch`` return) only after
  its batch is durable under the fsync policy: ``always`` (each append call
  is written and fdatasync'd on its own), ``batch`` (default: concurrent
  appends are coalesced into one write + fdatasync), ``interval`` (written at
  once, fdatasync at most every ``interval_s``; a machine crash can lose that
  window) or ``never`` (written, the OS decides when it reaches disk;
  segment seals, periodic checkpoints and close still sync).
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
Reopening recovers (:mod:`~agentlog.events.log_recovery`): it keeps the
longest valid prefix and truncates a torn tail. A damaged frame followed by
valid ones, or one below the durable watermark, is corruption:
:class:`LogCorruption` names segment, offset and last good LSN, unless
``salvage=True`` moves the damaged rest aside.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, NamedTuple

from agentlog._logging import get_logger

from . import framecodec
from .fs import fsync_dir, write_atomic
from .log_api import EventLog, LogClosed, LogCorruption, LogError, LogFenced, NotALog, PendingRecord
from .log_format import (
    CHECKPOINT_EVERY_BYTES,
    DEFAULT_MAX_RECORD_BYTES,
    DURABLE_NAME,
    ENV_HDR,
    FENCE_NAME,
    FRAME_CRC,
    FRAME_OVERHEAD,
    HEAD,
    INDEX_EVERY_BYTES,
    INDEX_NAME,
    LOCK_NAME,
    SEG_HDR_SIZE,
    TYPE_RECORD,
    Checkpoint,
    is_log_dir,
    pack_checkpoint,
    pack_durable,
    pack_fence,
    pack_segment_header,
    read_durable,
    read_fence,
    segment_name,
)
from .log_format import MASK_DELTA as _MASK_DELTA
from .log_format import crc_extend as _crc_extend
from .log_format import crc_value as _crc_value
from .log_lock import WriterLock, acquire_lock, release_lock
from .log_read import Cursor
from .log_recovery import fence_without_log, recover
from .types import TERMINAL_EVENT_TYPES, Envelope

log = get_logger("agentlog.events.log_writer")

FSYNC_POLICIES = ("always", "batch", "interval", "never")
_TERMINAL_SET = frozenset(TERMINAL_EVENT_TYPES)
_IOV_MAX = 1024
#: Payloads from this size on are written as their own iovec (never copied in Python).
_BIG_PAYLOAD = 4096
#: Periodic checkpoints are at least this many times the INDEX's size apart
#: (at most ~1/8 more bytes written), whatever ``checkpoint_bytes`` says.
_CKPT_SPACING = 8


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
    #: A periodic checkpoint of the state at ``end``, written once the data is synced.
    checkpoint: Checkpoint | None = None


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
        checkpoint_bytes: int = CHECKPOINT_EVERY_BYTES,
        fence: bool = True,
        _flock: bool = True,
    ) -> "FileLog":
        """Open (creating if needed) the log directory at ``path`` as its one
        writer, recovering from any crash. See the module docstring for the
        fsync policies. ``checkpoint_bytes``: rewrite the INDEX checkpoint each
        time the active segment has grown by this much (bounds what recovery
        after a crash rescans; under fsync="never" that flush syncs first). ``os_ops`` replaces
        the OS calls the writer uses for data (fault injection in tests).

        Every open takes a new writer epoch and records it in the ``FENCE``
        file before recovery; ``fence=True`` (default) makes the writer re-read
        FENCE before each batch it writes and before it acknowledges one, and
        go fatal with :class:`LogFenced` once a newer epoch has opened the log
        (see :meth:`_check_fence` for what this guards and its race window).
        ``fence=False`` skips those reads (a log on a local disk, where the
        flock already excludes a second writer); FENCE is still written.

        ``_flock=False`` is a test seam, not an option: it skips the flock to
        simulate a second writer on another node of a shared filesystem,
        where this node's flock does not exclude it. It is private because
        two live writers of one directory are never a supported setup: the
        fence stops a stale incarnation, with a race window, and does not
        make concurrent writers safe."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync: expected one of {'/'.join(FSYNC_POLICIES)}, found {fsync!r}")
        if segment_bytes < SEG_HDR_SIZE + 64:
            raise ValueError(f"segment_bytes: expected at least {SEG_HDR_SIZE + 64}, found {segment_bytes}")
        if max_record_bytes < 64:
            raise ValueError(f"max_record_bytes: expected at least 64, found {max_record_bytes}")
        if checkpoint_bytes < 1:
            raise ValueError(f"checkpoint_bytes: expected at least 1, found {checkpoint_bytes}")
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise NotALog(f"{directory}: is a file, expected a log directory")
        directory.mkdir(parents=True, exist_ok=True)
        if not is_log_dir(directory):
            strangers = sorted(n for n in os.listdir(directory) if n not in (LOCK_NAME, INDEX_NAME, FENCE_NAME) and not n.startswith("."))
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
        self._ckpt_bytes = self._ckpt_every = checkpoint_bytes
        self._os = os_ops or OsOps()
        self._fence_check = fence
        self._log = log.bind(log_dir=str(directory))
        _raise_nofile_limit()
        self._lock: WriterLock | None = acquire_lock(directory, flock=_flock)
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
        # Flusher-side (whoever holds _flushing): a periodic checkpoint whose
        # records are written but not yet synced (fsync="interval").
        self._ckpt_unsynced: Checkpoint | None = None
        # Submission-side state (under _cv).
        self._assigned = 0  # next LSN to hand out
        self._acked = 0  # records below this are acknowledged
        self._seg_first: int | None = None  # segment the next frame goes to; None: start one
        self._seg_size = 0
        self._last_index_off = 0
        self._ckpt_off = 0  # offset in the active segment of the last checkpoint taken
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
            release_lock(lock)
            self._lock = None

    # ------------------------------------------------------------ recovery

    def _recover(self, salvage: bool) -> None:
        """Recover the directory (see :mod:`agentlog.events.log_recovery`) and
        take over its state; publish the watermark and a fresh checkpoint."""
        d = self._dir
        # Fence first: a stale writer (on another node, whose flock this one
        # does not see) stops at its next batch, before this recovery reads
        # the tail it may still be writing. A fence-aware writer recorded its
        # epoch in FENCE; DURABLE covers logs written before fences existed.
        durable = read_durable(d)
        fenced = read_fence(d)
        lost = fence_without_log(d, fenced)
        if lost is not None:
            raise lost
        # DURABLE exists before FENCE names an epoch (so a FENCE of a later
        # epoch without DURABLE means records were removed: fence_without_log).
        created = not (d / DURABLE_NAME).exists()
        self._durable_fd = os.open(d / DURABLE_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        if created:
            fsync_dir(d)
        self._epoch = max(fenced, durable[1] if durable else 0) + 1
        write_atomic(d, FENCE_NAME, pack_fence(self._epoch))
        state = recover(d, max_record_bytes=self._cap, salvage=salvage)
        expected = state.next_lsn
        if state.epoch >= self._epoch:  # a segment or INDEX of a later epoch (DURABLE was lost)
            self._epoch = state.epoch + 1
            write_atomic(d, FENCE_NAME, pack_fence(self._epoch))
        st = os.stat(d / FENCE_NAME)
        self._fence_stat = (st.st_ino, st.st_size, st.st_mtime_ns)
        self._rescanned = state.rescanned_bytes
        self._segments = state.segments
        self._index = state.index
        self._next_seq = state.open_sessions
        self._assigned = self._acked = expected
        self._seg_first = None
        self._publish(expected)
        if state.stale_checkpoint:
            self._write_checkpoint(self._snapshot_at_end())
        self._log.info(
            "log.opened",
            epoch=self._epoch,
            next_lsn=expected,
            segments=len(state.segments),
            open_sessions=len(state.open_sessions),
            index="rebuilt" if state.rebuilt else "checkpoint",
            rescanned_bytes=state.rescanned_bytes,
            policy=self._policy,
        )

    # ------------------------------------------------------------ state helpers

    def _snapshot_at_end(self) -> Checkpoint:
        """Checkpoint of the state right after the last assigned record."""
        if self._segments:
            seg = self._segments[-1]
            off = self._seg_size if self._seg_first == seg else (self._dir / segment_name(seg)).stat().st_size
        else:
            seg, off = self._assigned, SEG_HDR_SIZE
        return self._snapshot(self._assigned, seg, off)

    def _snapshot(self, lsn: int, segment: int, offset: int) -> Checkpoint:
        """Under _cv (or before the writer starts): checkpoint of the state
        as of record ``lsn`` at ``offset`` in ``segment``, the last segment.
        O(open sessions + segments): only ``segment``'s index list is copied,
        as sealed segments' lists never change again and are shared."""
        return Checkpoint(
            epoch=self._epoch,
            lsn=lsn,
            segment=segment,
            offset=offset,
            segments=list(self._segments),
            open_sessions=dict(self._next_seq),
            index={k: (v if k != segment else list(v)) for k, v in self._index.items()},
        )

    def _write_checkpoint(self, ckpt: Checkpoint, *, durable: bool = True) -> None:
        if not ckpt.segments:
            # Nothing to index; an old INDEX would be stale.
            try:
                os.unlink(self._dir / INDEX_NAME)
            except FileNotFoundError:
                pass
            return
        data = pack_checkpoint(ckpt)
        write_atomic(self._dir, INDEX_NAME, data, durable=durable)
        # The INDEX holds the whole sparse index, so it grows with the log:
        # space periodic checkpoints so that rewriting it stays a small
        # fraction of the bytes appended (read by _submit; an int, no lock).
        self._ckpt_every = max(self._ckpt_bytes, _CKPT_SPACING * len(data))

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
    def max_record_bytes(self) -> int:
        """The largest record this log accepts (bytes, envelope included)."""
        return self._cap

    @property
    def rescanned_bytes(self) -> int:
        """Bytes of segment files this open's recovery scanned past the INDEX
        checkpoint (all of them when it rebuilt the index)."""
        return self._rescanned

    @property
    def fatal_reason(self) -> str | None:
        return self._fatal_msg if self._fatal is not None else None

    def _dead(self) -> LogClosed:
        if self._fatal is not None:
            fenced = self._fatal
            if isinstance(fenced, LogFenced):
                exc: LogClosed = LogFenced(self._fatal_msg, epoch=fenced.epoch, newer_epoch=fenced.newer_epoch)
            else:
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
        # Frames of more than this many bytes hold a record over max_record_bytes.
        too_big = self._cap + FRAME_OVERHEAD - ENV_HDR.size
        sids: list[bytes] = []
        sizes: list[int] = []
        for rec in checked:
            sidb = rec.session_id.encode()
            n = FRAME_OVERHEAD + len(sidb) + len(rec.payload)
            if n > too_big:
                raise LogError(
                    f"session {rec.session_id!r} seq {rec.session_seq}: record of {n - FRAME_OVERHEAD + ENV_HDR.size} "
                    f"bytes exceeds max_record_bytes {self._cap}"
                )
            sids.append(sidb)
            sizes.append(n)
        self._reserve_spares(*self._segments_needed(sizes))
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
        codec = framecodec.native
        encode = codec.encode_frame if codec is not None else None
        for rec, sidb, n in zip(checked, sids, sizes):
            sid, seq, body, payload = rec
            plen = len(payload)
            terminal = type(body) in terminal_types
            if encode is not None:
                # Compiled: the whole frame in one buffer, or (a big payload)
                # only its prefix, whose CRC covers the payload where it lies.
                frame = encode(lsn, seq, ts, terminal, sidb, payload, plen >= _BIG_PAYLOAD)
            else:
                head = head_pack(env_size + len(sidb) + plen, TYPE_RECORD, lsn, seq, ts, terminal, len(sidb)) + sidb
                c = crc_extend(crc_value(head), payload)  # C code over the bytes where they lie: no copy
                frame = crc_pack((((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF) + head
                if plen < _BIG_PAYLOAD:
                    frame += payload  # one small piece beats two iovecs
            if seg_first is None or (seg_size > SEG_HDR_SIZE and seg_size + n > seg_limit):
                run = self._start_segment(lsn, rotating=seg_first is not None, ops=ops)
                seg_first, seg_size, last_idx = lsn, SEG_HDR_SIZE, SEG_HDR_SIZE
            elif seg_size - last_idx >= INDEX_EVERY_BYTES:
                self._index[seg_first].append((lsn, seg_size))
                last_idx = seg_size
            run.append(frame)
            if plen >= _BIG_PAYLOAD:
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
            ckpt = None
            if seg_size - self._ckpt_off >= self._ckpt_every:
                # The state right after this submission, a consistent point of
                # the record stream; _flush writes it once these records are synced.
                ckpt = self._snapshot(lsn, seg_first, seg_size)
                self._ckpt_off = seg_size
            self._pending.append(_Submission(ops, lsn, ckpt))
        return envs, lsn

    def _start_segment(self, lsn: int, *, rotating: bool, ops: list) -> list:
        """Stage a new segment starting at ``lsn``; returns the run its frames go to."""
        self._segments.append(lsn)
        self._index[lsn] = [(lsn, SEG_HDR_SIZE)]
        self._ckpt_off = SEG_HDR_SIZE
        # A rotation checkpoints the state at the new segment's start, so a
        # crash never makes the next open rescan sealed segments. The writer's
        # first segment needs none: open left a valid checkpoint.
        ckpt = self._snapshot(lsn, lsn, SEG_HDR_SIZE) if rotating else None
        ops.append(_NewSegment(lsn, ckpt, self._spares.popleft() if self._spares else None))
        run: list = []
        ops.append(run)
        return run

    def _segments_needed(self, frame_sizes: list[int]) -> tuple[int, int]:
        """The segment accounting of ``_submit``'s staging loop, run ahead so
        that the files of new segments are opened before any state changes:
        (segments a batch of these frames starts, bytes in the last one after it)."""
        limit = self._segment_bytes
        started, size, rotations = self._seg_first is not None, self._seg_size, 0
        total = sum(frame_sizes)
        if started and size + total <= limit:
            return 0, size + total  # the common case: the batch fits the active segment
        for frame in frame_sizes:
            if not started or (size > SEG_HDR_SIZE and size + frame > limit):
                rotations += 1
                started, size = True, SEG_HDR_SIZE
            size += frame
        return rotations, size

    def _open_spare(self) -> None:
        """Under _cv: open one more spare segment file."""
        self._spare_count += 1
        # The epoch keeps a stale writer (see _check_fence) from truncating or
        # removing a newer writer's spare of the same number.
        tmp = f"{_SPARE_PREFIX}{self._epoch}-{self._spare_count}.tmp"
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
        """Write (and sync per policy) staged submissions. Runs without _cv held.
        The fence is checked before anything is written (a stale writer must
        not put bytes after a newer writer's recovery point) and again before
        the batch is acknowledged or published."""
        self._check_fence()
        buf: list = []
        ckpt = self._ckpt_unsynced
        for sub in subs:
            for op in sub.ops:
                if type(op) is list:
                    buf += op
                else:
                    if buf:
                        self._write_all(buf)
                        buf = []
                    self._roll(op)
                    ckpt = None  # the rotation's checkpoint is newer
            if sub.checkpoint is not None:
                ckpt = sub.checkpoint
        if buf:
            self._write_all(buf)
        end = subs[-1].end
        policy = self._policy
        if policy == "never" and ckpt is None:
            self._check_fence()
            self._publish(end, synced=False)
        elif policy == "interval" and time.monotonic() - self._last_sync < self._interval_s:
            self._check_fence()  # acknowledged once written, under "interval"
            self._unsynced = True
            self._ckpt_unsynced = ckpt  # written by the sync that makes its records durable
        else:
            # Under "never" only a flush carrying a checkpoint syncs (as a
            # segment seal does): an INDEX never describes unsynced records.
            self._sync(end, ckpt)

    def _sync(self, end: int, ckpt: Checkpoint | None) -> None:
        """fdatasync the active segment, publish ``end`` as durable, then
        write ``ckpt`` (whose records are now all synced), if any. The fence
        is checked after the sync (on NFS the data reaches the server there)
        and before anything is published or acknowledged."""
        self._os.fdatasync(self._seg_fd)
        self._last_sync = time.monotonic()
        self._unsynced = False
        self._check_fence()
        self._publish(end)
        if ckpt is not None:
            self._ckpt_unsynced = None
            # Not fsynced itself: a SIGKILL keeps it (the page cache survives);
            # a power loss may leave the previous INDEX or a torn one, which
            # recovery checks (CRC, position) and rebuilds. Two fsyncs per
            # checkpoint would cost the append path several % (measured).
            self._write_checkpoint_if_fds(ckpt, durable=False)

    def _check_fence(self) -> None:
        """Raise LogFenced when FENCE names a newer epoch than this writer's.

        One open + pread + close of a 20-byte file (opened afresh: FENCE is
        replaced by rename, and a fresh open is what makes an NFS client
        revalidate it). Called before each batch is written, after it is
        synced and before it is published or acknowledged, and before close
        publishes. So a stale writer never acknowledges a record after a
        newer writer has written FENCE, and never writes a batch it started
        after that.

        The race window (the classic fencing-token limit, without storage that
        enforces the token): a batch whose pre-write read came just before the
        newer writer wrote FENCE is still written. If its bytes reach the file
        before the newer writer's recovery reads that segment, recovery keeps
        them as it keeps any crashed writer's unacknowledged records (the
        stale caller got LogFenced: an outcome-unknown failure, as after an
        I/O error). If they land after it (on NFS, writes reach the server
        at the stale writer's next fdatasync), they sit past the recovery
        point of a sealed segment, or the stale DURABLE overwrites the new
        one until the new writer's next publish. ``verify``, a full recovery
        and readers (a segment never holds the LSN the next segment starts
        at: see ``log_read.Cursor``) report those frames as corruption and
        never yield them. The window is one batch's
        write + sync; a newer writer that waits longer than that after
        writing FENCE before it recovers closes it (not done here)."""
        if not self._fence_check:
            return
        try:
            newer = read_fence(self._dir)
        except OSError as exc:
            if exc.errno not in _OUT_OF_FDS:
                raise
            # Out of descriptors (appends stay healthy then, see _reserve_spares):
            # stat needs none. Only a writer's open replaces FENCE, so a file
            # other than the one this writer wrote means a newer writer. (On NFS
            # a stat may be served from the attribute cache, seconds old.)
            st = os.stat(self._dir / FENCE_NAME)
            if (st.st_ino, st.st_size, st.st_mtime_ns) == self._fence_stat:
                return
            raise LogFenced(
                f"log {self._dir}: a newer writer (epoch unknown: out of file descriptors to read {FENCE_NAME}) "
                f"opened this log; this writer (epoch {self._epoch}) is stale",
                epoch=self._epoch,
            ) from exc
        if newer == self._epoch:
            return
        if newer > self._epoch:
            raise LogFenced(
                f"log {self._dir}: a newer writer (epoch {newer}) opened this log; this writer (epoch {self._epoch}) is stale",
                epoch=self._epoch,
                newer_epoch=newer,
            )
        raise LogCorruption(
            f"log {self._dir}: its {FENCE_NAME} file names epoch {newer} (0: missing), below this writer's epoch "
            f"{self._epoch}; something other than a writer changed it, so this writer cannot prove it is still the newest"
        )

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
        self._ckpt_unsynced = None  # sealed: the rotation's checkpoint is newer
        if op.checkpoint is not None:
            self._write_checkpoint_if_fds(op.checkpoint)
        self._log.debug("log.segment.created", segment=name, epoch=self._epoch)

    def _write_checkpoint_if_fds(self, ckpt: Checkpoint, *, durable: bool = True) -> None:
        """Write a rotation's or a periodic checkpoint. Only an optimisation:
        the previous INDEX stays valid (recovery scans on from it), so a lack of
        descriptors (EMFILE) skips it with a warning instead of killing the log;
        any other OSError is fatal, like a failed data write."""
        try:
            self._write_checkpoint(ckpt, durable=durable)
        except OSError as exc:
            if exc.errno not in _OUT_OF_FDS:
                raise
            self._log.warning("log.checkpoint.skipped", segment=segment_name(ckpt.segment), lsn=ckpt.lsn, error=repr(exc))

    def _go_fatal(self, exc: BaseException) -> None:
        """Under _cv: refuse everything from now on; fail every waiter."""
        if self._fatal is None:
            self._fatal = exc
            seg = segment_name(self._cur_seg) if self._cur_seg is not None else "-"
            what = "an I/O error" if isinstance(exc, OSError) else "an unexpected error in the writer"
            if isinstance(exc, LogFenced):
                self._fatal_msg = (
                    f"{exc}; records from lsn {self._acked} on were not acknowledged by this writer; "
                    f"it refuses every append (the newer writer owns the log)"
                )
            else:
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
                    self._sync(self._acked, self._ckpt_unsynced)
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
        cur = Cursor(self._dir, from_lsn, self._cap, self._index_of, raw)
        try:
            yield from cur.records(self._acked)
        finally:
            cur.close()

    async def follow(self, from_lsn: int = 0, *, poll_s: float = 0.05) -> AsyncIterator[Envelope]:
        """Tail this log from ``from_lsn``: yields acknowledged records forever."""
        cur = Cursor(self._dir, from_lsn, self._cap, self._index_of, False)
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
                    self._check_fence()  # a stale writer must not overwrite DURABLE or INDEX
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
