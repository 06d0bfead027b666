"""A run's stream on JetStream, opened read-only: :class:`JetStreamRun`, and
:class:`JetStreamRef`, one log of it.

A log on JetStream (see :mod:`agentlog.events.log.jetstream`) is a subject
``<stream>.<name>`` of a run's stream, ``<name>`` being a partition
(``p0003``) or another log of the run (``learner``). :class:`JetStreamRun`
opens the stream a ``nats://`` URL names
(:mod:`~agentlog.events.log.jetstream_url`) without writing anything: no
stream is created, no epoch is taken, so it never disturbs the writers. It
lists the run's logs; :class:`JetStreamRef` reads and follows one of them
through the cursors of :mod:`~agentlog.events.log.jetstream_cursor`, and is
accepted by :func:`agentlog.events.read_log` and
:func:`agentlog.events.follow_logs` wherever a log directory is.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Generator

from ..._logging import get_logger
from .api import LogError, NotALog
from .jetstream_conn import Bridge, connect, retried
from .jetstream_cursor import SubjectCursor, follow_subject, last_seq, read_subject
from .jetstream_msg import lsn_after
from .jetstream_url import STREAM_RE, log_name, parse_nats_url
from .partitions import parse_partition_name

log = get_logger(__name__)


class JetStreamRun:
    """A run's stream, opened read-only (behind :mod:`~agentlog.events.log.source_nats`): its logs listed, read and followed.

    Creates nothing and takes no epoch, so it never disturbs the writers.
    One connection, held by a bridge thread; close it (or use ``with``)."""

    def __init__(self, url: str, stream: str, start_timeout_s: float = 30.0) -> None:
        self.url, self.stream = url, stream
        self.start_timeout_s = start_timeout_s
        self.where = f"nats stream {stream!r} at {url}"
        self.bridge = Bridge(f"jetstream-read-{stream}")
        # nats-py's client and JetStream context, made by the connection in open.
        self.nc: Any = None
        self.js: Any = None

    @classmethod
    def open(cls, url: str, stream: str, *, connect_timeout_s: float = 5.0, request_timeout_s: float = 10.0) -> "JetStreamRun":
        """Connect and check that ``stream`` exists (NotALog naming it otherwise)."""
        if not STREAM_RE.fullmatch(stream or ""):
            raise ValueError(f"stream name: expected letters, digits, '-' or '_' (1..200), found {stream!r}")
        self = cls(url, stream)
        try:
            self.bridge.call(self._open(connect_timeout_s, request_timeout_s))
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def open_url(cls, text: str, **kw: Any) -> "JetStreamRun":
        """Open the stream a ``nats://host:port/stream`` URL names."""
        url, stream, _ = parse_nats_url(text)
        return cls.open(url, stream, **kw)

    async def _open(self, connect_timeout_s: float, request_timeout_s: float) -> None:
        from nats.js.errors import NotFoundError

        async def on_error(exc: Exception) -> None:
            log.warning("jetstream.connection_error", stream=self.stream, error=repr(exc))

        try:
            self.nc = await connect(self.url, connect_timeout_s, on_error)
        except Exception as exc:
            raise LogError(f"{self.where}: cannot connect: {exc!r}") from exc
        self.js = self.nc.jetstream(timeout=request_timeout_s)
        try:
            info = await self._stream_info()
        except NotFoundError:
            raise NotALog(f"{self.where}: no such stream (expected a run written by JetStreamLog)") from None
        if not info.config.allow_direct:  # reads from an LSN and the end of a log are direct gets
            raise LogError(f"{self.where}: the stream's allow_direct is False, expected True (a stream made by JetStreamLog.open)")

    async def _stream_info(self, **kw: Any) -> Any:
        """The stream's info, asked again while the cluster elects a leader
        (a request to a lost meta or stream leader times out) for up to
        ``start_timeout_s``; a missing stream (NotFoundError) at once."""
        return await retried(lambda: self.js.stream_info(self.stream, **kw), "the stream's info", self.where,
                             self.start_timeout_s, 5.0, "start_timeout_s")

    def names(self) -> list[str]:
        """The logs of the run that hold messages (``learner``, ``p0000``, ...), sorted."""
        async def subjects() -> dict[str, int]:
            info = await self._stream_info(subjects_filter=f"{self.stream}.>")
            return info.state.subjects or {}

        prefix = f"{self.stream}."
        return sorted(s[len(prefix):] for s in self.bridge.call(subjects()) if s.startswith(prefix))

    def partitions(self) -> list[int]:
        """The partition ids that hold messages, ascending."""
        return sorted(pid for pid in map(parse_partition_name, self.names()) if pid is not None)

    def log(self, log: int | str) -> "JetStreamRef":
        """The reference to one log of the run (a partition id or a name)."""
        return JetStreamRef(self, log_name(log))

    def close(self) -> None:
        """Close the connection and stop the bridge thread."""
        try:
            if self.nc is not None and not self.nc.is_closed and self.bridge.loop.is_running():
                self.bridge.call(self.nc.close(), timeout=10)
        finally:
            self.bridge.stop()

    def __enter__(self) -> "JetStreamRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JetStreamRef:
    """One log of a run on JetStream (its stream's subject ``<stream>.<name>``),
    behind :class:`~agentlog.events.log.source_nats.SubjectSource` (and what
    :func:`~agentlog.events.follow_logs` takes in place of a directory)."""

    def __init__(self, run: JetStreamRun, name: str) -> None:
        self.run, self.name = run, name
        self.subject = f"{run.stream}.{name}"
        self.where = f"nats stream {run.stream!r} subject {self.subject!r}"

    def __str__(self) -> str:
        return f"{self.run.url}/{self.run.stream}/{self.name}"

    def exists(self) -> bool:
        """Whether the subject holds any message yet."""
        return self.run.bridge.call(last_seq(self.run.js, self.run.stream, self.subject)) > 0

    def next_lsn(self) -> int:
        """The LSN after the log's last record (0 for an empty subject), from
        the subject's last message as the stream leader has it: a record's msg
        id names its LSN, a fence the next LSN."""
        async def ask() -> int:
            from nats.js.errors import NotFoundError

            try:
                last = await retried(lambda: self.run.js.get_msg(self.run.stream, subject=self.subject),
                                     "the subject's last message", self.where, self.run.start_timeout_s, 5.0,
                                     "start_timeout_s")
            except NotFoundError:
                return 0
            return lsn_after(last, self.where)

        return self.run.bridge.call(ask())

    def read(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False) -> Generator[Any, None, None]:
        """Every record from ``from_lsn`` to the end as of the call (in lists of RawRecords with ``batches``)."""
        return read_subject(self.run.bridge, self.run.js, self.run.stream, self.subject, self.where, from_lsn,
                            raw=raw, batches=batches)

    def follow(self, from_lsn: int = 0, *, raw: bool = False, poll_s: float = 0.05) -> AsyncIterator:
        """Tail the log forever from ``from_lsn``."""
        return follow_subject(self.run.bridge, self.run.js, self.run.stream, self.subject, self.where, from_lsn,
                              raw=raw, poll_s=poll_s)

    def cursor(self, from_lsn: int = 0, *, raw: bool = False) -> "RefCursor":
        """A following cursor for a caller that polls several logs in one task (``follow_logs``)."""
        return RefCursor(self, from_lsn, raw)


class RefCursor:
    """A SubjectCursor driven from another event loop: ``await records(limit)`` never waits for new messages."""

    def __init__(self, ref: JetStreamRef, from_lsn: int, raw: bool) -> None:
        self.ref = ref
        self.cur = SubjectCursor(ref.run.js, ref.run.stream, ref.subject, ref.where, from_lsn, raw=raw, to_end=False)
        self.started = False

    async def records(self, limit: int) -> list:
        """The records available now (at most ``limit``)."""
        bridge = self.ref.run.bridge
        if not self.started:
            await asyncio.wrap_future(bridge.submit(self.cur.start()))
            self.started = True
        return await asyncio.wrap_future(bridge.submit(self.cur.take(limit, 0.0)))

    def close(self) -> None:
        """Drop the consumer (without waiting)."""
        if self.ref.run.bridge.loop.is_running():
            self.ref.run.bridge.submit(self.cur.close())
