"""Readers and followers of the file log, in any process, without the
writer's lock: :func:`read_log`, :func:`follow_log`, and the :class:`Cursor`
they share with ``FileLog.read`` / ``FileLog.follow``.

They yield only records below the DURABLE watermark (see
:mod:`agentlog.events.log.format`), follow segment rotation and writer
restarts, and raise :class:`LogCorruption` for damage that is not a torn tail,
or when records the watermark says were acknowledged are missing.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from pathlib import Path
from typing import AsyncIterator, Callable, Generator, Iterator, Mapping, NamedTuple

import msgspec

from .api import LogCorruption, NotALog, SchemaError
from .format import (
    DEFAULT_MAX_RECORD_BYTES,
    DURABLE_NAME,
    FLAG_TERMINAL,
    SEG_HDR_SIZE,
    Checkpoint,
    is_log_dir,
    list_segments,
    load_checkpoint,
    read_watermark,
    segment_name,
)
from .lazy import lazy_envelopes
from .scan import (
    Frame,
    SegmentScanner,
    classify_bad,
    header_being_created,
    missing_indexed,
    missing_start,
    open_segment,
    read_head,
)
from ..schema.types import TERMINAL_EVENT_TYPES, Envelope, decode_body, encode_body


class RawRecord(NamedTuple):
    """A record with its payload undecoded: a zero-copy view into the read
    buffer. ``decode()`` gives the Envelope."""

    lsn: int
    session_id: str
    session_seq: int
    ts_ns: int
    terminal: bool
    payload: memoryview

    def decode(self) -> Envelope:
        """Decode the payload into an Envelope (an unknown tag gives an
        UnknownEvent body). Raises SchemaError for a known tag whose fields do
        not decode, msgspec.DecodeError for a payload that is no event."""
        try:
            body = decode_body(self.payload)
        except msgspec.DecodeError as exc:
            err = SchemaError.of_payload(exc, self.payload, lsn=self.lsn, session_id=self.session_id)
            if err is not None:
                raise err from exc
            raise
        return Envelope(self.lsn, self.session_id, self.session_seq, self.ts_ns, body)

    @classmethod
    def of_envelope(cls, env: Envelope) -> "RawRecord":
        """The record a log stores for ``env``: its body encoded as a payload
        (what a log that keeps envelopes, MemoryLog, gives for ``read(raw=True)``)."""
        return cls(env.lsn, env.session_id, env.session_seq, env.ts_ns, isinstance(env.body, TERMINAL_EVENT_TYPES),
                   memoryview(encode_body(env.body)))


class Cursor:
    """Sequential position in a log directory, shared by ``FileLog.read``,
    :func:`read_log` and :func:`follow_log`. ``fetch(limit)`` returns the next
    records below ``limit`` (an exclusive LSN bound; None = every valid frame),
    following segment rotation by name: the record after the last one in a
    segment is either further on in it or first in the segment named by its LSN.
    """

    def __init__(
        self,
        directory: Path,
        from_lsn: int,
        cap: int,
        index: Callable[[int], list[tuple[int, int]] | None] | None,
        raw: bool,
    ) -> None:
        self.dir = directory
        self.from_lsn = max(0, from_lsn)
        self.cap = cap
        self.index = index
        self.raw = raw
        self.fd: int | None = None
        self.ino = 0
        self.name = ""
        self.scanner: SegmentScanner | None = None
        #: First LSN of the segment after the current one (None: none listed
        #: yet). A segment never holds that LSN: frames there are a stale
        #: writer's (see FileLog._check_fence) and reading them is refused.
        self.next_first: int | None = None
        #: The segments (first LSNs, ascending) as listed during the current _stretches
        #: call (after its limit was read); None until then.
        self._listed: list[int] | None = None
        #: The limit is a watermark written under fsync="never" (not synced).
        self.unsynced_limit = False
        #: The directory's INDEX checkpoint, whose records must exist when no
        #: watermark bounds the read (DURABLE missing): a reader that finds
        #: fewer raises instead of reporting a shorter log. None: not checked.
        self.indexed: Checkpoint | None = None
        #: The limit is ``indexed.lsn`` (a follower with no watermark to stop at).
        self.limit_is_index = False

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _switch(self, first: int, offset: int, expected: int, listed: list[int]) -> bool:
        """Move to segment ``first`` at ``offset`` (record ``expected`` next). False where the
        log ends here: no such segment yet, or its header is still being created. ``listed``:
        the segments listed (ascending first LSNs). When one of them starts after ``first``,
        that segment is not still to come but lost or cut, and its records with it: raised as
        LogCorruption (what verify says), never read as the end of a shorter log."""
        later = listed[bisect.bisect_right(listed, first)] if listed and listed[-1] > first else None
        try:
            fd, _epoch, _size = open_segment(self.dir, first)
        except FileNotFoundError:
            if later is None:
                return False
            raise LogCorruption(
                f"log {self.dir}: segment {segment_name(later)} starts at lsn {later}, expected {first}: segment "
                f"{segment_name(first)}, which would hold lsn {first}..{later - 1}, is missing",
                segment=segment_name(later), offset=0, last_good_lsn=first - 1,
            ) from None
        except LogCorruption as err:
            # A segment being created has a short (or not yet written) header;
            # it only counts as damage once records past it are durable, or a later segment exists.
            head = read_head(self.dir / segment_name(first))
            if later is None and header_being_created(len(head), head):
                return False
            raise LogCorruption(f"log {self.dir}: {err}; segment {segment_name(later)} follows, so this is damage, not a "
                                f"segment still being created (it would hold lsn {first} on)" if later is not None else str(err),
                                segment=err.segment, offset=err.offset, last_good_lsn=first - 1) from None
        self.close()
        self.fd = fd
        self.ino = os.fstat(fd).st_ino
        self.name = segment_name(first)
        self.scanner = SegmentScanner(fd, self.name, offset, expected, self.cap)
        self.next_first = None  # listed by _stretches as it starts on the segment
        return True

    def _segments(self) -> list[int]:
        """The segments (first LSNs, ascending), listed once per :meth:`_stretches` call."""
        if self._listed is None:
            self._listed = list_segments(self.dir)
        return self._listed

    def _find_next(self, first: int) -> None:
        """Record the first LSN of the segment after ``first``, if one is listed. The
        directory is listed once per :meth:`_stretches` call (after its ``limit`` was read,
        which the stale-writer check needs), not once per segment: a read across N
        segments lists it once, not N times (each listing costs O(N))."""
        segs = self._segments()
        i = bisect.bisect_right(segs, first)
        self.next_first = segs[i] if i < len(segs) else None

    def _position(self) -> bool:
        segs = self._listed = list_segments(self.dir)
        lost = missing_start(self.dir, segs)
        if lost is not None:
            raise lost
        if not segs:
            return False
        i = bisect.bisect_right(segs, self.from_lsn) - 1
        first = segs[max(i, 0)]
        offset, expected = SEG_HDR_SIZE, first
        entries = self.index(first) if self.index else None
        if entries:
            j = bisect.bisect_right(entries, (self.from_lsn, 1 << 62)) - 1
            if j >= 0:
                expected, offset = entries[j]
        if not self._switch(first, offset, expected, segs):
            self.name = segment_name(first)  # named if the records it should hold are missing
            return False
        if offset != SEG_HDR_SIZE:
            # Trust but verify an index hint: the frame there must carry the LSN.
            probe = SegmentScanner(self.fd, self.name, offset, expected, self.cap)
            if next(probe.frames(limit=expected + 1), None) is None:
                self.scanner = SegmentScanner(self.fd, self.name, SEG_HDR_SIZE, first, self.cap)
        return True

    @property
    def next_lsn(self) -> int:
        return self.scanner.expected if self.scanner else self.from_lsn

    def _check_reached(self, limit: int | None) -> None:
        """The readable log ends here: raise LogCorruption if that is below
        ``limit`` (the durable watermark), whose records were acknowledged
        and so must exist (an emptied, cut or deleted segment)."""
        nxt = self.next_lsn
        if limit is None or self.limit_is_index:
            # No watermark to hold the log to: the INDEX checkpoint's records must exist.
            if self.scanner is not None:
                name, size = self.name, self.scanner.offset
            else:
                name, size = (self.name if self.name and (self.dir / self.name).exists() else ""), 0
            err = missing_indexed(self.dir, name, size, max(nxt, self.from_lsn), self.indexed)
            if err is not None:
                raise err
            return
        if max(nxt, self.from_lsn) >= limit:
            return
        if self.scanner is not None:
            where, offset = f"segment {self.name} ends at offset {self.scanner.offset}", self.scanner.offset
        elif self.name:
            where, offset = f"segment {self.name} has no complete header", 0
        else:
            where, offset = "no segment files exist", 0
        hint = (
            "; the watermark was written under fsync=\"never\" and never synced, so a power loss explains "
            "this: reopening the log as its writer keeps what was synced"
            if self.unsynced_limit
            else ""
        )
        raise LogCorruption(
            f"log {self.dir}: {where} (last good lsn {nxt - 1}), but the durable watermark says "
            f"lsn {nxt}..{limit - 1} were acknowledged; they are missing{hint}",
            segment=self.name,
            offset=offset,
            last_good_lsn=nxt - 1,
        )

    def records(self, limit: int | None) -> Iterator:
        """Yield the records available now below ``limit``, then return:
        :class:`~agentlog.events.log.lazy.LazyEnvelope` s (bodies decoded on
        first use), or RawRecords when the cursor is raw. Raises LogCorruption
        for damage that is not a torn tail.

        The frames come as :meth:`SegmentScanner.frame_lists` hands them out:
        with the compiled codec a read buffer's worth at a time (the scanner's
        position is then past the list while its records are yielded: nothing
        reads it before this generator ends)."""
        from_lsn = self.from_lsn
        raw = self.raw
        for sc, seg_limit, size in self._stretches(limit):
            name = self.name
            for batch in sc.frame_lists(seg_limit, size):
                if not raw:
                    yield from lazy_envelopes(batch, name, from_lsn)
                    continue
                for fr in batch:
                    if fr.lsn >= from_lsn:
                        yield RawRecord(fr.lsn, fr.session_id, fr.session_seq, fr.ts_ns, bool(fr.flags & FLAG_TERMINAL), fr.payload)

    def frame_batches(self, limit: int | None) -> Iterator[list[Frame]]:
        """:meth:`records` as lists of undecoded :class:`~agentlog.events.log.scan.Frame`
        (lsn, session id, seq, ts, flags, payload view), built in bulk by the
        scanner: for readers that need a few fields of many records."""
        from_lsn = self.from_lsn
        for sc, seg_limit, size in self._stretches(limit):
            for batch in sc.batches(seg_limit, size):
                if batch[0].lsn < from_lsn:
                    batch = [fr for fr in batch if fr.lsn >= from_lsn]
                if batch:
                    yield batch

    def _stretches(self, limit: int | None) -> Iterator[tuple[SegmentScanner, int | None, int]]:
        """The walk of :meth:`records`: yields (scanner, LSN limit, file size)
        for each stretch of a segment to scan; the caller scans it to its end
        before asking for the next. Between stretches it follows rotation and
        raises LogCorruption for damage that is not a torn tail."""
        self._listed = None  # a listing made before ``limit`` was read may miss a newer writer's segment
        if self.scanner is None and not self._position():
            self._check_reached(limit)
            return
        while True:
            sc = self.scanner
            if limit is not None and sc.expected >= limit:
                return
            if self.next_first is None:
                # Listed after ``limit`` was read: a segment that holds records
                # below it exists by now, so a stale writer's frames cannot pass.
                self._find_next(int(self.name[:20]))
            nxt_first = self.next_first
            seg_limit = limit if nxt_first is None or (limit is not None and limit < nxt_first) else nxt_first
            size = os.fstat(self.fd).st_size
            yield sc, seg_limit, size
            bad = sc.bad
            if bad is None and nxt_first is not None and sc.expected >= nxt_first and (size > sc.offset or sc.rest):
                # Bytes past the limit, or a compressed batch it stopped in (the scanner is past the batch,
                # its records from the limit on wait in ``rest``): records of lsn nxt_first on, here too.
                past = f"a compressed batch ending at offset {sc.offset} whose records run" if sc.rest else \
                    f"{size - sc.offset} bytes past offset {sc.offset}"
                raise LogCorruption(
                    f"log {self.dir}: segment {self.name} holds {past} "
                    f"(lsn {nxt_first} on), but segment {segment_name(nxt_first)} starts at lsn {nxt_first}: "
                    f"written by a stale writer after a newer one recovered the log (see FENCE); verify names the damage",
                    segment=self.name,
                    offset=sc.offset,
                    last_good_lsn=nxt_first - 1,
                )
            if bad is None:
                if limit is not None and sc.expected >= limit:
                    return
                nxt = sc.expected
                path = self.dir / segment_name(nxt)
                if segment_name(nxt) == self.name:
                    # An empty segment replaced by a new writer's segment of the same name.
                    try:
                        if os.stat(path).st_ino == self.ino:
                            self._check_reached(limit)
                            return
                    except FileNotFoundError:
                        self._check_reached(limit)
                        return
                if self._switch(nxt, SEG_HDR_SIZE, nxt, self._segments()):
                    continue
                self._check_reached(limit)
                return
            later = any(s > int(self.name[:20]) for s in list_segments(self.dir))
            indexed = self.indexed.lsn if self.indexed is not None else None
            err = classify_bad(self.fd, self.name, size, bad, sc.expected, limit, later, self.cap, indexed)
            if err is not None:
                raise err
            return


def existing_log_dir(path: str | os.PathLike) -> Path:
    """``path`` as a Path; raises FileNotFoundError / NotALog unless it is a log directory."""
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such log directory")
    if not is_log_dir(directory):
        raise NotALog(f"{directory}: not an agentlog log directory (no segment files, no {DURABLE_NAME})")
    return directory


def _load_index_hint(directory: Path) -> Callable[[int], list[tuple[int, int]] | None]:
    ckpt, _ = load_checkpoint(directory)
    return _index_hint(ckpt)


def _index_hint(ckpt: Checkpoint | None) -> Callable[[int], list[tuple[int, int]] | None]:
    idx = ckpt.index if ckpt is not None else {}
    return lambda first: idx.get(first)


def read_log(
    path: str | os.PathLike,
    from_lsn: int = 0,
    *,
    durable_only: bool = True,
    raw: bool = False,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Generator[Envelope, None, None]:
    """Records of the log at ``path`` from ``from_lsn`` on, without taking the
    writer's lock (safe beside a live writer in another process).

    With ``durable_only`` (default) it stops at the DURABLE watermark; when
    no watermark file exists (a copied log) it reads every valid frame. A torn
    tail ends the iteration; corruption raises LogCorruption. A log of any
    backend is read through :func:`agentlog.events.log.source.open_source`.
    """
    return _read_dir(path, from_lsn, durable_only, raw, max_record_bytes)


def _read_dir(path, from_lsn: int, durable_only: bool, raw: bool, max_record_bytes: int) -> Generator[Envelope, None, None]:
    cur, limit = _reader(path, from_lsn, durable_only, raw, max_record_bytes)
    try:
        yield from cur.records(limit)
    finally:
        cur.close()


def read_frame_batches(
    path: str | os.PathLike,
    from_lsn: int = 0,
    *,
    durable_only: bool = True,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Generator[list[Frame], None, None]:
    """:func:`read_log` with ``raw=True``, in lists of undecoded
    :class:`~agentlog.events.log.scan.Frame` built in bulk by the scanner
    (one list per read buffer with the compiled codec): for readers that need
    a few fields of many records (``agentlog stats``). The same records, the
    same checks and errors."""
    return _frame_batches_of_dir(path, from_lsn, durable_only, max_record_bytes)


def _frame_batches_of_dir(path, from_lsn: int, durable_only: bool, max_record_bytes: int) -> Generator[list[Frame], None, None]:
    cur, limit = _reader(path, from_lsn, durable_only, True, max_record_bytes)
    try:
        yield from cur.frame_batches(limit)
    finally:
        cur.close()


def _reader(path: str | os.PathLike, from_lsn: int, durable_only: bool, raw: bool, cap: int) -> tuple[Cursor, int | None]:
    """A Cursor on the log at ``path`` and the LSN it reads up to (the durable watermark)."""
    directory = existing_log_dir(path)
    durable = read_watermark(directory) if durable_only else None
    ckpt, _ = load_checkpoint(directory)
    cur = Cursor(directory, from_lsn, cap, _index_hint(ckpt), raw)
    cur.unsynced_limit = durable is not None and not durable.synced
    if durable_only and durable is None:
        cur.indexed = ckpt
    return cur, durable.lsn if durable else None


async def follow_log(
    path: str | os.PathLike,
    from_lsn: int = 0,
    *,
    poll_s: float = 0.05,
    raw: bool = False,
    batches: bool = False,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> AsyncIterator[Envelope]:
    """Tail the log at ``path`` (written by any process) forever, across
    segment rotation and writer restarts. Yields only records below the
    DURABLE watermark, so never a record that a crash could take back.
    The one-log case of :func:`follow_logs` (a log not created yet is
    waited for); with ``batches`` it yields lists of undecoded frames, as
    :func:`read_frame_batches` does."""
    async for _, env in follow_logs({0: path}, {0: from_lsn}, poll_s=poll_s, raw=raw, batches=batches, max_record_bytes=max_record_bytes):
        yield env


async def follow_logs(
    paths: Mapping[int, str | os.PathLike],
    from_lsn: Mapping[int, int] | None = None,
    *,
    poll_s: float = 0.05,
    chunk: int = 512,
    idle_s: float | None = None,
    raw: bool = False,
    batches: bool = False,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> AsyncIterator[tuple[int, Envelope] | tuple[None, None]]:
    """Tail several logs at once (the partitions of a run), forever: yields
    ``(partition id, envelope)`` with each partition's records in its LSN
    order, partitions interleaved ``chunk`` records at a time in turn.

    A partition whose directory does not exist yet is picked up once it
    does; ``from_lsn`` gives each partition's first LSN (default 0). Like
    :func:`follow_log` it yields only durable records. One task, one cursor
    per partition: the caller sees every partition's corruption as its own
    exception, and a partition is never silently left behind. With ``raw``
    it yields RawRecords, as :func:`read_log` does; with ``batches``,
    ``(partition id, list of undecoded frames)`` as :func:`read_frame_batches`
    builds them (for consumers that need a few fields of many records). ``paths`` is
    read afresh each round: a partition the caller removes from it is no
    longer read. With ``idle_s``, ``(None, None)`` is yielded after each
    ``idle_s`` with nothing new: a heartbeat for a consumer that must act on
    silence (declare a partition lost). A value of ``paths`` may also be a
    JetStream subject (``jetstream_read.JetStreamRef``, handed in by
    :func:`agentlog.events.log.source.follow_sources`), read through an
    ordered consumer; its ``batches`` are lists of RawRecords, which carry
    the frame fields batch readers use."""
    starts = dict(from_lsn or {})
    cursors: dict[int, Cursor] = {}
    quiet_since = time.monotonic()
    try:
        while True:
            n = 0
            for pid, path in list(paths.items()):
                if not isinstance(path, (str, os.PathLike)):  # a JetStream subject: its cursor never waits
                    cur = cursors.get(pid)
                    if cur is None:
                        cur = cursors[pid] = path.cursor(starts.get(pid, 0), raw=raw or batches)
                    got = await cur.records(chunk)
                    if batches:  # RawRecords carry the fields of a frame that batch readers use
                        if got:
                            yield pid, got
                            n += len(got)
                        continue
                    for env in got:
                        yield pid, env
                        n += 1
                    continue
                directory = Path(path)
                cur = cursors.get(pid)
                if cur is None:
                    if not is_log_dir(directory):
                        continue  # its writer has not created it yet
                    # The INDEX hint lets a follower that starts deep in the log seek instead
                    # of scanning its segment from the start (a learner resuming at its low-water LSN).
                    cur = cursors[pid] = Cursor(directory, starts.get(pid, 0), max_record_bytes,
                                                lambda first, d=directory: _load_index_hint(d)(first), raw)
                durable = read_watermark(directory)
                if durable is None and cur.indexed is None:
                    # No watermark (yet, or it was lost): the records an INDEX describes were
                    # synced, so they may be followed, and must exist.
                    cur.indexed = load_checkpoint(directory)[0]
                cur.limit_is_index = durable is None and cur.indexed is not None
                limit = durable.lsn if durable else (cur.indexed.lsn if cur.indexed is not None else 0)
                cur.unsynced_limit = durable is not None and not durable.synced
                start = max(cur.next_lsn, cur.from_lsn)
                if limit > start:
                    if batches:
                        for batch in cur.frame_batches(min(limit, start + chunk)):
                            yield pid, batch
                            n += len(batch)
                    else:
                        for env in cur.records(min(limit, start + chunk)):
                            yield pid, env
                            n += 1
            if n:
                quiet_since = time.monotonic()
            elif idle_s is not None and time.monotonic() - quiet_since >= idle_s:
                quiet_since = time.monotonic()
                yield None, None
            # Yield to the event loop between rounds, and sleep when nothing is new.
            await asyncio.sleep(0 if n else poll_s)
    finally:
        for cur in cursors.values():
            cur.close()

