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

An ``append_batch`` is one JetStream atomic batch (``allow_atomic``, server
2.12+), fenced on its first message: a reader sees all of it or none of it
(batches over 1000 records are split, atomic per 1000).

A record over the server's max payload is split into chunks
(``Agentlog-Chunk: i/k``) inside its append's atomic batch, so a reader
gets it whole or not at all. The server bounds an atomic batch by its count
of messages (1000), not by bytes: one batch of 500 MB (500 chunks) commits
whole on R3 (measured, nats-server 2.15). A group commit is cut into
batches only between records, so a record stays in one batch; the limit is
one record of 1000 chunks (about 1000 x (max payload - 4 KiB), ~1 GB at the
default 1 MiB), and a larger one is refused before anything is written.

Failover (a stream leader lost on a cluster): the client holds every
node's URL and reconnects without limit. A publish that fails for want of a
leader (no responders, a timeout, a reconnect, a 503) is retried with the
same message ids until ``failover_timeout_s`` after its first failure; after
each failure the writer looks at the subject's last message, so a try that
landed although its ack was lost is acknowledged once, never twice. Past the
deadline the log goes fatal naming stream, subject and LSN; an append is
never acknowledged unless JetStream acknowledged it. The server elects a new
stream leader 4 to 9 s after losing one (raft timing constants of
nats-server, not configurable), so appends stall that long and resume.

Reads (:mod:`agentlog.events.log.jetstream_read`) find a late LSN by a binary
search over the subject by direct get, then take messages through an
ordered consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, NamedTuple, Sequence

from ..._logging import get_logger
from .api import EventLog, LogClosed, LogError, LogFenced, PendingRecord
from .format import FLAG_TERMINAL, encode_frame
from .jetstream_read import (
    HDR_CHUNK,
    HDR_KIND,
    HDR_MSG_ID,
    HDR_NEXT_LSN,
    KIND_FENCE,
    STREAM_RE,
    Bridge,
    connect,
    follow_subject,
    log_name,
    lsn_after,
    read_subject,
    retried,
    retry_errors,
)
from ..schema.types import TERMINAL_EVENT_TYPES, Envelope

log = get_logger(__name__)

#: JetStream's "wrong last sequence" refusals (Nats-Expected-Last-Subject-Sequence failed):
#: 10071 names the subject's sequence (a stream on one server, or the leader's store check);
#: 10164 names none (a replicated stream, or a batch, refusing while another message on the
#: subject is still in process). Both mean the same: the subject moved past what was expected.
#: Only :func:`is_wrong_last_sequence` reads them.
ERR_WRONG_LAST_SEQUENCE = 10071
ERR_WRONG_LAST_SEQUENCE_CONSTANT = 10164
WRONG_LAST_SEQUENCE_CODES = (ERR_WRONG_LAST_SEQUENCE, ERR_WRONG_LAST_SEQUENCE_CONSTANT)
#: An atomic batch whose message ids are already in the duplicate window (a retry of one that landed).
ERR_BATCH_DUPLICATE_MSG_ID = 10201
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_EPOCH = "Agentlog-Epoch"
#: Room left in each chunk for the message's headers (the server's max payload counts both).
_HEADER_ROOM = 4096
#: The server's default limit of messages in one atomic batch; a longer
#: append_batch is published as consecutive batches (atomic per 1000).
MAX_BATCH = 1000
#: A message id that is still being proposed (clustered stream): the try may yet land.
ERR_DUPLICATE_IN_PROCESS = 10158
#: An atomic batch that reached the leader incomplete (a reconnect cut it), and too many batches in flight.
ERR_BATCH_INCOMPLETE = 10176
ERR_BATCH_TOO_MANY_INFLIGHT = 10210
#: Refusals after which the try may have landed: look at the subject's end.
_MAYBE_LANDED = (*WRONG_LAST_SEQUENCE_CODES, ERR_BATCH_DUPLICATE_MSG_ID, ERR_DUPLICATE_IN_PROCESS)
#: Refusals that are transient: try again (as are status 503 answers).
_RETRY_API_CODES = (ERR_BATCH_INCOMPLETE, ERR_BATCH_TOO_MANY_INFLIGHT)
#: Pauses between publish tries while a stream elects a leader (doubling).
_RETRY_PAUSE_MIN_S = 0.05
_RETRY_PAUSE_MAX_S = 0.5
#: The landed check's own bound (it runs on a failure path, often mid-election).
_LANDED_TIMEOUT_S = 1.0
#: What :meth:`JetStreamLog._landed` answers when the subject moved on to another writer's message.
_MOVED = "moved"


def _epoch_of(msg) -> int:
    """The epoch of the writer that published ``msg`` (0 for a message without one)."""
    return int((msg.headers or {}).get(HDR_EPOCH, 0))


def is_wrong_last_sequence(exc: BaseException) -> bool:
    """Whether ``exc`` is JetStream refusing a publish because the subject's last
    sequence is not the one it expected (either code, see WRONG_LAST_SEQUENCE_CODES)."""
    from nats.js.errors import APIError

    return isinstance(exc, APIError) and exc.err_code in WRONG_LAST_SEQUENCE_CODES


class _Msg(NamedTuple):
    """One message to publish: the record's LSN, its data, its own headers."""

    lsn: int
    data: bytes
    headers: dict[str, str]


class FailoverExpired(LogError):
    """A publish was not acknowledged within ``failover_timeout_s`` of its first failure."""


def _count(records: list[list[_Msg]] | None) -> int:
    return sum(len(msgs) for msgs in records) if records else 0


class JetStreamLog(EventLog):
    """One log partition as a subject of a JetStream stream. Open with :meth:`open`."""

    reads_raw = True  # bodies stay encoded in the stream
    #: Seconds one publish try waits for its ack (set by :meth:`open`).
    _publish_timeout_s = 5.0
    #: Seconds after a publish's first failure during which it is retried (set by :meth:`open`).
    _failover_timeout_s = 30.0
    #: Seconds :meth:`close` waits for queued publishes to be acknowledged before it abandons them.
    _close_wait_s = 10.0

    def __init__(self, *, url: str, stream: str, partition: int, clock: Callable[[], int]) -> None:
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
        partition: int = 0,
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
        if not duplicate_window_s > 0:
            raise ValueError(f"duplicate_window_s: expected seconds > 0, found {duplicate_window_s!r}")
        for name, value in (("publish_timeout_s", publish_timeout_s), ("failover_timeout_s", failover_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected seconds > 0, found {value!r}")
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
        if (info.config.num_replicas or 1) != replicas:
            raise LogError(f"{self.where}: the stream has {info.config.num_replicas} replicas, expected {replicas}")
        if not info.config.allow_atomic:
            raise LogError(f"{self.where}: the stream does not allow atomic batches (allow_atomic); create it with JetStreamLog.open")
        await self._recover()
        await self._take_over()
        self._queue = asyncio.Queue()
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        self._writer.add_done_callback(self._writer_ended)

    def _writer_ended(self, task: asyncio.Task) -> None:
        """The writer task never dies silently: an unexpected end (an error, or
        cancelled by :meth:`close` while a publish was still being retried)
        makes the log fatal, logged, and fails every append it had not
        settled, so none waits forever on a writer that is gone."""
        if task.cancelled():
            reason = f"closed while publishing (not acknowledged within {self._close_wait_s:g} s of close)"
            log.error("jetstream.writer_abandoned", subject=self.subject, epoch=self.epoch)
        elif task.exception() is not None:
            reason = f"writer task died: {task.exception()!r}"
            log.error("jetstream.writer_died", subject=self.subject, error=repr(task.exception()))
        else:
            return
        self._fatal = self._fatal or reason
        items, self._taken = list(self._taken), []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for lsn, records, done in items:
            if not done.done():
                what = f"lsn {lsn} and later were not acknowledged" if records else "closing"
                done.set_exception(LogClosed(f"{self.where}: fatal ({reason}); {what}"))

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
            epoch = _epoch_of(await self._last_message())
        self.epoch = epoch + 1

    async def _read_records(self, from_lsn: int, end: int | None = None) -> int:
        """Advance next LSN and open sessions over the subject's records from
        ``from_lsn`` up to stream sequence ``end`` (the leader's end when
        None); the sequence read up to."""
        from .jetstream_read import SubjectCursor

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
            self._last_seq, self.epoch, self._next = last.seq, _epoch_of(last) + 1, lsn_after(last, self.where)
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

    # -- writing -------------------------------------------------------------

    @property
    def next_lsn(self) -> int:
        return self._next

    @property
    def fatal_reason(self) -> str | None:
        return self._fatal

    def _submit(self, records: Iterable[PendingRecord | tuple]) -> tuple[list[Envelope], concurrent.futures.Future]:
        with self._lock:
            if self._closed:
                raise LogClosed(f"{self.where}: closed; no further appends")
            if self._fatal is not None:
                raise LogClosed(f"{self.where}: fatal ({self._fatal}); reopen to recover")
            checked = self._check_batch(records)
            if not checked:  # nothing to publish: an empty batch would reach the writer as a batch of no messages
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(None)
                return [], done
            records, envs = [], []
            lsn = self._next
            chunk_bytes = self._max_payload - _HEADER_ROOM
            for rec in checked:
                ts = self._clock()
                sid = rec.session_id.encode("utf-8")
                flags = FLAG_TERMINAL if isinstance(rec.body, TERMINAL_EVENT_TYPES) else 0
                at = lsn + len(records)
                frame = encode_frame(at, rec.session_seq, ts, flags, sid, rec.payload)
                if len(frame) > chunk_bytes * MAX_BATCH:
                    raise LogError(
                        f"{self.where}: session {rec.session_id!r} seq {rec.session_seq}: record of {len(frame)} bytes "
                        f"exceeds {MAX_BATCH} chunks of {chunk_bytes} bytes (one atomic batch); nothing was written"
                    )
                records.append(self._messages_of(at, frame, chunk_bytes))
                envs.append(Envelope(at, rec.session_id, rec.session_seq, ts, rec.body))
            done = concurrent.futures.Future()
            # Running: a caller that stops waiting (its task cancelled) cannot cancel the
            # future under the writer, which would then fail to settle it and die.
            done.set_running_or_notify_cancel()
            for rec in checked:
                self._advance(rec)
            self._next = lsn + len(records)
            self._bridge.loop.call_soon_threadsafe(self._enqueue, (lsn, records, done))
            return envs, done

    def _enqueue(self, item: tuple) -> None:
        """Hand an append to the writer task (on the bridge loop). One submitted
        just as the writer died (it passed the fatal check first) is failed
        here: nothing would ever take it off the queue."""
        if self._writer is None or self._writer.done():
            item[2].set_exception(LogClosed(f"{self.where}: fatal ({self._fatal}); lsn {item[0]} and later were not acknowledged"))
            return
        self._queue.put_nowait(item)

    def _messages_of(self, lsn: int, frame: bytes, chunk_bytes: int) -> list[_Msg]:
        """A record's messages: one, or k chunks (``Agentlog-Chunk: i/k``) of
        a frame over ``chunk_bytes``; the last carries the record's msg id."""
        ident = self._msg_id(lsn)
        if len(frame) <= chunk_bytes:
            return [_Msg(lsn, frame, {HDR_MSG_ID: ident})]
        k = -(-len(frame) // chunk_bytes)
        return [
            _Msg(lsn, frame[i * chunk_bytes : (i + 1) * chunk_bytes], {HDR_MSG_ID: ident if i == k - 1 else f"{ident}:{i + 1}", HDR_CHUNK: f"{i + 1}/{k}"})
            for i in range(k)
        ]

    async def _write_loop(self) -> None:
        """Publish queued appends in LSN order. Appends queued meanwhile are
        group-committed: published together as one atomic batch (up to
        MAX_BATCH records; one append is never split unless it alone is
        longer). Any failure makes the log fatal and fails every pending append."""
        held = None  # an item taken from the queue that did not fit the last group
        while True:
            group = [held if held is not None else await self._queue.get()]
            held = None
            count = _count(group[0][1])
            while group[-1][1] is not None and not self._queue.empty():
                item = self._queue.get_nowait()
                if item[1] is not None and count + _count(item[1]) > MAX_BATCH:
                    held = item
                    break
                group.append(item)
                count += _count(item[1])
            self._taken = group + ([held] if held is not None else [])
            stop = group[-1] if group[-1][1] is None else None
            group = [item for item in group if item[1] is not None]
            if group:
                await self._commit(group)
            self._taken = [held] if held is not None else []
            if stop is not None:
                stop[2].set_result(None)
                return

    async def _commit(self, group: list) -> None:
        from nats.js.errors import APIError

        lsn = group[0][0]
        records = [rec for _, item_records, _ in group for rec in item_records]
        if self._fatal is not None:
            for _, _, done in group:
                done.set_exception(LogClosed(f"{self.where}: fatal ({self._fatal})"))
            return
        # Batches of at most MAX_BATCH messages, cut only between records
        # (a record's chunks always share one atomic batch).
        batches: list[list[_Msg]] = [[]]
        for msgs in records:
            if batches[-1] and len(batches[-1]) + len(msgs) > MAX_BATCH:
                batches.append([])
            batches[-1].extend(msgs)
        i = lsn
        try:
            for batch in batches:
                i = batch[0].lsn
                await self._publish(batch)
        except APIError as exc:
            if is_wrong_last_sequence(exc):
                err: Exception = LogFenced(
                    f"{self.where}: epoch {self.epoch} was fenced by a newer writer (the subject moved past "
                    f"sequence {self._last_seq}: a newer epoch, or another client publishing on it); "
                    f"lsn {i} and later were not acknowledged",
                    epoch=self.epoch,
                )
            else:
                err = LogError(f"{self.where}: publish of lsn {i} refused: {exc}")
            self._go_fatal(err, group)
        except LogFenced as exc:
            self._go_fatal(exc, group)
        except FailoverExpired as exc:
            self._go_fatal(LogError(f"{self.where}: publish of lsn {i} (and later) not acknowledged: {exc}"), group)
        except Exception as exc:  # anything else: fatal, never silent
            self._go_fatal(LogError(f"{self.where}: publish of lsn {i} failed: {exc!r}"), group)
        else:
            for _, _, done in group:
                done.set_result(None)

    async def _publish(self, msgs: list[_Msg]) -> None:
        """Publish ``msgs`` as one atomic batch (a lone message as a plain
        publish), fenced on the subject's last sequence; return once
        JetStream acknowledged it, exactly once.

        A try that fails for want of a stream leader (no responders, a
        timeout, a lost or reconnecting connection, 503, a batch cut short by
        a reconnect) is retried with the same message ids, with a growing
        pause, until ``failover_timeout_s`` after the first failure; then
        :class:`FailoverExpired`. A try may have landed although its ack was
        lost, and a retry of it is then refused (the expected last sequence
        moved: 10071 or 10164; a batch's ids are in the duplicate window: 10201; a
        message id still being proposed: 10158), so after every failure the
        writer looks at the subject's last message (:meth:`_landed`): if it
        carries this batch's last message id, the batch landed; if the
        subject moved past what this writer knows to someone else's message,
        the writer was fenced and the refusal is raised; otherwise it tries
        again. Any other refusal is raised at once."""
        from nats.js.errors import APIError

        transient = retry_errors()
        last_id = msgs[-1].headers[HDR_MSG_ID]
        lsn = msgs[0].lsn
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        pause = _RETRY_PAUSE_MIN_S
        attempt = 0
        while True:
            timeout = self._publish_timeout_s
            if deadline is not None:
                timeout = max(0.05, min(timeout, deadline - loop.time()))
            try:
                self._last_seq = await self._publish_once(msgs, attempt, timeout)
                if attempt:
                    log.info("jetstream.publish_recovered", subject=self.subject, lsn=lsn, attempts=attempt + 1)
                return
            except APIError as exc:
                if exc.err_code in _MAYBE_LANDED:
                    landed = await self._landed(last_id)
                    if landed == _MOVED:
                        raise
                    if isinstance(landed, int):
                        self._last_seq = landed
                        return
                elif not (exc.code == 503 or exc.err_code in _RETRY_API_CODES):
                    raise
                error: Exception = exc
            except transient as exc:
                error = exc
                landed = await self._landed(last_id)
                if isinstance(landed, int):
                    self._last_seq = landed
                    return
            now = loop.time()
            if deadline is None:
                deadline = now + self._failover_timeout_s
            if now >= deadline:
                raise FailoverExpired(
                    f"no ack from stream {self.stream!r} within failover_timeout_s={self._failover_timeout_s:g} "
                    f"after {attempt + 1} tries; last error: {error!r}"
                ) from error
            log.warning(
                "jetstream.publish_retry", subject=self.subject, lsn=lsn, attempt=attempt, error=repr(error),
                left_s=round(deadline - now, 2),
            )
            await asyncio.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, _RETRY_PAUSE_MAX_S)
            attempt += 1

    def _msg_id(self, lsn: int) -> str:
        return f"{self.partition}:{self.epoch}:{lsn}"

    async def _landed(self, msg_id: str) -> int | str | None:
        """Where the subject's end is, as a replica sees it: the stream
        sequence of its last message when that carries ``msg_id`` (it
        landed); :data:`_MOVED` when the last message is another's, past the
        last sequence this writer knows (a newer writer, or a foreign
        client); None when it is not known (no answer in time, no leader,
        or a replica that has not caught up), and the caller tries again."""
        from nats.js.errors import APIError, NotFoundError

        try:
            # Direct get may be answered by any replica: one that has a
            # message has it committed, so "landed" is sure; one that lags
            # shows an older end, which is read as "not known", not as fenced.
            msg = await asyncio.wait_for(self._js.get_msg(self.stream, subject=self.subject, direct=True),
                                         timeout=min(self._publish_timeout_s, _LANDED_TIMEOUT_S))
        except NotFoundError:
            return None
        except (APIError, *retry_errors()):
            return None
        if (msg.headers or {}).get(HDR_MSG_ID) == msg_id:
            return msg.seq
        return _MOVED if msg.seq > self._last_seq else None

    async def _publish_once(self, msgs: list[_Msg], attempt: int, timeout: float) -> int:
        """One try, waiting ``timeout`` s for the ack; the stream sequence of the last message stored."""
        import json

        from nats.js.errors import APIError

        first = {HDR_EXPECTED_LAST_SUBJECT_SEQ: str(self._last_seq)}
        epoch = {HDR_EPOCH: str(self.epoch)}
        if len(msgs) == 1:
            ack = await self._js.publish(self.subject, msgs[0].data, timeout=timeout, headers={**msgs[0].headers, **epoch, **first})
            if ack.duplicate and not attempt:
                # Never sent by this writer before, yet stored: another writer holds this epoch.
                raise LogFenced(
                    f"{self.where}: lsn {msgs[0].lsn}: message id {msgs[0].headers[HDR_MSG_ID]!r} is already on the "
                    f"stream (sequence {ack.seq}) from another writer of epoch {self.epoch}; not acknowledged",
                    epoch=self.epoch,
                )
            return ack.seq
        batch_id = f"{msgs[0].headers[HDR_MSG_ID]}:b{attempt}"  # a fresh id per try: a half-sent batch is abandoned whole
        for i, msg in enumerate(msgs):
            headers = {**msg.headers, **epoch, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i + 1), **(first if i == 0 else {})}
            if i < len(msgs) - 1:
                await self._nc.publish(self.subject, msg.data, headers=headers)
                continue
            headers["Nats-Batch-Commit"] = "1"
            reply = await self._nc.request(self.subject, msg.data, headers=headers, timeout=timeout)
            resp = json.loads(reply.data)
            if "error" in resp:
                raise APIError.from_error(resp["error"])
            if resp.get("count") != len(msgs):
                raise LogError(
                    f"{self.where}: batch from lsn {msgs[0].lsn} committed {resp.get('count')} messages, expected {len(msgs)}"
                )
            return int(resp["seq"])
        raise AssertionError("unreachable: msgs is not empty")

    def _go_fatal(self, err: Exception, group: list) -> None:
        self._fatal = str(err)
        log.error("jetstream.fatal", subject=self.subject, epoch=self.epoch, reason=self._fatal)
        for _, _, done in group:
            done.set_exception(err)

    def append_batch(self, records: Iterable[PendingRecord | tuple]) -> list[Envelope]:
        envs, done = self._submit(records)
        done.result()
        return envs

    async def append(self, session_id: str, session_seq: int, body: Any) -> Envelope:
        envs, done = self._submit([PendingRecord(session_id, session_seq, body)])
        await asyncio.wrap_future(done)
        return envs[0]

    # -- reading -------------------------------------------------------------

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Envelope]:
        if self._closed:
            raise LogClosed(f"{self.where}: closed")
        return read_subject(self._bridge, self._js, self.stream, self.subject, self.where, from_lsn, raw=raw)

    def follow(self, from_lsn: int = 0, *, poll_s: float = 0.05, raw: bool = False) -> AsyncIterator[Envelope]:
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
