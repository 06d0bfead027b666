"""The file-backed event log's writer: :class:`FileLog`, one writer per log
directory. This module opens and recovers a log, frames and stages appends,
and closes; the writer's other parts live apart: group commit and the writer
thread in :mod:`~agentlog.events.log.commit`, the fence and the spare segment
files in :mod:`~agentlog.events.log.fence`, the OS seam in
:mod:`~agentlog.events.log.osops`.

Its neighbours, one concept each: the on-disk format in
:mod:`agentlog.events.log.format`, the scanner in :mod:`~agentlog.events.log.scan`,
crash recovery in :mod:`~agentlog.events.log.recovery`, readers and followers
in :mod:`~agentlog.events.log.read`, verification in
:mod:`~agentlog.events.log.verify`, the writer lock in
:mod:`~agentlog.events.log.lock`. The format in short: a
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
* A new segment's file is opened ahead of need (:mod:`~agentlog.events.log.fence`).
* Each writer open starts a new segment (lazily, at its first append) whose
  header carries the new writer epoch, so a segment's records all come from
  one writer and recovery only ever truncates a segment nobody writes to.

Any I/O error makes the writer fatal (:mod:`~agentlog.events.log.commit`).
Reopening recovers (:mod:`~agentlog.events.log.recovery`): it keeps the
longest valid prefix and truncates a torn tail. A damaged frame followed by
valid ones, or one below the durable watermark, is corruption:
:class:`LogCorruption` names segment, offset and last good LSN, unless
``salvage=True`` moves the damaged rest aside.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import operator
import os
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator

from agentlog._logging import get_logger

from . import framecodec
from ..fs import fsync_dir, write_atomic
from ..schema.validation import is_number
from .api import CheckedBatch, DurableCallback, EventLog, LogClosed, LogError, NotALog, OnDurable, PendingRecord, check_record_body
from .batch_compression import BatchCompression, chosen_compression
from .commit import GroupCommit, _Submission
from .fence import _SPARE_AHEAD_FILL, _SPARE_PREFIX, FenceAndSpares, _Spare
from .format import CHECKPOINT_EVERY_BYTES, DEFAULT_MAX_RECORD_BYTES, DURABLE_NAME, ENV_HDR, FENCE_NAME, FRAME_OVERHEAD
from .format import INDEX_EVERY_BYTES, INDEX_NAME, LOCK_NAME, SEG_HDR_SIZE, Checkpoint, is_log_dir
from .format import check_compression, pack_durable, pack_fence, read_durable, read_fence, segment_name
from .lock import acquire_lock, release_lock
from .staging import _BIG_PAYLOAD, FrameStaging
from .read import Cursor
from .lazy import staged_envelope
from .osops import OsOps, raise_nofile_limit
from .recovery import fence_without_log, recover
from .writer_checkpoint import WriterCheckpoints
from ..schema.types import EVENT_TYPES, TERMINAL_EVENT_TYPES, Envelope

log = get_logger("agentlog.events.log.writer")

FSYNC_POLICIES = ("always", "batch", "interval", "never")
#: The largest max_record_bytes a frame's u32 length (and a compressed batch's u32 raw length) can hold.
MAX_RECORD_BYTES_LIMIT = 0xFFFFFFFF - FRAME_OVERHEAD - (1 << 16)
_EVENT_TYPES = frozenset(EVENT_TYPES)
_TERMINAL_TYPES = frozenset(TERMINAL_EVENT_TYPES)


class FileLog(GroupCommit, FrameStaging, FenceAndSpares, WriterCheckpoints, BatchCompression, EventLog):
    """The durable, segmented, CRC-framed log. Create with :meth:`open`."""

    stages_synchronously = True  # stage() checks and stages its record before it returns

    # Set by open() on the instance it builds (the rest of the state: _init_state and the mixins' declarations).
    _clock: Callable[[], int]
    _cap: int
    _ckpt_bytes: int
    _ckpt_every: int
    _thread: threading.Thread

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
        compression: str | None = None,
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

        ``compression``: ``"zstd"`` compresses the frames each flush writes
        together as batches, ``"none"`` does not; None (default) keeps what the log's last
        segment records (see :mod:`~agentlog.events.log.batch_compression`).

        ``_flock=False`` is a test seam, not an option: it skips the flock to simulate a
        second writer on another node of a shared filesystem. Two live writers of one
        directory are never supported: the fence stops a stale incarnation, with a race
        window, and does not make concurrent writers safe."""
        for name, value, ok, expected in (
            ("fsync", fsync, fsync in FSYNC_POLICIES, f"one of {'/'.join(FSYNC_POLICIES)}"),
            ("segment_bytes", segment_bytes, segment_bytes >= SEG_HDR_SIZE + 64, f"at least {SEG_HDR_SIZE + 64}"),
            ("max_record_bytes", max_record_bytes, 64 <= max_record_bytes <= MAX_RECORD_BYTES_LIMIT,
             f"64..{MAX_RECORD_BYTES_LIMIT} (a frame's length is a u32)"),
            ("interval_s", interval_s, is_number(interval_s, at_least=0), "a finite number of seconds >= 0"),
            ("checkpoint_bytes", checkpoint_bytes, checkpoint_bytes >= 1, "at least 1"),
        ):
            if not ok:
                raise ValueError(f"{name}: expected {expected}, found {value!r}")
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
        self._spare_ahead_at = _SPARE_AHEAD_FILL * segment_bytes  # fence's rule, read on every append
        self._cap = max_record_bytes
        self._interval_s = interval_s
        self._ckpt_bytes = self._ckpt_every = checkpoint_bytes
        self._os = os_ops or OsOps()
        self._fence_check = fence
        self._compression = check_compression(compression)
        self._log = log.bind(log_dir=str(directory))
        raise_nofile_limit()
        self._lock = acquire_lock(directory, flock=_flock)
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
        # taken once per append. The hot paths enter the lock itself (``with
        # self._mutex``: C code), not the condition (a Python-level __enter__).
        self._mutex = threading.Lock()
        self._cv = threading.Condition(self._mutex)
        self._pending: collections.deque[_Submission] = collections.deque()
        self._waiters: collections.deque[tuple[int, asyncio.Future, Any, asyncio.AbstractEventLoop] | DurableCallback] = collections.deque()
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
        self._seg_label: tuple[int | None, str] = (None, "")  # _seg_first and its file's name, for staged envelopes
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
        """Recover the directory (see :mod:`agentlog.events.log.recovery`) and
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
        self._fence_path, self._fence_bytes = str(d / FENCE_NAME), pack_fence(self._epoch)
        self._rescanned = state.rescanned_bytes
        self._segments = state.segments
        self._compression = chosen_compression(self._compression, d, state.segments)
        self._index = state.index
        self._next_seq = state.open_sessions
        self._placed_seq = dict(state.open_sessions)
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
            compression=self._compression,
        )

    def _publish(self, end: int, *, synced: bool = True) -> None:
        """Advance the DURABLE watermark readers in other processes trust.
        ``synced=False`` (fsync="never"): the records below ``end`` were only
        written, so recovery takes the watermark as a hint, not as proof."""
        if (end, synced) != self._published:
            assert self._durable_fd is not None, "DURABLE is open from recovery until close"
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

    def _submit(self, records: Iterable[PendingRecord | tuple]) -> tuple[list[Envelope], int]:
        """Validate, encode and stage records (caller holds _cv). All or nothing:
        every check that can fail runs before any state changes."""
        if self._fatal is not None or self._closing:
            raise self._dead()
        return self._stage(self._check_columns(records))  # encodes each body once; its payload is stored as is

    def _stage(self, batch: CheckedBatch) -> tuple[list[Envelope], int]:
        """Stage a checked batch (caller holds _cv): refuse a record over
        max_record_bytes, open the files of the segments it starts, then frame
        it (:mod:`~agentlog.events.log.staging`) and queue it."""
        sids = batch.session_ids
        sidbs = list(map(str.encode, sids))
        sizes = list(map(FRAME_OVERHEAD.__add__, map(operator.add, map(len, sidbs), map(len, batch.payloads))))
        if not sizes:
            return [], self._assigned
        # Frames of more than this many bytes hold a record over max_record_bytes.
        too_big = self._cap + FRAME_OVERHEAD - ENV_HDR.size
        if max(sizes) > too_big:
            i = next(i for i, n in enumerate(sizes) if n > too_big)
            raise LogError(
                f"session {sids[i]!r} seq {batch.seqs[i]}: record of {sizes[i] - FRAME_OVERHEAD + ENV_HDR.size} "
                f"bytes exceeds max_record_bytes {self._cap}"
            )
        if self._compression is not None:
            return self._submit_compressed(batch.records(), sidbs)
        rotations, _end_size = needed = self._segments_needed(sizes)
        self._reserve_spares(*needed)
        # From here on nothing can fail.
        ts = self._clock()
        lsn = self._assigned
        codec = framecodec.native
        if codec is not None and not rotations and self._seg_first is not None and max(sizes) < _BIG_PAYLOAD:
            # The common case: small frames that all fit the active segment,
            # framed in one call into one buffer.
            ops = self._stage_in_segment(codec, batch, sidbs, sizes, lsn, ts)
        else:
            ops = self._stage_frames(batch, sidbs, sizes, lsn, ts)
        end = lsn + len(sizes)
        envs = list(map(Envelope, range(lsn, end), sids, batch.seqs, itertools.repeat(ts, len(sizes)), batch.bodies))
        self._queue(ops, end)
        return envs, end

    def _submit_one(self, sid: str, seq: int, body: Any, staged: bool = False) -> tuple[Envelope, int]:
        """:meth:`_submit` of one record (caller holds _cv), for ``append``: the common case (the
        next record of an open session, a frame that fits the active segment short of its next
        index entry, the compiled codec; a big payload is written where it lies, after its frame's
        prefix) is checked and framed without a batch's columns; anything else goes through
        :meth:`_submit`. ``staged`` (:meth:`stage`): the common case's envelope keeps the stored
        bytes, not the body decoded back (:func:`~agentlog.events.log.lazy.staged_envelope`)."""
        codec = framecodec.native
        if (
            codec is None
            or self._compression is not None
            or self._fatal is not None
            or self._closing
            or self._seg_first is None
            or self._next_seq.get(sid) != seq
            or type(body) not in _EVENT_TYPES
        ):
            envs, end = self._submit([(sid, seq, body)])
            return envs[0], end
        payload, body = check_record_body(sid, seq, body)  # decoded back: what a reader gets
        sidb = sid.encode()
        n = FRAME_OVERHEAD + len(sidb) + len(payload)
        seg_size = self._seg_size
        if n > self._cap + FRAME_OVERHEAD - ENV_HDR.size or seg_size + n > self._segment_bytes:
            terminal = type(body) in _TERMINAL_TYPES
            checked = CheckedBatch([sid], [seq], [body], [payload], [int(terminal)], {sid: seq + 1}, {sid} if terminal else set())
            envs, end = self._stage(checked)
            return envs[0], end
        if not self._spares and seg_size + n >= self._spare_ahead_at:
            self._reserve_spares(0, seg_size + n)  # opens the next segment's file ahead of need
        ts = self._clock()
        lsn = self._assigned
        env: Envelope  # made before any state changes: what could fail making it (memory) leaves none half changed
        if staged:
            label = self._seg_label
            if label[0] != self._seg_first:  # the name of the active segment, made once it changed
                label = self._seg_label = (self._seg_first, segment_name(self._seg_first))
            env = staged_envelope(lsn, sid, seq, ts, type(body), payload, label[1], seg_size)
        else:
            env = Envelope(lsn, sid, seq, ts, body)
        # From here on nothing can fail.
        # A big payload is written where it lies (writev), after its frame's prefix, whose CRC covers it.
        big = len(payload) >= _BIG_PAYLOAD
        if type(body) in _TERMINAL_TYPES:
            frame = codec.encode_frame(lsn, seq, ts, 1, sidb, payload, big)
            del self._next_seq[sid]
        else:
            frame = codec.encode_frame(lsn, seq, ts, 0, sidb, payload, big)
            self._next_seq[sid] = seq + 1
        self._seg_size = seg_size + n
        if seg_size - self._last_index_off >= INDEX_EVERY_BYTES:  # a sparse index entry here, as _stage_frames makes
            assert self._seg_first is not None  # the fast path runs in an open segment
            self._index[self._seg_first].append((lsn, seg_size))
            self._last_index_off = seg_size
        end = lsn + 1
        pending = self._pending
        if pending and self._policy != "always" and seg_size + n - self._ckpt_off < self._ckpt_every:
            last = pending[-1]
            run = last.ops[-1]
            if last.checkpoint is None and type(run) is list:
                # Join the submission still waiting for a flush: one run, no new objects.
                run.append(frame)
                if big:
                    run.append(payload)
                last.end = self._assigned = end
                return env, end
        self._queue([[frame, payload] if big else [frame]], end)
        return env, end

    def _queue(self, ops: list, end: int) -> None:
        """Under _cv: hand staged frames (records up to ``end``) to the group commit."""
        self._assigned = end
        ckpt = None
        seg_size = self._seg_size
        if seg_size - self._ckpt_off >= self._ckpt_every:
            # The state right after this submission, a consistent point of
            # the record stream; _flush writes it once these records are synced.
            assert self._seg_first is not None  # a staged record always has its segment
            ckpt = self._snapshot(end, self._seg_first, seg_size)
            self._ckpt_off = seg_size
        self._pending.append(_Submission(ops, end, ckpt))

    def append_batch(self, records: Iterable[PendingRecord | tuple]) -> list[Envelope]:
        """Append records atomically in order; returns their envelopes once
        durable. Raises SequenceError / EventValidationError / LogError for bad
        input (nothing is appended) and LogClosed when the writer is closed or fatal."""
        with self._mutex:  # self._cv's lock
            envs, end = self._submit(records)
        if envs:
            self._commit(end)
        return envs

    async def append(self, session_id: str, session_seq: int, body: Any) -> Envelope:
        """Append one record; concurrent calls are group-committed by the
        writer thread, so the event loop never waits on disk. The record is
        staged before the first await (a caller cancelled while it waits for
        durability still has its record written: ``next_seq`` says so)."""
        fut = asyncio.get_running_loop().create_future()  # as submit does, without a call more per append
        self._enqueue(session_id, session_seq, body, fut)
        return await fut

    def submit(self, session_id: str, session_seq: int, body: Any) -> asyncio.Future[Envelope]:
        """:meth:`EventLog.submit`: the record is staged before this returns
        (bad input raises here, nothing staged), and the writer thread's
        acknowledgement resolves the future."""
        fut = asyncio.get_running_loop().create_future()
        self._enqueue(session_id, session_seq, body, fut)
        return fut

    def stage(self, session_id: str, session_seq: int, body: Any, on_durable: OnDurable) -> None:
        """:meth:`EventLog.stage`: the record is staged before this returns (bad
        input raises here, nothing staged), and the writer thread's
        acknowledgement calls ``on_durable`` on the loop directly, no future
        or task between. A :class:`DurableCallback` is taken as the waiter itself (one object
        less a record). The envelope it is given holds the stored bytes, its body decoded on
        first use (:func:`~agentlog.events.log.lazy.staged_envelope`)."""
        waiter = on_durable if isinstance(on_durable, DurableCallback) else DurableCallback(on_durable)
        self._enqueue(session_id, session_seq, body, waiter, True)

    def _enqueue(self, session_id: str, session_seq: int, body: Any, waiter: Any, staged: bool = False) -> None:
        """Stage one record and hand ``waiter`` (a future, or with ``staged`` a DurableCallback: see :meth:`_submit_one`) to the writer thread."""
        loop = asyncio.get_running_loop()
        with self._mutex:  # self._cv's lock
            env, end = self._submit_one(session_id, session_seq, body, staged)
            bare = staged and waiter.end == DurableCallback.NOT_QUEUED  # a stage's DurableCallback not waiting already: it carries end, env, loop
            if bare:
                waiter.end, waiter.env, waiter.loop = end, env, loop
            self._waiters.append(waiter if bare else (end, waiter, env, loop))
            if self._thread_idle:  # wake the writer only when it sleeps; a busy one picks this up after its flush
                self._thread_idle = False
                self._cv.notify_all()

    # ------------------------------------------------------------ reading

    def _index_of(self, first: int) -> list[tuple[int, int]] | None:
        with self._cv:
            entries = self._index.get(first)
            return list(entries) if entries else None

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Any]:  # typed by EventLog.read's overloads
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
