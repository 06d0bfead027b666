"""Compressed record batches of the file log: the writer compresses the
frames one flush writes together (group commit: every append call it takes;
our producer batch, as Kafka compresses its record batches) as zstd batch
frames, and the scanner turns a batch back into its frames. The layout is in
:mod:`agentlog.events.log.format` ("Compressed batch").

The choice is per log and recorded in each segment's header
(:func:`chosen_compression`): a writer opened with ``compression=None``
keeps what the log's last segment records; ``"zstd"`` or ``"none"`` sets it
for the segments this writer creates (each writer open starts a segment, so
a log changed this way holds both kinds, and every reader reads both). A
segment of a compressed log holds batches and plain frames mixed: a batch
that compression does not make smaller (tiny, or incompressible bytes) is
stored as its plain frames.

A batch is one unit on disk: one CRC over the stored (compressed) bytes, one
offset holding the LSN range [first, first + count). Recovery, verify and the
sparse index see it as one frame (a torn batch at the tail is cut whole; a
damaged one is damage to all its records); each record it yields carries the
batch's offset and end.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import zstandard

from . import framecodec
from .commit import _Submission
from .format import (
    BATCH_CODEC_ZSTD,
    BATCH_HDR,
    BATCH_MAX_RECORDS,
    BATCH_RAW_BYTES,
    FRAME_CRC,
    FRAME_HDR,
    FRAME_PREFIX,
    INDEX_EVERY_BYTES,
    SEG_HDR_SIZE,
    TYPE_BATCH,
    crc_extend,
    crc_value,
    encode_frame,
    mask_crc,
    batch_raw_cap,
    segment_name,
    parse_segment_header,
)
from ..schema.types import TERMINAL_EVENT_TYPES, Envelope

if TYPE_CHECKING:
    pass

#: zstd's fast level -1: no entropy coding of literals, so a batch decompresses about 5x faster than at level 1
#: and compresses about 2.5x faster, for about 1.4x the bytes (measured on 100-turn agent sessions: 0.45x the
#: final trajectory against 0.32x, replay 0.61x of an uncompressed log's against 0.34x; bench_compression.py).
#: Random token ids, which level 1 takes to 0.80x, are then stored plain (read as fast as an uncompressed log).
ZSTD_LEVEL = -1
#: A batch is stored compressed only when that saves at least this fraction of its bytes.
_MIN_SAVING = 0.1
#: Frames below this many bytes in all are never worth a compression call.
_MIN_RAW = 128
_HEAD = FRAME_HDR.size - FRAME_CRC.size  # length + type, after the CRC
_TERMINAL_SET = frozenset(TERMINAL_EVENT_TYPES)
_BATCH_PREFIX = FRAME_PREFIX + BATCH_HDR.size
_unpack_frame_hdr, _unpack_batch_hdr = FRAME_HDR.unpack_from, BATCH_HDR.unpack_from


def chosen_compression(requested: str | None, directory: Path, segments: list[int]) -> str | None:
    """The compression a writer opened with ``requested`` uses ("zstd" or
    None): the one asked for, else the one the log's last segment records
    (a new log: none)."""
    if requested is not None:
        return None if requested == "none" else requested
    return segment_compression(directory, segments[-1]) if segments else None


def segment_compression(directory: Path, first_lsn: int) -> str | None:
    """The compression ("zstd" or None) the header of segment ``first_lsn`` of the log at
    ``directory`` records; LogCorruption naming the segment when the header is damaged."""
    name = segment_name(first_lsn)
    with open(directory / name, "rb") as f:
        return parse_segment_header(f.read(SEG_HDR_SIZE), name, first_lsn).compression


def pack_batch(first_lsn: int, count: int, raw: bytes | memoryview, data: bytes) -> bytes:
    """The batch frame of ``count`` frames from ``first_lsn`` whose
    concatenation ``raw`` compresses (zstd) to ``data``."""
    head = FRAME_HDR.pack(0, BATCH_HDR.size + len(data), TYPE_BATCH)[FRAME_CRC.size :]
    head += BATCH_HDR.pack(first_lsn, count, len(raw), BATCH_CODEC_ZSTD)
    return FRAME_CRC.pack(mask_crc(crc_extend(crc_value(head), data))) + head + data


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    # One per thread: readers run in any thread, and a decompressor is not shareable.
    d = getattr(_local, "zstd", None)
    if d is None:
        d = _local.zstd = zstandard.ZstdDecompressor()
    return d


# ---------------------------------------------------------------- writing


class _Staged(NamedTuple):
    """The frames of one append call of a compressed log, staged uncompressed:
    ``buf`` holds them from LSN ``first`` on, ``ends`` their end offsets in it,
    ``keys`` each record's (session, seq, terminal)."""

    first: int
    buf: bytes
    ends: list[int]
    keys: list[tuple[str, int, bool]]


class BatchCompression:
    """The compressed staging of :class:`~agentlog.events.log.writer.FileLog`
    (a mixin: ``_submit`` hands it a checked submission when the log
    compresses). Staging only frames the records (LSNs, sessions' next seqs);
    the flush (:meth:`_lay_out_batches`, run by whoever flushes, one at a
    time) compresses every record it writes together into batches and places
    them: segments, rotations, the sparse index and periodic checkpoints are
    decided there, as ``FileLog._submit``'s staging decides them for plain frames."""

    # The FileLog state this uses (writer.py sets it) and its other parts' methods.
    _compression: str | None
    _clock: Callable[[], int]
    _cv: threading.Condition
    _assigned: int
    _seg_first: int | None
    _seg_size: int
    _last_index_off: int
    _ckpt_off: int
    _ckpt_every: int
    _segment_bytes: int
    _next_seq: dict[str, int]
    #: The sessions' next seqs as of the last record a flush placed (flusher side, under _cv).
    _placed_seq: dict[str, int]
    #: Bytes of frames staged and not placed yet (under _cv): what the spare reservation counts.
    _unplaced_bytes: int = 0
    _index: dict[int, list[tuple[int, int]]]
    _pending: Any
    _reserve_spares: Callable[[int, int], None]
    _segments_needed: Callable[[list[int]], tuple[int, int]]
    _start_segment: Callable[..., list]
    _snapshot: Callable[..., Any]
    _zstd: zstandard.ZstdCompressor | None = None

    def _submit_compressed(self, checked: list, sids: list[bytes]) -> tuple[list[Envelope], int]:
        """``FileLog._submit`` from its staging on, for a compressed log
        (caller holds _cv; every check that can fail has run, but the
        spare segment files' reservation, which runs here first)."""
        ts = self._clock()
        lsn = self._assigned
        flags = [type(rec.body) in _TERMINAL_SET for rec in checked]
        codec = framecodec.native
        if codec is not None:
            buf, ends = codec.encode_batch([(sid, rec.session_seq, fl, rec.payload) for rec, sid, fl in zip(checked, sids, flags)], lsn, ts)
        else:
            parts = [encode_frame(lsn + i, rec.session_seq, ts, fl, sid, rec.payload) for i, (rec, sid, fl) in enumerate(zip(checked, sids, flags))]
            buf, ends, at = b"".join(parts), [], 0
            for p in parts:
                at += len(p)
                ends.append(at)
        # The frames' own sizes bound what they take once placed (a batch is stored only when smaller).
        self._reserve_spares(*self._segments_needed([self._unplaced_bytes, len(buf)] if self._unplaced_bytes else [len(buf)]))
        # From here on nothing can fail.
        self._unplaced_bytes += len(buf)
        keys = []
        envs = []
        next_seq = self._next_seq
        for rec, terminal in zip(checked, flags):
            sid, seq, body, _payload = rec
            keys.append((sid, seq, terminal))
            envs.append(Envelope(lsn, sid, seq, ts, body))
            if terminal:
                next_seq.pop(sid, None)
            else:
                next_seq[sid] = seq + 1
            lsn += 1
        self._assigned = lsn
        self._pending.append(_Submission([_Staged(lsn - len(keys), buf, ends, keys)], lsn))
        return envs, lsn

    def _lay_out_batches(self, subs: list) -> None:
        """Before a flush of a compressed log writes ``subs`` (their ops:
        :class:`_Staged` frames): compress their frames together, in batches
        of at most BATCH_RAW_BYTES (outside _cv), then place the batches
        (under _cv) and make ``subs``' ops the runs and segment starts to
        write, with a periodic checkpoint when one is due."""
        staged = [op for sub in subs for op in sub.ops]
        if len(staged) == 1:
            buf, ends = staged[0].buf, staged[0].ends
        else:
            buf = b"".join([s.buf for s in staged])
            ends, base = [], 0
            for s in staged:
                ends += [e + base for e in s.ends] if base else s.ends
                base += len(s.buf)
        units = self._compressed_units(buf, ends, staged[0].first)
        with self._cv:
            ops, ckpt = self._place(units, [k for s in staged for k in s.keys], subs[-1].end)
            self._unplaced_bytes -= len(buf)
        subs[0].ops = ops
        for sub in subs[1:]:
            sub.ops = []
        subs[-1].checkpoint = ckpt

    def _compressed_units(self, buf: bytes, ends: list[int], lsn: int) -> list[tuple[int, int, bytes]]:
        """(first LSN, records, bytes) of each unit the frames in ``buf`` become: a
        compressed batch, or a plain frame where compressing its batch saves too little."""
        if self._zstd is None:
            self._zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        compress = self._zstd.compress
        view = memoryview(buf)
        units: list[tuple[int, int, bytes]] = []
        start, i, n = 0, 0, len(ends)
        while i < n:
            # The batch: frames from i while it stays under BATCH_RAW_BYTES (one frame at least).
            j = i + 1
            while j < n and j - i < BATCH_MAX_RECORDS and ends[j] - start <= BATCH_RAW_BYTES:
                j += 1
            raw = view[start : ends[j - 1]]
            data = compress(raw) if len(raw) >= _MIN_RAW else None
            if data is not None and len(data) + FRAME_PREFIX + BATCH_HDR.size <= len(raw) * (1 - _MIN_SAVING):
                units.append((lsn + i, j - i, pack_batch(lsn + i, j - i, raw, data)))
            else:
                at = start
                for k in range(i, j):
                    units.append((lsn + k, 1, bytes(view[at : ends[k]])))
                    at = ends[k]
            start, i = ends[j - 1], j
        return units

    def _place(self, units: list[tuple[int, int, bytes]], keys: list[tuple[str, int, bool]], end: int) -> tuple[list, Any]:
        """Under _cv: the ops that write ``units`` (segment starts, whose
        checkpoints hold the sessions as of their first record, and runs),
        their sparse index entries, and the checkpoint of the state at
        ``end`` when one is due."""
        seg_first, seg_size, last_idx = self._seg_first, self._seg_size, self._last_index_off
        run: list = []
        ops: list = [run]
        seg_limit = self._segment_bytes
        sessions = self._placed_seq
        k = 0
        for first, count, unit in units:
            n = len(unit)
            if seg_first is None or (seg_size > SEG_HDR_SIZE and seg_size + n > seg_limit):
                run = self._start_segment(first, rotating=seg_first is not None, ops=ops, sessions=sessions)
                seg_first, seg_size, last_idx = first, SEG_HDR_SIZE, SEG_HDR_SIZE
            elif seg_size - last_idx >= INDEX_EVERY_BYTES:
                self._index[seg_first].append((first, seg_size))
                last_idx = seg_size
            run.append(unit)
            seg_size += n
            for sid, seq, terminal in keys[k : k + count]:
                if terminal:
                    sessions.pop(sid, None)
                else:
                    sessions[sid] = seq + 1
            k += count
        self._seg_first, self._seg_size, self._last_index_off = seg_first, seg_size, last_idx
        ckpt = None
        if seg_size - self._ckpt_off >= self._ckpt_every:
            assert seg_first is not None
            ckpt = self._snapshot(end, seg_first, seg_size, sessions=sessions)
            self._ckpt_off = seg_size
        return ops, ckpt


# ---------------------------------------------------------------- reading


def read_batch(sc: Any, off: int, size: int) -> str:
    """Decode the compressed batch at offset ``off`` (== ``sc.offset``) of the
    :class:`~agentlog.events.log.scan.SegmentScanner` ``sc``, whose file
    is ``size`` bytes. On success it returns "" with the batch's frames
    waiting in ``sc.rest`` (last first) and ``sc.offset`` past the batch; else
    the reason the batch is bad (``sc`` unchanged). The mapped scanner's second
    thread has a compiled twin of these checks (``walk_batch`` in _framecodec.c)
    that takes only batches passing all of them and leaves the rest here:
    a check added here goes there too (the differential tests compare them)."""
    need = _BATCH_PREFIX
    if size - off < need:
        return f"incomplete batch header ({size - off} bytes before end of file)"
    sc._fill(off + need, size)
    buf, rel = sc._buf, off - sc._buf_off
    crc, length, _typ = _unpack_frame_hdr(buf, rel)
    first, count, raw_len, codec = _unpack_batch_hdr(buf, rel + FRAME_PREFIX)
    raw_cap = batch_raw_cap(sc.cap)
    if length <= BATCH_HDR.size or length > BATCH_HDR.size + raw_cap:
        return f"compressed batch length {length} out of range (expected {BATCH_HDR.size + 1}..{BATCH_HDR.size + raw_cap} bytes)"
    end = off + FRAME_PREFIX + length
    if end > size:
        return f"compressed batch of {FRAME_PREFIX + length} bytes runs past end of file ({size})"
    sc._fill(end, size)
    buf, rel = sc._buf, off - sc._buf_off
    native = framecodec.native
    # A view, not a copy: the CRC and the decompressor read the read buffer in place.
    body = memoryview(buf)[rel + FRAME_CRC.size : rel + FRAME_PREFIX + length]
    if mask_crc(native.crc32c(body) if native is not None else crc_value(bytes(body))) != crc:
        return "CRC mismatch"
    if first != sc.expected:
        return f"lsn {first}, expected {sc.expected}"
    if codec != BATCH_CODEC_ZSTD or not 0 < count <= BATCH_MAX_RECORDS or raw_len > raw_cap:
        return (f"compressed batch header: codec {codec}, {count} records, {raw_len} bytes raw (expected codec "
                f"{BATCH_CODEC_ZSTD} (zstd), 1..{BATCH_MAX_RECORDS} records, at most {raw_cap} bytes)")
    data = body[_HEAD + BATCH_HDR.size :]
    try:
        # The frame's own content size (the writer always records it) must be the header's: it bounds what
        # decompress allocates, which is then given no max_output_size (that path is ~1.5x slower).
        told = zstandard.frame_content_size(data)
        if told != raw_len:
            return f"compressed batch (lsn {first}..{first + count - 1}): its zstd frame says {told} bytes raw, its header {raw_len}"
        # One frame and nothing after it, as the writer stores a batch: zstandard would otherwise ignore
        # trailing bytes (the mapped walk checks the frame's compressed size and leaves such a batch to this path).
        raw = _decompressor().decompress(data, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        return f"compressed batch (lsn {first}..{first + count - 1}) does not decompress: {exc}"
    if len(raw) != raw_len:
        return f"compressed batch (lsn {first}..{first + count - 1}) decompresses to {len(raw)} bytes, its header says {raw_len}"
    # Its frames are checked as any segment's (CRC, LSN sequence, lengths, id), in memory: the batch's CRC
    # covers the stored bytes, this a writer or codec fault, at ~0.1 us per KiB with the compiled codec.
    if native is not None:
        # Built with the batch's place, last first (as ``rest`` keeps them).
        rest, at, why = native.scan_batch(raw, sc.frame_type, first, count, off, end, sc.cap)
        if why is None and (len(rest) != count or at != raw_len):
            why = f"{len(rest)} frames in {at} bytes, its header says {count} in {raw_len}"
    else:
        inner = type(sc)(-1, sc.name, 0, first, sc.cap)
        inner._buf = raw
        frames = list(inner.frames(size=raw_len))
        at, why = inner.offset, inner.bad.reason if inner.bad is not None else None
        if why is None and len(frames) != count:
            why = f"{len(frames)} frames, its header says {count}"
        rest = [type(fr)(off, end, *fr[2:]) for fr in reversed(frames)]
    if why is not None:
        return f"compressed batch (lsn {first}..{first + count - 1}), byte {at} of its frames: {why}"
    sc.rest = rest
    sc.offset = end
    return ""
