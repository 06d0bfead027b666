"""The reducers composed: log envelopes in, samples and released groups out.

One code path serves the online loop (:class:`Reducer`, fed envelope by
envelope while the log is tailed) and offline reconstruction
(:func:`reduce_log` over a whole log); both give byte-identical samples.

Each envelope goes through the one fold driver (:class:`reducers.fold.SessionFold`)
and its lifecycle and sequence step (:func:`reducers.lifecycle_step.evolve`): its LSN must increase,
its ``session_seq`` must be the session's ``last + 1``, its move must be in
the lifecycle table, and an ended session's id may not come back (checked
against the last ``ENDED_WINDOW`` ended ids, and exactly within a pending
group). This fold must not go on past a bad record: a violation raises
:class:`ReduceError` naming the LSN, the session and the violation's kind;
an event type this version does not know (a
newer writer's :class:`events.schema.types.UnknownEvent`) raises its subclass
:class:`UnknownEventError`, which says to upgrade. A session's state is
evicted at its terminal event, once its samples are emitted; a group's once
it is released. The reducer is pure: no clock, randomness, I/O or torch.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import msgspec

from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import (
    Envelope,
    PolicyUpdated,
    RewardAssigned,
    SessionAborted,
    SessionOpened,
    TeacherScored,
    TurnDelta,
    TurnRecorded,
    TurnUndelivered,
    UnknownEvent,
)

from .config import DEFAULT_CONFIG, ReduceConfig
from .errors import ReduceError, UnknownEventError
from .fold import ConfirmUsed, SessionFold, Tracked
from .lifecycle import IdFilter
from .lifecycle_step import SessionLife, Violation
from .groups import DROPPED, FINISHED, Group, GroupError, GroupTracker
from .health import SessionHealth
from .metrics import MetricsAccumulator
from .outcome import SessionOutcome, session_outcome, would_make_rows
from .samples import Sample, SampleDigest, aborted_placeholder, finished_samples, lineage_rewards
from .teacher import TeacherScoreError
from .trajectory import SessionTrajectory, Trajectory, TrajectoryError

__all__ = ["ENDED_WINDOW", "InFlightWindow", "Outputs", "ReduceError", "ReduceResult", "Reducer", "UnknownEventError", "reduce_log", "session_trajectory"]


#: How many recently ended session ids the reducer remembers, to refuse an id
#: that is opened again (ids are never reused). Bounded, so memory does not
#: grow with the length of the run; a reuse within one pending group is
#: refused whatever its distance (see ``GroupTracker.open``).
ENDED_WINDOW = 1024


class Outputs(NamedTuple):
    """What one or more envelopes produced: samples (in emission order),
    groups (in release order), the health flags of every session that
    ended (session id -> its flags, sorted; :mod:`reducers.health`) and what
    each became in its group (session id -> its :class:`~reducers.outcome.SessionOutcome`:
    whether it trains, with what reward, in the baseline or not)."""

    samples: list[Sample]
    groups: list[Group]
    flags: dict[str, tuple[str, ...]]
    outcomes: dict[str, SessionOutcome]


class _Session:
    __slots__ = (
        "life",
        "group_id",
        "group_size",
        "sample_index",
        "policy_version",
        "lsn_first",
        "trajectory",
        "last_reward",
        "health",
    )

    def __init__(self, life: SessionLife, opened: SessionOpened, session_id: str, lsn: int, config: ReduceConfig) -> None:
        self.life = life
        self.group_id = opened.group_id
        self.group_size = opened.group_size
        self.sample_index = opened.sample_index
        self.policy_version = opened.policy_version
        self.lsn_first = lsn
        self.trajectory = SessionTrajectory(session_id, config.fork_threshold)
        self.last_reward: Any = None
        self.health = SessionHealth(session_id, config)


def _refuse(violation: Violation) -> None:
    raise ReduceError.of_violation(violation)


def _refuse_unknown(lsn: int, session_id: str, tag: str) -> None:
    # Samples need every event of every session interpreted; guessing
    # what a newer event meant could train on a wrong trajectory.
    raise UnknownEventError(lsn, session_id, tag)


class Reducer:
    """Incremental reducer: ``feed`` envelopes in LSN order, get outputs back.

    Memory is bounded by the sessions and groups still in flight, plus, with
    ``confirm_used``, the id filter (4 bytes an id ever opened).
    """

    def __init__(self, config: ReduceConfig = DEFAULT_CONFIG, *, confirm_used: ConfirmUsed | None = None) -> None:
        """``confirm_used``: for a reducer that can read its log again (``agentlog reconstruct``,
        ``export-dataset``): it then also keeps an id filter over every session it opened, so a
        reused id is refused however long ago it ended, and an opening the filter alone calls a
        reuse is confirmed by ``confirm_used(session_id, lsn)`` (a scan of the log: the filter has
        false positives). Without it (the online loop, whose engine refuses a reused id at open),
        a reuse is refused within the last ``ENDED_WINDOW`` ended ids and within a pending group."""
        if not isinstance(config, ReduceConfig):
            raise TypeError(f"Reducer: expected a ReduceConfig, found {type(config).__name__}")
        self.config = config
        self._fold: SessionFold[_Session] = SessionFold(
            opened=self._opened, applied=self._applied, ended=self._terminal, refused=_refuse, unknown=_refuse_unknown,
            ended_window=ENDED_WINDOW, ids=None if confirm_used is None else IdFilter(), confirm_used=confirm_used,
        )
        self._sessions = self._fold.live
        self._groups = GroupTracker(config.min_valid)
        self.metrics = MetricsAccumulator(config.reward_key, config.solve_threshold)
        self.digest = SampleDigest()
        self.events = 0
        self.samples_emitted = 0
        self.groups_released = 0
        self._out: Outputs | None = None

    @property
    def last_lsn(self) -> int:
        """The LSN of the last envelope folded (-1 before any)."""
        return self._fold.next_lsn - 1

    # ------------------------------------------------------------------ feed

    def feed(self, env: Envelope) -> Outputs:
        """Fold one envelope; returns the samples and groups it completed.

        Raises ReduceError (naming the LSN and session) on an envelope the
        log should never hold; the reducer is then left as it was before
        that envelope."""
        self._out = None
        body = env.body
        if type(body) is UnknownEvent:
            self._fold.feed(env.lsn, env.session_id, env.session_seq, body.tag, env, True)
        else:  # learner progress passes the driver: no session event
            self._fold.feed(env.lsn, env.session_id, env.session_seq, body.__struct_config__.tag, env)
        self.events += 1
        out = self._out
        return Outputs([], [], {}, {}) if out is None else out

    def _opened(self, lsn: int, sid: str, env: Envelope, life: SessionLife) -> _Session:
        body = env.body
        assert isinstance(body, SessionOpened)
        try:
            self._groups.open(body.group_id, sid, body.group_size, body.sample_index, lsn, body.replaces or "")
        except GroupError as exc:
            raise ReduceError(lsn, sid, str(exc)) from None
        return _Session(life, body, sid, lsn, self.config)

    def _applied(self, session: _Session, lsn: int, tag: str, env: Envelope) -> None:
        body = env.body
        try:
            if isinstance(body, (TurnRecorded, TurnDelta)):
                session.trajectory.record_turn(body, lsn)
            elif isinstance(body, TurnUndelivered):
                session.trajectory.mark_undelivered(body.turn_index, body.reason, lsn)
            elif isinstance(body, TeacherScored):
                session.trajectory.record_teacher(body, lsn)
        except (TrajectoryError, TeacherScoreError) as exc:
            raise ReduceError(lsn, env.session_id, str(exc)) from None
        if isinstance(body, RewardAssigned):
            session.last_reward = body.reward
        session.health.observe(tag, body)

    def feed_many(self, envelopes: Iterable[Envelope]) -> Outputs:
        """Fold a chunk of envelopes; the outputs of every ``feed``, concatenated."""
        samples: list[Sample] = []
        groups: list[Group] = []
        flags: dict[str, tuple[str, ...]] = {}
        outcomes: dict[str, SessionOutcome] = {}
        for env in envelopes:
            out = self.feed(env)
            samples.extend(out.samples)
            groups.extend(out.groups)
            flags.update(out.flags)
            outcomes.update(out.outcomes)
        return Outputs(samples, groups, flags, outcomes)

    def _terminal(self, session: _Session, lsn: int, sid: str, state: State, env: Envelope) -> None:
        # Evicted already (the driver did it first): nothing may follow a terminal event.
        body = env.body
        traj = session.trajectory
        samples: list[Sample]
        # A member that would train is linearised once, for its rows and its flags.
        rows = linearise(traj, self.config) if would_make_rows(body, self.config) else None
        flags = session.health.flags(traj if rows is None else rows)
        outcome = session_outcome(body, session.last_reward, flags, self.config)
        status = outcome.status
        if status == DROPPED:
            samples = []
        elif not outcome.makes_rows:
            # An excluded abort, or a member its flags make untrainable: one placeholder, out of the baseline.
            samples = [self._placeholder(session, sid, lsn, outcome.end_reason, outcome.untrainable)]
        else:
            assert rows is not None
            # A finished session, or an abort its class counts as a failure: its recorded turns
            # train, with its reward (the configured failure reward for the abort).
            how = {"reward_problem": outcome.reason} if status == FINISHED else {"abort_reason": outcome.end_reason}
            by_lineage = lineage_rewards(outcome.raw_reward)[0] if status == FINISHED else {}
            samples = self._row_samples(session, sid, lsn, outcome.reward, rows, by_lineage, **how)
        member = outcome.member(sid, session.sample_index, tuple(samples))
        if status == DROPPED:
            self.metrics.observe_session(DROPPED, reason=outcome.end_reason, turns=traj.n_turns, output_tokens=traj.output_tokens)
        else:
            self.metrics.observe_session(status, reason=outcome.end_reason, reward=outcome.raw_reward, turns=traj.n_turns,
                                         output_tokens=traj.output_tokens, samples=samples)
        for s in samples:
            self.digest.update(s)
        self.samples_emitted += len(samples)
        group = self._groups.close(session.group_id, member, sid, lsn, refill=isinstance(body, SessionAborted) and body.refill is True,
                                   drop_reason=outcome.end_reason if status == DROPPED else "")
        ended = {sid: outcome}
        if group is None:
            self._out = Outputs(samples, [], {sid: flags}, ended)
            return
        self.groups_released += 1
        self.metrics.observe_group(group)
        self._out = Outputs(samples, [group], {sid: flags}, ended)

    def _placeholder(self, session: _Session, sid: str, lsn: int, reason: str, untrainable: tuple[str, ...] = ()) -> Sample:
        """The one zero-masked row of a member out of its baseline: an excluded abort, or
        one its health flags make untrainable (:func:`aborted_placeholder`)."""
        return aborted_placeholder(
            session.group_id, sid, session.sample_index, reason, policy_version=session.policy_version,
            turns=session.trajectory.n_turns, lsn_first=session.lsn_first, lsn_last=lsn, untrainable=untrainable,
        )

    def _row_samples(self, session: _Session, sid: str, lsn: int, reward: float | None, rows: Trajectory,
                     by_lineage: dict[str, float], **how: str) -> list[Sample]:
        """The samples of an ended session's trajectory ``rows``, each with ``reward`` or its
        lineage's (``how``: ``reward_problem`` or ``abort_reason``, see :func:`finished_samples`)."""
        traj = session.trajectory
        return finished_samples(
            rows.rows,
            group_id=session.group_id,
            session_id=sid,
            sample_index=session.sample_index,
            reward=reward,
            turns=traj.n_turns,
            lsn_first=session.lsn_first,
            lsn_last=lsn,
            turn_sampling=traj.turn_sampling,
            row_teacher=traj.teacher.row_fields if traj.teacher else None,
            lineages=traj.lineages,
            rewards_by_lineage=by_lineage,
            **how,
        )

    # ---------------------------------------------------------------- state

    def open_sessions(self) -> dict[str, str]:
        """Sessions not yet terminal, with their state."""
        return {sid: str(s.life.state) for sid, s in self._sessions.items()}

    def pending_groups(self) -> dict[str, tuple[int, int, int]]:
        """Groups not yet released: ``group_id -> (group_size, opened, terminal)``."""
        return self._groups.pending()

    def oldest_in_flight_lsn(self) -> int | None:
        """The LSN of the oldest ``session_opened`` of any member (ended or not)
        of a group not yet released, or None when nothing is in flight. Every
        open session belongs to such a group, so a fold resumed from here
        (:class:`InFlightWindow`) rebuilds every pending group whole."""
        return self._groups.oldest_open_lsn()

    def session_flags(self, session_id: str) -> tuple[str, ...]:
        """The health flags of a session still in flight, as far as its events so far
        decide them (sorted; :mod:`reducers.health`). An ended session's are in the
        ``Outputs.flags`` of the envelope that ended it."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"session {session_id!r} is not in flight (never opened, or already terminal and evicted)")
        return session.health.flags(session.trajectory)

    def trajectory(self, session_id: str) -> Trajectory:
        """The current linearisation of a session still in flight (for inspection)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(f"session {session_id!r} is not in flight (never opened, or already terminal and evicted)")
        return linearise(session.trajectory, self.config)


class InFlightWindow:
    """Which envelopes a fold resumed at a low-water LSN must feed its reducer.

    A consumer that has taken every group released up to ``through_lsn``
    (``settled_groups``) and recorded the low-water LSN then
    (:meth:`Reducer.oldest_in_flight_lsn`) restarts by reading the log from
    that LSN into a fresh :class:`Reducer`, feeding only what ``admits``:

    * up to ``through_lsn``, the events of sessions whose ``session_opened``
      lies in the window and whose group is not settled. Every member of a
      group pending at ``through_lsn`` opened at or after the low-water mark
      (that is how the mark is chosen, ended members included), so those
      groups are rebuilt whole. Sessions opened before the mark ended before
      ``through_lsn`` in groups already settled; a settled group's members
      that opened inside the window are left out too, so no partial group is
      left dangling in the reducer;
    * after ``through_lsn``, everything, exactly as a fold from 0 would see it.

    The groups then released, their order and their samples equal those of a
    fold from LSN 0 that skips the settled groups. What the window does not
    re-check is the lifecycle of the sessions it leaves out (a fold from 0
    did check it, before the consumer recorded the mark); an event after
    ``through_lsn`` of such a session is fed and refused by the reducer as a
    session never opened. ``through_lsn = -1`` admits everything (a fold
    from 0).
    """

    __slots__ = ("through_lsn", "settled_groups", "_members")

    def __init__(self, through_lsn: int, settled_groups: set[str] | frozenset[str]) -> None:
        self.through_lsn = through_lsn
        self.settled_groups = settled_groups
        self._members: set[str] = set()  # sessions opened in the window, group not settled

    def admits(self, env: Envelope) -> bool:
        """Whether ``env`` (read in LSN order from the low-water mark) is fed to the reducer."""
        if env.lsn > self.through_lsn:
            if self._members:
                self._members = set()  # past the mark nothing is filtered: free the set
            return True
        body = env.body
        if isinstance(body, SessionOpened):
            if body.group_id in self.settled_groups:
                return False
            self._members.add(env.session_id)
            return True
        if isinstance(body, PolicyUpdated):
            return True
        return env.session_id in self._members


class ReduceResult(msgspec.Struct):
    """A whole log reduced: outputs plus what is needed to state and check them."""

    config: ReduceConfig
    samples: list[Sample]
    groups: list[Group]
    metrics: dict[str, Any]
    digest: str  # sha256 over the sample stream, in emission order
    events: int
    last_lsn: int
    open_sessions: dict[str, str]
    pending_groups: dict[str, tuple[int, int, int]]

    def header(self) -> dict[str, Any]:
        """The stream header to write before the samples: the configuration
        that produced them, its digest, and the sample digest."""
        return {
            "reduce_config": self.config.to_dict(),
            "reduce_config_digest": self.config.digest(),
            "sample_digest": self.digest,
            "samples": len(self.samples),
            "groups": len(self.groups),
            "events": self.events,
            "last_lsn": self.last_lsn,
        }


def reduce_log(source: Any, config: ReduceConfig = DEFAULT_CONFIG) -> ReduceResult:
    """Reduce a whole log: any object with ``read(from_lsn)`` (an EventLog or a
    reader) or any iterable of envelopes in LSN order."""
    envelopes = source.read(0) if hasattr(source, "read") else source
    reducer = Reducer(config)
    out = reducer.feed_many(envelopes)
    return ReduceResult(
        config=config,
        samples=out.samples,
        groups=out.groups,
        metrics=reducer.metrics.snapshot(),
        digest=reducer.digest.hexdigest(),
        events=reducer.events,
        last_lsn=reducer.last_lsn,
        open_sessions=reducer.open_sessions(),
        pending_groups=reducer.pending_groups(),
    )


def linearise(trajectory: SessionTrajectory, config: ReduceConfig) -> Trajectory:
    """``trajectory``'s rows and decisions under ``config`` (its context cut and train-once setting)."""
    return trajectory.linearise(config.max_context_tokens, config.allow_repeated_targets)


def session_trajectory(envelopes: Iterable[Envelope], session_id: str, config: ReduceConfig = DEFAULT_CONFIG) -> Trajectory:
    """The linearised trajectory (rows and per-turn drift decisions) of one
    session, from the envelopes of a log; for ``agentlog show``. The session's
    events are taken in order; other sessions' events are skipped."""
    trajectory: list[SessionTrajectory] = []

    def opened(lsn: int, sid: str, env: Envelope, life: SessionLife) -> Tracked:
        trajectory.append(SessionTrajectory(session_id, config.fork_threshold))
        return Tracked(life)

    def applied(session: Tracked, lsn: int, tag: str, env: Envelope) -> None:
        body, traj = env.body, trajectory[0]
        try:
            if isinstance(body, (TurnRecorded, TurnDelta)):
                traj.record_turn(body, lsn)
            elif isinstance(body, TurnUndelivered):
                traj.mark_undelivered(body.turn_index, body.reason, lsn)
        except TrajectoryError as exc:
            raise ReduceError(lsn, session_id, str(exc)) from None

    # One session, kept after its terminal event (anything later is refused); its LSNs are not checked.
    fold: SessionFold[Tracked] = SessionFold(
        opened=opened, applied=applied, refused=_refuse, unknown=_refuse_unknown,
        session_id=session_id, check_lsn=False, resync=False, evict=False,
    )
    for env in envelopes:
        fold.feed_envelope(env)
    if not trajectory:
        raise KeyError(f"session {session_id!r}: no session_opened in the log")
    return linearise(trajectory[0], config)
