"""A live session's handle: :class:`SessionHandle`, what a caller holds between
open and the terminal event (its lifecycle triggers, its in-session events,
its in-flight work), and ``async with engine.session(...)``, the scope that
always ends the session.

The handle keeps the per-session state the engine needs between events (its
sequence number, turn count, the previous turn's context, the FIFO lock's
slots); the decisions (is this event legal now, what state follows) stay with
:class:`engine.core.SessionEngine`, which every method calls into.
"""

from __future__ import annotations

import asyncio
import math
import traceback as _traceback
import struct
from collections import deque
from typing import TYPE_CHECKING, Any, Coroutine

import numpy as np

from agentlog._logging import get_logger
from agentlog.events.log.api import EventLog, OnDurable, settle_from_task
from agentlog.events.schema.lifecycle import TERMINAL_STATES, LifecycleError, State
from agentlog.events.schema.types import (
    CommandRan,
    Envelope,
    RewardAssigned,
    SandboxSnapshotted,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionStarted,
    TeacherScored,
    TurnRecorded,
    TurnUndelivered,
    pack_log_probs,
    pack_tokens,
)
from agentlog.events.schema.turn_delta import EncodingContext, ExtendedPrompt
from agentlog.events.schema.validation import READING_STORED

from .errors import SessionTimeout
from .lineages import Declared, LineageTracker
from .session_lock import acquire_contended, handed_over, queue_for, release
from .staged import PendingTurn

if TYPE_CHECKING:
    from .core import SessionEngine

_log = get_logger("agentlog.engine")


#: The context of a session before its first turn: empty, shared by every handle (never changed).
_BEFORE_THE_FIRST_TURN = EncodingContext()

#: What a live session keeps of each recorded turn, for a teacher's scores of it: its output tokens and
#: sampling temperature. One bytearray a session: unlike ``array`` or a list, it is no object the cyclic
#: collector walks, and thousands of sessions in flight sit in its old generation.
TURN_SCORE = struct.Struct("<Id")


def _copied(value: Any) -> Any:
    """A list or dict a caller handed over, copied (one level: a message object is kept as it is)."""
    return list(value) if type(value) is list else dict(value) if type(value) is dict else value


def stage_built_turn(log: EventLog, session_id: str, seq: int, body: Any, on_durable: OnDurable,
                     caller_waits: bool = False) -> None:
    """``log.stage`` of a turn the engine built (:meth:`SessionHandle._turn_body`), taken as
    checked when built: with ``READING_STORED`` set while the log checks it, its write-time
    check still encodes the body and decodes it back strictly (nothing a reader cannot decode
    is stored) without running the turn's value checks a second time. They ran on the caller's
    values when the ``TurnRecorded`` was built, and the delta's own fields and the lineage when
    the engine made them. That is sound where nothing of the caller's runs in between: a log
    that stages synchronously (``stages_synchronously``) checks before this returns; any other
    checks in a task of its own a loop step later, which runs flagged only when the caller
    waits for the record (``caller_waits``, :meth:`SessionHandle.record_turn`), and else
    checks in full (:meth:`SessionHandle.begin_turn`'s caller goes on at once and may change
    a value it handed over: a ``sampling`` dict, a ``version_spans`` list). ``on_durable``
    runs without the flag either way."""
    if log.stages_synchronously or not caller_waits:
        token = READING_STORED.set(True) if log.stages_synchronously else None
        try:
            log.stage(session_id, seq, body, on_durable)
        finally:
            if token is not None:
                READING_STORED.reset(token)
        return
    token = READING_STORED.set(True)
    try:
        staged = log.submit(session_id, seq, body)  # its task takes the flag with it
    finally:
        READING_STORED.reset(token)
    staged.add_done_callback(settle_from_task(on_durable))  # added unflagged: the callback runs so


class SessionHandle:
    """One live session. All methods return once their event is durable.

    ``state`` stays readable after the session ended; the engine itself no
    longer holds the handle then.
    """

    __slots__ = (
        "_engine", "session_id", "group_id", "sample_index", "state", "turns", "budget_s",
        "_seq", "_busy", "_waiters", "_inflight", "_timer", "_owner", "_owner_cancelled", "_expired", "_log",
        "_context", "_turn_scores", "_lineages", "opened_lsn",
    )

    def __init__(self, engine: "SessionEngine", session_id: str, group_id: str, budget_s: float | None) -> None:
        self._engine = engine
        self.session_id = session_id
        self.group_id = group_id
        self.sample_index = 0  #: its place in the group (set by open_session, which may assign it)
        self.state = State.OPEN
        self.turns = 0  #: turns recorded so far (the next turn_index)
        self.budget_s = budget_s
        self._seq = 0
        #: The LSN of its session_opened, once the log acknowledged it (-1 before).
        self.opened_lsn = -1
        # The session's lock (engine.session_lock): FIFO, in two slots.
        self._busy = False
        self._waiters: deque[asyncio.Future] | None = None
        self._inflight: set[asyncio.Task] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._owner: asyncio.Task | None = None
        self._owner_cancelled = False
        self._expired = False
        self._log: Any = None
        #: The previous turn's prompt + output token ids and its messages'
        #: digests: what the next turn is stored as a delta against (its
        #: context's token bytes + 16 bytes a message, + a pointer a message for a
        #: caller that records frozen messages; dropped when the session ends).
        self._context: EncodingContext | None = _BEFORE_THE_FIRST_TURN
        #: The session's lineages (its conversation threads): the engine places each turn in one.
        self._lineages = LineageTracker()
        #: Per recorded turn, its output tokens and sampling temperature (NaN
        #: when not a number): what a teacher's scores of the turn are checked
        #: against (:data:`TURN_SCORE`, 12 bytes a turn, where a list of tuples costs ~120).
        self._turn_scores = bytearray()

    def __repr__(self) -> str:
        return f"SessionHandle({self.session_id!r}, state={self.state}, turns={self.turns})"

    @property
    def ended_by_engine(self) -> bool:
        """Whether the session ended without an outcome of its own: dropped (at the engine's
        shutdown, a cancel, or anyone's ``drop``: cleanup, never a sample) or aborted by the
        engine when its wall-clock budget ran out. A finish or abort after that raises
        SessionClosed; one who plays the session may take it as this ending's doing."""
        return self.state is State.DROPPED or self._ended_by_budget

    @property
    def _ended_by_budget(self) -> bool:
        """The budget's abort took the session, or is about to: not when it finished or was dropped
        first. (``_expire`` sets ``_expired`` before it waits for the session's lock, and clears it only
        once it wakes to find the session ended; an owner may leave its scope in between.)"""
        return self._expired and self.state is not State.FINISHED and self.state is not State.DROPPED

    @property
    def log(self) -> Any:
        """A logger bound to this session (bound on first use)."""
        if self._log is None:
            self._log = _log.bind(session_id=self.session_id, group_id=self.group_id)
        return self._log

    # -- lifecycle triggers --------------------------------------------------

    async def start(self, harness: str = "", sandbox: str = "", details: dict[str, Any] | None = None) -> Envelope:
        """open -> running: the agent began (sandbox ready, harness launched)."""
        body = SessionStarted(harness=harness, sandbox=sandbox, details=details or {})
        return await self._engine._transition(self, "start", body)  # type: ignore[return-value]

    async def finish(self, reward: Any = None, metadata: dict[str, Any] | None = None) -> Envelope:
        """running -> finished, with the reward (None: the last assigned one).
        Raises SessionClosed if the session already ended."""
        body = SessionFinished(reward=reward, metadata=metadata or {})
        return await self._engine._transition(self, "finish", body)  # type: ignore[return-value]

    async def abort(self, reason: str, error: str = "", traceback: str = "") -> Envelope:
        """open/running -> aborted (a failure; yields one zero-masked placeholder).
        Raises SessionClosed if the session already ended."""
        body = SessionAborted(reason=reason, error=error, traceback=traceback)
        return await self._engine._transition(self, "abort", body)  # type: ignore[return-value]

    async def cancel(self, reason: str) -> Envelope | None:
        """Drop the session for ``reason`` and cancel the task playing it (the one in
        ``engine.session``), which then sees CancelledError. None if it already ended.
        The task is cancelled as the drop is applied, before it runs again."""
        return await self._engine._transition(self, "drop", SessionDropped(reason=reason), stop_owner=True)

    async def drop(self, reason: str) -> Envelope | None:
        """open/running -> dropped (cleanup, no sample). A no-op returning None
        on a session that already ended, so it is safe in every ``finally``."""
        if self.state in TERMINAL_STATES:
            return None
        body = SessionDropped(reason=reason)
        return await self._engine._transition(self, "drop", body)

    # -- in-session events -----------------------------------------------------

    async def record_turn(
        self,
        messages: list[dict[str, Any]] | None = None,
        prompt_ids: Any = b"",
        sampling: dict[str, Any] | None = None,
        *,
        frozen_messages: bool = False,
        declared_lineage: Declared | None = None,
        **fields: Any,
    ) -> Envelope:
        """Record one generation; the engine assigns ``turn_index``. Returns the durable envelope.
        ``fields``: the turn's other fields by name (:class:`~agentlog.events.schema.turn.TurnBody`:
        output_ids, output_log_probs, finish_reason, ...), so a new turn field needs no change here.
        ``frozen_messages=True`` promises that the message objects and the response message
        are never changed afterwards: the session then holds a reference to each (a pointer a
        message), and a message passed again as the very same object is not hashed again
        (:meth:`~agentlog.events.schema.turn_delta.EncodingContext.encode`); the recorded turn is
        the same either way. ``prompt_ids`` may be an
        :class:`~agentlog.events.schema.turn_delta.ExtendedPrompt` (a chat template's
        incremental encode): the bytes it proves it kept of the previous prompt are then
        not compared again; the recorded turn is the same. The engine places the turn in
        one of the session's lineages (:mod:`agentlog.engine.lineages`), in
        ``declared_lineage`` when the agent named one.
        Raises StragglerRefused if the session is not running, TypeError naming an unknown
        field, LineageError for a declared lineage the session cannot take."""
        h = self
        if h._busy:
            await acquire_contended(h)
        else:
            h._busy = True
        try:
            body, after = h._turn_body(messages, prompt_ids, sampling, frozen_messages, declared_lineage, fields)
        except BaseException:
            release(h)
            raise
        return await h._engine._append(h, body, None, after)  # releases the lock

    def begin_turn(
        self,
        messages: list[dict[str, Any]] | None = None,
        prompt_ids: Any = b"",
        sampling: dict[str, Any] | None = None,
        *,
        frozen_messages: bool = False,
        declared_lineage: Declared | None = None,
        **fields: Any,
    ) -> "PendingTurn":
        """:meth:`record_turn`, its record staged before this returns where it can be:
        the session's lock is free and the log stages synchronously (the file log).
        Then a refusal (StragglerRefused, LineageError, a bad field) raises here,
        and the turn is applied when the log's writer acknowledges it, with no task
        between (the gateway's turn path: each task step is a trip through an event
        loop that 256 sessions share). With the lock held by someone else, it takes
        its place in the lock's queue now (in call order: a later ``finish`` comes
        after it) and records as a task once the lock is handed over, with the
        arguments as they were (their lists and dicts copied). Await ``.durable``
        for the envelope; cancelling that wait cancels nothing: the turn is still
        recorded, and ``.settled()`` waits for it."""
        loop = asyncio.get_running_loop()
        pending = PendingTurn(loop)
        h = self
        if h._busy:
            # In the lock's queue now, in call order, with the arguments as they are now (their lists
            # and dicts copied: an agent loop may extend its conversation once this returns).
            task = loop.create_task(h._record_queued(
                queue_for(h), _copied(messages), _copied(prompt_ids), _copied(sampling), frozen_messages, declared_lineage,
                {k: _copied(v) for k, v in fields.items()}, pending))
            task.add_done_callback(settle_from_task(pending.settle))
            return pending
        h._busy = True
        try:
            body, after = h._turn_body(messages, prompt_ids, sampling, frozen_messages, declared_lineage, fields)
            pending.built(body.turn_index, h._lineages.placed)
            h._engine._stage(h, body, None, after, pending)
        except BaseException:
            release(h)
            raise
        return pending

    async def _record_queued(self, queued: asyncio.Future, messages: list[dict[str, Any]] | None, prompt_ids: Any,
                             sampling: dict[str, Any] | None, frozen_messages: bool, declared_lineage: Declared | None,
                             fields: dict[str, Any], pending: PendingTurn) -> Envelope:
        """:meth:`record_turn` of a turn :meth:`begin_turn` queued for the busy lock (``queued``)."""
        await handed_over(self, queued)
        try:
            body, after = self._turn_body(messages, prompt_ids, sampling, frozen_messages, declared_lineage, fields)
            pending.built(body.turn_index, self._lineages.placed)
        except BaseException:
            release(self)
            raise
        return await self._engine._append(self, body, None, after)  # releases the lock

    def _turn_body(
        self, messages: list[dict[str, Any]] | None, prompt_ids: Any, sampling: dict[str, Any] | None,
        frozen_messages: bool, declared_lineage: Declared | None, fields: dict[str, Any],
    ) -> tuple[Any, EncodingContext]:
        """The next turn's stored body (its lock held) and the context after it; refused unless running."""
        if self.state is not State.RUNNING:
            self._engine._refuse(self.session_id, "turn_recorded", self.state, self)
        proof = None
        if type(prompt_ids) is ExtendedPrompt:  # built from an earlier prompt: its kept bytes need no comparing
            proof, prompt_ids = prompt_ids, prompt_ids.packed
        full = TurnRecorded(turn_index=self.turns, messages=messages or [], prompt_ids=prompt_ids, sampling=sampling or {}, **fields)
        # The caller sends the whole prompt (as the chat APIs do); the log
        # stores what is new since the previous turn.
        before = self._context or _BEFORE_THE_FIRST_TURN
        digests = self._lineages.digests(before, full.messages, frozen_messages)
        body, after = before.encode(full, frozen_messages, digests, proof)
        return self._lineages.stamp(full, body, before, digests, declared_lineage), after

    def check_lineage(self, declared: Declared) -> None:
        """Raise LineageError when a turn declaring ``declared`` would be refused now
        (an unknown parent or spawning call, or one contradicting the lineage's first turn):
        the gateway asks before it generates."""
        self._lineages.check(declared)

    async def record_turn_undelivered(self, turn_index: int, reason: str = "") -> Envelope:
        """The response of recorded turn ``turn_index`` never reached the agent."""
        if not isinstance(turn_index, int) or not 0 <= turn_index < self.turns:
            raise ValueError(
                f"session {self.session_id!r}: turn_undelivered.turn_index: expected a recorded turn in [0, {self.turns}), found {turn_index!r}"
            )
        return await self._engine._in_session(self, TurnUndelivered(turn_index=turn_index, reason=reason))

    async def record_teacher_scores(
        self, turn_index: int, *, teacher: str, teacher_version: str, temperature: float, log_probs: Any,
        start: int = 0, top_ids: Any = None, top_log_probs: Any = None,
    ) -> Envelope:
        """Record a teacher's log-probs of turn ``turn_index``'s output tokens
        ``start..start+len(log_probs)`` (on-policy distillation), with its top-K
        tokens when given (``top_ids`` / ``top_log_probs`` shaped (n, K)).

        Refused with ValueError, naming the session and turn, when the turn was
        never recorded, when the scores run past its output, or when
        ``temperature`` is not the one the turn was sampled at: log-probs at
        another temperature are of another distribution."""
        n_out, sampled_at = self._scored_turn(turn_index, "teacher_scored")
        lp = pack_log_probs(log_probs)
        n = len(lp) // 4
        if start < 0 or start + n > n_out:
            raise ValueError(f"session {self.session_id!r}: teacher_scored of turn {turn_index} by {teacher!r}: tokens "
                             f"{start}..{start + n - 1} run past the turn's {n_out} output tokens")
        if sampled_at is None or float(temperature) != sampled_at:
            raise ValueError(f"session {self.session_id!r}: teacher_scored of turn {turn_index} by {teacher!r}: scored at "
                             f"temperature {temperature!r}, but the turn was sampled at temperature {sampled_at!r}; "
                             "score at the rollout temperature")
        top_k = 0
        ids = tlp = b""
        if top_ids is not None or top_log_probs is not None:
            ids_arr = np.asarray(top_ids if top_ids is not None else [], dtype=np.int64)
            lp_arr = np.asarray(top_log_probs if top_log_probs is not None else [], dtype=np.float64)
            if ids_arr.ndim != 2 or ids_arr.shape != lp_arr.shape or ids_arr.shape[0] != n:
                raise ValueError(f"session {self.session_id!r}: teacher_scored of turn {turn_index} by {teacher!r}: top_ids and "
                                 f"top_log_probs must both be shaped ({n}, K); found {ids_arr.shape} and {lp_arr.shape}")
            top_k = int(ids_arr.shape[1])
            ids, tlp = pack_tokens(ids_arr.reshape(-1)), pack_log_probs(lp_arr.reshape(-1))
        body = TeacherScored(turn_index=turn_index, teacher=teacher, teacher_version=teacher_version,
                             temperature=float(temperature), log_probs=lp, start=start, top_k=top_k,
                             top_ids=ids, top_log_probs=tlp)
        return await self._engine._in_session(self, body)

    async def record_teacher_failure(self, turn_index: int, *, teacher: str, teacher_version: str, error: str) -> Envelope:
        """Record that a teacher failed to score turn ``turn_index`` (an error,
        a timeout): the turn is then not distilled, and the reason is in the log."""
        _, sampled_at = self._scored_turn(turn_index, "teacher_scored")
        if not isinstance(error, str) or not error:
            raise ValueError(f"session {self.session_id!r}: teacher failure of turn {turn_index}: expected the error text, found {error!r}")
        body = TeacherScored(turn_index=turn_index, teacher=teacher, teacher_version=teacher_version,
                             temperature=sampled_at or 1.0, error=error)
        return await self._engine._in_session(self, body)

    def _scored_turn(self, turn_index: int, event: str) -> tuple[int, float | None]:
        if self.state is not State.RUNNING:
            self._engine._refuse(self.session_id, event, self.state, self)
        recorded = len(self._turn_scores) // TURN_SCORE.size
        if not isinstance(turn_index, int) or isinstance(turn_index, bool) or not 0 <= turn_index < recorded:
            raise ValueError(f"session {self.session_id!r}: {event}.turn_index: expected a recorded turn in "
                             f"[0, {recorded}), found {turn_index!r}")
        n_out, temperature = TURN_SCORE.unpack_from(self._turn_scores, turn_index * TURN_SCORE.size)
        return n_out, None if math.isnan(temperature) else temperature

    async def record_command(
        self, command: str, exit_code: int | None, budget_exceeded: bool, duration_s: float, output_tail: str
    ) -> Envelope:
        """Record a command that ran in the session's sandbox."""
        body = CommandRan(command=command, exit_code=exit_code, budget_exceeded=budget_exceeded,
                          duration_s=duration_s, output_tail=output_tail)
        return await self._engine._in_session(self, body)

    async def record_snapshot(self, turn_index: int, digest: str, *, files: int = 0, bytes: int = 0, new_bytes: int = 0,
                              seconds: float = 0.0) -> Envelope:
        """Record that the sandbox was saved (durably, already) as turn ``turn_index``'s request
        found it: ``turn_index`` must be the next turn's. Raises ValueError naming the session otherwise."""
        if turn_index != self.turns:
            raise ValueError(f"session {self.session_id!r}: sandbox_snapshotted.turn_index: expected the next turn's "
                             f"index {self.turns} (a snapshot is taken before its turn), found {turn_index!r}")
        body = SandboxSnapshotted(turn_index=turn_index, digest=digest, files=files, bytes=bytes, new_bytes=new_bytes,
                                  seconds=seconds)
        return await self._engine._in_session(self, body)

    async def assign_reward(self, reward: Any, source: str = "") -> Envelope:
        """Record a verifier's reward (a finite float or dict of them)."""
        return await self._engine._in_session(self, RewardAssigned(reward=reward, source=source))

    async def run_command(self, sandbox: Any, cmd: str, budget_s: float) -> Any:
        """Run ``cmd`` in ``sandbox`` (None: the engine's default sandbox) under
        a time budget and record ``command_ran``.

        The run is in-flight work of the session: a terminal transition
        drains it (bounded), then cancels it (the sandbox kills the process
        group). Returns the sandbox's CommandResult. Raises StragglerRefused
        if the session is not running, or ended while the command ran.
        """
        if self.state is not State.RUNNING:
            self._engine._refuse(self.session_id, "command_ran", self.state, self)
        if sandbox is None:
            sandbox = self._engine.sandbox
            if sandbox is None:
                raise ValueError(f"session {self.session_id!r}: run_command needs a sandbox (none given and the engine has no default)")

        async def run_and_record() -> Any:
            res = await sandbox.run_command(cmd, budget_s)
            await self.record_command(res.command, res.exit_code, res.budget_exceeded, res.duration_s, res.output_tail)
            return res

        task = self.spawn(run_and_record())
        try:
            return await task
        except asyncio.CancelledError:
            cur = asyncio.current_task()
            if task.cancelled() and (cur is None or cur.cancelling() == 0):
                # The engine cancelled the command because the session ended.
                self._engine._refuse(self.session_id, "command_ran", self.state, self)
            raise

    def in_flight(self) -> "InFlight":
        """``with h.in_flight() as work:``: what the current task does inside is this
        session's in-flight work, as :meth:`spawn`'s task would be, without a task of
        its own (the gateway's generation: a task costs two trips through an event
        loop that every session shares). Refused (StragglerRefused) once the session
        ended."""
        if self.state in TERMINAL_STATES:
            self._engine._refuse(self.session_id, "spawn", self.state, self)
        return InFlight(self)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as in-flight work of this session: a terminal transition
        waits for it up to ``drain_s`` and then cancels it; the wall-clock
        budget cancels it at once."""
        if self.state in TERMINAL_STATES:
            coro.close()
            self._engine._refuse(self.session_id, "spawn", self.state, self)
        task = asyncio.get_running_loop().create_task(coro)
        self._track(task)
        return task

    def _track(self, work: asyncio.Future) -> None:
        """Hold ``work`` (a task, or an InFlightMarker) among the in-flight work until it is done."""
        if self._inflight is None:
            self._inflight = set()
        self._inflight.add(work)  # type: ignore[arg-type]  # a marker is a future: what asyncio.wait and cancel need
        work.add_done_callback(self._inflight.discard)


class InFlightMarker(asyncio.Future):
    """What :class:`InFlight` puts among a session's in-flight work in place of a
    task: the engine waits for it (a drain) and cancels it as it would a task.
    Its ``cancel`` cancels the task inside the scope at once, and the marker
    stays pending until that task leaves the scope, so a drain waits for the
    cancelled work to finish as it waits for a cancelled task."""

    def __init__(self, task: asyncio.Task | None, session_id: str) -> None:
        super().__init__()
        #: The task inside the scope (None once it left).
        self.task = task
        #: Whether the session cancelled it (its drain timed out, its budget ran out).
        self.by_session = False
        self._session_id = session_id

    def cancel(self, msg: Any = None) -> bool:
        if self.done():
            return False
        if not self.by_session and self.task is not None:
            self.by_session = True
            self.task.cancel(f"session {self._session_id!r} cancelled its in-flight work")
        return True


class InFlight:
    """The scope :meth:`SessionHandle.in_flight` returns: while the current task
    is inside, the session's in-flight work holds an :class:`InFlightMarker`
    for it; :attr:`cancelled_by_session` tells a cancel by the session from any
    other (a client that left)."""

    __slots__ = ("_h", "_marker")

    def __init__(self, h: SessionHandle) -> None:
        self._h = h
        self._marker: InFlightMarker | None = None

    def __enter__(self) -> "InFlight":
        self._marker = marker = InFlightMarker(asyncio.current_task(), self._h.session_id)
        self._h._track(marker)
        return self

    def __exit__(self, *exc: Any) -> None:
        marker = self._marker
        if marker is not None:
            marker.task = None  # left: a cancel from here on cancels nothing
            if not marker.done():
                marker.set_result(None)

    @property
    def cancelled_by_session(self) -> bool:
        """Whether the session cancelled this work (its drain timed out, its budget ran out)."""
        return self._marker is not None and self._marker.by_session


class _SessionContext:
    """``async with engine.session(...)``: a session that always ends.

    An exception inside aborts it (``exception:<Type>``, with the capped
    traceback) and re-raises; cancellation drops it (``cancelled``) and
    re-raises; leaving without a terminal event drops it (``unfinished``) with
    a warning; an exhausted wall-clock budget raises SessionTimeout.
    """

    __slots__ = ("_engine", "_sid", "_kw", "_h", "_resume")

    def __init__(self, engine: "SessionEngine", session_id: str, kw: dict[str, Any], resume: bool = False) -> None:
        self._engine = engine
        self._sid = session_id
        self._kw = kw
        self._h: SessionHandle | None = None
        #: Enter by resuming an adopted orphan (SessionEngine.resume) instead of opening a new session.
        self._resume = resume

    async def __aenter__(self) -> SessionHandle:
        if self._resume:
            h = await self._engine.resume(self._sid, **self._kw)
        else:
            h = await self._engine.open_session(self._sid, **self._kw)
        h._owner = asyncio.current_task()
        self._h = h
        return h

    async def __aexit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        h = self._h
        assert h is not None
        h._owner = None
        if h._ended_by_budget:
            if h._owner_cancelled:
                task = asyncio.current_task()
                if task is not None and et is not None and issubclass(et, asyncio.CancelledError):
                    task.uncancel()
            if et is None or issubclass(et, (asyncio.CancelledError, LifecycleError)):
                # Whatever the body was doing was cut short by the budget.
                raise SessionTimeout(h.session_id, h.budget_s or 0.0) from exc
            return False
        if h.state in TERMINAL_STATES:
            return False
        if et is None:
            h.log.warning("session.unfinished", state=str(h.state))
            await h.drop("unfinished")
            return False
        if issubclass(et, asyncio.CancelledError):
            await h.drop("cancelled")
            return False
        if issubclass(et, Exception):
            tb_text = "".join(_traceback.format_exception(et, exc, tb))
            await h.abort(f"exception:{et.__name__}", error=str(exc), traceback=tb_text)
            return False
        # KeyboardInterrupt / SystemExit / GeneratorExit: cleanup only.
        await h.drop(f"interrupted:{et.__name__}")
        return False
