"""The JetStream implementations of :class:`~agentlog.events.log.source.LogSource`:
a run's stream (:class:`StreamSource`, its ``pNNNN`` subjects read merged)
and one subject (:class:`SubjectSource`), and :func:`open_nats`, which opens
a ``nats://host:port/stream[/log]`` URL with one-line errors.

The stream is opened read-only (:class:`~agentlog.events.log.jetstream_read.JetStreamRun`)
on first use and shared by every source derived from the one the factory
returned (its partitions, its siblings); closing that one closes it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Generator

from .api import EventLog, LogCorruption, LogError, NotALog
from .source import LogSource, LogTail, SourceError, StreamMissing
from .verify import VerifyReport

if TYPE_CHECKING:
    from .jetstream_cursor import SubjectCursor
    from .jetstream_read import JetStreamRun

#: Seconds to wait for a TCP connection to a NATS server before saying it cannot be reached.
CONNECT_TIMEOUT_S = 3.0


class _Stream:
    """One run's stream: its servers, its name, and the read-only connection opened on first use."""

    def __init__(self, servers: str, stream: str, base: str) -> None:
        self.servers, self.stream, self.base = servers, stream, base
        self._run: JetStreamRun | None = None

    def run(self) -> Any:
        """The stream opened read-only (NotALog naming it while no writer has created it)."""
        if self._run is None:
            from .jetstream_read import JetStreamRun

            # nats-py logs each failed connection attempt with a traceback; the error raised says it all.
            nats_logger = logging.getLogger("nats")
            level = nats_logger.level
            nats_logger.setLevel(logging.CRITICAL)
            try:
                self._run = JetStreamRun.open(self.servers, self.stream)
            finally:
                nats_logger.setLevel(level)
        return self._run

    def exists(self) -> bool:
        """Whether the stream has been created (by its first writer)."""
        try:
            self.run()
        except NotALog:
            return False
        return True

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.close()


class _NatsSource(LogSource):
    def __init__(self, stream: _Stream, name: str | None, *, owner: bool) -> None:
        self._stream, self.name, self._owner = stream, name, owner

    @property
    def location(self) -> str:
        return self._stream.base if self.name is None else f"{self._stream.base}/{self.name}"

    def sibling(self, name: str) -> LogSource:
        from .jetstream_url import log_name

        return SubjectSource(self._stream, log_name(name), owner=False)

    def log_names(self) -> list[str]:
        """The logs of the run's stream that hold messages (``learner``, ``p0000``, ...), sorted."""
        return self._stream.run().names()

    def close(self) -> None:
        if self._owner:
            self._stream.close()


class StreamSource(_NatsSource):
    """A run's stream: its partition subjects ``<stream>.pNNNN``, read merged."""

    partitioned = True

    def describe(self) -> str:
        s = self._stream.stream
        return f"{self.location} (subjects {s}.pNNNN, {s}.learner)"

    def exists(self) -> bool:
        return self._stream.exists() and bool(self._stream.run().partitions())

    def partitions(self) -> list[int]:
        return self._stream.run().partitions()

    def partition(self, pid: int) -> LogSource:
        from .partitions import partition_name

        return SubjectSource(self._stream, partition_name(pid), owner=False)

    def byte_size(self) -> int:
        """The stream's size as the server counts it (every subject, headers included)."""
        run = self._stream.run()
        return int(run.bridge.call(run.js.stream_info(run.stream)).state.bytes or 0)


class SubjectSource(_NatsSource):
    """One log of a run's stream: the subject ``<stream>.<name>``."""

    def _ref(self) -> Any:
        return self._stream.run().log(self.name)

    def read(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False) -> Generator[Any, None, None]:
        return self._ref().read(from_lsn, raw=raw, batches=batches)

    def follow(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False, poll_s: float = 0.05) -> AsyncIterator[Any]:
        if batches:
            return super().follow(from_lsn, raw=raw, batches=batches, poll_s=poll_s)
        return self._ref().follow(from_lsn, raw=raw, poll_s=poll_s)

    def tail(self, from_lsn: int = 0) -> LogTail:
        return _SubjectTail(self, from_lsn)

    def next_lsn(self) -> int:
        return self._ref().next_lsn() if self._stream.exists() else 0

    def exists(self) -> bool:
        return self._stream.exists() and self._ref().exists()

    def open_writer(self, *, fsync: str = "batch", fence: bool = False, replicas: int = 1,
                    duplicate_window_s: float = 120.0, clock: Callable[[], int] | None = None,
                    compression: str | None = None) -> EventLog:
        from .format import check_compression
        from .jetstream import JetStreamLog
        from .partitions import parse_partition_name

        if compression not in (None, "none"):
            check_compression(compression)  # an unknown value: its own message first
            raise ValueError(f"{self.describe()}: compression {compression!r} compresses a file log's record batches; a "
                             "JetStream log stores each record as a message of its own (expected 'none' or None)")
        assert self.name is not None  # a subject source always names its log
        pid = parse_partition_name(self.name)
        options: dict[str, Any] = {} if clock is None else {"clock": clock}
        return JetStreamLog.open(self._stream.servers, self._stream.stream, self.name if pid is None else pid,
                                 replicas=replicas, duplicate_window_s=duplicate_window_s, **options)

    def describe(self) -> str:
        s = self._stream.stream
        return f"nats stream {s!r} subject {s}.{self.name}"

    def fence_epoch(self) -> int | None:
        return None  # known to the writer that took it (JetStreamLog.epoch), not stored beside the log

    def verify(self, *, repair: bool = False, progress: Any = None) -> Any:
        if repair:
            raise ValueError(f"{self}: repair cuts a log directory's torn tail; a log on JetStream has none")
        return verify_subject(self)

    def _follow_target(self) -> Any:
        return self._ref()


class _SubjectTail(LogTail):
    """One ordered consumer kept open, so a poll with nothing new costs no
    request. Until the stream exists (its first writer creates it) a poll finds nothing."""

    def __init__(self, source: SubjectSource, from_lsn: int) -> None:
        self.source, self.next_lsn = source, from_lsn
        self._cursor: SubjectCursor | None = None
        self.ref: Any = None

    def poll(self, limit: int = 4096) -> list:
        if self._cursor is None:
            from .jetstream_cursor import SubjectCursor

            if not self.source._stream.exists():
                return []
            ref = self.ref = self.source._ref()
            cur = SubjectCursor(ref.run.js, ref.run.stream, ref.subject, ref.where, self.next_lsn, raw=False, to_end=False)
            ref.run.bridge.call(cur.start())
            self._cursor = cur
        out = self.ref.run.bridge.call(self._cursor.take(limit, 0.0))
        if out:
            self.next_lsn = out[-1].lsn + 1
        return out

    def close(self) -> None:
        cur, self._cursor = self._cursor, None
        if cur is not None and self.ref.run.bridge.loop.is_running():
            self.ref.run.bridge.call(cur.close(), timeout=10)


def stream_source(servers: str, stream: str, base: str, name: str | None = None) -> _NatsSource:
    """A source of ``stream`` (``name`` None) or of its log ``name``, opened
    lazily: nothing is checked until it is read (a run's logs before its first
    writer created the stream). ``base``: ``nats://host:port/stream``."""
    s = _Stream(servers, stream, base)
    return StreamSource(s, None, owner=True) if name is None else SubjectSource(s, name, owner=True)


def open_nats(text: str, *, allow_empty: bool = False, label: str | None = None, check: bool = True) -> LogSource:
    """The source a ``nats://host:port/stream[/log]`` URL names, its stream
    opened and checked (see :func:`~agentlog.events.log.source.open_source`).
    Errors name ``label`` (default: the URL); ``check=False`` connects on first use instead."""
    from .jetstream_url import parse_nats_url

    try:
        servers, stream, name = parse_nats_url(text)
    except ValueError as exc:
        raise SourceError(str(exc)) from None
    hosts = text[len("nats://"):].partition("/")[0]
    source = stream_source(servers, stream, f"nats://{hosts}/{stream}", name)
    if not check:
        return source
    try:
        _check(label or text, source, allow_empty)
    except BaseException:
        source.close()
        raise
    return source


def _check(text: str, source: _NatsSource, allow_empty: bool) -> None:
    s = source._stream
    check_reachable(text, s.servers)
    try:
        run = s.run()
    except NotALog as exc:  # no such stream
        raise StreamMissing(f"{text}: {exc}") from None
    except LogError as exc:  # cannot connect, nats-py missing
        raise SourceError(f"{text}: {exc}") from None
    if allow_empty:
        return
    names = run.names()
    held = f"it holds {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else "it holds no message"
    stream, name = s.stream, source.name
    if name is None and not run.partitions():
        raise SourceError(f"{text}: stream {stream!r} holds no partition log (expected subjects {stream}.p0000 ...); {held}")
    if name is not None and name not in names:
        raise SourceError(f"{text}: stream {stream!r} holds no log {name!r} (no message on subject {stream}.{name}); {held}")


def check_reachable(text: str, servers: str) -> None:
    """SourceError at once, naming each server and why, when no server of
    ``servers`` accepts a TCP connection (nats-py would retry for seconds first)."""
    import socket

    why = []
    for url in servers.split(","):
        host, _, port = url[len("nats://"):].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
            return
        except OSError as exc:
            why.append(f"{host}:{port}: {exc.strerror or exc}")
    raise SourceError(f"{text}: cannot connect to a NATS server ({'; '.join(why)}); expected a running nats-server with JetStream")


class SubjectVerifyReport(VerifyReport):
    """A :class:`VerifyReport` of one subject: its line names the subject and
    the frames' bytes where a directory's names segments and bytes."""

    subject: str = ""

    def summary(self) -> str:
        """One line for humans."""
        body = (f"{self.records} records (lsn 0..{self.next_lsn - 1}) on JetStream subject {self.subject}, "
                f"{self.bytes} bytes of frames, {self.open_sessions} open sessions")
        if self.unknown_types:
            body += (f"; note: {sum(self.unknown_types.values())} records of unknown types (newer writer): "
                     f"tags {', '.join(sorted(self.unknown_types))}")
        if self.status == "ok":
            return f"{self.path}: ok, {body}"
        if self.status == "schema":
            return (f"{self.path}: SCHEMA MISMATCH: {self.schema_errors} records this version cannot decode "
                    f"(upgrade agentlog); first: {self.schema_problem}; {body}")
        return f"{self.path}: CORRUPT: {self.problem}"


def verify_subject(source: SubjectSource) -> SubjectVerifyReport:
    """The frame check of one subject: every message's frame is checked as it
    is read (CRC, length, LSN continuity), each payload decoded as a
    schema-v1 event (a newer writer's fields count as a schema mismatch,
    unknown tags as unknown types), open sessions counted. ``bytes`` counts
    the frames' bytes (what segments would hold, less their headers). A
    server that stops answering mid-read raises its LogError."""
    import msgspec

    from .api import SchemaError
    from .format import FRAME_OVERHEAD
    from ..schema.types import UnknownEvent, decode_body

    rep = SubjectVerifyReport(path=str(source), status="ok", subject=f"{source._stream.stream}.{source.name}")
    live: set[str] = set()
    it = source.read(raw=True)
    try:
        for rec in it:
            try:
                body = decode_body(rec.payload)
            except msgspec.DecodeError as exc:
                schema = SchemaError.of_payload(exc, rec.payload, lsn=rec.lsn, session_id=rec.session_id)
                if schema is None:
                    rep.status = "corrupt"
                    rep.problem = (f"lsn {rec.lsn}, session {rec.session_id!r}: CRC-valid frame whose payload "
                                   f"does not decode as a schema-v1 event: {exc}")
                    rep.last_good_lsn = rec.lsn - 1
                    return rep
                rep.schema_errors += 1
                rep.schema_problem = rep.schema_problem or str(schema)
            else:
                if type(body) is UnknownEvent:
                    rep.unknown_types[body.tag] = rep.unknown_types.get(body.tag, 0) + 1
            if rec.terminal:
                live.discard(rec.session_id)
            else:
                live.add(rec.session_id)
            rep.records += 1
            rep.next_lsn = rec.lsn + 1
            rep.bytes += FRAME_OVERHEAD + len(rec.session_id.encode()) + len(rec.payload)
    except LogCorruption as exc:
        rep.status, rep.problem, rep.last_good_lsn = "corrupt", str(exc), rep.next_lsn - 1
        return rep
    finally:
        it.close()
        rep.open_sessions = len(live)
    if rep.schema_errors:
        rep.status = "schema"
    return rep
