"""The one scanner of the file log: frames of a segment, and a walk over a
log directory's segments that recovery and verify share.

:class:`SegmentScanner` reads CRC-valid frames of one segment (the hot loop of
every reader). :class:`LogWalk` walks the segments in LSN order: it checks each
header and that each segment starts where the previous one ended, hands the
caller each segment's frames, and says why it stopped before the log's clean
end, and whether that stop is a torn tail (never acknowledged: recovery cuts
it, verify reports ``torn``) or corruption (a :class:`LogCorruption` naming
segment, offset and last good LSN). Readers and followers position themselves
with the sparse index instead (:mod:`agentlog.events.log.read`) but classify
what they find with the same functions.
"""

from __future__ import annotations

import os
from itertools import chain
from pathlib import Path
from typing import Any, Generator, Iterator, NamedTuple, Sequence

from ..errors import AgentlogError
import numpy as np

from . import framecodec, segmap
from .api import LogCorruption, SchemaError
from .batch_compression import read_batch
from .lost import missing_acked, missing_indexed, missing_start
from .format import (
    ENV_HDR, FRAME_HDR, FRAME_PREFIX, LOG_START_LSN, BATCH_MAX_RECORDS, SEG_HDR_SIZE, TYPE_BATCH, TYPE_RECORD, Checkpoint,
    Watermark, crc_value as _crc_value, mask_crc, parse_segment_header, segment_name,
)


class Frame(NamedTuple):
    """A CRC-valid frame found by the scanner; ``payload`` is a zero-copy view (the
    compiled walk of a scanner whose ``payloads`` is off leaves it None, outside a compressed batch)."""

    offset: int
    end: int
    lsn: int
    session_seq: int
    ts_ns: int
    flags: int
    session_id: str
    payload: memoryview


class BadFrame(NamedTuple):
    """Where and why scanning a segment stopped before its end."""

    offset: int
    reason: str


_sid_cache: dict[bytes, str] = {}


def _decode_sid(raw: bytes) -> str:
    sid = _sid_cache.get(raw)
    if sid is None:
        sid = raw.decode("utf-8")
        if len(_sid_cache) > 65536:  # bounded: ids of ended sessions age out
            _sid_cache.clear()
        _sid_cache[raw] = sid
    return sid


#: Frames one call of the compiled scanner returns at most (bounds the work a
#: consumer that stops early wastes).
_NATIVE_BATCH = 4096
_NEED, _BAD, _MORE = 0, 3, 4  # the compiled scanner's stop codes (see _framecodec.c)


class _Shrunk(AgentlogError):
    pass


class SegmentScanner:
    """Reads CRC-valid frames of one segment file sequentially from an offset.

    It reads the segment mapped into memory where it can (:mod:`~agentlog.events.log.segmap`),
    else in large chunks with ``pread``, and never allocates more than
    ``max_record_bytes`` plus one chunk, whatever a length field claims.
    """

    #: Read size. Small enough that a chunk stays in the CPU cache between
    #: the ``pread`` that fills it and the CRC pass over it: measured (2-core
    #: VM, 2048-token events), the scan of 25 MB took 2.9 ms with 256 KiB
    #: chunks, 4.3 ms with 1 MiB and 7.8 ms with 4 MiB (a raw read: 1.6 ms).
    CHUNK = 256 << 10
    #: What the scanner yields (read_batch builds a compressed batch's frames as these).
    frame_type = Frame
    #: Read with the segment mapped into memory where it can (:mod:`~agentlog.events.log.segmap`).
    mapped = True
    #: Off: the compiled walk leaves ``payload`` None outside a compressed batch, for a walk that reads only where
    #: records are and whose (recovery): a view per frame is about a quarter of its time.
    payloads = True

    def __init__(self, fd: int, name: str, offset: int, expected_lsn: int, max_record_bytes: int) -> None:
        self.fd = fd
        self.name = name
        self.offset = offset
        self.expected = expected_lsn
        self.cap = max_record_bytes
        self.bad: BadFrame | None = None
        self._buf = b""
        self._buf_off = offset  # file offset of _buf[0]
        #: Frames of a compressed batch that a limit stopped in, last first (``offset`` is past the batch).
        self.rest: list[Frame] = []
        self._map: tuple | None = None  # (mmap, its memoryview) once mapped

    def _take_rest(self, limit: int | None) -> Iterator[Frame]:
        rest = self.rest
        while rest and (limit is None or rest[-1].lsn < limit):
            fr = rest.pop()
            self.expected = fr.lsn + 1
            yield fr

    def _fill(self, need_end: int, size: int) -> None:
        """Make _buf cover [self.offset, need_end) (need_end <= size)."""
        if self._buf_off <= self.offset and need_end <= self._buf_off + len(self._buf):
            return
        want = max(need_end, min(size, self.offset + self.CHUNK)) - self.offset
        self._buf = os.pread(self.fd, want, self.offset)
        self._buf_off = self.offset
        if len(self._buf) < need_end - self.offset:
            # The file shrank under us (a writer truncating a torn tail).
            raise _Shrunk()

    def frames(self, limit: int | None = None, size: int | None = None) -> Iterator[Frame]:
        """Yield valid frames until the end of the file, the first bad frame
        (recorded in ``self.bad``) or ``limit`` (an exclusive LSN bound)."""
        self.bad = None
        if size is None:
            size = os.fstat(self.fd).st_size
        try:
            yield from self._frames(limit, size)
        except _Shrunk:
            self.bad = BadFrame(self.offset, "file shrank while reading")

    def batches(self, limit: int | None = None, size: int | None = None) -> Iterator[list[Frame]]:
        """:meth:`frames` in lists (one per buffer's worth with the compiled
        codec, up to ``_NATIVE_BATCH`` with the pure-Python one), for readers
        that pay per record for each generator they pass a record through.
        ``offset`` and ``expected`` are past a list when it is yielded."""
        self.bad = None
        if size is None:
            size = os.fstat(self.fd).st_size
        batch: list[Frame] = []
        try:
            if framecodec.native is not None:
                yield from self._frames(limit, size, batched=True)
                return
            for fr in self._frames_py(limit, size, False):
                batch.append(fr)
                if len(batch) >= _NATIVE_BATCH:
                    yield batch
                    batch = []
        except _Shrunk:
            self.bad = BadFrame(self.offset, "file shrank while reading")
        if batch:  # the frames read before the walk stopped
            yield batch

    def frame_lists(self, limit: int | None = None, size: int | None = None) -> Iterator[Sequence[Frame]]:
        """:meth:`frames` in lists (:meth:`batches`), or one by one with the pure-Python codec, whose frames copy their bytes."""
        if framecodec.native is not None:
            return self.batches(limit, size)
        return ((fr,) for fr in self.frames(limit, size))

    def hand_out(self, frames: list, batched: bool, offset: int, expected: int) -> Iterator[Any]:
        """Yield scanned ``frames``, as one list with ``batched``, else one by one with ``offset``/``expected``
        kept current per frame, or past the whole batch for a compressed batch's frames, which share its place (a
        consumer may stop anywhere); ``offset``/``expected``: where the scan of them ended."""
        if batched:
            self.offset, self.expected = offset, expected
            yield frames
            return
        n, at = len(frames), -1
        for i, fr in enumerate(frames):
            if i > at:  # a frame, or a compressed batch's first: past the batch, as read_batch leaves it
                at = i
                while at + 1 < n and frames[at + 1].end == fr.end:
                    at += 1
                self.offset, self.expected = fr.end, frames[at].lsn + 1
            yield fr

    def _frames(self, limit: int | None, size: int, batched: bool = False) -> Iterator:
        codec = framecodec.native
        if codec is None:
            yield from self._frames_py(limit, size, False)
            return
        if self.rest:
            taken = list(self._take_rest(limit))
            yield from ([taken] if batched and taken else taken)
            if self.rest:
                return
        if segmap.mappable(self, size) and not (yield from segmap.frames_mapped(self, limit, size, batched, _NATIVE_BATCH)):
            return
        # The compiled walk takes every frame wholly inside the buffer in one call; one that
        # is not is read into a fresh buffer starting at it and the walk goes on there. Only a
        # header cut by the end of the file goes through one step of the Python loop.
        scan, cap = codec.scan, self.cap
        unpack_length = FRAME_HDR.unpack_from
        while True:
            buf, base = self._buf, self._buf_off
            rel = self.offset - base
            if 0 <= rel <= len(buf):
                frames, rel, expected, code, reason = scan(
                    buf, memoryview(buf) if self.payloads else None, Frame, rel, base, size, self.expected, limit, cap, _NATIVE_BATCH
                )
                if frames:
                    yield from self.hand_out(frames, batched, base + rel, expected)
                if code == _MORE:
                    continue
                if code == _BAD and buf[rel + 8] == TYPE_BATCH:  # a compressed batch, read here (never nested)
                    why = read_batch(self, base + rel, size)
                    if why:
                        self.bad = BadFrame(self.offset, why)
                        return
                    rest = self.rest
                    if limit is None or rest[0].lsn < limit:  # all its frames (rest is last first)
                        taken, self.rest = rest[::-1], []
                        self.expected = taken[-1].lsn + 1
                    else:
                        taken = list(self._take_rest(limit))
                    if batched:
                        if taken:
                            yield taken
                    else:
                        for fr in taken:
                            yield fr
                    if self.rest:
                        return
                    continue
                if code == _BAD:
                    self.bad = BadFrame(self.offset, reason)
                    return
                if code != _NEED and code != _BAD:  # limit or end of file
                    return
                off = self.offset
                if rel + FRAME_PREFIX <= len(buf):
                    # The header is here and the scan checked its length (within the cap and
                    # the file): read the whole frame, and what follows up to a chunk.
                    self._fill(off + FRAME_PREFIX + unpack_length(buf, rel)[1], size)
                    continue
                if size - off >= FRAME_PREFIX:
                    self._fill(off + FRAME_PREFIX, size)
                    continue
            if batched:
                step = list(self._frames_py(limit, size, True))
                if step:
                    yield step
                # A frame read means go on; none means the step stopped the walk.
                if not step or self.rest:
                    return
            else:
                more = yield from self._frames_py(limit, size, True)
                if not more:
                    return

    def _frames_py(self, limit: int | None, size: int, once: bool) -> Generator[Frame, None, bool]:
        """The pure-Python scanner (``once``: stop after one frame and return
        True; otherwise, or when it stops first, return False)."""
        # The hot loop of every reader: buffer state lives in locals, and the
        # buffer is refilled only when a frame is not wholly inside it.
        cap = self.cap
        unpack_hdr, unpack_env, crc_value = FRAME_HDR.unpack_from, ENV_HDR.unpack_from, _crc_value
        env_size = ENV_HDR.size
        p = 5 + env_size  # session id offset inside ``body`` (which starts after the CRC)
        yield from self._take_rest(limit)
        if self.rest:
            return False
        buf, base = self._buf, self._buf_off
        expected = self.expected
        while limit is None or expected < limit:
            off = self.offset
            if off >= size:
                return False
            rel = off - base
            if rel < 0 or rel + FRAME_PREFIX > len(buf):
                if size - off < FRAME_PREFIX:
                    self._fill(size, size)
                    self.bad = BadFrame(off, f"incomplete frame header ({size - off} bytes before end of file)")
                    return False
                self._fill(off + FRAME_PREFIX, size)
                buf, base = self._buf, self._buf_off
                rel = off - base
            crc, length, typ = unpack_hdr(buf, rel)
            if typ == TYPE_BATCH and self.fd >= 0:  # a compressed batch (batch_compression.py; never nested)
                reason = read_batch(self, off, size)
                if reason:
                    self.bad = BadFrame(off, reason)
                    return False
                yield from self._take_rest(limit)
                if once or self.rest:
                    return not self.rest
                buf, base, expected = self._buf, self._buf_off, self.expected
                continue
            if typ != TYPE_RECORD:
                what = "zero-filled" if typ == 0 and not any(buf[rel : rel + 64]) else f"type byte {typ}"
                self.bad = BadFrame(off, f"{what} (expected a record, type {TYPE_RECORD})")
                return False
            if length < env_size or length > cap:
                self.bad = BadFrame(off, f"frame length {length} out of range (expected {env_size}..{cap} bytes)")
                return False
            end = off + FRAME_PREFIX + length
            if end > size:
                self.bad = BadFrame(off, f"frame of {FRAME_PREFIX + length} bytes runs past end of file ({size})")
                return False
            if end - base > len(buf):
                self._fill(end, size)
                buf, base = self._buf, self._buf_off
                rel = off - base
            body = buf[rel + 4 : rel + FRAME_PREFIX + length]
            if mask_crc(crc_value(body)) != crc:
                self.bad = BadFrame(off, "CRC mismatch")
                return False
            lsn, seq, ts, flags, sidlen = unpack_env(body, 5)
            if env_size + sidlen > length:
                self.bad = BadFrame(off, f"session-id length {sidlen} exceeds frame length {length}")
                return False
            if lsn != expected:
                self.bad = BadFrame(off, f"lsn {lsn}, expected {expected}")
                return False
            try:
                sid = _decode_sid(body[p : p + sidlen])
            except UnicodeDecodeError:
                self.bad = BadFrame(off, "session id is not UTF-8")
                return False
            expected = lsn + 1
            self.offset = end
            self.expected = expected
            yield Frame(off, end, lsn, seq, ts, flags, sid, memoryview(body)[p + sidlen :])
            if once:
                return True
        return False


def find_later_frame(fd: int, start: int, size: int, lsn_lo: int, max_record_bytes: int) -> int | None:
    """Offset of a CRC-valid frame or compressed batch after ``start`` whose
    (first) lsn is in [lsn_lo, lsn_lo + BATCH_MAX_RECORDS + 2] (a damaged batch
    may hold that many records), or None. It compares the 8 bytes at every
    offset with the range, vectorised (the LSN is at a fixed place in every
    frame and batch), so it runs at C speed over megabytes."""
    lsn_at, hi = FRAME_PREFIX, lsn_lo + BATCH_MAX_RECORDS + 2  # lsn follows crc, length and type
    pos = start + 1
    chunk = 1 << 20
    while pos < size:
        buf = os.pread(fd, min(chunk + 16, size - pos), pos)
        n = len(buf) - lsn_at - 7
        if n > 0:
            lsns = np.ndarray((n,), "<u8", buf, lsn_at, (1,))  # unaligned: the u64 at each offset
            kinds = np.frombuffer(buf, np.uint8, n, lsn_at - 1)
            hits = np.flatnonzero((lsns >= lsn_lo) & (lsns <= hi) & ((kinds == TYPE_RECORD) | (kinds == TYPE_BATCH)))
            for i in hits.tolist():
                expected = int(lsns[i])
                sc = SegmentScanner(fd, "", pos + i, expected, max_record_bytes)
                for _ in sc.frames(limit=expected + 1, size=size):
                    return pos + i
        pos += chunk
    return None


# ---------------------------------------------------------------- classification


def classify_bad(fd: int, name: str, size: int, bad: BadFrame, expected: int, watermark: int | None, later_segments: bool,
                 cap: int, indexed: int | None = None) -> LogCorruption | None:
    """A stop in the middle of a segment: corruption (returned) or a torn tail (None).

    It is corruption when valid records follow (later segments, or a valid
    frame further on in this one) or when the damaged record was already
    durable per the DURABLE watermark, or described by the INDEX checkpoint
    (``indexed``: its LSN; it describes only synced records). Otherwise it is
    the tail of a write that never completed, which was never acknowledged.
    """
    where = f"segment {name}, offset {bad.offset}, last good lsn {expected - 1}: {bad.reason}"
    if later_segments:
        why = "later segments exist, so this is not a torn tail"
    elif watermark is not None and expected < watermark:
        why = f"lsn {expected} is below the durable watermark {watermark}, so it was acknowledged"
    elif indexed is not None and expected < indexed:
        why = f"the INDEX checkpoint describes records up to lsn {indexed - 1}, so lsn {expected} was synced"
    else:
        later = find_later_frame(fd, bad.offset, size, expected, cap)
        if later is None:
            return None
        why = f"a valid frame follows at offset {later}, so this is not a torn tail"
    return LogCorruption(f"{where}; {why}", segment=name, offset=bad.offset, last_good_lsn=expected - 1)


def proof(durable: Watermark | None) -> int | None:
    """The watermark recovery and verify may hold the log to: only one whose
    records were synced (under fsync="never" a power loss can keep the
    watermark and drop the data it covers)."""
    return durable.lsn if durable is not None and durable.synced else None


def read_head(path: Path) -> bytes:
    """The first SEG_HDR_SIZE bytes of a file (a segment may be 64 MiB)."""
    with open(path, "rb") as f:
        return f.read(SEG_HDR_SIZE)


def header_being_created(size: int, header: bytes) -> bool:
    """A segment header that is short or all zeros: what a crash (or a live
    writer) leaves while the segment is being created."""
    return size < SEG_HDR_SIZE or not any(header)


def torn_new_segment(size: int, header: bytes, first: int, watermark: int | None) -> bool:
    """Is a last segment with a bad header the remains of a crash while it was
    being created? Yes if it cannot hold an acknowledged record: the watermark
    says nothing from its first LSN on was durable, or (no watermark) the
    header is short or all zeros."""
    if watermark is not None:
        return first >= watermark
    return header_being_created(size, header)


def open_segment(directory: Path, first: int, flags: int = os.O_RDONLY) -> tuple[int, int, int]:
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


def payload_error(name: str, fr: Frame, exc: Exception) -> LogCorruption | SchemaError:
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


# ---------------------------------------------------------------- the walk (recovery and verify)


class ScanStop(NamedTuple):
    """Why a :class:`LogWalk` stopped before the log's clean end."""

    #: Position, in the walked segment list, of the segment it stopped in.
    index: int
    #: Where it stopped: the bad frame's offset, or 0 for a bad header or a segment that starts at the wrong LSN.
    offset: int
    #: Bytes from ``offset`` to the end of the segment file.
    tail_bytes: int
    #: What is wrong there, in a few words.
    reason: str
    #: None for a torn tail or torn header (never acknowledged: safe to cut);
    #: otherwise the corruption, naming segment, offset and last good LSN.
    corruption: LogCorruption | None
    #: True when the walk stopped before the segment (its header is bad, or it
    #: starts at the wrong LSN): nothing of it was scanned.
    header: bool


class SegmentScan:
    """One segment of a :class:`LogWalk`, open while the walk is on it. Iterate
    :meth:`frames` (or :meth:`frame_lists`), then call :meth:`end` to learn why it ended."""

    def __init__(self, walk: "LogWalk", index: int, first: int, fd: int, epoch: int, size: int, offset: int) -> None:
        self.walk = walk
        self.index = index
        self.first = first
        self.name = segment_name(first)
        self.fd = fd
        self.epoch = epoch
        self.size = size
        self.last = index == len(walk.segments) - 1
        self.scanner = SegmentScanner(fd, self.name, offset, walk.expected, walk.cap)
        self.scanner.payloads = walk.payloads

    def frame_lists(self) -> Iterator[Sequence[Frame]]:
        """The segment's CRC-valid frames in order, up to the first bad one, in lists (:meth:`SegmentScanner.frame_lists`)."""
        return self.scanner.frame_lists(size=self.size)

    def frames(self) -> Iterator[Frame]:
        """:meth:`frame_lists`, one frame at a time."""
        return chain.from_iterable(self.frame_lists())

    def end(self) -> ScanStop | None:
        """After :meth:`frames` is exhausted: None when the segment ended
        cleanly, else the stop (also kept as ``walk.stop``; the walk goes no
        further). Advances ``walk.expected`` past the segment's last good record."""
        walk, sc = self.walk, self.scanner
        walk.expected = sc.expected
        bad = sc.bad
        if bad is None:
            return None
        indexed = walk.indexed.lsn if walk.indexed is not None else None
        err = classify_bad(self.fd, self.name, self.size, bad, sc.expected, walk.watermark, not self.last, walk.cap, indexed)
        walk.stop = ScanStop(self.index, bad.offset, self.size - bad.offset, bad.reason, err, False)
        return walk.stop

    def close(self) -> None:
        """Close the segment's descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LogWalk:
    """One pass over a log directory's segments in LSN order, from a start
    position (the first segment's header, or a checkpoint's segment, offset
    and LSN). Recovery and verify both scan the log with it.

    Iterate :meth:`scan`: it yields a :class:`SegmentScan` per segment, open
    (read-write with ``writable``) and closed again when the caller moves on.
    A segment that starts at the wrong LSN, or whose header is bad, ends the
    walk before it is yielded; a bad frame ends it at that segment's
    :meth:`SegmentScan.end`. Either way ``stop`` says why; ``expected`` is the
    LSN after the last good record."""

    def __init__(
        self,
        directory: Path,
        segments: list[int],
        *,
        max_record_bytes: int,
        watermark: int | None,
        indexed: Checkpoint | None = None,
        start_index: int = 0,
        offset: int = SEG_HDR_SIZE,
        expected: int | None = None,
        writable: bool = False,
        payloads: bool = True,
    ) -> None:
        self.dir = directory
        self.segments = segments
        self.cap = max_record_bytes
        #: The proven durable watermark (see :func:`proof`), or None.
        self.watermark = watermark
        #: The directory's INDEX checkpoint (CRC-checked), whose records must exist too, or None.
        self.indexed = indexed
        self.start_index = start_index
        self.offset = offset
        self.expected = expected if expected is not None else LOG_START_LSN
        self.flags = os.O_RDWR if writable else os.O_RDONLY
        #: Off: the frames' payloads are not read (:attr:`SegmentScanner.payloads`).
        self.payloads = payloads
        self.stop: ScanStop | None = None

    def scan(self) -> Generator[SegmentScan, None, None]:
        """The segments, one at a time (see the class docstring)."""
        offset = self.offset
        for i in range(self.start_index, len(self.segments)):
            first = self.segments[i]
            name = segment_name(first)
            expected = self.expected
            if offset == SEG_HDR_SIZE and first != expected:
                head = missing_start(self.dir, self.segments) if i == 0 else None
                err = head or LogCorruption(
                    f"segment {name}: starts at lsn {first}, expected {expected} (the previous segment ends at lsn {expected - 1})",
                    segment=name,
                    offset=0,
                    last_good_lsn=expected - 1,
                )
                self.stop = ScanStop(i, 0, (self.dir / name).stat().st_size, f"starts at lsn {first}", err, True)
                return
            try:
                fd, epoch, size = open_segment(self.dir, first, self.flags)
            except LogCorruption as err:
                size = (self.dir / name).stat().st_size
                torn = i == len(self.segments) - 1 and torn_new_segment(size, read_head(self.dir / name), first, self.watermark)
                # The header check knows the file, not the log: name the last good record too.
                err = LogCorruption(str(err), segment=err.segment, offset=err.offset, last_good_lsn=expected - 1)
                self.stop = ScanStop(i, 0, size, f"segment header torn ({size} bytes)", None if torn else err, True)
                return
            seg = SegmentScan(self, i, first, fd, epoch, size, offset)
            try:
                yield seg
            finally:
                seg.close()
            if self.stop is not None:
                return
            offset = SEG_HDR_SIZE

    def missing_acked(self, name: str, size: int) -> LogCorruption | None:
        """At the log's clean end (``size`` bytes into segment ``name``, or no
        segment: ``name`` empty): the corruption when acknowledged records
        (below the proven watermark) or records the INDEX checkpoint
        describes are missing, else None."""
        if self.watermark is not None and self.expected < self.watermark:
            return missing_acked(name, size, self.expected, self.watermark)
        return missing_indexed(self.dir, name, size, self.expected, self.indexed)
