"""The file log writer's staging: a checked batch turned into frames, in
runs of the segments they go to, with the sparse index entries, before
anything is written.

Mixed into :class:`~agentlog.events.log.writer.FileLog`, whose ``_submit``
checks a batch and reserves its segments' files, then stages it here (under
``_cv``, where nothing can fail any more) as a list of ops for the group
commit (:mod:`~agentlog.events.log.commit`): runs of frames (lists of
buffers, written with one ``writev``) and :class:`~agentlog.events.log.fence._NewSegment`
markers. Two ways, one result, byte for byte: a batch of small frames that
fits the active segment is framed by the compiled codec in one call; any
other batch (a rotation, a big payload, the pure-Python codec) frame by frame.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Callable

from . import framecodec
from .fence import _NewSegment
from .format import ENV_HDR, FRAME_CRC, HEAD, INDEX_EVERY_BYTES, SEG_HDR_SIZE, TYPE_RECORD, Checkpoint
from .format import MASK_DELTA as _MASK_DELTA
from .format import crc_extend as _crc_extend
from .format import crc_value as _crc_value

if TYPE_CHECKING:
    import collections

    from .api import CheckedBatch
    from .fence import _Spare

#: Payloads from this size on are written as their own iovec (never copied in Python).
_BIG_PAYLOAD = 4096


class FrameStaging:
    """The staging of :class:`~agentlog.events.log.writer.FileLog` (a mixin:
    it holds no state of its own)."""

    # The FileLog state this uses (writer.py sets it; all under _cv).
    _segment_bytes: int
    _seg_first: int | None
    _seg_size: int
    _last_index_off: int
    _ckpt_off: int
    _segments: list[int]
    _next_seq: dict[str, int]
    _index: dict[int, list[tuple[int, int]]]
    _spares: collections.deque[_Spare]
    _snapshot: Callable[..., Checkpoint]

    def _stage_in_segment(self, codec: Any, batch: CheckedBatch, sidbs: list[bytes], sizes: list[int], lsn: int, ts: int) -> list:
        """Stage a batch of small frames that fits the active segment: one
        buffer from the compiled codec, the sparse index entries (every
        INDEX_EVERY_BYTES) found by bisection over the frames' offsets, and
        the sessions' next seqs as of the batch's end."""
        data, ends = codec.encode_columns(sidbs, batch.seqs, batch.terminal, batch.payloads, lsn, ts)
        seg_size, last_idx = self._seg_size, self._last_index_off
        if seg_size + len(data) - last_idx > INDEX_EVERY_BYTES:
            assert self._seg_first is not None
            index = self._index[self._seg_first]
            starts = [0] + ends[:-1]
            while True:
                i = bisect.bisect_left(starts, last_idx + INDEX_EVERY_BYTES - seg_size)
                if i >= len(starts):
                    break
                last_idx = seg_size + starts[i]
                index.append((lsn + i, last_idx))
        self._seg_size, self._last_index_off = seg_size + len(data), last_idx
        next_seq = self._next_seq
        next_seq.update(batch.next_seq)
        for sid in batch.ended:
            del next_seq[sid]
        return [[data]]

    def _stage_frames(self, batch: CheckedBatch, sidbs: list[bytes], sizes: list[int], lsn: int, ts: int) -> list:
        """Stage a batch frame by frame: rotations (whose checkpoints hold
        the sessions as of their first record), index entries, big payloads
        written where they lie. The frame layout is inlined (see
        format.encode_frame, which readers' tests use) for the pure-Python codec."""
        seg_first, seg_size, last_idx = self._seg_first, self._seg_size, self._last_index_off
        run: list = []
        ops: list = [run]
        seg_limit = self._segment_bytes
        head_pack, crc_pack, crc_value, crc_extend = HEAD.pack, FRAME_CRC.pack, _crc_value, _crc_extend
        env_size = ENV_HDR.size
        codec = framecodec.native
        encode = codec.encode_frame if codec is not None else None
        next_seq = self._next_seq
        for sid, seq, terminal, payload, sidb, n in zip(batch.session_ids, batch.seqs, batch.terminal, batch.payloads, sidbs, sizes):
            plen = len(payload)
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
            # Record by record: a rotation's checkpoint holds the sessions as of its first record.
            if terminal:
                next_seq.pop(sid, None)
            else:
                next_seq[sid] = seq + 1
            lsn += 1
        self._seg_first, self._seg_size, self._last_index_off = seg_first, seg_size, last_idx
        return ops

    def _start_segment(self, lsn: int, *, rotating: bool, ops: list, sessions: dict[str, int] | None = None) -> list:
        """Stage a new segment starting at ``lsn``; returns the run its frames
        go to. ``sessions``: the next seqs as of ``lsn``, if not ``_next_seq``."""
        self._segments.append(lsn)
        self._index[lsn] = [(lsn, SEG_HDR_SIZE)]
        self._ckpt_off = SEG_HDR_SIZE
        # A rotation checkpoints the state at the new segment's start, so a
        # crash never makes the next open rescan sealed segments. The writer's
        # first segment needs none: open left a valid checkpoint.
        ckpt = self._snapshot(lsn, lsn, SEG_HDR_SIZE, sessions=sessions) if rotating else None
        ops.append(_NewSegment(lsn, ckpt, self._spares.popleft() if self._spares else None))
        run: list = []
        ops.append(run)
        return run
