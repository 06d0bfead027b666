"""Lost records: the log ends cleanly, but before records it must hold (the
DURABLE watermark says they were acknowledged, or the INDEX checkpoint
describes them), or its head is gone. Nothing removes a log's head or
acknowledged records on purpose, so each is corruption, named with the
segment and LSN range. The walk (:mod:`agentlog.events.log.scan`) and the
readers (:mod:`agentlog.events.log.read`) call these where the log ends.
"""

from __future__ import annotations

from pathlib import Path

from .api import LogCorruption
from .format import LOG_START_LSN, Checkpoint, list_segments, segment_name


def missing_acked(name: str, size: int, expected: int, watermark: int) -> LogCorruption:
    """The log ends cleanly (at ``size`` in segment ``name``; ``name`` empty:
    no segment files exist), but before records the watermark says were
    acknowledged."""
    if not name:
        return LogCorruption(
            f"no segment files exist, but the durable watermark says lsn {expected}..{watermark - 1} "
            f"were acknowledged; they are missing",
            segment="",
            offset=0,
            last_good_lsn=expected - 1,
        )
    return LogCorruption(
        f"segment {name}, offset {size}, last good lsn {expected - 1}: the log ends here, but the durable "
        f"watermark says lsn {expected}..{watermark - 1} were acknowledged; they are missing",
        segment=name,
        offset=size,
        last_good_lsn=expected - 1,
    )


def missing_start(directory: Path, segments: list[int]) -> LogCorruption | None:
    """The head of the log is gone: its first segment file does not start at
    :data:`~agentlog.events.log.format.LOG_START_LSN` (nothing removes a
    log's head on purpose). None when it does, or when there are no segments."""
    if not segments or segments[0] == LOG_START_LSN:
        return None
    lost, found = segment_name(LOG_START_LSN), segment_name(segments[0])
    return LogCorruption(
        f"log {directory}: segment {lost} is missing: the first segment is {found}, which starts at lsn "
        f"{segments[0]}; expected the log to start at lsn {LOG_START_LSN}, so lsn {LOG_START_LSN}..{segments[0] - 1} are missing",
        segment=lost,
        offset=0,
        last_good_lsn=LOG_START_LSN - 1,
    )


def missing_indexed(directory: Path, name: str, size: int, expected: int, ckpt: Checkpoint | None) -> LogCorruption | None:
    """At the log's clean end (``size`` bytes into segment ``name``; ``name``
    empty: no segment files exist), with ``expected`` the LSN after the last
    record found: the corruption when the ``INDEX`` checkpoint ``ckpt``
    describes records past it, else None. The writer writes an INDEX only
    once the records it describes are synced, so they must exist (a last
    segment deleted, with DURABLE, say)."""
    if ckpt is None or expected >= ckpt.lsn:
        return None
    on_disk = set(list_segments(directory))
    gone = [segment_name(s) for s in ckpt.segments if s not in on_disk]
    where = f"the log ends at offset {size} of segment {name}" if name else "no segment files exist"
    return LogCorruption(
        f"log {directory}: {where} (last good lsn {expected - 1}), but its INDEX checkpoint (writer epoch "
        f"{ckpt.epoch}, at offset {ckpt.offset} of segment {segment_name(ckpt.segment)}) says lsn "
        f"{expected}..{ckpt.lsn - 1} were written; they are missing"
        + (f" (INDEX names segment{'s' if len(gone) > 1 else ''} {', '.join(gone[:4])}{'...' if len(gone) > 4 else ''}, not on disk)" if gone else ""),
        segment=name,
        offset=size,
        last_good_lsn=expected - 1,
    )
