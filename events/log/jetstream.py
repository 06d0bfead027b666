"""A log partition on NATS JetStream, behind the same interface as FileLog.

One stream per run (``stream``), one subject per partition
(``<stream>.p0003``), file storage, replicas as configured. Each record is
stored as one message whose data is exactly the file log's frame
(:func:`encode_frame`: CRC, LSN, session seq, timestamp, session id, and the
payload that :meth:`EventLog._check_batch` encoded and decoded back), so
nothing reaches the stream that a reader cannot decode, and a reader checks
the same CRC a segment reader does.

Identity and fencing:

- Every record carries ``Nats-Msg-Id = "<partition>:<epoch>:<lsn>"``; a
  retried publish inside the stream's duplicate window is deduplicated. A
  fence's id is its writer's own (``<partition>:<epoch>:fence:<random>``,
  see :meth:`JetStreamLog._fence`).
- Every publish carries ``Nats-Expected-Last-Subject-Sequence`` = the stream
  sequence of the partition's last message this writer knows of. A new
  writer opens with epoch = last epoch + 1 and publishes a *fence* message
  (no data, header ``Agentlog-Kind: fence``) on the subject; that moves the
  subject's last sequence, so the stale writer's next append is refused by
  the server and raised as :class:`LogFenced`. Readers skip fence messages.

Bridging: nats-py is asyncio, the log interface is partly sync. Each
JetStreamLog owns one daemon thread running its own event loop that holds
the NATS connection. Sync calls submit coroutines with
``run_coroutine_threadsafe`` and wait; ``append`` and ``follow`` await the
same futures with ``asyncio.wrap_future`` from the caller's loop. Publishes
go through one queue drained by one writer task on the bridge loop, so they
reach the server in LSN order (fencing needs the previous message's stream
sequence, so publishes of a partition go one after another; appends queued
meanwhile are group-committed as one atomic batch).

This module connects, sets up the stream, recovers the partition, fences
earlier writers (the take-over), reads and closes. The append path (group
commit, atomic batches, chunks of large records, retries through a
failover) is :mod:`agentlog.events.log.jetstream_append`, whose
:class:`JetStreamAppender` is the base class of :class:`JetStreamLog`.

Reads (:mod:`agentlog.events.log.jetstream_cursor`) find a late LSN by a
binary search over the subject by direct get, then take messages through an
ordered consumer. The connection and its bridge thread are
:mod:`~agentlog.events.log.jetstream_conn`'s, the message headers
:mod:`~agentlog.events.log.jetstream_msg`'s, the names
:mod:`~agentlog.events.log.jetstream_url`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from ..._logging import get_logger
from .api import LogClosed, LogCorruption, LogError, LogFenced
from .jetstream_append import HDR_EPOCH, JetStreamAppender, _Msg, is_wrong_last_sequence
from .jetstream_conn import Bridge, connect, retried
from .jetstream_cursor import follow_subject, read_subject
from ..schema.validation import is_number
from .jetstream_msg import HDR_KIND, HDR_MSG_ID, HDR_NEXT_LSN, KIND_FENCE, lsn_after
from .jetstream_url import STREAM_RE, log_name
from ..schema.types import Envelope

log = get_logger(__name__)


def _epoch_of(msg, where: str) -> int:
    """The epoch of the writer that published ``msg`` (0 for a message without one);
    LogCorruption naming the message when its epoch header is not a whole number."""
    value = (msg.headers or {}).get(HDR_EPOCH, "0")
    if not value.isascii() or not value.isdigit():
        raise LogCorruption(f"{where} seq {msg.seq}: header {HDR_EPOCH} is {value!r}, expected a whole number "
                            "(a message no agentlog writer published)", segment=where)
    return int(value)


#: The longest duration the server takes (a Go time.Duration, in whole seconds).
_MAX_DURATION_S = (2**63 - 1) // 10**9


def _subject_matches(pattern: str, subject: str) -> bool:
    """Whether the NATS subject ``pattern`` (``*`` one token, ``>`` the rest) covers ``subject``."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


def _check_stream_config(cfg, where: str, subject: str, replicas: int) -> None:
    """LogError naming the setting when a stream (one made by someone else, say)
    cannot hold this log: the subject not bound to it, no direct gets (readers and
    the landed check need them), retention and limits that drop stored records,
    other replicas than asked for, or no atomic batches."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType

    def bad(what: str, found: Any, expected: str) -> LogError:
        return LogError(f"{where}: the stream's {what} is {found!r}, expected {expected} (a stream made by JetStreamLog.open)")

    if not any(_subject_matches(p, subject) for p in cfg.subjects or []):
        raise bad("subjects", cfg.subjects, f"one that covers {subject!r}")
    if not cfg.allow_direct:
        raise bad("allow_direct", cfg.allow_direct, "True")
    if cfg.storage not in (None, StorageType.FILE):
        raise bad("storage", cfg.storage, "file")
    if cfg.retention not in (None, RetentionPolicy.LIMITS):
        raise bad("retention", cfg.retention, "limits (records are never removed)")
    if cfg.max_age:
        raise bad("max_age", cfg.max_age, "0 (records never expire)")
    if cfg.discard in (None, DiscardPolicy.OLD):
        for name in ("max_msgs", "max_bytes", "max_msgs_per_subject"):
            value = getattr(cfg, name)
            if value is not None and value > 0:
                raise bad(name, value, "no limit (-1): with discard 'old' the server deletes acknowledged records")
    if (cfg.num_replicas or 1) != replicas:
        raise LogError(f"{where}: the stream has {cfg.num_replicas} replicas, expected {replicas}")
    if not cfg.allow_atomic:
        raise LogError(f"{where}: the stream does not allow atomic batches (allow_atomic); create it with JetStreamLog.open")


class JetStreamLog(JetStreamAppender):
    """One log partition as a subject of a JetStream stream. Open with :meth:`open`."""

    #: Seconds one publish try waits for its ack (set by :meth:`open`).
    _publish_timeout_s = 5.0
    #: Seconds after a publish's first failure during which it is retried (set by :meth:`open`).
    _failover_timeout_s = 30.0
    #: Seconds :meth:`close` waits for queued publishes to be acknowledged before it abandons them.
    _close_wait_s = 10.0

    def __init__(self, *, url: str | Sequence[str], stream: str, partition: int | str, clock: Callable[[], int]) -> None:
        super().__init__(clock)
        self.url, self.stream, self.partition = url, stream, partition
        self.subject = f"{stream}.{log_name(partition)}"
        self.where = f"nats stream {stream!r} subject {self.subject!r}"
        self.epoch = 0
        self._lock = threading.Lock()  # check + LSN assignment + submission, in one order
        self._next = 0
        self._last_seq = 0  # stream sequence of the subject's last message this writer knows
        self._max_payload = 1 << 20
        self._closed = False
        self._fatal: str | None = None
        self._bridge = Bridge(f"jetstream-{self.subject}")
        self._queue: asyncio.Queue | None = None
        self._writer: asyncio.Task | None = None
        #: What the writer task has taken off the queue and not yet settled (failed, should it end).
        self._taken: list = []
        self._nc = self._js = None

    # -- opening -------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str | Sequence[str],
        stream: str,
        partition: int | str = 0,
        *,
        replicas: int = 1,
        duplicate_window_s: float = 120.0,
        clock: Callable[[], int] = time.time_ns,
        connect_timeout_s: float = 5.0,
        publish_timeout_s: float = 5.0,
        failover_timeout_s: float = 30.0,
    ) -> "JetStreamLog":
        """Connect, create the stream if missing (file storage, ``replicas``,
        duplicate window set explicitly), recover the partition's LSN and open
        sessions, and fence any earlier writer with a new epoch.

        ``url`` is one server URL, several separated by commas, or a list (a
        cluster's nodes: the client reconnects to another when one dies).
        A publish that fails for want of a stream leader (no responders, a
        timeout, a lost connection: a leader election) is retried with the
        same message ids until ``failover_timeout_s`` after its first failure;
        past that the log goes fatal, naming stream, subject and LSN. Each
        try waits at most ``publish_timeout_s`` for its ack."""
        if not isinstance(stream, str) or not STREAM_RE.fullmatch(stream):
            raise ValueError(f"stream name: expected letters, digits, '-' or '_' (1..200), found {stream!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 5:
            raise ValueError(f"replicas: expected an int in 1..5, found {replicas!r}")
        for name, value in (("duplicate_window_s", duplicate_window_s), ("connect_timeout_s", connect_timeout_s),
                            ("publish_timeout_s", publish_timeout_s), ("failover_timeout_s", failover_timeout_s)):
            # At most a Go time.Duration (the server's type for the duplicate window): about 292 years.
            if not is_number(value, above=0) or value > _MAX_DURATION_S:
                raise ValueError(f"{name}: expected seconds > 0 (at most {_MAX_DURATION_S}), found {value!r}")
        self = cls(url=url, stream=stream, partition=partition, clock=clock)
        self._publish_timeout_s, self._failover_timeout_s = float(publish_timeout_s), float(failover_timeout_s)
        try:
            self._bridge.call(self._open(replicas, duplicate_window_s, connect_timeout_s, publish_timeout_s))
        except BaseException:
            self._shutdown()
            raise
        log.info("jetstream.opened", stream=stream, subject=self.subject, epoch=self.epoch, next_lsn=self._next)
        return self

    async def _open(self, replicas: int, window_s: float, connect_timeout_s: float, publish_timeout_s: float) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        async def on_error(exc: Exception) -> None:
            log.warning("jetstream.connection_error", subject=self.subject, error=repr(exc))

        self._nc = await connect(self.url, connect_timeout_s, on_error)
        self._max_payload = self._nc.max_payload
        self._js = self._nc.jetstream(timeout=publish_timeout_s)
        # Stream requests go through the meta leader: during an election
        # (or on a loaded cluster creating an R3 stream) they are tried again
        # for up to failover_timeout_s. Creating a stream again with the same
        # config is a no-op, so a retried create that had landed is harmless.
        def ask(what: str, call):
            return retried(call, what, self.where, self._failover_timeout_s, publish_timeout_s, "failover_timeout_s")

        try:
            info = await ask("the stream's info", lambda: self._js.stream_info(self.stream))
        except NotFoundError:
            cfg = StreamConfig(
                name=self.stream,
                subjects=[f"{self.stream}.>"],
                storage=StorageType.FILE,
                num_replicas=replicas,
                duplicate_window=window_s,
                allow_direct=True,
                # One append_batch is one atomic batch (server 2.12+): all of it or none.
                allow_atomic=True,
            )
            info = await ask("creating the stream", lambda: self._js.add_stream(cfg))
        _check_stream_config(info.config, self.where, self.subject, replicas)
        await self._recover()
        await self._take_over()
        self._queue = asyncio.Queue()
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        self._writer.add_done_callback(self._writer_ended)

    async def _recover(self) -> None:
        """Rebuild next LSN, open sessions and the last epoch from the subject
        (read through an ordered consumer, every frame checked). The cursor
        reads up to the end the stream leader reports (a replica answering
        direct gets may lag: a writer that recovered from it would fence on a
        stale sequence), and waits out an election (no leader, no consumer
        yet, a stream just created) for up to ``failover_timeout_s``."""
        self._last_seq = await self._read_records(0)
        # Every message carries its writer's epoch; the subject's last one has the newest.
        # Asked of the stream leader, not by direct get: a lagging replica could answer
        # with an older message, and a repeated epoch would repeat the old writer's
        # message ids (deduplicated: the fence "lands" at the old sequence, and the new
        # writer is then refused as if fenced).
        epoch = -1
        if self._last_seq:
            epoch = _epoch_of(await self._last_message(), self.where)
        self.epoch = epoch + 1

    async def _read_records(self, from_lsn: int, end: int | None = None) -> int:
        """Advance next LSN and open sessions over the subject's records from
        ``from_lsn`` up to stream sequence ``end`` (the leader's end when
        None); the sequence read up to."""
        from .jetstream_cursor import SubjectCursor

        cur = SubjectCursor(self._js, self.stream, self.subject, self.where, from_lsn, raw=True, to_end=True,
                            start_timeout_s=self._failover_timeout_s, end=end)
        await cur.start()
        try:
            while not cur.done:
                for rec in await cur.take(1024, 0.0):
                    self._advance(rec.decode())
                    self._next = rec.lsn + 1
        finally:
            await cur.close()
        if cur.joiner.parts:  # held back by readers; appending after them would bury every later record
            raise LogCorruption(
                f"{self.where} seq {cur.joiner.first}: the subject ends in {len(cur.joiner.parts)} chunk(s) of a record "
                f"whose last chunk never came (after lsn {self._next - 1}); expected whole records: not appending after them",
                segment=self.where, last_good_lsn=self._next - 1)
        return cur.end

    async def _last_message(self):
        """The subject's last message, asked of the stream leader (retried through an election)."""
        return await retried(lambda: self._js.get_msg(self.stream, subject=self.subject), "the subject's last message",
                             self.where, self._failover_timeout_s, self._publish_timeout_s, "failover_timeout_s")

    async def _take_over(self) -> None:
        """Fence the partition at the end this writer recovered; while the
        fence is refused because the subject moved on (the old writer is
        still appending, or another writer opened), fence again at its new
        end, for up to ``failover_timeout_s``. Each new try costs one get of
        the subject's last message (its sequence, its writer's epoch, the LSN
        after it), so the window an old writer's append can slip into is one
        round trip, and a live writer cannot hold the partition; once the
        fence lands, that writer's next append is refused (LogFenced). The
        records that landed before the fence are then read (every frame
        checked, as at recovery), so none acknowledged to the old writer is
        lost; they must end where the fence says, or the open fails."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._failover_timeout_s
        recovered, tries = self._next, 1
        while True:
            try:
                await self._fence()
                break
            except Exception as exc:
                if not is_wrong_last_sequence(exc):
                    raise
                if loop.time() >= deadline:
                    raise LogFenced(
                        f"{self.where}: the subject kept moving while epoch {self.epoch} was opening: {tries} fences were "
                        f"refused within failover_timeout_s={self._failover_timeout_s:g}; not taking over",
                        epoch=self.epoch,
                    ) from exc
            last = await self._last_message()
            self._last_seq, self.epoch, self._next = last.seq, _epoch_of(last, self.where) + 1, lsn_after(last, self.where)
            tries += 1
        if self._next == recovered:
            return
        fenced_at = self._next
        self._next = recovered
        await self._read_records(recovered, end=self._last_seq)
        if self._next != fenced_at:
            raise LogError(f"{self.where}: the records before this writer's fence end at lsn {self._next - 1}, but the "
                           f"subject's end said the next lsn is {fenced_at}")
        log.info("jetstream.took_over", subject=self.subject, epoch=self.epoch, fences=tries,
                 records_caught_up=fenced_at - recovered)

    async def _fence(self) -> None:
        """Publish this writer's fence at the subject sequence it knows; the
        refusal of a subject that moved is raised (``is_wrong_last_sequence``).
        Retried through a leader election like any append (same message id).

        The fence's message id is this writer's alone (a random suffix): two
        writers that recovered the same end take the same epoch, and with a
        shared fence id the server would deduplicate the second fence into an
        ack of the first, leaving two writers with one epoch whose records
        (same ids) are deduplicated the same way: acknowledged, not stored.
        With its own id the second fence is refused (the subject moved)."""
        import uuid

        ident = f"{self.partition}:{self.epoch}:fence:{uuid.uuid4().hex}"
        # The fence names the next LSN, so a subject that ends in fences still tells its end in one get.
        fence = _Msg(self._next, b"", {HDR_KIND: KIND_FENCE, HDR_MSG_ID: ident, HDR_NEXT_LSN: str(self._next)})
        await self._publish([fence])

    # -- reading -------------------------------------------------------------

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Any]:  # typed by EventLog.read's overloads
        if self._closed:
            raise LogClosed(f"{self.where}: closed")
        return read_subject(self._bridge, self._js, self.stream, self.subject, self.where, from_lsn, raw=raw)

    def follow(self, from_lsn: int = 0, *, poll_s: float = 0.05, raw: bool = False) -> AsyncIterator[Envelope]:
        if self._closed:  # as read: its connection's loop is gone
            raise LogClosed(f"{self.where}: closed")
        return follow_subject(self._bridge, self._js, self.stream, self.subject, self.where, from_lsn, raw=raw, poll_s=poll_s)

    # -- closing -------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:
        async def finish() -> None:
            if self._writer is not None and not self._writer.done():
                done: concurrent.futures.Future = concurrent.futures.Future()
                assert self._queue is not None  # made before the writer task
                self._queue.put_nowait((0, None, done))
                try:
                    await asyncio.wait_for(asyncio.shield(self._writer), self._close_wait_s)
                except asyncio.TimeoutError:
                    # A publish still being retried (no leader, a paused server): abandon it; the
                    # writer's end fails every append not acknowledged (:meth:`_writer_ended`).
                    self._writer.cancel()
                    await asyncio.gather(self._writer, return_exceptions=True)
            if self._nc is not None and not self._nc.is_closed:
                await self._nc.close()

        try:
            if self._bridge.loop.is_running():
                self._bridge.call(finish(), timeout=self._close_wait_s + 10)
        finally:
            self._bridge.stop()
