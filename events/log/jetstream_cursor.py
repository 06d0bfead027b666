"""Reading one log subject: where to start, and the cursor that reads on.

A reader never writes: no stream is created, no epoch is taken, so any
number of them, on any host, can read beside the live writer. A read:

- finds the stream sequence to start from with a binary search over the
  subject by direct get (:func:`seq_of_lsn`; each record message's
  ``Nats-Msg-Id`` names its LSN), so reading from a late LSN costs
  O(log n) requests, not a scan;
- then takes the messages through an *ordered consumer* (an ephemeral push
  consumer that the client restarts at the right sequence on any gap), so
  a record costs no round trip of its own: :class:`SubjectCursor`, driven
  synchronously by :func:`read_subject` or from another loop by
  :func:`follow_subject`;
- joins chunks and checks every frame (:mod:`~agentlog.events.log.jetstream_msg`).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Generator

from .api import LogError
from .jetstream_conn import retried
from .jetstream_msg import ChunkJoiner, decode_message, msg_id_lsn

#: Seconds a reader waits for the next message while the subject is known to hold more.
READ_STALL_S = 30.0


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
        at = msg_id_lsn(msg.headers) if msg is not None and msg.seq < hi else None  # an LSN, past the loop
        if msg is None or at is None or at >= lsn:
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
        self.sub: Any = None  # the ordered consumer's subscription (nats-py), made by start()
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
                first_lsn = msg_id_lsn(msg.headers)
                # Never past from_lsn: a first record later than it means the records between are
                # missing (deleted, expired), and the frame check below names the gap.
                self.expected = min(first_lsn, self.from_lsn) if first_lsn is not None else self.from_lsn
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
                 chunk: int = 512, batches: bool = False) -> Generator[Any, None, None]:
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
