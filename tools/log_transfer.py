"""Copying logs between JetStream and log directories, frame for frame
(``agentlog export`` and ``agentlog import``).

A copy keeps every record's LSN, session id, session seq, timestamp and
payload, so its frames are byte-identical to the source's. It goes through
each log's ordinary, checked append path (``append_batch``: sequence and
schema checks, the writer's fencing, JetStream's publish acks), with one
thing replaced: the log's clock. A :class:`ReplayClock` hands the writer the
recorded timestamps instead of the time of day. LSNs need nothing: a log
gives the next one, from 0, and the copy checks before each append that it
is the source's (and after, from the returned envelopes, that LSN and
timestamp came out as recorded: a log that read its clock differently
would be caught there, not written wrong silently).

How often a writer reads its clock differs: ``FileLog`` once per
``append_batch`` (every record of a batch shares one timestamp),
``JetStreamLog`` once per record. :func:`copy_records` cuts the source into
batches accordingly (for a FileLog, one batch per run of equal timestamps,
several runs staged for each flush with ``FileLog.append_batches``, so that
a compressed copy compresses them together).

Payloads are not copied as bytes but decoded and re-encoded by the writer's
check (the canonical msgspec encoding that wrote them). Every copy is
therefore read back and its :class:`~agentlog.tools.cli_common.RecordDigest`
compared with the source's: a payload that did not re-encode to the same
bytes would show as DIFFERENT, never pass unnoticed.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator

from agentlog.events.errors import AgentlogError

#: Records per append when the writer stamps each record (JetStream; atomic batches hold up to 1000 messages),
#: and per run of one timestamp for a FileLog.
BATCH = 256
#: What a FileLog copy stages before one flush writes it (records, payload bytes): runs of one record (a
#: stream's records each carry their own timestamp) share a write, and a compressed copy compresses them
#: together; held in memory until the flush.
FLUSH_RECORDS = 4096
FLUSH_BYTES = 8 << 20


class ReplayClock:
    """A writer's clock that returns the timestamps it was given, in order:
    the recorded ``ts_ns`` of the records being copied. Asked for more than
    it holds, it raises (a copy bug, never a silent wrong time)."""

    def __init__(self) -> None:
        self._pending: collections.deque[int] = collections.deque()

    def load(self, stamps: Iterable[int]) -> None:
        """Queue the timestamps the next clock reads must return."""
        self._pending.extend(stamps)

    def __call__(self) -> int:
        if not self._pending:
            raise RuntimeError("ReplayClock: the writer read its clock more often than records were given")
        return self._pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)


class CopyError(AgentlogError):
    """A record the copy could not write as it was recorded; the message names the log, LSN and why."""


def _read(records: Iterator[Any], lsn: int, where: str) -> Iterator[tuple[Any, Any]]:
    """``(raw record, envelope)`` of each source record, its LSNs checked to
    run on from ``lsn``. A record the source cannot give (damage, a lost
    server) or that does not decode, and a gap in the LSNs, raise
    :class:`CopyError` naming that record's LSN."""
    from agentlog.events.log.api import LogError, SchemaError
    from agentlog.events.schema.types import EventValidationError

    it = iter(records)
    while True:
        try:
            rec = next(it, None)  # only the source's own errors: the caller's come from its own code
        except LogError as exc:  # it names where on the source
            raise CopyError(f"{where}: at lsn {lsn}: {exc}") from None
        if rec is None:
            return
        if rec.lsn != lsn:
            raise CopyError(f"{where}: record at lsn {rec.lsn}, but the copy is at lsn {lsn} "
                            "(the source's LSNs must run from 0 without a gap)")
        try:
            env = rec.decode()
        except SchemaError as exc:  # it names the record
            raise CopyError(f"{where}: {exc}") from None
        except EventValidationError as exc:  # an unknown (newer) event type
            raise CopyError(f"{where}: at lsn {lsn}: {exc}") from None
        yield rec, env
        lsn += 1


def _appends(records: Iterator[Any], first_lsn: int, *, where: str, per_record_ts: bool) -> Iterator[list[list[tuple[Any, Any]]]]:
    """The source (:func:`_read` from ``first_lsn``) as the copy's appends,
    each a list of batches of ``(raw record, envelope)``. A writer that
    stamps each record (JetStream) takes one batch of up to BATCH records an
    append. A FileLog stamps a batch, so its batches are runs of one
    timestamp (up to BATCH records), and one append (``append_batches``: one
    flush) takes runs until they reach FLUSH_RECORDS records or FLUSH_BYTES
    of payload: runs of one record each (a stream's records carry their own
    timestamps) then share a write, and a compressed copy compresses them
    together. A source error raises before the runs held for the append are
    written."""
    runs: list[list[tuple[Any, Any]]] = []
    batch: list[tuple[Any, Any]] = []
    held = staged = 0  # records and payload bytes in ``runs`` and ``batch``
    for rec, env in _read(records, first_lsn, where):
        if batch and (len(batch) >= BATCH or (not per_record_ts and rec.ts_ns != batch[0][0].ts_ns)):
            runs.append(batch)
            batch = []
            if per_record_ts or held >= FLUSH_RECORDS or staged >= FLUSH_BYTES:
                yield runs
                runs, held, staged = [], 0, 0
        batch.append((rec, env))
        held += 1
        staged += len(rec.payload)
    if batch:
        runs.append(batch)
    if runs:
        yield runs


def copy_records(records: Iterator[Any], dest: Any, clock: ReplayClock, *, where: str, per_record_ts: bool,
                 digest: Any = None) -> int:
    """Append the RawRecords ``records`` (LSN order, from ``dest.next_lsn``)
    to the log ``dest``, opened with ``clock``, keeping each LSN, session,
    seq and timestamp (``per_record_ts``: ``dest`` reads its clock once per
    record, a JetStreamLog; else once per batch, a FileLog, which takes
    several batches an ``append_batches``). ``digest`` (a RecordDigest), when
    given, takes every source record. Returns how many were copied; raises
    :class:`CopyError` naming ``where`` and the LSN for a record the source
    cannot give, the writer refuses or that would not come out as recorded."""
    from agentlog.events.log.api import LogError, SchemaError
    from agentlog.events.schema.types import EventValidationError

    def bodies(batch: list[tuple[Any, Any]]) -> list[tuple[str, int, Any]]:
        return [(env.session_id, env.session_seq, env.body) for _, env in batch]

    n = 0
    for runs in _appends(records, dest.next_lsn, where=where, per_record_ts=per_record_ts):
        first = runs[0][0][0]
        try:
            if per_record_ts:
                clock.load(rec.ts_ns for rec, _ in runs[0])
                written = [dest.append_batch(bodies(runs[0]))]
            else:
                clock.load([run[0][0].ts_ns for run in runs])  # each run is of one timestamp
                written = dest.append_batches([bodies(run) for run in runs])
        except SchemaError as exc:
            raise CopyError(f"{where}: {exc}") from None
        except (EventValidationError, LogError) as exc:  # a sequence gap, a refused publish: the batches before it are written
            raise CopyError(f"{where}: at lsn {dest.next_lsn}: {exc}") from None
        if len(clock):
            raise CopyError(f"{where}: the writer read its clock {len(clock)} time(s) less than expected at lsn {first.lsn}")
        for run, envs in zip(runs, written, strict=True):
            for (rec, _), got in zip(run, envs, strict=True):
                if (got.lsn, got.ts_ns) != (rec.lsn, rec.ts_ns):
                    raise CopyError(f"{where}: lsn {rec.lsn} ts {rec.ts_ns} was written as lsn {got.lsn} ts {got.ts_ns}")
                if digest is not None:
                    digest.update(rec)
            n += len(run)
    return n


def digest_of(records: Iterable[Any]) -> Any:
    """The RecordDigest of ``records`` (RawRecords)."""
    from agentlog.tools.cli_common import RecordDigest

    d = RecordDigest()
    for rec in records:
        d.update(rec)
    return d


class Copied:
    """One log copied: its name, where it went, how many records, and the
    digests of the source and of the copy read back."""

    def __init__(self, name: str, dest: str, records: int, source_digest: str, copy_digest: str) -> None:
        self.name, self.dest, self.records = name, dest, records
        self.source_digest, self.copy_digest = source_digest, copy_digest

    @property
    def equal(self) -> bool:
        """Whether the copy's records are byte-identical to the source's."""
        return self.source_digest == self.copy_digest

    def line(self) -> str:
        """One line for the command's output."""
        verdict = "EQUAL" if self.equal else f"DIFFERENT (source {self.source_digest})"
        return f"{self.name}: {self.records} records -> {self.dest}: records {self.copy_digest} {verdict}"


def export_log(ref: Any, directory: Any, name: str, compression: str = "none") -> Copied:
    """Write the log ``ref`` (a LogSource: one log of a run's stream) to a new
    log directory, frame for frame (its records stored as ``compression``
    says: see ``FileLog.open``); read it back and compare digests."""
    from agentlog.events.log.source import open_source
    from agentlog.tools.cli_common import RecordDigest

    clock = ReplayClock()
    source = RecordDigest()
    copy_log = open_source(directory, check=False, partitioned=False)
    # fsync "never": the copy syncs once, at close (a crash mid-export leaves a copy to delete, not a run to lose).
    dest = copy_log.open_writer(fsync="never", clock=clock, fence=False, compression=compression)
    try:
        it = ref.read(raw=True)
        try:
            n = copy_records(it, dest, clock, where=f"{ref} -> {directory}", per_record_ts=False, digest=source)
        finally:
            it.close()
    finally:
        dest.close()
    back = copy_log.read(raw=True)
    try:
        copy = digest_of(back)
    finally:
        back.close()
    return Copied(name, str(directory), n, source.hexdigest(), copy.hexdigest())


def import_log(source: Any, target: Any, *, replicas: int, resume: bool) -> Copied:
    """Append the log ``source`` (a LogSource: a log directory) to the log
    ``target`` (a LogSource: one subject of a run's stream), frame for frame;
    read it back and compare digests. An existing subject is refused unless
    ``resume``: then the records it holds must be the source's first ones
    (compared record by record), and the copy continues after them."""
    from agentlog.tools.cli_common import RecordDigest

    label = str(target).rsplit("/", 1)[-1]
    clock = ReplayClock()
    dest = target.open_writer(replicas=replicas, clock=clock)
    where = f"{source} -> {target.describe()}"
    digest = RecordDigest()
    try:
        it = source.read(raw=True)
        try:
            held = dest.next_lsn
            if held and not resume:
                raise CopyError(f"{where}: the subject already holds {held} records; "
                                "import into a new stream, or pass --resume to continue an import")
            if held:
                _check_prefix(it, dest, held, where, digest)
            n = held + copy_records(it, dest, clock, where=where, per_record_ts=True, digest=digest)
        finally:
            it.close()
        back = dest.read(raw=True)
        try:
            copy = digest_of(back)
        finally:
            back.close()
    finally:
        dest.close()
    return Copied(label, str(target), n, digest.hexdigest(), copy.hexdigest())


def _check_prefix(it: Iterator[Any], dest: Any, held: int, where: str, digest: Any) -> None:
    """The subject's ``held`` records must be the first records of the source
    iterator ``it``, one for one (a resumed import); they go into ``digest``."""
    fields = ("lsn", "session_id", "session_seq", "ts_ns", "terminal")
    theirs = dest.read(raw=True)
    try:
        for got in theirs:
            mine = next(it, None)
            if mine is None:
                raise CopyError(f"{where}: the subject holds {held} records, the source only {got.lsn}: it holds another run")
            if tuple(getattr(mine, f) for f in fields) != tuple(getattr(got, f) for f in fields) or bytes(mine.payload) != bytes(got.payload):
                raise CopyError(f"{where}: lsn {got.lsn} on the subject differs from the source's; "
                                "it holds another run: import into a new stream")
            digest.update(mine)
    finally:
        theirs.close()
