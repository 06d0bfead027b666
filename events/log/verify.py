"""Verification of a log directory: :func:`verify_log` checks every segment
header, frame CRC, LSN and payload (the frame check; each session's sequence
and lifecycle are the reducers' one check, ``reducers.lifecycle.LifecycleCheck``,
which ``agentlog verify`` runs next), reports what it
found as a :class:`VerifyReport`, and with ``repair=True`` cuts a torn tail.

It scans with the same :class:`~agentlog.events.log.scan.LogWalk` as the
writer's recovery, so both agree on what is a torn tail and what is
corruption; verify changes nothing unless asked to repair, and never touches
mid-log corruption.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import msgspec

from ..fs import fsync_dir
from .api import SchemaError
from .format import (
    DEFAULT_MAX_RECORD_BYTES,
    FLAG_TERMINAL,
    SEG_HDR_SIZE,
    list_segments,
    load_checkpoint,
    read_watermark,
    segment_name,
)
from .lock import acquire_lock, release_lock
from .read import existing_log_dir
from .scan import LogWalk, payload_error, proof
from ..schema.types import UnknownEvent, decode_body


class VerifyReport(msgspec.Struct):
    """What :func:`verify_log` found. ``status``: ok, torn, corrupt, repaired,
    or schema (sound frames, but records of known types this version cannot
    decode: a newer writer's; upgrade)."""

    path: str
    status: str
    segments: int = 0
    records: int = 0
    next_lsn: int = 0
    bytes: int = 0
    open_sessions: int = 0
    problem: str = ""
    segment: str = ""
    offset: int = -1
    last_good_lsn: int = -1
    torn_bytes: int = 0
    #: Records whose tag this version does not know (a newer writer's), by tag.
    unknown_types: dict[str, int] = {}
    #: Records of known types whose fields do not decode here, and the first one's message.
    schema_errors: int = 0
    schema_problem: str = ""

    @property
    def ok(self) -> bool:
        """True when the log is sound (or was repaired to soundness)."""
        return self.status in ("ok", "repaired")

    def summary(self) -> str:
        """One line for humans."""
        body = f"{self.records} records (lsn 0..{self.next_lsn - 1}) in {self.segments} segments, {self.bytes} bytes, {self.open_sessions} open sessions"
        if self.unknown_types:
            n = sum(self.unknown_types.values())
            body += f"; note: {n} records of unknown types (newer writer): tags {', '.join(sorted(self.unknown_types))}"
        if self.status == "ok":
            return f"{self.path}: ok, {body}"
        if self.status == "schema":
            return (
                f"{self.path}: SCHEMA MISMATCH: {self.schema_errors} records this version cannot decode "
                f"(upgrade agentlog); first: {self.schema_problem}; {body}"
            )
        if self.status == "repaired":
            return f"{self.path}: repaired, truncated a torn tail of {self.torn_bytes} bytes at segment {self.segment} offset {self.offset}; {body}"
        if self.status == "torn":
            return (
                f"{self.path}: torn tail at segment {self.segment} offset {self.offset} ({self.torn_bytes} bytes) "
                f"after lsn {self.last_good_lsn}: {self.problem}; run with --repair to truncate it"
            )
        return f"{self.path}: CORRUPT: {self.problem}"


def verify_log(path: str | os.PathLike, repair: bool = False, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
               progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every segment header, frame CRC, LSN and payload of the log at
    ``path`` (the frame check; each session's sequence and lifecycle are
    checked by ``reducers.lifecycle.LifecycleCheck``, which ``agentlog
    verify`` runs next). ``repair=True`` truncates a torn tail
    (taking the writer lock); it never touches mid-log corruption.
    Raises FileNotFoundError / NotALog for a path that is not a log.
    ``progress``: called as ``progress(bytes_checked, total_bytes)`` after each
    segment of the first scan (the CLI draws it; the log draws nothing)."""
    directory = existing_log_dir(path)
    rep = _scan(directory, max_record_bytes, progress)
    if rep.status == "torn" and repair:
        # Cut only from a scan taken under the writer lock: since the unlocked
        # scan a writer may have opened (recovering the tail itself), appended
        # and acknowledged records, which a cut at the stale position destroys.
        lock = acquire_lock(directory)
        try:
            rep = _scan(directory, max_record_bytes)
            if rep.status == "torn":
                _repair_tail(directory, rep)
        finally:
            release_lock(lock)
    return rep


def _scan(directory: Path, max_record_bytes: int, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """The checks of :func:`verify_log`, changing nothing."""
    segs = list_segments(directory)
    walk = LogWalk(
        directory,
        segs,
        max_record_bytes=max_record_bytes,
        watermark=proof(read_watermark(directory)),
        indexed=load_checkpoint(directory)[0],
    )
    rep = VerifyReport(path=str(directory), status="ok", segments=len(segs))
    live: set[str] = set()
    total = sum((directory / segment_name(s)).stat().st_size for s in segs)
    checked = 0

    def corrupt(msg: str, name: str, offset: int, last_good_lsn: int) -> VerifyReport:
        rep.status, rep.problem, rep.segment, rep.offset, rep.last_good_lsn = "corrupt", msg, name, offset, last_good_lsn
        return rep

    try:
        # closing(): a return from inside the walk closes the segment it has open at once.
        with contextlib.closing(walk.scan()) as segments:
            for seg in segments:
                name = seg.name
                for fr in seg.frames():
                    try:
                        body = decode_body(fr.payload)
                    except msgspec.DecodeError as exc:  # ValidationError included
                        err = payload_error(name, fr, exc)
                        if not isinstance(err, SchemaError):
                            return corrupt(str(err), name, fr.offset, fr.lsn - 1)
                        # Sound on disk, only newer than this reader: keep checking the rest.
                        rep.schema_errors += 1
                        rep.schema_problem = rep.schema_problem or str(err)
                    else:
                        if type(body) is UnknownEvent:
                            rep.unknown_types[body.tag] = rep.unknown_types.get(body.tag, 0) + 1
                    # Sequence and lifecycle are the reducers' one check (agentlog verify runs it
                    # after this frame check); here only which sessions are still open.
                    if fr.flags & FLAG_TERMINAL:
                        live.discard(fr.session_id)
                    else:
                        live.add(fr.session_id)
                    rep.records += 1
                stop = seg.end()
                checked += seg.size
                if progress is not None:
                    progress(checked, total)
                if stop is None:
                    rep.bytes += seg.size
                elif stop.corruption is None:
                    rep.bytes += stop.offset  # the good prefix before a torn tail
        stop = walk.stop
        if stop is not None:
            name = segment_name(segs[stop.index])
            if stop.corruption is not None:
                return corrupt(str(stop.corruption), name, stop.offset, walk.expected - 1)
            rep.status, rep.problem, rep.segment, rep.offset = "torn", stop.reason, name, stop.offset
            rep.last_good_lsn, rep.torn_bytes = walk.expected - 1, stop.tail_bytes
        else:
            end = walk.missing_acked(segment_name(segs[-1]) if segs else "", (directory / segment_name(segs[-1])).stat().st_size if segs else 0)
            if end is not None:
                return corrupt(str(end), end.segment, end.offset, walk.expected - 1)
            if rep.schema_errors:
                rep.status = "schema"
    finally:
        rep.next_lsn = walk.expected
        rep.open_sessions = len(live)
    return rep


def _repair_tail(directory: Path, rep: VerifyReport) -> None:
    """Cut the torn tail ``rep`` found; the caller holds the writer lock."""
    path = directory / rep.segment
    if rep.offset <= SEG_HDR_SIZE:
        os.unlink(path)
        rep.segments -= 1
    else:
        fd = os.open(path, os.O_RDWR)
        try:
            os.ftruncate(fd, rep.offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)
    # Reported through the returned VerifyReport (the CLI prints it as its one line).
    rep.status = "repaired"
