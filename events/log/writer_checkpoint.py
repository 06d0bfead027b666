"""The file log writer's ``INDEX`` checkpoints: snapshots of the writer's
state at a consistent point of the record stream (right after one append
call) and their writing. Mixed into
:class:`~agentlog.events.log.writer.FileLog`; when they are taken and why
is in :mod:`agentlog.events.log.writer` and docs/design.md ("Checkpoint").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..fs import write_atomic
from .format import INDEX_NAME, SEG_HDR_SIZE, Checkpoint, pack_checkpoint, segment_name
from .osops import _OUT_OF_FDS

#: Periodic checkpoints are at least this many times the INDEX's size apart
#: (at most ~1/8 more bytes written), whatever ``checkpoint_bytes`` says.
_CKPT_SPACING = 8


class WriterCheckpoints:
    """Checkpoint snapshots and writes of
    :class:`~agentlog.events.log.writer.FileLog` (a mixin: it holds no state
    of its own)."""

    # The FileLog state this uses (writer.py sets it).
    _dir: Path
    _log: Any
    _epoch: int
    _assigned: int
    _segments: list[int]
    _seg_first: int | None
    _seg_size: int
    _next_seq: dict[str, int]
    _index: dict[int, list[tuple[int, int]]]
    _ckpt_bytes: int
    _ckpt_every: int

    def _snapshot_at_end(self) -> Checkpoint:
        """Checkpoint of the state right after the last assigned record."""
        if self._segments:
            seg = self._segments[-1]
            off = self._seg_size if self._seg_first == seg else (self._dir / segment_name(seg)).stat().st_size
        else:
            seg, off = self._assigned, SEG_HDR_SIZE
        return self._snapshot(self._assigned, seg, off)

    def _snapshot(self, lsn: int, segment: int, offset: int, *, sessions: dict[str, int] | None = None) -> Checkpoint:
        """Under _cv (or before the writer starts): checkpoint of the state
        as of record ``lsn`` at ``offset`` in ``segment``, the last segment.
        O(open sessions + segments): only ``segment``'s index list is copied,
        as sealed segments' lists never change again and are shared.
        ``sessions``: the open sessions' next seqs as of ``lsn`` when
        ``_next_seq`` is ahead of it (a compressed log's flush)."""
        return Checkpoint(
            epoch=self._epoch,
            lsn=lsn,
            segment=segment,
            offset=offset,
            segments=list(self._segments),
            open_sessions=dict(self._next_seq if sessions is None else sessions),
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
