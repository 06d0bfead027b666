"""The SessionEngine: many concurrent sessions, each an explicit state machine.

The engine decides with the shared lifecycle table
(:func:`events.schema.lifecycle.next_state`; no per-session ``transitions`` models,
which would be O(n) to add and remove) and records through the log: every
operation returns once its event is durable. Operations of one session are
serialised by that session's FIFO lock (:mod:`engine.session_lock`), so turns are ordered
and none can land after the terminal event. A terminal transition drains the
session's in-flight work (bounded by ``drain_s``), cancels what is left, and
releases everything the engine held for the session: after any mix of
outcomes the engine holds no per-session state except a bounded cache of
recently ended states (for :meth:`SessionEngine.status`) and a fixed-size id
filter.

Duplicate ids. Ids are never reused, even after their session ended and was
evicted. ``open()`` folds the log (:class:`engine.restart.RestartFold`: the
lifecycle check and the group rule, from the engine's last checkpoint on,
so a restart reads only the records since then), whose Bloom filter (:class:`reducers.lifecycle.IdFilter`, 1 MiB preallocated for 262,144
ids, then ~4 B per id) holds every id in the log; the engine adds each id it
opens. A filter miss proves the id is fresh (no false negatives). A hit is
confirmed exactly: first against the live sessions and the recently ended
cache, then by a sparse scan of the log in a worker thread (expected only for
~3.4e-7 of fresh ids). So refusals are exact and memory stays fixed up to the
filter's capacity. The sessions a crashed process left open are taken from the
log's exact open-session map, never from the filter-gated fold.
"""

from __future__ import annotations

import asyncio
import traceback as _traceback
from collections import OrderedDict, deque
from typing import Any, Callable, Coroutine

import numpy as np

from agentlog._logging import get_logger
from agentlog.events.schema.lifecycle import TERMINAL_STATES, LifecycleError, SessionClosed, State, next_state
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import (
    CommandRan,
    Envelope,
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TeacherScored,
    TurnDelta,
    TurnRecorded,
    TurnUndelivered,
    pack_log_probs,
    pack_tokens,
    turn_temperature,
    validate_id,
)
from agentlog.events.schema.turn_delta import TurnContext
from agentlog.reducers.groups import GroupError, GroupTracker
from agentlog.reducers.lifecycle import IdFilter

from .errors import TIMEOUT_REASON, DuplicateSession, EngineClosed, SessionTimeout, StragglerRefused
from .restart import Checkpointer, checkpoint_path_of, resume_fold
from .session_lock import acquire_contended, release

_log = get_logger("agentlog.engine")

#: Reason recorded for sessions a crashed engine left open or running.
RESTART_REASON = "engine_restart"
#: Records between two restart checkpoints: a restart folds at most this many (about 50 ms), and each
#: checkpoint (about 1 MiB: the ID filter) costs a few ms of writing in a background thread.
DEFAULT_CHECKPOINT_EVERY = 4096


class SessionHandle:
    """One live session. All methods return once their event is durable.

    ``state`` stays readable after the session ended; the engine itself no
    longer holds the handle then.
    """

    __slots__ = (
        "_engine", "session_id", "group_id", "sample_index", "state", "turns", "budget_s",
        "_seq", "_busy", "_waiters", "_inflight", "_timer", "_owner", "_owner_cancelled", "_expired", "_log",
        "_context", "_turn_shapes",
    )

    def __init__(self, engine: "SessionEngine", session_id: str, group_id: str, budget_s: float | None) -> None:
        self._engine = engine
        self.session_id = session_id
        self.group_id = group_id
        #: Its place in the group (set by open_session, which may assign it).
        self.sample_index = 0
        self.state = State.OPEN
        #: Turns recorded so far (the next turn_index).
        self.turns = 0
        self.budget_s = budget_s
        self._seq = 0
        # The session's lock (engine.session_lock): FIFO, in two slots.
        self._busy = False
        self._waiters: deque[asyncio.Future] | None = None
        self._inflight: set[asyncio.Task] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._owner: asyncio.Task | None = None
        self._owner_cancelled = False
        self._expired = False
        self._log: Any = None
        #: The previous turn's prompt + output and messages + response: what
        #: the next turn is stored as a delta against (O(current context);
        #: dropped when the session ends).
        self._context: TurnContext | None = TurnContext()
        #: Per recorded turn: (output tokens, sampling temperature or None when
        #: not a number): what a teacher's scores of the turn are checked against.
        self._turn_shapes: list[tuple[int, float | None]] = []

    def __repr__(self) -> str:
        return f"SessionHandle({self.session_id!r}, state={self.state}, turns={self.turns})"

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
        output_ids: Any = b"",
        output_log_probs: Any = b"",
        finish_reason: str = "stop",
        response_message: dict[str, Any] | None = None,
        policy_version: int = 0,
        ill_formed: bool = False,
        generate_s: float = 0.0,
        sampling: dict[str, Any] | None = None,
    ) -> Envelope:
        """Record one generation; the engine assigns ``turn_index``. Returns the durable envelope.
        Raises StragglerRefused if the session is not running."""
        h = self
        eng = self._engine
        if h._busy:
            await acquire_contended(h)
        else:
            h._busy = True
        try:
            if h.state is not State.RUNNING:
                eng._refuse(h.session_id, "turn_recorded", h.state, h)
            full = TurnRecorded(
                turn_index=h.turns, messages=messages or [], prompt_ids=prompt_ids, output_ids=output_ids,
                output_log_probs=output_log_probs, finish_reason=finish_reason, response_message=response_message,
                ill_formed=ill_formed, policy_version=policy_version, generate_s=generate_s, sampling=sampling or {},
            )
            # The caller sends the whole prompt (as the chat APIs do); the log
            # stores what is new since the previous turn.
            context = h._context if h._context is not None else TurnContext()
            body = context.delta_of(full)
            return await eng._append(h, body, None, TurnContext.after(full))
        finally:
            release(h)

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
        if not isinstance(turn_index, int) or isinstance(turn_index, bool) or not 0 <= turn_index < len(self._turn_shapes):
            raise ValueError(f"session {self.session_id!r}: {event}.turn_index: expected a recorded turn in "
                             f"[0, {len(self._turn_shapes)}), found {turn_index!r}")
        return self._turn_shapes[turn_index]

    async def record_command(
        self, command: str, exit_code: int | None, budget_exceeded: bool, duration_s: float, output_tail: str
    ) -> Envelope:
        """Record a command that ran in the session's sandbox."""
        body = CommandRan(command=command, exit_code=exit_code, budget_exceeded=budget_exceeded,
                          duration_s=duration_s, output_tail=output_tail)
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

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` as in-flight work of this session: a terminal transition
        waits for it up to ``drain_s`` and then cancels it; the wall-clock
        budget cancels it at once."""
        if self.state in TERMINAL_STATES:
            coro.close()
            self._engine._refuse(self.session_id, "spawn", self.state, self)
        task = asyncio.get_running_loop().create_task(coro)
        if self._inflight is None:
            self._inflight = set()
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task


class _SessionContext:
    """``async with engine.session(...)``: a session that always ends.

    An exception inside aborts it (``exception:<Type>``, with the capped
    traceback) and re-raises; cancellation drops it (``cancelled``) and
    re-raises; leaving without a terminal event drops it (``unfinished``) with
    a warning; an exhausted wall-clock budget raises SessionTimeout.
    """

    __slots__ = ("_engine", "_sid", "_kw", "_h")

    def __init__(self, engine: "SessionEngine", session_id: str, kw: dict[str, Any]) -> None:
        self._engine = engine
        self._sid = session_id
        self._kw = kw
        self._h: SessionHandle | None = None

    async def __aenter__(self) -> SessionHandle:
        h = await self._engine.open_session(self._sid, **self._kw)
        h._owner = asyncio.current_task()
        self._h = h
        return h

    async def __aexit__(self, et: Any, exc: BaseException | None, tb: Any) -> bool:
        h = self._h
        assert h is not None
        h._owner = None
        if h._expired:
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


class SessionEngine:
    """Drives concurrent sessions over one :class:`events.log.api.EventLog`.

    Create with ``await SessionEngine.open(log)``, which first aborts any
    session a crashed process left open (reason ``engine_restart``).
    """

    def __init__(
        self,
        log: EventLog,
        *,
        session_budget_s: float | None = None,
        drain_s: float = 1.0,
        status_cache: int = 4096,
        id_capacity: int = 1 << 18,
        sandbox: Any = None,
        checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
        checkpoint_poll_s: float = 0.2,
    ) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected >= 0 records (0: no checkpoints), found {checkpoint_every}")
        self._log_ = log
        #: Records between restart checkpoints (:mod:`engine.restart`); 0 turns them off.
        self.checkpoint_every = checkpoint_every
        self.checkpoint_poll_s = checkpoint_poll_s
        self._checkpointer: Checkpointer | None = None
        self.session_budget_s = session_budget_s
        self.drain_s = drain_s
        #: Default sandbox for callers that do not bring their own.
        self.sandbox = sandbox
        self._live: dict[str, SessionHandle] = {}
        self._recent: OrderedDict[str, State] = OrderedDict()
        self._status_cache = status_cache
        self._id_capacity = id_capacity
        self._ids = IdFilter(id_capacity)
        # Membership of the groups still in flight, under the reducers' own
        # rule (GroupTracker.check_open): a member they would refuse is
        # refused at open instead of poisoning the log. Released groups are
        # forgotten, so this holds only the open groups.
        self._groups = GroupTracker(min_valid=0)
        self._bg: set[asyncio.Task] = set()
        #: None while every background task (budget expiry) ended well; else
        #: the first crash, in one line (health checks report it).
        self.background_failure: str | None = None
        self._closed = False
        #: Counters: opened, finished, aborted, dropped, stragglers, id_scans, restart_aborted, violations,
        #: restart_folded (records the restart folded after its checkpoint).
        self.stats: dict[str, int] = dict.fromkeys(
            ("opened", "finished", "aborted", "dropped", "stragglers", "id_scans", "restart_aborted", "violations",
             "restart_folded"), 0
        )

    # -- construction and restart ----------------------------------------------

    @classmethod
    async def open(cls, log: EventLog, *, progress: Callable[[int, int], None] | None = None, **options: Any) -> "SessionEngine":
        """Fold the existing log with the lifecycle reducer and abort every
        session left open or running (reason ``engine_restart``), so each
        session in the log ends with exactly one terminal event. A record the
        lifecycle step (``reducers.lifecycle_step.evolve``, shared by every
        fold) refuses is counted in ``stats["violations"]``, logged as
        ``engine.log_violation`` with its LSN, session and kind, and not applied. ``options``
        are the keywords of :class:`SessionEngine` itself. ``progress``: called as
        ``progress(folded, total)`` while the restart fold runs (the CLI draws it;
        the engine draws nothing)."""
        eng = cls(log, **options)
        eng._recover(progress)
        if eng._checkpointer is not None:
            eng._background(eng._checkpoint_loop(), name="engine.checkpointer")
        return eng

    def _recover(self, progress: Callable[[int, int], None] | None) -> None:
        path = checkpoint_path_of(self._log_) if self.checkpoint_every else None
        fold = resume_fold(self._log_, path, recent_window=self._status_cache, id_capacity=self._id_capacity)
        total = self._log_.next_lsn - fold.next_lsn
        folded_now = fold.catch_up(self._log_, progress=None if progress is None else (lambda n: progress(n, total)))
        self.stats["restart_folded"] = folded_now
        self.stats["violations"] += fold.violations
        for v in fold.first_violations:
            _log.warning("engine.log_violation", lsn=v.lsn, session_id=v.session_id, kind=v.kind, message=v.message)
        # The orphans come from the log's exact open-session map, not from the
        # fold: the fold skips a session whose id is a Bloom-filter false
        # positive (it reports it as a reused id), and such a session, left
        # open here, would never be aborted and its group never released.
        folded = fold.check.open_sessions()
        orphans = self._log_.open_sessions()
        if orphans:
            records = []
            was: dict[str, str] = {}
            for sid, seq in sorted(orphans.items()):
                state, fold_seq = folded.get(sid, ("open (untracked by the lifecycle fold)", seq))
                was[sid] = str(state)
                if fold_seq != seq:
                    # The log enforces its own sequence; a mismatch means the fold saw a violation here.
                    _log.warning("engine.restart_seq_mismatch", session_id=sid, reducer_seq=fold_seq, log_seq=seq)
                body = SessionAborted(
                    reason=RESTART_REASON,
                    error=f"left {state} by a previous engine process; aborted when a new engine opened the log",
                )
                records.append((sid, seq, body))
            self._log_.append_batch(records)
            # The aborts end the orphans in the fold too: their groups, the recent window.
            fold.catch_up(self._log_)
            for sid in sorted(orphans):
                _log.warning("session.aborted", session_id=sid, reason=RESTART_REASON, was=was[sid])
            self.stats["restart_aborted"] += len(orphans)
            self.stats["aborted"] += len(orphans)
        self._ids = fold.id_filter()
        self._groups = fold.group_tracker()
        for sid, (state, _lsn) in fold.check.recent.items():
            self._recent[sid] = state
        if path is not None:
            # Written now, so a crash before the first periodic one restarts from here.
            self._checkpointer = Checkpointer(self._log_, fold, path, self.checkpoint_every)
            self._checkpointer.advance(cache_only=True)  # a cache: failing to write it never stops the open
        _log.info("engine.restarted", resumed_from=fold.resumed_from, folded=folded_now,
                  aborted=len(orphans), checkpoint=str(path) if path is not None else None)

    # -- public API -------------------------------------------------------------

    @property
    def log(self) -> EventLog:
        """The log this engine appends to."""
        return self._log_

    @property
    def checkpoint_problem(self) -> str | None:
        """Why the last attempt to write the restart checkpoint failed, in one
        line naming the file (a full disk, a directory in its place); None
        when it was written, or checkpoints are off. The checkpoint is a
        cache: the engine goes on without it (a restart folds more of the
        log); a service may still refuse to start on a disk it cannot write."""
        return self._checkpointer.write_error if self._checkpointer is not None else None

    @property
    def live_count(self) -> int:
        """Sessions not yet ended."""
        return len(self._live)

    def get(self, session_id: str) -> SessionHandle | None:
        """The live session's handle, or None (never opened, or ended)."""
        return self._live.get(session_id)

    def status(self, session_id: str) -> State | None:
        """The state of a live or recently ended session (bounded cache), else None."""
        h = self._live.get(session_id)
        if h is not None:
            return h.state
        return self._recent.get(session_id)

    async def open_session(
        self,
        session_id: str,
        *,
        group_id: str,
        group_size: int,
        sample_index: int | None = None,
        prompt: list[dict[str, Any]] | None = None,
        prompt_ids: Any = b"",
        label: Any = None,
        agent: str = "",
        policy_version: int = 0,
        metadata: dict[str, Any] | None = None,
        budget_s: float | None = None,
    ) -> SessionHandle:
        """Append ``session_opened`` for a fresh id and return its handle.

        ``sample_index`` None takes the group's smallest free index. Raises
        DuplicateSession if the id was ever used, and GroupError (naming the
        group and the conflict) for a membership the reducers would refuse:
        another ``group_size`` than the group's, a taken ``sample_index``,
        more members than ``group_size``, or a group already released."""
        if self._closed:
            raise EngineClosed(f"engine closed; cannot open session {session_id!r}")
        validate_id("session_id", session_id)
        if sample_index is None:
            sample_index = self._groups.next_sample_index(group_id)
        body = SessionOpened(
            group_id=group_id, group_size=group_size, sample_index=sample_index, prompt=prompt or [],
            prompt_ids=prompt_ids, label=label, agent=agent, policy_version=policy_version, metadata=metadata or {},
        )
        live = self._live.get(session_id)
        if live is not None:
            raise DuplicateSession(session_id, live.state, "a live session")
        if self._groups.is_member(group_id, session_id):
            raise DuplicateSession(session_id, None, f"a member of group {group_id!r}, which is still in flight")
        # Joined before the first await, so concurrent opens cannot both take
        # the last place or the same index; withdrawn if the open fails.
        try:
            self._groups.open(group_id, session_id, group_size, sample_index, None)
        except GroupError:
            # A reused id is reported as such, not as the group conflict it also causes.
            if session_id in self._ids:
                await self._confirm_fresh(session_id)
            raise
        budget = budget_s if budget_s is not None else self.session_budget_s
        h = SessionHandle(self, session_id, group_id, budget)
        h.sample_index = sample_index
        # Claim the id before the first await, holding the session's lock, so
        # no concurrent open of the same id and no early op can slip in.
        h._busy = True  # nobody else can see h yet
        self._live[session_id] = h
        try:
            if self._ids.add(session_id):  # maybe seen before: confirm exactly
                await self._confirm_fresh(session_id)
            await self._log_.append(session_id, 0, body)
        except asyncio.CancelledError:
            if self._log_.next_seq(session_id) == 1:
                # Staged before the cancel: the log writes it, so the session
                # exists, but nobody holds its handle. End it like any
                # cancelled session, in the background.
                self._opened(h, budget)
                release(h)
                self._background(h.drop("cancelled"))
            else:
                del self._live[session_id]
                self._groups.withdraw(group_id, session_id)
                release(h)
            raise
        except BaseException:
            del self._live[session_id]
            self._groups.withdraw(group_id, session_id)
            release(h)
            raise
        self._opened(h, budget)
        release(h)
        return h

    def _opened(self, h: SessionHandle, budget: float | None) -> None:
        h._seq = 1
        self.stats["opened"] += 1
        if budget is not None:
            h._timer = asyncio.get_running_loop().call_later(budget, self._on_budget, h)

    def session(self, session_id: str, **kwargs: Any) -> _SessionContext:
        """``async with engine.session(id, group_id=..., group_size=...) as h``:
        same arguments as :meth:`open_session`; the session always ends."""
        return _SessionContext(self, session_id, kwargs)

    async def close(self) -> None:
        """Drop every live session (reason ``shutdown``) and open no more.
        The log stays open: whoever opened it closes it."""
        self._closed = True
        live = list(self._live.values())
        results = await asyncio.gather(*(h.drop("shutdown") for h in live), return_exceptions=True)
        for t in list(self._bg):
            t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if self._checkpointer is not None and not self._log_.closed:
            # The last checkpoint, after the drops: a clean restart then folds nothing
            # (a cache: one that cannot be written is a warning; reading the log still fails here).
            try:
                await asyncio.to_thread(self._checkpointer.advance, cache_only=True)
            except Exception as exc:
                _log.error("engine.checkpoint_failed", path=str(self._checkpointer.path), error=f"{type(exc).__name__}: {exc}")
                errors.append(exc)
        if errors:
            raise errors[0]

    async def __aenter__(self) -> "SessionEngine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- internals ---------------------------------------------------------------

    async def _confirm_fresh(self, session_id: str) -> None:
        """The filter says the id may be in the log: confirm exactly."""
        st = self._recent.get(session_id)
        if st is not None:
            raise DuplicateSession(session_id, st, "it already ended in this log")
        self.stats["id_scans"] += 1
        _log.info("engine.id_scan", session_id=session_id)
        found = await asyncio.to_thread(self._scan_log_for, session_id)
        if found is not None:
            raise DuplicateSession(session_id, None, f"the log holds it at lsn {found}")

    def _scan_log_for(self, session_id: str) -> int | None:
        # Only ids are needed: skip decoding bodies where the log can.
        records = self._log_.read(0, raw=True) if self._log_.reads_raw else self._log_.read(0)
        for env in records:
            if env.session_id == session_id:
                return env.lsn
        return None

    def _refuse(self, session_id: str, what: str, state: State | None, h: SessionHandle | None) -> None:
        self.stats["stragglers"] += 1
        lg = h.log if h is not None else _log.bind(session_id=session_id)
        lg.warning("session.straggler_refused", what=what, state=str(state) if state is not None else None)
        raise StragglerRefused(session_id, what, state)

    async def _append(self, h: SessionHandle, body: Any, dest: State | None, context: TurnContext | None = None) -> Envelope:
        """Append one event of ``h`` (its lock held) and apply it: next seq,
        turn count, new state, release on a terminal state."""
        seq = h._seq
        try:
            env = await self._log_.append(h.session_id, seq, body)
        except asyncio.CancelledError:
            # Logs stage a record synchronously and then wait for durability.
            # If ours was staged before the cancel, the log writes it anyway:
            # apply it, so the session stays in step with the log.
            if self._log_.next_seq(h.session_id) != seq:
                self._apply(h, body, dest, None, context)
            raise
        self._apply(h, body, dest, env.lsn, context)
        return env

    def _apply(self, h: SessionHandle, body: Any, dest: State | None, lsn: int | None, context: TurnContext | None = None) -> None:
        h._seq += 1
        if type(body) is TurnDelta or type(body) is TurnRecorded:
            h.turns += 1
            h._context = context
            h._turn_shapes.append((len(body.output_ids) // 4, turn_temperature(body.sampling)))
        if dest is not None:
            h.state = dest
            if dest in TERMINAL_STATES:
                self._release(h, body, lsn)

    async def _in_session(self, h: SessionHandle, body: Any) -> Envelope:
        # In-session events are legal only while running (events.schema.lifecycle.RUNNING_ONLY_EVENTS).
        if h._busy:
            await acquire_contended(h)
        else:
            h._busy = True
        try:
            if h.state is not State.RUNNING:
                self._refuse(h.session_id, type(body).__struct_config__.tag, h.state, h)
            return await self._append(h, body, None)
        finally:
            release(h)

    async def _transition(self, h: SessionHandle, trigger: str, body: Any, *, drain: bool = True) -> Envelope | None:
        # Decide early (cheap) so a refused trigger does not wait for the drain.
        if next_state(h.session_id, h.state, trigger) is None:
            return None
        if drain and trigger != "start" and h._inflight:
            await self._drain(h)
        if h._busy:
            await acquire_contended(h)
        else:
            h._busy = True
        try:
            dest = next_state(h.session_id, h.state, trigger)
            if dest is None:
                return None
            return await self._append(h, body, dest)
        finally:
            release(h)

    async def _drain(self, h: SessionHandle) -> None:
        """Wait up to drain_s for the session's in-flight work, then cancel the rest."""
        cur = asyncio.current_task()
        tasks = {t for t in (h._inflight or ()) if t is not cur and not t.done()}
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=self.drain_s)
        if pending:
            h.log.info("session.inflight_cancelled", count=len(pending))
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=self.drain_s)

    def _release(self, h: SessionHandle, body: Any, lsn: int | None) -> None:
        """Forget everything held for a session that just ended (``lsn``: of its terminal event, if known)."""
        sid = h.session_id
        h._context = None  # the next-turn context: nothing follows a terminal event
        self._groups.close(h.group_id, None, sid, lsn)
        self._live.pop(sid, None)
        if not self._live:
            # dicts never shrink on delete: drop the table a burst grew, so an
            # idle engine holds no per-session memory at all.
            self._live = {}
        if h._timer is not None:
            h._timer.cancel()
            h._timer = None
        if h._inflight:
            cur = asyncio.current_task()
            for t in list(h._inflight):
                if t is not cur and not t.done():
                    t.cancel()
        self._remember(sid, h.state)
        if h.state is State.FINISHED:
            self.stats["finished"] += 1
        elif h.state is State.ABORTED:
            self.stats["aborted"] += 1
            h.log.warning("session.aborted", reason=body.reason, error=body.error[:200])
        else:
            self.stats["dropped"] += 1
            h.log.info("session.dropped", reason=body.reason)

    def _remember(self, sid: str, state: State) -> None:
        if self._status_cache <= 0:
            return
        self._recent[sid] = state
        if len(self._recent) > self._status_cache:
            self._recent.popitem(last=False)

    def _on_budget(self, h: SessionHandle) -> None:
        h._timer = None
        if h.state in TERMINAL_STATES:
            return
        self._background(self._expire(h))

    async def _checkpoint_loop(self) -> None:
        """Write a restart checkpoint each time ``checkpoint_every`` records
        have been appended since the last one (the fold runs in a thread)."""
        ckpt = self._checkpointer
        assert ckpt is not None
        while True:
            await asyncio.sleep(self.checkpoint_poll_s)
            if ckpt.due():
                # A cache: a failed write is a warning (the next due one tries again), never a background failure.
                await asyncio.to_thread(ckpt.advance, cache_only=True)

    def _background(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> None:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._bg.add(t)
        t.add_done_callback(self._bg_done)

    def _bg_done(self, t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            _log.error("engine.background_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            if self.background_failure is None:
                self.background_failure = f"background task {t.get_name()} crashed: {type(exc).__name__}: {exc}"
        self._bg.discard(t)
        if not self._bg:
            self._bg = set()  # sets never shrink either; see _release

    async def _expire(self, h: SessionHandle) -> None:
        """The wall-clock budget ran out: cancel in-flight work, abort, stop the owner."""
        if h.state in TERMINAL_STATES:
            return
        h._expired = True
        for t in list(h._inflight or ()):
            if not t.done():
                t.cancel()
        body = SessionAborted(reason=TIMEOUT_REASON, error=f"wall-clock budget of {h.budget_s}s exhausted")
        try:
            await self._transition(h, "abort", body, drain=False)
        except SessionClosed:
            # It ended on its own while we waited for its lock: nothing to abort.
            h._expired = False
            return
        owner = h._owner
        if owner is not None and not owner.done() and owner is not asyncio.current_task():
            h._owner_cancelled = True
            owner.cancel()


__all__ = [
    "DuplicateSession",
    "EngineClosed",
    "RESTART_REASON",
    "SessionEngine",
    "SessionHandle",
    "SessionTimeout",
    "StragglerRefused",
    "TIMEOUT_REASON",
]
