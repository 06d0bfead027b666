"""The file log writer's group commit: the queue of staged submissions, the
leader/follower flush that writes and syncs them under the fsync policy, the
writer thread (async appends, ``interval`` syncs) and the fatal path that
fails every waiter.

Mixed into :class:`~agentlog.events.log.writer.FileLog`, whose state these
methods use: ``_cv`` guards ``_pending`` (staged :class:`_Submission` s),
``_waiters`` (async appenders), ``_flushing`` (one flusher at a time) and
``_acked``; whoever holds ``_flushing`` owns the segment descriptor. The
fsync policies are described in :mod:`agentlog.events.log.writer`.

Any ``OSError`` from write or fsync, and any unexpected exception in the
writer thread, makes the writer fatal: every pending and later append raises
:class:`LogClosed` naming the cause, and ``fatal_reason`` reports it. Nothing
is retried in place (after a failed fsync the page cache may no longer hold
the data).
"""

from __future__ import annotations

import asyncio
import errno
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from agentlog._logging import get_logger

from .api import DurableCallback, LogClosed, LogFenced, answer_durable
from .format import Checkpoint, segment_name

if TYPE_CHECKING:
    import collections
    import threading
    from pathlib import Path

    from .fence import _NewSegment, _Spare
    from .osops import OsOps

# The writer's logger: these are the writer's events, whichever module emits them.
log = get_logger("agentlog.events.log.writer")

_IOV_MAX = 1024


class _Submission:
    """Staged records waiting for a flush: their frames (bytes) and
    :class:`~agentlog.events.log.fence._NewSegment` markers in order (``ops``),
    the exclusive LSN bound ``end``, and a periodic checkpoint of the state at
    ``end``, written once the data is synced (a compressed log stages its
    records' frames uncompressed, and the flush that takes them compresses
    and places them: :mod:`~agentlog.events.log.batch_compression`). Until a flush takes it, a
    one-record async append may join the last one (its last run grows,
    ``end`` with it): under ``_cv``, and never under ``fsync="always"``, which
    syncs each append call on its own."""

    __slots__ = ("ops", "end", "checkpoint")

    def __init__(self, ops: list, end: int, checkpoint: Checkpoint | None = None) -> None:
        self.ops = ops
        self.end = end
        self.checkpoint = checkpoint


class GroupCommit:
    """The group commit and writer thread of
    :class:`~agentlog.events.log.writer.FileLog` (a mixin: it holds no state
    of its own)."""

    # The FileLog state this uses (writer.py sets it) and its other mixin's methods (fence.py).
    _dir: Path
    _policy: str
    _interval_s: float
    _os: OsOps
    _log: Any
    _cv: threading.Condition
    _mutex: threading.Lock  # _cv's lock
    _pending: collections.deque[_Submission]
    #: (end, future, envelope, loop) of an append or submit; a stage's DurableCallback carries them itself.
    _waiters: collections.deque[tuple[int, asyncio.Future, Any, asyncio.AbstractEventLoop] | DurableCallback]
    _flushing: bool
    _closed: bool
    _fatal: BaseException | None
    _seg_fd: int | None
    _cur_seg: int | None
    _acked: int
    _assigned: int
    _last_sync: float
    _unsynced: bool
    _thread_idle: bool
    _ckpt_unsynced: Checkpoint | None
    _check_fence: Callable[[], None]
    _roll: Callable[[_NewSegment], None]
    _discard_spares: Callable[[Iterable[_Spare]], None]
    _unused_spares: Callable[[Iterable[_Submission]], list[_Spare]]
    _publish: Callable[..., None]
    _write_checkpoint_if_fds: Callable[..., None]
    _compression: str | None
    _lay_out_batches: Callable[[list[_Submission]], None]
    _submit: Callable[[Iterable[Any]], tuple[list[Any], int]]

    def append_batches(self, batches: Iterable[Iterable[Any]]) -> list[list[Any]]:
        """Append each of ``batches`` atomically and in order, as ``append_batch``
        does, and make them durable with one commit: every batch is staged
        first (its checks, then its LSNs and one reading of the clock, as
        ``append_batch`` stamps a batch), then one flush writes them all and
        syncs them per the fsync policy (``always`` flushes and syncs each
        batch on its own, as it does each append call). So batches with timestamps of their own
        (``agentlog export``'s copy of a stream, whose records each carry one)
        share a write, and a compressed log compresses them together. Returns
        each batch's envelopes once durable. A batch the checks refuse raises
        its error (nothing of it is appended, nor of any batch after it) once
        the batches before it are durable. The caller bounds how much it
        stages: every batch is held in memory until the flush."""
        done: list[list[Any]] = []
        end = 0
        try:
            for records in batches:
                with self._mutex:  # self._cv's lock, as append_batch stages
                    envs, last = self._submit(records)
                if envs:
                    end = last
                done.append(envs)
        finally:
            if end:  # also when a batch was refused: the ones staged before it are appended
                self._commit(end)
        return done

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
        with self._mutex:  # cv's lock
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
        assert fd is not None, "frames are written only after a segment was started"
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
        if self._compression is not None:
            self._lay_out_batches(subs)  # one compression per flush: its records compress together
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
        assert self._seg_fd is not None, "a sync follows written frames, so a segment is open"
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
            item = self._waiters.popleft()
            fut, loop = (item[1], item[3]) if isinstance(item, tuple) else (item, item.loop)
            by_loop.setdefault(loop, []).append((fut, None))
        for loop, items in by_loop.items():
            _call_in_loop(loop, _fail_futures, items, err)

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

    def _resolve_waiters(self) -> None:
        """Under _cv: acknowledge every async appender whose record is now durable."""
        acked = self._acked
        by_loop: dict[Any, list] = {}
        w = self._waiters
        while w:
            first = w[0]
            if isinstance(first, tuple):  # (end, future, envelope, loop): an append's future
                if first[0] > acked:
                    break
                w.popleft()
                by_loop.setdefault(first[3], []).append((first[1], first[2]))
            else:  # a DurableCallback carrying its end, envelope and loop (stage)
                if first.end > acked:
                    break
                by_loop.setdefault(first.loop, []).append(w.popleft())
        for loop, items in by_loop.items():
            _call_in_loop(loop, answer_durable, items)

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
                    # Only submissions someone awaits here (async appends): an
                    # append_batch caller flushes its own as leader, and taking it
                    # from under it would make it wait for this thread instead.
                    if self._pending and not self._flushing and self._waiters:
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
