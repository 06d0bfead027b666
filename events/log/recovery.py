"""Crash recovery of a log directory, run by the writer when it opens the log.

It keeps the longest valid prefix: a torn tail (records past the durable
watermark, never acknowledged) is truncated, and a segment torn while being
created is removed. A damaged frame followed by valid ones, or one below the
durable watermark, is corruption: :class:`LogCorruption` names segment,
offset and last good LSN, unless ``salvage=True`` moves the damaged rest into
``salvage-<epoch>/`` (never deleted). It scans with the same
:class:`~agentlog.events.log.scan.LogWalk` as ``verify_log``, from the
``INDEX`` checkpoint when that checks out, so opening a log does not rescan it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from agentlog._logging import get_logger

from ..fs import atomic_file, fsync_dir
from .api import LogCorruption
from .format import (
    DURABLE_NAME,
    FENCE_NAME,
    FLAG_TERMINAL,
    INDEX_EVERY_BYTES,
    LOG_START_LSN,
    SEG_HDR_SIZE,
    Checkpoint,
    list_segments,
    load_checkpoint,
    read_watermark,
    segment_name,
)
from . import framecodec
from .scan import Frame, LogWalk, SegmentScanner, open_segment, proof

log = get_logger("agentlog.events.log.recovery")


def note_frames(frames: Iterable[Frame], entries: list[tuple[int, int]], last_off: int, every: int,
                state: dict[str, int], terminal: int) -> int:
    """Recovery's step over scanned ``frames``: add ``(lsn, offset)`` to the
    segment's sparse index ``entries`` each ``every`` bytes past ``last_off``,
    and keep ``state`` (session -> next session_seq) of the sessions a
    terminal frame has not ended. Returns the new ``last_off``. The compiled
    codec's ``recovery_note`` is this loop in C (a differential test holds
    them to the same result): it runs once per record rescanned."""
    # Unpacked, not read by name.
    for frame_at, _end, lsn, seq, _ts, flags, sid, _payload in frames:
        if frame_at - last_off >= every:
            entries.append((lsn, frame_at))
            last_off = frame_at
        if flags & terminal:
            state.pop(sid, None)
        else:
            state[sid] = seq + 1
    return last_off


class Recovered(NamedTuple):
    """The writer state a recovered log directory holds."""

    #: The highest writer epoch found (the next writer takes one more).
    epoch: int
    #: First LSNs of the segments kept, ascending.
    segments: list[int]
    #: Sparse index of the kept segments: first lsn -> [(lsn, offset), ...].
    index: dict[int, list[tuple[int, int]]]
    #: Open sessions with their next session_seq.
    open_sessions: dict[str, int]
    #: The LSN the next record gets.
    next_lsn: int
    #: True when the INDEX checkpoint could not be used and the index was rebuilt by a scan.
    rebuilt: bool
    #: True when the INDEX checkpoint no longer describes the directory (rewrite it).
    stale_checkpoint: bool
    #: Bytes of segment files scanned past the starting point (the checkpoint's
    #: offset, or the first segment's header when the index was rebuilt).
    rescanned_bytes: int = 0


def checkpoint_problem(directory: Path, ckpt: Checkpoint, segs: list[int], cap: int) -> str:
    """Why the checkpoint cannot be trusted ('' when it can).

    Its position must be a frame boundary of its segment: the frames from
    the segment's last index entry (itself a frame, or the checkpoint's own
    position for a rotation's checkpoint) must end exactly at its offset with
    its LSN, a scan of at most one index interval. What follows it, if
    anything, is for the recovery walk to judge (a torn tail is cut there)."""
    if not ckpt.segments or ckpt.segments != segs[: len(ckpt.segments)] or ckpt.segment != ckpt.segments[-1]:
        return "its segment list does not match the directory"
    if ckpt.offset < SEG_HDR_SIZE:
        return f"offset {ckpt.offset} is inside the segment header"
    own = ckpt.index.get(ckpt.segment)
    if not own:
        return f"index has no entry for its own segment {segment_name(ckpt.segment)}"
    name = segment_name(ckpt.segment)
    try:
        fd, _, size = open_segment(directory, ckpt.segment)
    except (OSError, LogCorruption) as exc:
        return f"segment {name} unreadable: {exc}"
    try:
        if ckpt.offset > size:
            return f"offset {ckpt.offset} is past the end of {name} ({size} bytes)"
        lsn, off = own[-1]
        sc = SegmentScanner(fd, name, off, lsn, cap)
        for _ in sc.frames(limit=ckpt.lsn, size=ckpt.offset):
            pass
        if sc.rest:  # the checkpoint's lsn lies inside a compressed batch: no frame boundary
            return (f"the checkpoint's lsn {ckpt.lsn} lies inside the compressed batch of {name} that ends at offset "
                    f"{sc.offset}, lsn {sc.rest[0].lsn + 1}: not a frame boundary")
        if (sc.expected, sc.offset) != (ckpt.lsn, ckpt.offset):
            return (
                f"the frames of {name} from index entry (lsn {lsn}, offset {off}) end at lsn {sc.expected}, "
                f"offset {sc.offset}, not at the checkpoint's lsn {ckpt.lsn}, offset {ckpt.offset}"
            )
    finally:
        os.close(fd)
    # Spot-check the last index entry of every other segment it covers.
    for first, entries in ckpt.index.items():
        if first not in ckpt.segments or not entries:
            return f"index names segment {first} it does not list"
        if first == ckpt.segment:
            continue
        lsn, off = entries[-1]
        try:
            fd, _, size = open_segment(directory, first)
        except (OSError, LogCorruption) as exc:
            return f"segment {segment_name(first)} unreadable: {exc}"
        try:
            sc = SegmentScanner(fd, segment_name(first), off, lsn, cap)
            if next(sc.frames(limit=lsn + 1, size=size), None) is None:
                return f"index entry (lsn {lsn}, offset {off}) of {segment_name(first)} does not match the log"
        finally:
            os.close(fd)
    return ""


def fence_without_log(directory: Path, fence_epoch: int) -> LogCorruption | None:
    """Cross-check of ``FENCE`` against the directory, before a writer opens
    it: a FENCE naming epoch 2 or more says writers opened the log before,
    and each left a DURABLE watermark behind (a writer creates DURABLE
    before it writes FENCE; writers before that order could leave a lone
    FENCE of epoch 1 by a crash at their first open). With DURABLE and every
    segment gone, the log's records were removed: refused, never restarted
    at lsn 0. None when the FENCE is consistent with what is on disk."""
    if fence_epoch < 2 or (directory / DURABLE_NAME).exists() or list_segments(directory):
        return None
    return LogCorruption(
        f"log {directory}: its {FENCE_NAME} file says writer epoch {fence_epoch} opened it, but {DURABLE_NAME} "
        f"and every segment file ({segment_name(LOG_START_LSN)} on) are missing: its records were removed; "
        f"expected segments from lsn {LOG_START_LSN} and a {DURABLE_NAME} watermark. Restore them, or remove "
        f"{FENCE_NAME} to start an empty log here",
        segment=segment_name(LOG_START_LSN),
        offset=0,
        last_good_lsn=LOG_START_LSN - 1,
    )


def recover(directory: Path, *, max_record_bytes: int, salvage: bool) -> Recovered:
    """Recover the log directory at ``directory`` (the caller holds the
    writer lock): cut a torn tail, remove a segment torn while being created
    and an empty last segment, make what a crashed writer wrote durable, and
    return the state the next writer starts from. Raises LogCorruption for
    corruption unless ``salvage`` moves the damaged rest aside."""
    d = directory
    rlog = log.bind(log_dir=str(d))
    segs = list_segments(d)
    durable = read_watermark(d)
    watermark = proof(durable)
    if durable is not None and watermark is None:
        rlog.info("log.recovery.watermark_unsynced", watermark=durable.lsn, reason="written under fsync=never: a hint, not proof")
    ckpt, why = load_checkpoint(d)
    epoch = max(durable.epoch if durable else 0, ckpt.epoch if ckpt else 0)
    state: dict[str, int] = {}
    index: dict[int, list[tuple[int, int]]] = {}
    start_i, offset, expected = 0, SEG_HDR_SIZE, LOG_START_LSN
    rebuilt = True
    if ckpt is not None and segs:
        why = checkpoint_problem(d, ckpt, segs, max_record_bytes)
        if not why:
            rebuilt = False
            start_i = segs.index(ckpt.segment)
            offset, expected = ckpt.offset, ckpt.lsn
            state = dict(ckpt.open_sessions)
            index = {k: list(v) for k, v in ckpt.index.items()}
    if rebuilt and segs:
        rlog.info("log.index.rebuilding", reason=why, segments=len(segs))
    scanned = 0
    rescanned = 0
    changed = False
    truncated = False
    walk = LogWalk(
        d,
        segs,
        max_record_bytes=max_record_bytes,
        watermark=watermark,
        # An INDEX describes only synced records: they must all be found, even
        # when it cannot be used as a starting point.
        indexed=ckpt,
        start_index=start_i,
        offset=offset,
        expected=expected,
        writable=True,
        payloads=False,  # it reads where records are and whose, never what they say
    )
    # closing(): an error raised inside the walk closes the segment it has open at once.
    with contextlib.closing(walk.scan()) as walked:
        for seg in walked:
            first, name, fd = seg.first, seg.name, seg.fd
            epoch = max(epoch, seg.epoch)
            entries = index.setdefault(first, [(first, SEG_HDR_SIZE)])
            last_off = entries[-1][1]
            # In C a list of frames at a time with the compiled codec, else the same loop in Python (note_frames).
            native = framecodec.native
            if native is None:
                last_off = note_frames(seg.frames(), entries, last_off, INDEX_EVERY_BYTES, state, FLAG_TERMINAL)
            else:
                for frames in seg.frame_lists():
                    last_off = native.recovery_note(frames, entries, last_off, INDEX_EVERY_BYTES, state, FLAG_TERMINAL)
            scanned += 1
            rescanned += seg.size - (offset if seg.index == start_i else SEG_HDR_SIZE)
            stop = seg.end()
            size = seg.size
            if stop is not None:
                if stop.corruption is not None:
                    if not salvage:
                        raise stop.corruption
                    _salvage(d, segs[seg.index + 1 :], fd, stop.offset, stop.corruption, epoch, name)
                    segs = segs[: seg.index + 1]
                else:
                    rlog.warning(
                        "log.recovery.torn_tail",
                        segment=name,
                        offset=stop.offset,
                        cut_bytes=stop.tail_bytes,
                        last_good_lsn=walk.expected - 1,
                        reason=stop.reason,
                    )
                    os.ftruncate(fd, stop.offset)
                truncated = True
                size = stop.offset
            if seg.index == len(segs) - 1:
                err = walk.missing_acked(name, size)
                if err is not None:
                    if not salvage:
                        raise err
                    rlog.warning("log.recovery.salvaged", error=str(err), last_good_lsn=walk.expected - 1)
                # Records a crashed writer wrote but never synced become durable now,
                # before the watermark claims them.
                os.fsync(fd)
                if size <= SEG_HDR_SIZE:
                    # No records: the next writer starts a segment of this very name.
                    seg.close()
                    os.unlink(d / name)
                    fsync_dir(d)
                    index.pop(first, None)
                    segs = segs[: seg.index]
                    changed = True
    stop = walk.stop
    if stop is not None and stop.header:
        # The walk ended before segment ``stop.index``: it starts at the wrong
        # LSN, or its header is bad.
        name = segment_name(segs[stop.index])
        if stop.corruption is None:
            # Torn while being created: it never held an acknowledged record.
            rlog.warning("log.recovery.removed_torn_segment", segment=name, size=stop.tail_bytes)
            os.unlink(d / name)
            fsync_dir(d)
        else:
            if not salvage:
                raise stop.corruption
            _salvage(d, segs[stop.index :], None, 0, stop.corruption, epoch)
        segs = segs[: stop.index]
        changed = changed or stop.corruption is None
    if not salvage:
        name = segment_name(segs[-1]) if segs else ""
        err = walk.missing_acked(name, (d / name).stat().st_size if segs else 0)
        if err is not None:
            raise err
    return Recovered(
        epoch=epoch,
        segments=list(segs),
        index={k: v for k, v in index.items() if k in set(segs)},
        open_sessions=state,
        next_lsn=walk.expected,
        rebuilt=rebuilt,
        # Anything rescanned is checkpointed again, so repeated crashes never
        # add up to a longer rescan than one.
        stale_checkpoint=rebuilt or changed or scanned > 1 or truncated or rescanned > 0,
        rescanned_bytes=rescanned,
    )


def _copy_range(fd: int, start: int, end: int, out: Any, what: str) -> None:
    """Write bytes ``start..end`` of the file ``fd`` (``what``, for the error) to the open file ``out``."""
    pos = start
    while pos < end:
        chunk = os.pread(fd, min(1 << 20, end - pos), pos)
        if not chunk:
            raise LogCorruption(f"{what}: ended at offset {pos} while being copied up to offset {end} (it shrank)")
        out.write(chunk)
        pos += len(chunk)


def _salvage(directory: Path, later: list[int], fd: int | None, offset: int, err: LogCorruption, epoch: int, name: str = "") -> None:
    """Move damaged bytes and everything after them into ``salvage-<epoch>/``
    (never deleted), keeping the valid prefix as the log."""
    dest = directory / f"salvage-{epoch + 1}"
    dest.mkdir(exist_ok=True)
    if fd is not None:
        with open(dest / f"{name}.tail@{offset}", "wb") as out:
            _copy_range(fd, offset, os.fstat(fd).st_size, out, f"{directory / name}")
            out.flush()
            os.fsync(out.fileno())
        # The kept prefix replaces the segment as a new file; the file is never cut in place. A
        # reader (another process) may hold frames past the damage, mapped from this file (it
        # sought past the damage with the INDEX): cutting the file under its mapping would kill it
        # with SIGBUS. Its mapping keeps the old file, whose space is freed once nobody maps it.
        with atomic_file(directory / name) as kept:
            _copy_range(fd, 0, offset, kept, f"{directory / name}")
    for first in later:
        os.replace(directory / segment_name(first), dest / segment_name(first))
    fsync_dir(dest)
    fsync_dir(directory)
    log.bind(log_dir=str(directory)).warning(
        "log.recovery.salvaged",
        error=str(err),
        moved_segments=len(later),
        moved_to=str(dest),
        last_good_lsn=err.last_good_lsn,
    )
