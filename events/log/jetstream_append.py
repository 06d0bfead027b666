"""The append path of a log partition on NATS JetStream: from an append to
JetStream's acknowledgement, exactly once.

An append is framed and handed to the partition's one writer task (on the
bridge loop), which publishes in LSN order; appends queued meanwhile are
group-committed. Every publish is fenced on the subject's last sequence
(``Nats-Expected-Last-Subject-Sequence``) and carries the writer's epoch.

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

:class:`JetStreamAppender` is the base class of
:class:`agentlog.events.log.jetstream.JetStreamLog`, which connects, sets up
the stream, recovers the partition, fences earlier writers, reads and
closes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

from ..._logging import get_logger
from .api import EventLog, LogClosed, LogError, LogFenced, OnDurable, PendingRecord
from .format import FLAG_TERMINAL, encode_frame
from .jetstream_conn import retry_errors
from .jetstream_msg import HDR_CHUNK, HDR_MSG_ID
from ..schema.types import TERMINAL_EVENT_TYPES, Envelope

if TYPE_CHECKING:
    import threading

    from .jetstream_conn import Bridge

# The JetStream writer's events, under one logger name wherever its code lives.
log = get_logger("agentlog.events.log.jetstream")

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


class JetStreamAppender(EventLog):
    """The append path of :class:`agentlog.events.log.jetstream.JetStreamLog`
    (its base class): LSN assignment, the writer task, group commit, atomic
    batches and publishes retried through a failover."""

    #: :meth:`stage` (and so :meth:`EventLog.submit`) checks and stages its record before it returns.
    stages_synchronously = True

    # Set by JetStreamLog (its constructor and open); declared here for the type checker.
    subject: str
    stream: str
    where: str
    partition: int | str  # a partition id, or a named log (learner)
    epoch: int
    _lock: threading.Lock
    _next: int
    _last_seq: int
    _max_payload: int
    _closed: bool
    _fatal: str | None
    _bridge: Bridge
    _queue: asyncio.Queue | None
    _writer: asyncio.Task | None
    _taken: list
    _nc: Any
    _js: Any
    _publish_timeout_s: float
    _failover_timeout_s: float
    _close_wait_s: float

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
        assert self._queue is not None  # made before the writer task this callback watches
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for lsn, records, done in items:
            if not done.done():
                what = f"lsn {lsn} and later were not acknowledged" if records else "closing"
                done.set_exception(LogClosed(f"{self.where}: fatal ({reason}); {what}"))

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
            batch: list[list[_Msg]] = []
            envs = []
            lsn = self._next
            chunk_bytes = self._max_payload - _HEADER_ROOM
            for rec in checked:
                ts = self._clock()
                sid = rec.session_id.encode("utf-8")
                flags = FLAG_TERMINAL if isinstance(rec.body, TERMINAL_EVENT_TYPES) else 0
                at = lsn + len(batch)
                frame = encode_frame(at, rec.session_seq, ts, flags, sid, rec.payload)
                if len(frame) > chunk_bytes * MAX_BATCH:
                    raise LogError(
                        f"{self.where}: session {rec.session_id!r} seq {rec.session_seq}: record of {len(frame)} bytes "
                        f"exceeds {MAX_BATCH} chunks of {chunk_bytes} bytes (one atomic batch); nothing was written"
                    )
                batch.append(self._messages_of(at, frame, chunk_bytes))
                envs.append(Envelope(at, rec.session_id, rec.session_seq, ts, rec.body))
            done = concurrent.futures.Future()
            # Running: a caller that stops waiting (its task cancelled) cannot cancel the
            # future under the writer, which would then fail to settle it and die.
            done.set_running_or_notify_cancel()
            for rec in checked:
                self._advance(rec)
            self._next = lsn + len(batch)
            self._bridge.loop.call_soon_threadsafe(self._enqueue, (lsn, batch, done))
            return envs, done

    def _enqueue(self, item: tuple) -> None:
        """Hand an append to the writer task (on the bridge loop). One submitted
        just as the writer died (it passed the fatal check first) is failed
        here: nothing would ever take it off the queue."""
        if self._writer is None or self._writer.done():
            item[2].set_exception(LogClosed(f"{self.where}: fatal ({self._fatal}); lsn {item[0]} and later were not acknowledged"))
            return
        assert self._queue is not None  # made before the writer task
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
        assert self._queue is not None  # made before this task is started
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
                    if landed == _MOVED and is_wrong_last_sequence(exc):
                        raise  # the callers tell this refusal apart (append: LogFenced; a take-over: fence again)
                    if landed == _MOVED:
                        # Another writer's message is past ours, and the retry met a duplicate-id refusal
                        # (a thawed stale writer's own ids still in the window): fenced all the same.
                        raise LogFenced(
                            f"{self.where}: epoch {self.epoch} was fenced by a newer writer (the subject moved past "
                            f"sequence {self._last_seq} to another writer's message; the server refused lsn {lsn}: "
                            f"{exc}); lsn {lsn} and later were not acknowledged",
                            epoch=self.epoch,
                        ) from exc
                    if isinstance(landed, int):
                        self._last_seq = landed
                        return
                elif not (exc.code == 503 or exc.err_code in _RETRY_API_CODES):
                    raise
                error: BaseException = exc
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

        unknown_end: tuple[type[BaseException], ...] = (APIError, *retry_errors())
        try:
            # Direct get may be answered by any replica: one that has a
            # message has it committed, so "landed" is sure; one that lags
            # shows an older end, which is read as "not known", not as fenced.
            msg = await asyncio.wait_for(
                self._js.get_msg(self.stream, subject=self.subject, direct=True),
                timeout=min(self._publish_timeout_s, _LANDED_TIMEOUT_S),
            )
        except NotFoundError:
            return None
        except unknown_end:
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

    def stage(self, session_id: str, session_seq: int, body: Any, on_durable: OnDurable) -> None:
        """:meth:`EventLog.stage`: the record is checked and staged before this returns (bad input
        raises here, nothing staged: the engine's turn path learns of a refusal at its call, not
        a loop step later), and the stream's acknowledgement calls ``on_durable`` on the running
        event loop, with no task between."""
        envs, done = self._submit([PendingRecord(session_id, session_seq, body)])
        env = envs[0]

        def acknowledged(acked: asyncio.Future) -> None:
            # `done` runs before _submit returns, so it is never cancelled; a failure goes to on_durable.
            exc = asyncio.CancelledError() if acked.cancelled() else acked.exception()
            on_durable(env if exc is None else None, exc)

        # In a context of its own: the caller's (with READING_STORED set, say, while the engine stages a
        # turn it built) must not reach on_durable, which runs unflagged as the file log's does.
        asyncio.wrap_future(done).add_done_callback(acknowledged, context=contextvars.Context())
