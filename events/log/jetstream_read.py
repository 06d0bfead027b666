"""Reading JetStream log partitions: one ordered consumer per subject.

A log on JetStream (see :mod:`agentlog.events.log.jetstream`) is a subject
``<stream>.<name>`` of a run's stream, ``<name>`` being a partition
(``p0003``) or another log of the run (``learner``). Its records are the
file log's frames, one message each (a frame over the server's max payload
is split into chunks inside one atomic batch).

Readers here never write: no stream is created, no epoch is taken, so any
number of them, on any host, can read beside the live writer. A reader:

- finds the stream sequence to start from with a binary search over the
  subject by direct get (each record message's ``Nats-Msg-Id`` names its
  LSN), so reading from a late LSN costs O(log n) requests, not a scan;
- then takes the messages through an *ordered consumer* (an ephemeral push
  consumer that the client restarts at the right sequence on any gap), so
  a record costs no round trip of its own;
- joins chunks and checks every frame exactly as a segment reader does
  (CRC, length, LSN continuity): :func:`decode_message`.

``nats://host:port/stream`` names a run's stream (several servers:
``nats://h1:4222,h2:4222/stream``); :func:`parse_nats_url` splits it and
:class:`JetStreamRun` opens it read-only. :class:`JetStreamRef` names one of
its logs, and is accepted by :func:`agentlog.events.read_log` and
:func:`agentlog.events.follow_logs` wherever a log directory is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
from typing import Any, AsyncIterator, Iterator

from ..._logging import get_logger
from .api import LogCorruption, LogError, NotALog
from .format import ENV_HDR, FLAG_TERMINAL, FRAME_HDR, FRAME_PREFIX, TYPE_RECORD, crc_value, mask_crc
from .read import RawRecord
from .partitions import parse_partition_name, partition_name

log = get_logger(__name__)

HDR_MSG_ID = "Nats-Msg-Id"
HDR_KIND = "Agentlog-Kind"
#: "i/k" on the messages of a record split into k chunks (i from 1); absent on a whole record.
HDR_CHUNK = "Agentlog-Chunk"
KIND_FENCE = "fence"
#: On a fence message: the LSN its writer appends next.
HDR_NEXT_LSN = "Agentlog-Next-Lsn"
STREAM_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: A log's name inside its run's stream: a partition (p0003) or a named log (learner).
LOG_NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}")
#: Seconds a reader waits for the next message while the subject is known to hold more.
READ_STALL_S = 30.0


def require_nats():
    """The nats package, or a LogError naming the extra to install."""
    try:
        import nats  # noqa: F401
    except ImportError as exc:  # a clear cure, not a bare ImportError
        raise LogError("the JetStream log needs nats-py: pip install 'agentlog[nats]'") from exc
    return nats


def retry_errors() -> tuple[type[BaseException], ...]:
    """Client-side failures of one request that a leader election or a
    reconnect causes (the connection itself stays open)."""
    import nats.errors
    import nats.js.errors

    return (
        nats.errors.TimeoutError,
        asyncio.TimeoutError,
        nats.errors.NoRespondersError,
        nats.js.errors.NoStreamResponseError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.StaleConnectionError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.FlushTimeoutError,
    )


#: JetStream refusals that a node coming back makes for a moment: "no suitable peers for
#: placement, peer offline" (creating an R3 stream while a restarted node is not current yet).
TRANSIENT_API_ERRORS = (10005,)
#: Pause between tries of a request during an election.
RETRY_PAUSE_S = 0.05


async def retried(call, what: str, where: str, timeout_s: float, per_try_s: float, setting: str) -> Any:
    """``await call()``, tried again for up to ``timeout_s`` while it fails the
    way an election or a reconnect makes it fail (a client timeout, no
    responders, a 503 from the server, a peer still offline); any other error at once. Past the
    deadline a LogError names ``where``, ``what`` was asked and the
    ``setting`` that bounds it."""
    from nats.js.errors import APIError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    transient = retry_errors()
    while True:
        try:
            return await asyncio.wait_for(call(), timeout=per_try_s)
        except (APIError, *transient) as exc:
            if isinstance(exc, APIError) and exc.code != 503 and exc.err_code not in TRANSIENT_API_ERRORS:
                raise
            if loop.time() >= deadline:
                raise LogError(f"{where}: {what} not answered within {setting}={timeout_s:g} s: {exc!r}") from exc
            log.info("jetstream.retry", where=where, what=what, error=repr(exc))
            await asyncio.sleep(RETRY_PAUSE_S)


async def connect(url, connect_timeout_s: float, error_cb=None):
    """A nats-py connection to ``url`` (one nats:// URL, several joined by
    commas, or a list), reconnecting without limit and quickly: when the
    node a client is on dies, it must reach the survivors while the stream
    elects a leader; the callers' deadlines, not the connection, bound
    their requests."""
    nats = require_nats()
    servers = [url] if isinstance(url, str) else list(url)
    servers = [u.strip() for entry in servers for u in str(entry).split(",") if u.strip()]
    if not servers:
        raise ValueError(f"url: expected a nats:// URL or a list of them, found {url!r}")
    return await nats.connect(servers=servers, connect_timeout=connect_timeout_s, error_cb=error_cb,
                              allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.2)


def is_nats_url(text: Any) -> bool:
    """Whether ``text`` names a JetStream log (``nats://...``) rather than a directory."""
    return isinstance(text, str) and text.startswith("nats://")


def parse_nats_url(text: str) -> tuple[str, str, str | None]:
    """``nats://host:port[,host:port...]/stream[/name]`` -> (server URLs as
    nats-py takes them, stream, log name or None). ValueError naming the
    part that is wrong and what was expected."""
    if not is_nats_url(text):
        raise ValueError(f"{text!r}: expected nats://host:port/stream")
    rest = text[len("nats://"):]
    hosts, _, path = rest.partition("/")
    parts = path.split("/") if path else []
    if not hosts or not parts or not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"{text!r}: expected nats://host:port/stream or nats://host:port/stream/<log> (p0003, learner)")
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{text!r}: server {host!r} is not host:port")
    if not STREAM_RE.fullmatch(parts[0]):
        raise ValueError(f"{text!r}: stream {parts[0]!r}: expected letters, digits, '-' or '_' (1..200)")
    name = parts[1] if len(parts) == 2 else None
    if name is not None and not LOG_NAME_RE.fullmatch(name):
        raise ValueError(f"{text!r}: log {name!r}: expected a partition (p0003) or a name such as 'learner'")
    return ",".join(f"nats://{h}" for h in hosts.split(",")), parts[0], name


def log_name(log: int | str) -> str:
    """The subject suffix of a log: a partition id as ``p%04d``, or a checked name."""
    if isinstance(log, str):
        if not LOG_NAME_RE.fullmatch(log):
            raise ValueError(f"log name: expected lowercase letters, digits, '-' or '_' starting with a letter, found {log!r}")
        return log
    return partition_name(log)


class Bridge:
    """A daemon thread running one asyncio loop: the NATS connection lives
    there, and sync callers (or other event loops) submit coroutines to it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule ``coro`` on the bridge loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None = None) -> Any:
        """Run ``coro`` on the bridge loop and wait for its result."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop (a client's heartbeat tasks), stop it and join the thread."""
        if self.loop.is_running():
            try:
                self.call(_cancel_others(), timeout=5)
            except concurrent.futures.TimeoutError:  # stopping anyway: the thread is a daemon
                log.warning("jetstream.bridge_stop_timeout", thread=self.thread.name)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def decode_message(data: bytes, where: str, expected_lsn: int) -> RawRecord:
    """The record one JetStream message holds: its frame checked exactly as a
    segment reader checks it (type, length, CRC, LSN). Raises LogCorruption
    naming ``where`` and what was wrong."""

    def bad(reason: str) -> LogCorruption:
        return LogCorruption(f"{where}: {reason}", segment=where, last_good_lsn=expected_lsn - 1)

    if len(data) < FRAME_PREFIX + ENV_HDR.size:
        raise bad(f"message of {len(data)} bytes is shorter than a frame header ({FRAME_PREFIX + ENV_HDR.size})")
    crc, length, typ = FRAME_HDR.unpack_from(data, 0)
    if typ != TYPE_RECORD:
        raise bad(f"type byte {typ} (expected a record, type {TYPE_RECORD})")
    if FRAME_PREFIX + length != len(data):
        raise bad(f"frame length {length} does not match the message ({len(data) - FRAME_PREFIX} bytes after the header)")
    view = memoryview(data)
    if mask_crc(crc_value(data[4:])) != crc:
        raise bad("CRC mismatch")
    lsn, seq, ts, flags, sidlen = ENV_HDR.unpack_from(data, FRAME_PREFIX)
    if lsn != expected_lsn:
        raise bad(f"lsn {lsn}, expected {expected_lsn}")
    p = FRAME_PREFIX + ENV_HDR.size
    if p + sidlen > len(data):
        raise bad(f"session-id length {sidlen} exceeds the frame")
    try:
        sid = bytes(view[p : p + sidlen]).decode("utf-8")
    except UnicodeDecodeError:
        raise bad("session id is not UTF-8") from None
    return RawRecord(lsn, sid, seq, ts, bool(flags & FLAG_TERMINAL), view[p + sidlen :])


def msg_id_lsn(headers: dict | None) -> int | None:
    """The LSN a record message's ``Nats-Msg-Id`` (``<log>:<epoch>:<lsn>[:<chunk>]``) names; None for a fence or a foreign message."""
    parts = (headers or {}).get(HDR_MSG_ID, "").split(":")
    return int(parts[2]) if len(parts) >= 3 and parts[2].isdigit() else None


def lsn_after(last, where: str) -> int:
    """The LSN that follows a log whose subject ends in message ``last``: a record's
    msg id names its LSN, a fence the next LSN; anything else is LogCorruption."""
    headers = last.headers or {}
    lsn = msg_id_lsn(headers)
    if lsn is not None:
        return lsn + 1
    if headers.get(HDR_KIND) == KIND_FENCE and headers.get(HDR_NEXT_LSN, "").isdigit():
        return int(headers[HDR_NEXT_LSN])
    raise LogCorruption(f"{where} seq {last.seq}: the last message is neither a record nor a fence naming "
                        f"the next LSN (headers {sorted(headers)})", segment=where)


class ChunkJoiner:
    """Joins a subject's messages into frames: a whole record as it is, the
    chunks of a split record joined at its last chunk (never yielded in
    part); fence messages skipped. Chunks out of order are LogCorruption."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.parts: list[bytes] = []
        self.first = 0

    def push(self, seq: int, headers: dict | None, data: bytes) -> bytes | None:
        """The frame completed by this message, or None (a fence, or a chunk before the last)."""
        headers = headers or {}
        if headers.get(HDR_KIND) == KIND_FENCE:
            return None
        chunk = headers.get(HDR_CHUNK)
        if chunk is None:
            if self.parts:
                raise LogCorruption(f"{self.where} seq {seq}: a whole message inside the chunks begun at seq {self.first}", segment=self.where)
            return data
        i, _, k = chunk.partition("/")
        if not (i.isdigit() and k.isdigit() and int(i) == len(self.parts) + 1 <= int(k)):
            raise LogCorruption(f"{self.where} seq {seq}: chunk {chunk!r}, expected {len(self.parts) + 1}/k", segment=self.where)
        if not self.parts:
            self.first = seq
        self.parts.append(data)
        if int(i) < int(k):
            return None
        joined, self.parts = b"".join(self.parts), []
        return joined


#: How long a direct get is retried while no server answers it (a stream just
#: created, or its replicas changing leader, has no direct-get responder for a moment).
DIRECT_GET_WAIT_S = 10.0


async def direct_get(js, stream: str, **kw):
    """``js.get_msg(stream, direct=True, **kw)``, retried for up to
    DIRECT_GET_WAIT_S while the server cannot answer it (no responder yet)."""
    return await retried(lambda: js.get_msg(stream, direct=True, **kw), "a direct get", f"nats stream {stream!r}",
                         DIRECT_GET_WAIT_S, 5.0, "DIRECT_GET_WAIT_S")


async def _direct_get(js, stream: str, subject: str, seq: int):
    """The subject's first message at stream sequence ``seq`` or later, or None."""
    from nats.js.errors import NotFoundError

    try:
        return await direct_get(js, stream, seq=seq, subject=subject, next=True)
    except NotFoundError:
        return None


async def last_seq(js, stream: str, subject: str, *, leader: bool = False) -> int:
    """The stream sequence of the subject's last message (0 when it has none).
    With ``leader`` it is asked of the stream leader: a direct get may be
    answered by a replica that has not applied the newest acknowledged
    messages yet, and a read to "the end" from there would miss them."""
    from nats.js.errors import NotFoundError

    try:
        if leader:
            return (await js.get_msg(stream, subject=subject)).seq
        return (await direct_get(js, stream, subject=subject)).seq
    except NotFoundError:
        return 0


async def seq_of_lsn(js, stream: str, subject: str, lsn: int, end: int) -> int:
    """A stream sequence to start reading ``subject`` at so that the first
    record read is the first with an LSN >= ``lsn``: a binary search by
    direct get over sequences 1..``end`` (LSNs grow with the sequence).
    Messages without an LSN (fences) are stepped over."""
    lo, hi = 1, end + 1
    while lo < hi:
        mid = (lo + hi) // 2
        msg = await _direct_get(js, stream, subject, mid)
        while msg is not None and msg.seq < hi and msg_id_lsn(msg.headers) is None:
            msg = await _direct_get(js, stream, subject, msg.seq + 1)
        if msg is None or msg.seq >= hi or msg_id_lsn(msg.headers) >= lsn:
            hi = mid
        else:
            lo = msg.seq + 1
    return lo


class SubjectCursor:
    """A position in one log subject, read through an ordered consumer.

    ``take(limit, wait_s)`` returns the next records (Envelopes, or
    RawRecords with ``raw``), waiting up to ``wait_s`` for the first. With
    ``to_end`` the cursor stops at the subject's last message as of
    :meth:`start` (``done`` is then set), or at stream sequence ``end``
    when given; otherwise it follows forever.
    Runs on the event loop that holds the connection."""

    def __init__(self, js, stream: str, subject: str, where: str, from_lsn: int, *, raw: bool, to_end: bool,
                 start_timeout_s: float = 30.0, end: int | None = None) -> None:
        self.js, self.stream, self.subject, self.where = js, stream, subject, where
        self.start_timeout_s = start_timeout_s
        self.given_end = end
        self.from_lsn, self.raw, self.to_end = max(0, from_lsn), raw, to_end
        self.expected: int | None = None  # the LSN the next record must carry
        self.joiner = ChunkJoiner(where)
        self.sub = None
        self.end = 0
        self.seen = 0  # stream sequence of the last message taken
        self.done = False
        self.failed: Exception | None = None

    async def start(self) -> None:
        """Find where to begin and subscribe (nothing to subscribe to for an empty subject read to its end)."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        # Every step goes through the stream's leaders (creating the consumer
        # through the meta leader): during an election it is tried again,
        # for up to start_timeout_s in all.
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s

        def left() -> float:
            return max(0.0, deadline - asyncio.get_running_loop().time())

        def ask(what: str, call):
            return retried(call, what, self.where, left(), 5.0, "start_timeout_s")

        # The leader's end: a read sees every record acknowledged before it began.
        self.end = self.given_end if self.given_end is not None else await ask(
            "the subject's last message", lambda: last_seq(self.js, self.stream, self.subject, leader=True))
        first = 1
        if self.from_lsn and self.end:
            first = await ask(f"the sequence of lsn {self.from_lsn}",
                              lambda: seq_of_lsn(self.js, self.stream, self.subject, self.from_lsn, self.end))
        else:
            self.expected = 0
        if self.to_end and first > self.end:
            self.done = True
            return
        self.sub = await ask("an ordered consumer", lambda: self.js.subscribe(
            self.subject,
            stream=self.stream,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first),
        ))

    async def take(self, limit: int, wait_s: float) -> list:
        """Up to ``limit`` records; waits up to ``wait_s`` for the first
        message (reading to the end, a stall of READ_STALL_S while the
        subject holds more is an error naming the sequence)."""
        import nats.errors

        out: list = []
        if self.failed is not None:  # met after the records before it were handed out
            raise self.failed
        if self.done:
            return out
        while len(out) < limit:
            if self.to_end and self.seen >= self.end:
                self.done = True
                break
            if self.sub.pending_msgs == 0 and (out or (wait_s <= 0 and not self.to_end)):
                break
            try:
                # wait_for(..., 0) times out even on a ready queue, so a pending message gets a real timeout.
                timeout = READ_STALL_S if self.to_end else (wait_s if self.sub.pending_msgs == 0 else READ_STALL_S)
                msg = await self.sub.next_msg(timeout=timeout)
            except nats.errors.TimeoutError:
                if self.to_end:
                    raise LogError(
                        f"{self.where}: no message from the server for {READ_STALL_S:.0f} s while reading up to "
                        f"stream sequence {self.end} (last taken: {self.seen})"
                    ) from None
                break
            self.seen = msg.metadata.sequence.stream
            frame = self.joiner.push(self.seen, msg.headers, msg.data or b"")
            if frame is None:
                continue
            if self.expected is None:  # a read from a later LSN begins at what the search found
                self.expected = msg_id_lsn(msg.headers) if msg_id_lsn(msg.headers) is not None else self.from_lsn
            try:
                rec = decode_message(frame, f"{self.where} seq {self.seen}", self.expected)
                self.expected += 1
                if rec.lsn < self.from_lsn:
                    continue
                out.append(rec if self.raw else rec.decode())
            except Exception as exc:
                if not out:
                    raise
                # The good records before the damage go out first (as a
                # segment reader yields the records before a bad frame); the
                # error is raised by the next call.
                self.failed = exc
                break
        return out

    async def close(self) -> None:
        """Unsubscribe (the server drops the ephemeral consumer)."""
        sub, self.sub = self.sub, None
        if sub is not None:
            await sub.unsubscribe()


def read_subject(bridge, js, stream: str, subject: str, where: str, from_lsn: int = 0, *, raw: bool = False,
                 chunk: int = 512, batches: bool = False) -> Iterator:
    """Every record of a subject from ``from_lsn`` to its end as of the
    call, synchronously, through ``bridge`` (the thread holding the connection).
    With ``batches``, the lists the cursor takes (RawRecords), as they come."""
    cur = SubjectCursor(js, stream, subject, where, from_lsn, raw=raw or batches, to_end=True)
    bridge.call(cur.start())
    try:
        while not cur.done:
            taken = bridge.call(cur.take(chunk, 0.0))
            if not batches:
                yield from taken
            elif taken:
                yield taken
    finally:
        if bridge.loop.is_running():
            bridge.call(cur.close())


async def follow_subject(bridge, js, stream: str, subject: str, where: str, from_lsn: int = 0, *, raw: bool = False,
                         poll_s: float = 0.05, chunk: int = 512) -> AsyncIterator:
    """Tail a subject forever from ``from_lsn``, from the caller's event loop."""
    cur = SubjectCursor(js, stream, subject, where, from_lsn, raw=raw, to_end=False)
    await asyncio.wrap_future(bridge.submit(cur.start()))
    try:
        while True:
            for rec in await asyncio.wrap_future(bridge.submit(cur.take(chunk, poll_s))):
                yield rec
    finally:
        if bridge.loop.is_running():
            bridge.submit(cur.close())


class JetStreamRun:
    """A run's stream, opened read-only (behind :mod:`~agentlog.events.log.source_nats`): its logs listed, read and followed.

    Creates nothing and takes no epoch, so it never disturbs the writers.
    One connection, held by a bridge thread; close it (or use ``with``)."""

    def __init__(self, url: str, stream: str, start_timeout_s: float = 30.0) -> None:
        self.url, self.stream = url, stream
        self.start_timeout_s = start_timeout_s
        self.where = f"nats stream {stream!r} at {url}"
        self.bridge = Bridge(f"jetstream-read-{stream}")
        self.nc = self.js = None

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
            await self._stream_info()
        except NotFoundError:
            raise NotALog(f"{self.where}: no such stream (expected a run written by JetStreamLog)") from None

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

    def read(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False) -> Iterator:
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
