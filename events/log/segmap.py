"""The segment scanner's fast path: frames read straight from the segment
file mapped into memory, with no copy into a read buffer
(:class:`~agentlog.events.log.scan.SegmentScanner` uses it with the compiled
codec and its hardware CRC32C).

A mapped file that shrinks (recovery cutting a torn tail, a repair) would
turn a read past its new end into SIGBUS; the compiled ``scan_mapped`` reads
the mapping under a guard that reports that as "file shrank while reading",
the pread scanner's words. Everything else the fast path meets but a plain
valid frame (a torn or damaged frame, a header cut by the end of the file)
is left to the pread path, which says why it stopped in its usual words,
and so is a compressed batch (with what follows it in the pread buffer:
measured, decompression costs far more than the copy, and a mapped scan
per batch saved nothing).
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any, Generator

from . import framecodec

if TYPE_CHECKING:
    from .scan import SegmentScanner

#: Map a segment only when this much of it is left to read: below it one pread is as cheap.
MIN_MAPPED_BYTES = 256 << 10
_MORE, _BAD, _SHRANK = 4, 3, 5  # the compiled scanner's stop codes (see _framecodec.c)


def mappable(sc: "SegmentScanner", size: int) -> bool:
    """True when the fast path can read ``sc``'s segment from its offset to ``size``."""
    codec = framecodec.native
    return (
        sc.mapped
        and sc.fd >= 0
        and codec is not None
        and size - sc.offset >= MIN_MAPPED_BYTES
        and codec.crc_backend() == "hardware"
        and not sc.rest
    )


def _mapping(sc: "SegmentScanner", size: int) -> tuple[Any, memoryview]:
    """The segment mapped from its start to ``size`` (mapped again when the file grew)."""
    m = sc._map
    if m is None or len(m[0]) < size:
        mm = mmap.mmap(sc.fd, size, prot=mmap.PROT_READ)
        # Frames handed out keep views of the old mapping: it is unmapped when the last goes.
        m = sc._map = (mm, memoryview(mm))
    return m


def frames_mapped(sc: "SegmentScanner", limit: int | None, size: int, batched: bool, max_frames: int) -> Generator[Any, None, bool]:
    """Yield ``sc``'s valid frames (lists of them with ``batched``) from the
    mapped segment, keeping ``sc.offset``/``sc.expected`` as the pread path
    does. Returns True when the pread path must go on from ``sc.offset`` (a
    frame that is not plainly valid, or a compressed batch), False when the
    scan is over (end of file, ``limit``, or the file shrank: ``sc.bad`` set)."""
    from .scan import BadFrame  # scan imports this module

    codec = framecodec.native
    assert codec is not None  # mappable() checked it
    scan = codec.scan_mapped
    try:
        mm, view = _mapping(sc, size)
    except (OSError, ValueError):  # not mappable (the file shrank since its size was taken, a file system without mmap)
        sc._buf, sc._buf_off = b"", sc.offset
        return True
    make, cap = sc.frame_type, sc.cap
    while True:
        frames, rel, expected, code, _reason = scan(mm, view, make, sc.offset, 0, size, sc.expected, limit, cap, max_frames)
        if frames:
            yield from sc.hand_out(frames, batched, rel, expected)
        sc.offset, sc.expected = rel, expected
        if code == _MORE:
            continue
        if code == _SHRANK:
            sc.bad = BadFrame(rel, "file shrank while reading")
            return False
        if code == _BAD or code == 0:  # the pread path reads it (a compressed batch) or names what is wrong
            sc._buf, sc._buf_off = b"", sc.offset
            return True
        return False  # limit or end of file

