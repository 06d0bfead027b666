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
ids, then ~4 B per id) holds every id in the log; the engine adds each id
whose opening the log acknowledged (:mod:`engine.ids`, the rule's owner). A
filter miss proves the id is fresh (no false negatives). A hit is confirmed
exactly: first against the live sessions and the recently ended cache, then by
a sparse scan of the log in a worker thread (expected only for ~3.4e-7 of
fresh ids). So refusals are exact and memory stays fixed up to the filter's
capacity. The sessions a crashed process left open are taken from the log's
exact open-session map, never from the filter-gated fold.

Restart checkpoints are served from this state (:mod:`engine.checkpointer`):
the engine applies each record the log acknowledged in LSN order, and its id
filter, recent window, groups and sessions are then what a fold of the log up
to that record holds.

This module owns the engine's decisions (open, finish, abort, drop, what an
event does to a session). The handle callers hold is :mod:`engine.handle`;
the restart fold and the aborts of orphaned sessions are
:mod:`engine.restart`; budget expiry, the checkpoint loop and the background
tasks are :mod:`engine.timers`.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Callable

import msgspec

from agentlog._logging import get_logger
from agentlog.events.schema.lifecycle import TERMINAL_STATES, State, next_state
from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import (
    Envelope,
    SessionOpened,
    TurnDelta,
    TurnRecorded,
    validate_id,
)
from agentlog.events.schema.turn import scored_against
from agentlog.events.schema.validation import is_number
from agentlog.events.schema.turn_delta import EncodingContext
from agentlog.reducers.abort_classes import REFILL
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.groups import GroupError, GroupTracker
from agentlog.reducers.lifecycle import IdFilter
from agentlog.reducers.lifecycle_step import EndedWindow
from agentlog.reducers.resume import ResumePoint

from .errors import TIMEOUT_REASON, DuplicateSession, EngineClosed, SessionTimeout, StragglerRefused
from .handle import TURN_SCORE, SessionHandle, _SessionContext, stage_built_turn
from . import adopt as engine_adopt
from .adopt import adopt_orphans
from .checkpointer import Checkpointer
from .ids import SessionIds
from .restart import RESTART_REASON, abort_orphans, checkpoint_path_of, resume_fold
from .session_lock import acquire_contended, release
from .staged import StagedOpening, StagedRecord
from .timers import BackgroundWork, own_work

_log = get_logger("agentlog.engine")

#: Records between two restart checkpoints: a restart folds at most this many (about 50 ms), and each
#: checkpoint (about 1 MiB: the ID filter) costs a few ms of writing in a background thread.
DEFAULT_CHECKPOINT_EVERY = 4096


class SessionEngine(BackgroundWork):
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
        groups: ReduceConfig | None = None,
        adopt_orphans: bool = False,
    ) -> None:
        for name, value, ok, expected in (
            ("checkpoint_every", checkpoint_every, type(checkpoint_every) is int and checkpoint_every >= 0, "an int >= 0 records (0: no checkpoints)"),
            ("drain_s", drain_s, is_number(drain_s, at_least=0), "finite seconds >= 0"),
            ("checkpoint_poll_s", checkpoint_poll_s, is_number(checkpoint_poll_s, above=0), "finite seconds > 0"),
            ("status_cache", status_cache, type(status_cache) is int and status_cache >= 0, "an int >= 0 (recently ended sessions kept)"),
        ):
            if not ok:
                raise ValueError(f"{name}: expected {expected}, found {value!r}")
        self._log_ = log
        #: Adopt the sessions a killed process left open (engine.adopt) instead of aborting them.
        self.adopt_orphans = adopt_orphans
        #: Adopted sessions not yet resumed or aborted, with their resume points (engine.adopt).
        self.orphans: dict[str, ResumePoint] = {}
        #: Records between restart checkpoints (:mod:`engine.restart`); 0 turns them off.
        self.checkpoint_every = checkpoint_every
        self.checkpoint_poll_s = checkpoint_poll_s
        self._checkpointer: Checkpointer | None = None
        self.session_budget_s = session_budget_s
        self.drain_s = drain_s
        #: Default sandbox for callers that do not bring their own.
        self.sandbox = sandbox
        self._live: dict[str, SessionHandle] = {}
        self._status_cache = status_cache
        self._id_capacity = id_capacity
        # Membership of the groups in flight, under the reducers' own rule (GroupTracker.check_open): a member
        # they would refuse is refused at open, not poisoning the log. Released groups are forgotten.
        self._groups = GroupTracker(min_valid=0)
        #: The abort classes and refill cap (a run's [groups]): with a "refill" class,
        #: an abort owes its group a replacement (recorded as session_aborted.refill).
        self.group_rules = groups
        #: Per group: refill decisions taken whose abort is not folded into _groups yet.
        self._refills_deciding: dict[str, int] = {}
        self._bg: set[asyncio.Task] = set()
        #: None while every background task (budget expiry) ended well; else
        #: the first crash, in one line (health checks report it).
        self.background_failure: str | None = None
        self._closed = False
        #: Counters: opened, finished, aborted, dropped, stragglers, id_scans, restart_aborted, violations,
        #: restart_folded (records the restart folded after its checkpoint).
        self.stats: dict[str, int] = dict.fromkeys(
            ("opened", "finished", "aborted", "dropped", "stragglers", "id_scans", "restart_aborted", "violations",
             "restart_folded", "resumed"), 0
        )
        #: Every id the log holds, and the recently ended sessions (engine.ids).
        self._ids = SessionIds(log, IdFilter(id_capacity), (), EndedWindow(status_cache), self.stats)

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
        if self.adopt_orphans:
            self.orphans = adopt_orphans(self, fold)
        # Every orphan not adopted (all of them by default) is aborted, as a crashed process left it.
        aborted = abort_orphans(self._log_, fold, keep=set(self.orphans))
        self.stats["restart_aborted"] += aborted
        self.stats["aborted"] += aborted
        self._ids = SessionIds(self._log_, IdFilter.from_snapshot(fold.check.ids.to_snapshot()), fold.refused_opens,
                               EndedWindow.from_snapshot(fold.check.recent.to_snapshot()), self.stats)
        self._groups = fold.group_tracker()
        if path is not None:
            # Written now, so a crash before the first periodic one restarts from here.
            self._checkpointer = Checkpointer(self._log_, fold, path, self.checkpoint_every, self)
            self._checkpointer.advance(cache_only=True)  # a cache: failing to write it never stops the open
        _log.info("engine.restarted", resumed_from=fold.resumed_from, folded=folded_now,
                  aborted=aborted, checkpoint=str(path) if path is not None else None)

    # -- public API -------------------------------------------------------------

    async def resume(self, session_id: str, snapshot: str, *, worker: str = "", budget_s: float | None = None) -> SessionHandle:
        """Continue the adopted orphan ``session_id`` (:attr:`orphans`) as a new incarnation:
        append ``session_resumed`` naming ``snapshot`` (the digest its sandbox was restored
        from) and return its handle. Raises KeyError naming the session when it is not an
        undecided orphan, and IllegalTransition when it never started."""
        budget = self._budget(session_id, budget_s)  # before the orphan is taken: a refusal leaves it undecided
        point = self._undecided(session_id)
        try:
            h = await engine_adopt.resume(self, point, snapshot, worker=worker, budget_s=budget)
        except BaseException:
            if self.status(session_id) not in TERMINAL_STATES:
                self.orphans[session_id] = point  # still undecided: the caller may abort it
            raise
        self.stats["resumed"] += 1
        return h

    async def abort_orphan(self, session_id: str, error: str) -> None:
        """Abort the adopted orphan ``session_id`` (reason ``engine_restart``), ``error``
        saying why it could not resume."""
        self._undecided(session_id)
        await self._live[session_id].abort(RESTART_REASON, error=error)
        self.stats["restart_aborted"] += 1

    def resumed(self, session_id: str, snapshot: str, **kwargs: Any) -> _SessionContext:
        """``async with engine.resumed(id, snapshot, worker=..., budget_s=...) as h``: :meth:`resume`
        as the scope :meth:`session` gives a new session: the session always ends."""
        return _SessionContext(self, session_id, {"snapshot": snapshot, **kwargs}, resume=True)

    def _budget(self, session_id: str, budget_s: float | None) -> float | None:
        """The wall-clock budget a session opened or resumed with ``budget_s`` gets (the engine's default
        when None); ValueError naming the session when it is not seconds >= 0. Checked before anything
        is decided: the session's timer starts once its record is acknowledged."""
        budget = budget_s if budget_s is not None else self.session_budget_s
        if budget is not None and not is_number(budget, at_least=0):
            raise ValueError(f"session {session_id!r}: budget_s: expected seconds >= 0 (or None), found {budget!r}")
        return budget

    def _undecided(self, session_id: str) -> ResumePoint:
        point = self.orphans.pop(session_id, None)
        if point is None:
            raise KeyError(f"session {session_id!r}: not an adopted orphan awaiting resume or abort "
                           f"(undecided: {len(self.orphans)})")
        return point

    def _opened_again(self, h: SessionHandle) -> None:
        """Start a resumed session's budget timer, as :meth:`_opened` does for a new one."""
        if h.budget_s is not None:
            h._timer = asyncio.get_running_loop().call_later(h.budget_s, self._on_budget, h)

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
        return self._ids.state_of(session_id)

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
        replaces: str = "",
    ) -> SessionHandle:
        """Append ``session_opened`` for a fresh id and return its handle.
        ``replaces``: open a replacement (per-sample refill) for that aborted
        member of the group, which the group must owe (:meth:`owed_replacements`).

        ``sample_index`` None takes the group's smallest free index. Raises
        DuplicateSession if the id was ever used, and GroupError (naming the
        group and the conflict) for a membership the reducers would refuse:
        another ``group_size`` than the group's, a taken ``sample_index``,
        more members than ``group_size``, or a group already released."""
        if self._closed:
            raise EngineClosed(f"engine closed; cannot open session {session_id!r}")
        validate_id("session_id", session_id)
        budget = self._budget(session_id, budget_s)
        if sample_index is None:
            # A replacement takes a slot past the originals', never one an original may still open.
            sample_index = self._groups.replacement_index(group_id) if replaces else self._groups.next_sample_index(group_id)
        body = SessionOpened(
            group_id=group_id, group_size=group_size, sample_index=sample_index, prompt=prompt or [],
            prompt_ids=prompt_ids, label=label, agent=agent, policy_version=policy_version, metadata=metadata or {},
            replaces=replaces or msgspec.UNSET,
        )
        live = self._live.get(session_id)
        if live is not None:
            raise DuplicateSession(session_id, live.state, "a live session")
        if self._groups.is_member(group_id, session_id):
            raise DuplicateSession(session_id, None, f"a member of group {group_id!r}, which is still in flight")
        hashes = self._ids.hashes(session_id)  # once, for the filter's question now and its insert once in the log
        # Joined before the first await, so concurrent opens cannot both take
        # the last place or the same index; withdrawn if the open fails.
        try:
            self._groups.open(group_id, session_id, group_size, sample_index, None, replaces)
        except GroupError:
            # A reused id is reported as such, not as the group conflict it also causes.
            if self._ids.maybe_used(session_id, hashes):
                await self._ids.confirm_fresh(session_id)
            raise
        h = SessionHandle(self, session_id, group_id, budget)
        h.sample_index = sample_index
        # Claim the id before the first await, holding the session's lock, so
        # no concurrent open of the same id and no early op can slip in.
        h._busy = True  # nobody else can see h yet
        self._live[session_id] = h
        done = asyncio.get_running_loop().create_future()
        try:
            if self._ids.maybe_used(session_id, hashes):  # maybe seen before: confirm exactly
                await self._ids.confirm_fresh(session_id)
            self._log_.stage(session_id, 0, body, StagedOpening(self, h, body, done, budget, hashes))
        except BaseException:
            self._unopened(h)
            release(h)
            raise
        try:
            await done
        except asyncio.CancelledError:
            if not done.cancelled() and done.exception() is None:  # opened just before the cancel came
                self._background(h.drop("cancelled"))
            raise
        return h

    def _unopened(self, h: SessionHandle) -> None:
        """Forget ``h``, whose ``session_opened`` the log refused (or never got). What queued on its lock
        meanwhile (a drop at close, an admin's start: a log that stages in a task checks the opening a
        loop step late, and the id scan awaits) is refused as after an ending, and appends nothing."""
        del self._live[h.session_id]
        self._groups.withdraw(h.group_id, h.session_id)
        h.state = State.DROPPED

    def _opened(self, h: SessionHandle, budget: float | None, hashes: tuple[int, int], lsn: int | None) -> None:
        """``h``'s session_opened is in the log, at ``lsn`` (None: see :meth:`_stage`)."""
        h._seq = 1
        self._ids.opened(hashes)
        if lsn is not None:
            h.opened_lsn = lsn
            self._groups.placed(h.group_id, h.session_id, lsn)
        if self._checkpointer is not None:
            self._checkpointer.applied(lsn, h.session_id, 0)
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
                await self._checkpointer.checkpoint(final=True)
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

    def _refuse(self, session_id: str, what: str, state: State | None, h: SessionHandle | None) -> None:
        self.stats["stragglers"] += 1
        lg = h.log if h is not None else _log.bind(session_id=session_id)
        lg.warning("session.straggler_refused", what=what, state=str(state) if state is not None else None)
        raise StragglerRefused(session_id, what, state)

    def _append(self, h: SessionHandle, body: Any, dest: State | None, context: EncodingContext | None = None,
                settled: Callable[[], None] | None = None) -> asyncio.Future[Envelope]:
        """Append one record of ``h`` and apply it (:meth:`_stage`), called holding ``h``'s lock,
        which this releases on every path; returns a future of the record's envelope (a refusal
        raises here). ``settled``: called once the record is applied or failed (or the log refused
        it). Cancelling the wait cancels nothing. A plain function, not a coroutine: a record in
        flight holds one coroutine fewer, which every full collection would walk (thousands of
        sessions in flight keep their objects into the old generation)."""
        done: asyncio.Future[Envelope] = asyncio.get_running_loop().create_future()
        try:
            self._stage(h, body, dest, context, done, settled, True)
        except BaseException:
            release(h)
            if settled is not None:
                settled()
            raise
        return done

    def _stage(self, h: SessionHandle, body: Any, dest: State | None, context: EncodingContext | None, waiter: Any,
               settled: Callable[[], None] | None = None, caller_waits: bool = False) -> None:
        """Stage one record of ``h`` (its lock held; ``context``: the one a turn the engine built leaves,
        :meth:`SessionHandle._turn_body`): once the log acknowledges it, apply it at its LSN, release the
        lock and answer ``waiter`` (:class:`~agentlog.engine.staged.StagedRecord`). A refusal by a log
        that stages synchronously raises here, nothing staged and the lock still the caller's.
        ``settled``: see :meth:`_append`; ``caller_waits``: the caller awaits the record
        (see :func:`~agentlog.engine.handle.stage_built_turn`).

        Every record is applied as its acknowledgement comes, never as a caller's wait is cancelled,
        so the engine applies its records in the log's order and knows each one's LSN. The one
        exception is a log that stages in a task (not the file log) whose task was cancelled (the
        event loop shutting down) after the record went out: it is applied then, its LSN unknown."""
        staged = StagedRecord(self, h, body, dest, context, waiter, settled)
        if context is None:
            self._log_.stage(h.session_id, staged.seq, body, staged)
        else:
            stage_built_turn(self._log_, h.session_id, staged.seq, body, staged, caller_waits)

    def _apply(self, h: SessionHandle, staged: StagedRecord, lsn: int | None, stored: Any = None) -> None:
        """Apply ``h``'s record ``staged`` as the log acknowledged it, at ``lsn`` (None: see
        :meth:`_stage`), and tell the checkpointer it is applied. What is applied is what was
        stored, never what a caller changed afterwards in a dict it handed over: ``stored``, the
        body as the log decoded it back, when its envelope holds one; else (the file log's, whose
        body decodes on first use) the body the engine built, whose fields read here are values
        (a turn's index, a terminal event's reason), and what was read of a turn as it was staged
        and encoded (:class:`~agentlog.engine.staged.StagedRecord`)."""
        body, dest, context = staged.body, staged.dest, staged.context
        h._seq += 1
        if type(body) is TurnDelta or type(body) is TurnRecorded:
            n_out, temperature = (staged.n_out, staged.temperature) if stored is None else scored_against(stored)
            h.turns += 1
            h._turn_scores += TURN_SCORE.pack(n_out, temperature)
            h._context = context
            if context is not None:
                h._lineages.commit(body.turn_index, context)
        if dest is not None:
            h.state = dest
            if dest in TERMINAL_STATES:
                self._release(h, body, lsn, staged.ender)
        if self._checkpointer is not None:
            self._checkpointer.applied(lsn, h.session_id, h._seq - 1)

    async def _in_session(self, h: SessionHandle, body: Any) -> Envelope:
        # In-session events are legal only while running (events.schema.lifecycle.RUNNING_ONLY_EVENTS).
        if h._busy:
            await acquire_contended(h)
        else:
            h._busy = True
        if h.state is not State.RUNNING:
            release(h)
            self._refuse(h.session_id, type(body).__struct_config__.tag, h.state, h)
        return await self._append(h, body, None)  # releases the lock

    async def _transition(self, h: SessionHandle, trigger: str, body: Any, *, drain: bool = True,
                          stop_owner: bool = False) -> Envelope | None:
        """Record ``h``'s transition ``trigger`` with ``body`` (None when the session already left the
        states it applies to). ``stop_owner``: cancel the task playing the session as the ending is
        applied (:meth:`_stop_owner`)."""
        # Decide early (cheap) so a refused trigger does not wait for the drain.
        if next_state(h.session_id, h.state, trigger) is None:
            return None
        if drain and trigger != "start" and h._inflight:
            await self._drain(h)
        if h._busy:
            await acquire_contended(h)
        else:
            h._busy = True
        settled = None
        try:
            dest = next_state(h.session_id, h.state, trigger)  # raises for an illegal one
            if dest is None:
                release(h)
                return None
            if stop_owner:
                settled = partial(self._stop_owner, h, dest, asyncio.current_task())
            if trigger == "abort" and not body.refill and self._owes_refill(h.group_id, body.reason):
                # The engine decides, the log records: the group is released only with a replacement.
                # Counted until the abort is applied, so concurrent aborts respect the cap.
                body = msgspec.structs.replace(body, refill=True)
                self._refills_deciding[h.group_id] = self._refills_deciding.get(h.group_id, 0) + 1
                settled = partial(self._refill_decided, h.group_id, settled)
        except BaseException:
            release(h)
            raise
        return await self._append(h, body, dest, settled=settled)  # releases the lock

    def _refill_decided(self, group_id: str, then: Callable[[], None] | None = None) -> None:
        """An abort that owes ``group_id`` a replacement is applied (or failed): no longer deciding;
        then ``then``, the record's other ``settled``."""
        left = self._refills_deciding[group_id] - 1
        if left:
            self._refills_deciding[group_id] = left
        else:
            del self._refills_deciding[group_id]
        if then is not None:
            then()

    def _stop_owner(self, h: SessionHandle, ended: State, caller: asyncio.Task | None) -> None:
        """As ``h``'s ending to ``ended`` is applied (an :meth:`_append` ``settled``, before anything else of the
        session's runs): cancel the task playing it (``engine.session``'s), unless that is ``caller``, who ended
        it. Cancelled once the caller ran again, a task already due to run would first go on to record past the
        session's end (a turn refused, a finish raising SessionClosed). Nothing when the ending was refused."""
        owner = h._owner
        if h.state is ended and owner is not None and owner is not caller and not owner.done():
            h._owner_cancelled = True
            owner.cancel()

    def _owes_refill(self, group_id: str, reason: str) -> bool:
        """Whether an abort for ``reason`` in ``group_id`` owes the group a replacement:
        its abort class's outcome is "refill" and the group is under its refill cap."""
        rules = self.group_rules
        if rules is None or rules.outcome_of(reason) != REFILL:
            return False
        return self._groups.refills(group_id) + self._refills_deciding.get(group_id, 0) < rules.max_refills

    def live_members(self, group_id: str) -> list[SessionHandle]:
        """The live (not yet ended) sessions of ``group_id``."""
        return [h for h in self._live.values() if h.group_id == group_id]

    def replacement_index(self, group_id: str) -> int:
        """The sample_index of the next replacement of ``group_id`` (in flight): past every
        original member's slot, so a replacement never takes an index a member may still open."""
        return self._groups.replacement_index(group_id)

    def owed_replacements(self, group_id: str) -> list[str]:
        """The aborted members of ``group_id`` (in flight) owed a replacement that has
        not opened yet: open each with ``open_session(..., replaces=member)``."""
        return self._groups.owed(group_id)

    def _release(self, h: SessionHandle, body: Any, lsn: int | None, ender: asyncio.Task | None) -> None:
        """Forget everything held for a session that just ended (``lsn``: of its terminal event, if
        known), and cancel its in-flight work but ``ender``'s (the task that ended it)."""
        sid = h.session_id
        h._context = None  # the next-turn context: nothing follows a terminal event
        if self._groups.is_member(h.group_id, sid):  # an adopted orphan whose membership the log refused has none
            self._groups.close(h.group_id, None, sid, lsn, refill=h.state is State.ABORTED and body.refill is True)
        self._live.pop(sid, None)
        if not self._live:
            self._live = {}  # dicts never shrink on delete: an idle engine holds no per-session memory at all
        if h._timer is not None:
            h._timer.cancel()
            h._timer = None
        if h._inflight:
            for t in list(h._inflight):
                if not own_work(t, ender) and not t.done():
                    t.cancel()
        self._ids.ended(sid, h.state, -1 if lsn is None else lsn)
        if h.state is State.FINISHED:
            self.stats["finished"] += 1
        elif h.state is State.ABORTED:
            self.stats["aborted"] += 1
            h.log.warning("session.aborted", reason=body.reason, error=body.error[:200])
        else:
            self.stats["dropped"] += 1
            h.log.info("session.dropped", reason=body.reason)


__all__ = [
    "DuplicateSession",
    "EngineClosed",
    "SessionEngine",
    "SessionHandle",
    "SessionTimeout",
    "StragglerRefused",
    "TIMEOUT_REASON",
]
