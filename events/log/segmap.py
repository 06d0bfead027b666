"""The segment scanner's fast path: frames read straight from the segment
file mapped into memory, with no copy into a read buffer
(:class:`~agentlog.events.log.scan.SegmentScanner` uses it with the compiled
codec and its hardware CRC32C).

A mapped file that shrinks (recovery cutting a torn tail, a repair) would
turn a read past its new end into SIGBUS; the compiled ``scan_mapped`` reads
the mapping under a guard that reports that as "file shrank while reading",
the pread scanner's words. Everything else the fast path meets but a plain
valid frame (a torn or damaged frame, a header cut by the end of the file)
is left to the pread path, which says why it stopped in its usual words.
A compressed batch is decompressed and checked by the compiled walk too
(libzstd, loaded by the compiled codec), which takes only a batch plainly
valid, whole and below the limit; any other goes to the pread path, which
reads it again and names what is wrong.

With two CPUs or more and at least ``MIN_THREADED_BYTES`` left to read, the
walk over the mapping (bounds, CRC32C, LSN sequence: the part that touches
every byte) runs in a thread of the compiled codec's own (``MappedScan``),
which never takes the GIL, a ring of checked frames ahead of this thread,
which builds their Python objects and hands them on. No frame is handed out
before the walk has checked it, and its stops are ``scan_mapped``'s, so the
reader's results and errors are the same; only the CRC pass, about as long
as the per-record Python work of a replay, runs beside that work instead of
before it. Closing the generator (a reader that stops early) stops the thread.
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any, Generator

from . import framecodec
from .format import batch_raw_cap
from .osops import raise_nofile_limit

if TYPE_CHECKING:
    from .scan import SegmentScanner

#: Map a segment only when this much of it is left to read: below it one pread is as cheap.
MIN_MAPPED_BYTES = 256 << 10
_MORE, _BAD, _SHRANK = 4, 3, 5  # the compiled scanner's stop codes (see _framecodec.c)
#: Check the frames in a second thread (the compiled ``MappedScan``) when this
#: much is left to read: its CRC pass then runs beside the per-record Python
#: work instead of before it. Below it, starting the thread costs more than it saves.
MIN_THREADED_BYTES = 4 << 20
#: Decompress and check compressed batches in the compiled walk (with the libzstd the
#: compiled codec loads, ``zstd_version()``), in that thread or, without it, in this
#: one (``scan_mapped``): a batch's frames then arrive checked, as a segment's do. Off,
#: every batch goes through the pread path.
WALK_BATCHES = True


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: CPUs this process may run on (a second thread helps only with two or more).
CPUS = _cpus()


def mappable(sc: "SegmentScanner", size: int) -> bool:
    """True when the fast path can read ``sc``'s segment from its offset to ``size``."""
    codec = framecodec.native
    return (
        sc.mapped
        and sc.fd >= 0
        and codec is not None
        and size - sc.offset >= MIN_MAPPED_BYTES
        and codec.crc_backend() != "python"  # either hardware kernel: the walk runs without the GIL
        and not sc.rest
    )


def _mapping(sc: "SegmentScanner", size: int) -> tuple[Any, memoryview]:
    """The segment mapped from its start to ``size`` (mapped again when the file grew)."""
    m = sc._map
    if m is None or len(m[0]) < size:
        # A mapping holds a descriptor of its own (CPython's mmap keeps a dup) for as long as a frame
        # handed out from it lives: a caller holding the envelopes of many segments holds that many.
        raise_nofile_limit()
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
    codec = framecodec.native
    assert codec is not None  # mappable() checked it
    try:
        mm, view = _mapping(sc, size)
    except (OSError, ValueError):  # not mappable (the file shrank since its size was taken, a file system without mmap)
        sc._buf, sc._buf_off = b"", sc.offset
        return True
    walk = None
    payload_view = view if sc.payloads else None  # the frames' payloads are slices of it; None: frames without
    raw_cap = batch_raw_cap(sc.cap) if WALK_BATCHES else 0
    if CPUS > 1 and size - sc.offset >= MIN_THREADED_BYTES:
        try:
            walk = codec.MappedScan(mm, payload_view, sc.frame_type, sc.offset, 0, size, sc.expected, limit, sc.cap, raw_cap)
        except OSError:  # no thread to be had (a process limit): the walk runs in this thread
            walk = None
    try:
        return (yield from _walk(sc, walk, mm, payload_view, limit, size, batched, max_frames, raw_cap, os.getpid()))
    finally:
        if walk is not None:
            walk.close()  # a consumer that stopped early: the thread stops too (a forked child's close leaves it be)


def _walk(sc: "SegmentScanner", walk: Any, mm: Any, view: memoryview | None, limit: int | None, size: int, batched: bool,
          max_frames: int, raw_cap: int, owner: int) -> Generator[Any, None, bool]:
    """The loop of :func:`frames_mapped`: frames from ``walk`` (a ``MappedScan``, whose thread runs in
    process ``owner``) or, without one, from ``scan_mapped``. A forked child that goes on with a reader
    its parent started has no walk thread: it reads on with ``scan_mapped`` from where the last take ended."""
    from .scan import BadFrame  # scan imports this module

    codec = framecodec.native
    assert codec is not None
    scan = codec.scan_mapped
    make, cap = sc.frame_type, sc.cap
    while True:
        if walk is not None and owner != os.getpid():
            walk = None  # its thread is the parent's (closed by frames_mapped: a no-op here)
        if walk is not None:
            frames, rel, expected, code, _reason = walk.take(max_frames)
        else:
            frames, rel, expected, code, _reason = scan(mm, view, make, sc.offset, 0, size, sc.expected, limit, cap, max_frames, raw_cap)
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

