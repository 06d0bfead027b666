"""The file log writer's segment files: the fence that stops a stale writer,
and spare segment files opened ahead of need.

Mixed into :class:`~agentlog.events.log.writer.FileLog`, whose state these
methods use (its ``_dir``, ``_epoch``, ``_cv``-guarded spares and segment
accounting, ``_seg_fd``, ``_lock``). The fence: each writer open records a
new epoch in ``FENCE``; :meth:`FenceAndSpares._check_fence` re-reads it around
every batch, so a writer whose log a newer writer opened stops (see its race
window). The spares: a new segment's file is opened under a temporary name
before any state changes, so a rotation never needs a new descriptor at a
bad moment (EMFILE) and an append that would need one when none is free is
refused with the log still healthy.
"""

from __future__ import annotations

import collections
import errno
import os
from typing import TYPE_CHECKING, Iterable, NamedTuple

from .api import LogCorruption, LogError, LogFenced
from .format import FENCE_NAME, SEG_HDR_SIZE, Checkpoint, pack_segment_header, parse_fence, read_fence_bytes, segment_name
from .osops import _OUT_OF_FDS

if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any, Callable

    from .commit import _Submission
    from .lock import WriterLock
    from .osops import OsOps


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


class FenceAndSpares:
    """The fence checks, segment rolls and spare segment files of
    :class:`~agentlog.events.log.writer.FileLog` (a mixin: it holds no state
    of its own)."""

    # The FileLog state this uses (writer.py sets it) and its other mixin's methods (commit.py).
    _dir: Path
    _epoch: int
    _compression: str | None
    _os: OsOps
    _log: Any
    _lock: WriterLock | None
    _fence_check: bool
    _fence_stat: tuple[int, int, int]
    _fence_path: str  # the FENCE file's path, as a str: built once, not per check
    _fence_bytes: bytes  # what this writer wrote to FENCE (its epoch)
    _segment_bytes: int
    _spare_ahead_at: float  # _SPARE_AHEAD_FILL of _segment_bytes: a segment this full opens the next one's file
    _seg_fd: int | None
    _seg_first: int | None
    _seg_size: int
    _cur_seg: int | None
    _ckpt_unsynced: Checkpoint | None
    _spares: collections.deque[_Spare]
    _spare_count: int
    _write_all: Callable[[list], None]
    _write_checkpoint_if_fds: Callable[..., None]

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
                    f"segment ({errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror or exc})"
                    + ("; free file descriptors and retry, the log is healthy" if exc.errno in _OUT_OF_FDS else "")
                ) from exc
        if len(self._spares) == needed and end_size >= self._spare_ahead_at:
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
        at: see ``read.Cursor``) report those frames as corruption and
        never yield them. The window is one batch's
        write + sync; a newer writer that waits longer than that after
        writing FENCE before it recovers closes it (not done here)."""
        if not self._fence_check:
            return
        try:
            raw = read_fence_bytes(self._fence_path)
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
        if raw == self._fence_bytes:
            return  # the FENCE this writer wrote (its epoch): the common case, parsed once at open
        newer = 0 if raw is None else parse_fence(raw, self._fence_path)
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
            self._write_all([pack_segment_header(self._epoch, op.first_lsn, self._compression)])
        else:
            self._seg_fd = op.spare.fd
            self._cur_seg = op.first_lsn
            self._write_all([pack_segment_header(self._epoch, op.first_lsn, self._compression)])
            os.link(self._dir / op.spare.tmp, self._dir / name)
            os.unlink(self._dir / op.spare.tmp)
        assert self._lock is not None, "a segment rolls only while the writer holds its lock"
        os.fsync(self._lock.dir_fd)
        self._ckpt_unsynced = None  # sealed: the rotation's checkpoint is newer
        if op.checkpoint is not None:
            self._write_checkpoint_if_fds(op.checkpoint)
        self._log.debug("log.segment.created", segment=name, epoch=self._epoch)
