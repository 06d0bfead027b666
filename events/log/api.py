"""The log interface every implementation honours, and the in-memory log.

A log assigns each appended record the next LSN (gapless, from 0), stamps
wall time, enforces ``session_seq == last + 1`` per session, and takes only
bodies its readers can decode (each is encoded and decoded back before
anything is written). An append returns only once its record is durable under
the log's fsync policy.
Readers iterate from any LSN; followers tail the live log and see only
durable records.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import functools
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Iterator, Literal, NamedTuple, overload

import msgspec

from ..errors import AgentlogError
from ..schema.batch_check import check_bodies
from ..schema.types import (
    EVENT_TYPES, KNOWN_TAGS, TERMINAL_EVENT_TYPES, Envelope, EventValidationError, check_body, describe_validation_error,
    stored_tag, validate_id,
)

if TYPE_CHECKING:
    from .read import RawRecord

_EVENT_TYPE_SET = frozenset(EVENT_TYPES)
_TERMINAL_TYPE_SET = frozenset(TERMINAL_EVENT_TYPES)


class LogError(AgentlogError):
    """Base of all log errors."""


class SequenceError(LogError):
    """An append's ``session_seq`` is not the session's ``last + 1``."""


class LogClosed(LogError):
    """The log was closed, or went fatal after an I/O error; reopen to recover."""


class LogFenced(LogClosed):
    """A newer writer (higher epoch) opened this log, on this node or another
    node of a shared filesystem: this writer is stale and fatal. It is a
    :class:`LogClosed` (the writer refuses everything from now on; handlers
    of a fatal log handle it as such) whose message names the directory,
    both epochs and the first LSN not acknowledged."""

    def __init__(self, message: str, *, epoch: int = -1, newer_epoch: int = -1) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.newer_epoch = newer_epoch


class LogCorruption(LogError):
    """A frame that acknowledged data depends on is damaged.

    ``segment``, ``offset`` and ``last_good_lsn`` (-1 when none) say where.
    """

    def __init__(self, message: str, *, segment: str = "", offset: int = -1, last_good_lsn: int = -1) -> None:
        super().__init__(message)
        self.segment = segment
        self.offset = offset
        self.last_good_lsn = last_good_lsn


class LogLocked(LogError):
    """Another writer holds the log directory's lock."""


class NotALog(LogError):
    """The path is not a log directory."""


class SchemaError(LogError):
    """A record whose checksum is valid and whose tag this version knows, but
    whose fields do not decode with this version's schema: written by a newer
    (or foreign) agentlog, not disk damage. Names the LSN, session, tag and
    field; the cure is to upgrade agentlog, not to salvage the log."""

    def __init__(self, message: str, *, lsn: int, session_id: str, tag: str, field: str) -> None:
        super().__init__(message)
        self.lsn = lsn
        self.session_id = session_id
        self.tag = tag
        self.field = field

    @classmethod
    def of_payload(
        cls, exc: Exception, payload: Any, *, lsn: int, session_id: str, where: str = ""
    ) -> "SchemaError | None":
        """The SchemaError for a stored ``payload`` that failed to decode with
        ``exc``, when it is a tagged map of a known event type; None when it is
        not (not an event body at all: the caller reports damage). ``where``
        prefixes the position (``segment ..., offset ...``)."""
        if not isinstance(exc, msgspec.ValidationError):
            return None
        tag = stored_tag(payload)
        if tag not in KNOWN_TAGS:
            return None
        field, what = describe_validation_error(exc)
        field = field or "(body)"
        return cls(
            f"{where + ', ' if where else ''}lsn {lsn}, session {session_id!r}: {tag} record whose field {field} does not "
            f"decode with this version's schema ({what}); written by a newer agentlog? upgrade agentlog to read this log "
            "(the record's checksum is valid: this is not disk damage)",
            lsn=lsn,
            session_id=session_id,
            tag=tag,
            field=field,
        )


class PendingRecord(NamedTuple):
    """What a caller appends: the log adds the LSN and the timestamp."""

    session_id: str
    session_seq: int
    body: Any


class CheckedRecord(NamedTuple):
    """A PendingRecord that passed every write-time check: its body as any
    reader will decode it, and the encoded payload the log stores."""

    session_id: str
    session_seq: int
    body: Any
    payload: Any  # bytes, or a msgspec.Raw view into the batch's encoded bodies


class CheckedBatch(NamedTuple):
    """A batch that passed every write-time check, as columns (one entry per record, in order): what the file log frames."""

    session_ids: list[str]
    seqs: list[int]
    #: Each body as any reader will decode it.
    bodies: list[Any]
    #: Each encoded body, stored as is: ``bytes`` or a ``msgspec.Raw`` view.
    payloads: list[Any]
    #: 1 where the body is a terminal event, else 0 (the frame's flag).
    terminal: list[int]
    #: Each session's next session_seq after the batch, and the sessions whose last record in it is terminal (they end).
    next_seq: dict[str, int]
    ended: set[str]

    def records(self) -> list[CheckedRecord]:
        """The batch one record at a time."""
        return list(map(CheckedRecord._make, zip(self.session_ids, self.seqs, self.bodies, self.payloads)))


def _is_valid_id(value: Any) -> bool:
    try:
        validate_id("session_id", value)
    except EventValidationError:
        return False
    return True


def check_record_body(sid: str, seq: int, body: Any) -> tuple[bytes, Any]:
    """:func:`check_body` of one record's body: ``(payload, decoded)``, or
    EventValidationError naming the record's session and seq, the event type,
    the field and what was expected."""
    try:
        return check_body(body)
    except EventValidationError as exc:
        raise EventValidationError(
            f"session {sid!r} seq {seq}: {exc} (the log refuses what its readers "
            "could not decode; nothing was written)"
        ) from None


def _check_one_by_one(sids: list[str], seqs: list[int], bodies: list[Any]) -> tuple[list, list]:
    """The bodies of a batch that :func:`check_bodies` refused, checked one at
    a time: raises for the first refused record (:func:`check_record_body`)."""
    payloads, decoded = [], []
    for sid, seq, body in zip(sids, seqs, bodies):
        payload, back = check_record_body(sid, seq, body)
        payloads.append(payload)
        decoded.append(back)
    return payloads, decoded


#: What :meth:`EventLog.stage` calls once its record is durable (envelope, None) or failed (None, the error).
OnDurable = Callable[[Envelope | None, BaseException | None], None]


def answer(waiter: Any, env: Any, exc: BaseException | None) -> None:
    """Give ``waiter`` (a caller's future, or an :data:`OnDurable` callable) a record's envelope or failure; a future done takes nothing."""
    if not isinstance(waiter, asyncio.Future):
        waiter(env, exc)
    elif not waiter.done():
        if exc is None:
            waiter.set_result(env)
        else:
            waiter.set_exception(exc)


class DurableCallback:
    """A waiter in place of an asyncio future (the file log's and MemoryLog's ``stage``): it runs ``fn(env, None)``, or ``fn(None,
    exc)`` when the log failed (a subclass overrides :meth:`run`). What it raises goes to the loop's exception handler, naming the
    record, and the records answered with it are still answered (SystemExit and KeyboardInterrupt propagate). Called as ``(env,
    exc)``, it is an ``on_durable``. The file log's queue sets its ``end``, ``env``, ``loop`` while it waits (``end`` NOT_QUEUED when not)."""

    __slots__ = ("fn", "end", "env", "loop")
    NOT_QUEUED = -1  # its end while it waits in no log's queue
    env: Any
    loop: asyncio.AbstractEventLoop

    def __init__(self, fn: Callable[[Any, BaseException | None], None]) -> None:
        self.fn, self.end = fn, DurableCallback.NOT_QUEUED  # a subclass that does not call this sets it too

    def done(self) -> bool:
        return False  # a callback is never cancelled: it runs once, for the one record it waits for

    def set_result(self, env: Any) -> None:
        self._call(env, None)

    def set_exception(self, exc: BaseException) -> None:
        self._call(None, exc)

    def __call__(self, env: Any, exc: BaseException | None) -> None:
        self._call(env, exc)

    def run(self, env: Any, exc: BaseException | None) -> None:
        """What the acknowledgement (``env``) or the failure (``exc``) of the record does."""
        self.fn(env, exc)

    def _call(self, env: Any, exc: BaseException | None) -> None:
        try:
            self.run(env, exc)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as failure:  # the other waiters must still be answered: reported, never swallowed
            record = f"LSN {env.lsn} (session {env.session_id!r}), acknowledged" if env is not None else "a failed record"
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"log: the durable callback of {record}, raised", "exception": failure})


def answer_durable(items: list) -> None:
    """Answer a batch of ``(waiter, envelope)`` (or DurableCallbacks with their ``env``) in order (a flush); a future already
    done takes nothing. SystemExit or KeyboardInterrupt from a waiter stops the loop: the rest of the batch goes back on it first."""
    for i, item in enumerate(items):
        try:
            if type(item) is not tuple:  # a DurableCallback that carries its env (the file log's stage), free again
                env, item.env, item.end = item.env, None, DurableCallback.NOT_QUEUED
                item._call(env, None)
            elif isinstance(item[0], DurableCallback):
                item[0]._call(item[1], None)  # a callback is never done, and its set_result is this call
            elif not item[0].done():
                item[0].set_result(item[1])
        except (SystemExit, KeyboardInterrupt):
            if i + 1 < len(items):
                asyncio.get_running_loop().call_soon(answer_durable, items[i + 1:], context=contextvars.Context())
            raise


def settle_from_task(on_durable: OnDurable) -> Callable[[asyncio.Future], None]:
    """A done-callback for a task (or future) whose result is an envelope, calling ``on_durable``
    with (its result, None) or (None, what it raised or a CancelledError)."""

    def settle(task: asyncio.Future) -> None:
        if task.cancelled():
            on_durable(None, asyncio.CancelledError())
        elif (exc := task.exception()) is not None:
            on_durable(None, exc)
        else:
            on_durable(task.result(), None)

    return settle


class EventLog(abc.ABC):
    """Writer and reader over one log. One writer per log."""

    #: Whether :meth:`stage` checks and stages its record before it returns (the
    #: file log); the default runs :meth:`append` as a task, a loop step later.
    stages_synchronously = False

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        # Next expected session_seq of every session that has not ended.
        # Terminal events evict their session, so this stays bounded by the
        # number of open sessions.
        self._next_seq: dict[str, int] = {}

    # -- sequence bookkeeping shared by every implementation ----------------

    def next_seq(self, session_id: str) -> int:
        """The session_seq the next append for ``session_id`` must carry
        (0 for a session the log does not hold open)."""
        return self._next_seq.get(session_id, 0)

    def open_sessions(self) -> dict[str, int]:
        """Sessions without a terminal event, with their next session_seq."""
        return dict(self._next_seq)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no appends, no reads after it)."""
        return getattr(self, "_closed", False)

    @property
    def fatal_reason(self) -> str | None:
        """None while the log accepts appends; once its writer has failed for
        good, the one-line reason (what failed, where, what to do). Health
        checks of anything built on the log report this."""
        return None

    def _check_batch(self, records: Iterable[PendingRecord | tuple]) -> list[CheckedRecord]:
        """Validate a batch without changing state (see :meth:`_check_columns`);
        the checked records one by one."""
        return self._check_columns(records).records()

    def _check_columns(self, records: Iterable[PendingRecord | tuple]) -> CheckedBatch:
        """Validate a batch without changing state: the per-session sequence
        (SequenceError naming the session and both numbers) and each body
        against the schema (EventValidationError naming the session, event
        type, field and what was expected). The bodies are encoded and decoded
        back strictly (:func:`check_bodies`: the whole batch in one pass), so
        nothing reaches the log that a reader cannot decode, whichever API
        built the event; the checked batch carries the payloads (stored as
        they are: no second encode) and the decoded bodies (what readers get).

        The records are taken as columns, and only the sequence is checked
        record by record; a batch with anything wrong is checked again by
        :meth:`_check_each`, record by record, which raises for the first
        record at fault exactly as the checks always have."""
        recs = records if type(records) is list else list(records)
        if not recs:
            return CheckedBatch([], [], [], [], [], {}, set())
        try:
            sids, seqs, bodies = map(list, zip(*recs, strict=True))
        except (TypeError, ValueError):  # a malformed record
            return self._check_each(recs)
        kinds = set(map(type, bodies))
        if not kinds <= _EVENT_TYPE_SET:
            return self._check_each(recs)
        staged: dict[str, int] = {}
        open_seq = self._next_seq
        for sid, seq in zip(sids, seqs):
            expected = staged.get(sid)
            if expected is None:
                expected = open_seq.get(sid)
                if expected is None:
                    if not _is_valid_id(sid):  # only a session the log does not hold yet: open ones were checked
                        return self._check_each(recs)
                    expected = 0
            if seq != expected:
                return self._check_each(recs)
            staged[sid] = expected + 1
        ended: set[str] = set()
        if kinds & _TERMINAL_TYPE_SET:
            terminal = [1 if type(body) in _TERMINAL_TYPE_SET else 0 for body in bodies]
            # A session ends with the batch when its last record in it is terminal.
            ended = {sids[i] for i, t in enumerate(terminal) if t and staged[sids[i]] == seqs[i] + 1}
        else:
            terminal = [0] * len(bodies)
        return self._checked(sids, seqs, bodies, terminal, staged, ended, kinds)

    def _check_each(self, records: list) -> CheckedBatch:
        """:meth:`_check_columns` record by record: raises for the first
        record at fault (its session, seq and what was wrong)."""
        staged: dict[str, int] = {}
        ended: set[str] = set()
        sids: list[str] = []
        seqs: list[int] = []
        bodies: list[Any] = []
        terminal: list[int] = []
        open_seq = self._next_seq
        for rec in records:
            try:
                sid, seq, body = rec  # a PendingRecord or a plain 3-tuple: no NamedTuple built per record
            except (TypeError, ValueError):
                sid, seq, body = PendingRecord(*rec)  # raises the constructor's error for a malformed record
            expected = staged.get(sid)
            if expected is None:
                expected = open_seq.get(sid)
                if expected is None:
                    # Only a session the log does not hold yet needs its id checked:
                    # every open one was checked when it was first appended.
                    validate_id("session_id", sid)
                    expected = 0
            if seq != expected:
                raise SequenceError(
                    f"session {sid!r}: session_seq {seq} refused, expected {expected}"
                    + (" (a repeat)" if seq < expected else " (a gap)")
                )
            kind = type(body)
            if kind not in _EVENT_TYPE_SET:
                raise EventValidationError(
                    f"session {sid!r} seq {seq}: body: expected a schema-v1 event, "
                    f"found {kind.__name__}; nothing was written"
                )
            staged[sid] = expected + 1
            sids.append(sid)
            seqs.append(seq)
            bodies.append(body)
            is_terminal = kind in _TERMINAL_TYPE_SET
            terminal.append(int(is_terminal))
            if is_terminal:
                ended.add(sid)
            else:
                ended.discard(sid)  # a record after the terminal one (a later batch's gap check refuses the next)
        return self._checked(sids, seqs, bodies, terminal, staged, ended)

    @staticmethod
    def _checked(
        sids: list[str],
        seqs: list[int],
        bodies: list[Any],
        terminal: list[int],
        staged: dict[str, int],
        ended: set[str],
        kinds: set | None = None,
    ) -> CheckedBatch:
        """The checked batch of records whose sequence and body types passed:
        their bodies encoded and decoded back strictly (one pass for the
        batch; body by body to name the first refused one)."""
        if len(bodies) < 2:  # one body: two msgspec calls, not the batch's three
            payloads, decoded = _check_one_by_one(sids, seqs, bodies)
        else:
            try:
                payloads, decoded = check_bodies(bodies, kinds)
            except EventValidationError:
                payloads, decoded = _check_one_by_one(sids, seqs, bodies)
        return CheckedBatch(sids, seqs, decoded, payloads, terminal, staged, ended)

    def _advance(self, rec: PendingRecord | CheckedRecord) -> None:
        if isinstance(rec.body, TERMINAL_EVENT_TYPES):
            self._next_seq.pop(rec.session_id, None)
        else:
            self._next_seq[rec.session_id] = rec.session_seq + 1

    # -- the interface ------------------------------------------------------

    @property
    @abc.abstractmethod
    def next_lsn(self) -> int:
        """The LSN the next appended record gets."""

    @abc.abstractmethod
    def append_batch(self, records: Iterable[PendingRecord | tuple]) -> list[Envelope]:
        """Append records atomically in order; returns their envelopes once durable."""

    @abc.abstractmethod
    async def append(self, session_id: str, session_seq: int, body: Any) -> Envelope:
        """Append one record from asyncio; concurrent calls are group-committed.
        It checks the record before its first await (every log here does): the
        engine sets ``READING_STORED`` while a log that stages synchronously
        stages a turn it built (``engine.handle.stage_built_turn``), which is sound only if the values
        checked are the values the caller handed over."""

    def submit(self, session_id: str, session_seq: int, body: Any) -> asyncio.Future[Envelope]:
        """:meth:`append` as a future to await instead of a coroutine. A log that
        stages synchronously (the file log) stages the record before this returns
        (bad input raises here, nothing staged), so a flag set around this call
        covers the record's check and nothing after it (as ``engine.handle.stage_built_turn`` does);
        cancelling the future cancels the wait only, as with :meth:`append`. This
        default is :meth:`stage` answering a future for a log that stages synchronously,
        and else runs :meth:`append` as a task."""
        loop = asyncio.get_running_loop()
        if not self.stages_synchronously:
            return loop.create_task(self.append(session_id, session_seq, body))
        fut: asyncio.Future[Envelope] = loop.create_future()
        self.stage(session_id, session_seq, body, functools.partial(answer, fut))
        return fut

    def stage(self, session_id: str, session_seq: int, body: Any, on_durable: OnDurable) -> None:
        """Append one record from asyncio without awaiting it: ``on_durable(env, None)``
        is called on the running event loop once the record is durable (``env.body`` may
        be decoded on first use: the file log's is), or ``on_durable(None, exc)`` when the
        append failed; it must not raise. A log that stages synchronously (the file log)
        refuses bad input here, raising with nothing staged, and calls back with no task
        between: the gateway's turn path saves the hops of a task. This default runs
        :meth:`append` as a task (its refusals reach ``on_durable``)."""
        task = asyncio.get_running_loop().create_task(self.append(session_id, session_seq, body))
        task.add_done_callback(settle_from_task(on_durable))

    @overload
    def read(self, from_lsn: int = 0, *, raw: Literal[False] = False) -> Iterator[Envelope]: ...
    @overload
    def read(self, from_lsn: int = 0, *, raw: Literal[True]) -> Iterator[RawRecord]: ...
    @overload
    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Envelope | RawRecord]: ...

    @abc.abstractmethod
    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Envelope | RawRecord]:
        """Durable records with lsn >= from_lsn, in LSN order; with ``raw``,
        :class:`~agentlog.events.log.read.RawRecord` s (payload undecoded) instead."""

    @abc.abstractmethod
    def follow(self, from_lsn: int = 0, *, poll_s: float = 0.05) -> AsyncIterator[Envelope]:
        """Tail the log forever from ``from_lsn``; yields only durable records."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush, release the writer, and refuse further appends."""

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MemoryLog(EventLog):
    """An in-memory log with the same interface and rules (tests, dry runs).

    It stages synchronously, as the file log does: :meth:`stage` and :meth:`submit` append
    before they return (a refusal raises there) and answer later, never inside the call, with no task a
    record. A subclass that overrides :meth:`append` (a test log that delays, gates or fails
    appends) stages through that ``append`` instead, as a task (``stages_synchronously`` False)."""

    stages_synchronously = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "append" in cls.__dict__ and "stages_synchronously" not in cls.__dict__:
            cls.stages_synchronously = False

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        super().__init__(clock)
        self._records: list[Envelope] = []
        self._closed = False
        #: The loop and the records staged on it since it last answered: a batch its own callback
        #: answers (:meth:`_answer_staged`), open to more records until that callback runs.
        self._unanswered: tuple[asyncio.AbstractEventLoop, list[tuple[DurableCallback, Envelope]]] | None = None

    @property
    def next_lsn(self) -> int:
        return len(self._records)

    def append_batch(self, records: Iterable[PendingRecord | tuple]) -> list[Envelope]:
        if self._closed:
            raise LogClosed("memory log: closed; no further appends")
        checked = self._check_batch(records)
        out = []
        for rec in checked:
            env = Envelope(len(self._records), rec.session_id, rec.session_seq, self._clock(), rec.body)
            self._records.append(env)
            self._advance(rec)
            out.append(env)
        return out

    async def append(self, session_id: str, session_seq: int, body: Any) -> Envelope:
        return self.append_batch([PendingRecord(session_id, session_seq, body)])[0]

    def stage(self, session_id: str, session_seq: int, body: Any, on_durable: OnDurable) -> None:
        if not self.stages_synchronously:
            return super().stage(session_id, session_seq, body, on_durable)
        loop = asyncio.get_running_loop()
        env = self.append_batch([PendingRecord(session_id, session_seq, body)])[0]
        # Later, as a durable log answers (never inside this call), in a context of its own: the caller's (the
        # engine's READING_STORED while it stages a built turn) must not reach on_durable. One callback answers
        # the records staged before the loop does, as a flush: a record in flight holds a list entry, not a
        # handle, a context and their arguments (objects every full collection walks).
        open_batch = self._unanswered
        if open_batch is not None and open_batch[0] is loop:
            batch = open_batch[1]
        else:  # the first since the last answer, or staged from another loop (which answers the batch it has)
            batch = []
            self._unanswered = (loop, batch)
            loop.call_soon(self._answer_staged, batch, context=contextvars.Context())
        # As the file log's writer does: a DurableCallback (the engine's records are) is the waiter itself.
        batch.append((on_durable if isinstance(on_durable, DurableCallback) else DurableCallback(on_durable), env))

    def _answer_staged(self, batch: list[tuple[DurableCallback, Envelope]]) -> None:
        """Answer ``batch``'s records (see :meth:`stage`, :func:`answer_durable`); a record staged
        from here on starts the next batch."""
        if self._unanswered is not None and self._unanswered[1] is batch:
            self._unanswered = None
        answer_durable(batch)

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Any]:  # typed by EventLog.read's overloads
        from .read import RawRecord

        lsn = max(0, from_lsn)
        while lsn < len(self._records):
            yield RawRecord.of_envelope(self._records[lsn]) if raw else self._records[lsn]
            lsn += 1

    async def follow(self, from_lsn: int = 0, *, poll_s: float = 0.01) -> AsyncIterator[Envelope]:
        lsn = max(0, from_lsn)
        while True:
            while lsn < len(self._records):
                yield self._records[lsn]
                lsn += 1
            await asyncio.sleep(poll_s)

    def close(self) -> None:
        self._closed = True
