"""Run statistics over a log, in one cheap pass: the fold behind ``agentlog
stats`` and ``agentlog tail --summary``.

A pure, incremental fold. It counts sessions by state (live ones too), abort
and drop reasons, turns and tokens, commands, sandbox snapshots and
resumes (a resumed session is one session: counted once, its resumes
beside it), rewards (through
:class:`reducers.metrics.MetricsAccumulator`, finished sessions only) and
GRPO groups (through :class:`reducers.groups.GroupTracker`: released,
complete, skipped, pending), the health flags of each ended session
(:class:`reducers.health.SessionHealth`, the one rule), and the time span. Every record goes through
the one fold driver (:class:`reducers.fold.SessionFold`) and its lifecycle and sequence step
(:func:`reducers.lifecycle_step.evolve`: ``session_seq`` gaps and repeats,
events after the terminal one, illegal moves, reused ids); this fold counts
a violation (by kind, the first few kept with LSN and session), does not
apply the record, and carries on (:func:`reducers.lifecycle_step.resync`).

Why not the full reducers: statistics need no trajectories, and decoding
every chat message of every turn dominates the cost on a big log. So this
fold also accepts a *projection* of each body: :func:`decode_projection`
decodes a raw payload into small Structs carrying only the fields the
statistics need (msgspec skips the rest without building Python objects).
The projection is a view of schema v1 from :mod:`events.schema.types`: same tags,
same field names (a test checks that every projected field exists there); the
two turn projections are built from the schema's turn bodies themselves, so a
new turn field needs no change here.
Full event bodies are accepted as well (``feed``), with identical results.
A turn's projection comes with its stored bytes (``feed_record``'s
``payload``, required for it): the health flags keep a session's turns until
it ends, each as its new tokens and messages only (a stored ``turn_delta``,
:class:`reducers.health.SessionHealth`), and only a session some turn of
which does not extend the turn before is decoded in full and linearised,
for its ``drift`` flag.
Events of a type this version does not know (a newer writer's
:class:`events.schema.types.UnknownEvent`) are counted per tag, not interpreted.

No clock, randomness, I/O or torch. Memory is bounded by the sessions and
groups still in flight.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Union

import msgspec

from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.turn import TurnDelta, TurnRecorded
from agentlog.events.schema.types import Envelope, UnknownEvent, as_unknown_event, decode_deep

from .config import DEFAULT_CONFIG, ReduceConfig
from .fold import ConfirmUsed, SessionFold
from .lifecycle import IdFilter
from .lifecycle_step import SessionLife, Violation, ViolationKind
from .groups import ABORTED, DROPPED, FINISHED, Group, GroupError, GroupTracker
from .health import SessionHealth, flag_counts
from .metrics import MetricsAccumulator
from .outcome import session_outcome

__all__ = ["RunStats", "decode_projection", "PROJECTED_FIELDS"]


# ---------------------------------------------------------------- projection of schema v1


# Big fields the statistics never read are declared ``msgspec.Raw``: msgspec
# then only delimits them, about 2x faster than skipping an undeclared field.
_RAW = msgspec.Raw(b"")


class _Opened(msgspec.Struct, tag="session_opened"):
    group_id: str
    group_size: int
    sample_index: int = 0
    prompt: msgspec.Raw = _RAW
    metadata: msgspec.Raw = _RAW
    replaces: str = ""


class _Started(msgspec.Struct, tag="session_started"):
    pass


def _turn_projection(body: type[msgspec.Struct], read: dict[str, Any]) -> Any:
    """The projection of a schema turn body: the fields the statistics read,
    typed as in ``read``, and every other field of the body (a turn field
    added since included) declared Raw, so it is delimited, never decoded."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(body):
        if f.name not in read:
            fields.append((f.name, msgspec.Raw, _RAW))
        elif f.required:
            fields.append((f.name, read[f.name]))
        else:
            fields.append((f.name, read[f.name], f.default))
    return msgspec.defstruct("_" + body.__name__, fields, tag=body.__struct_config__.tag, module=__name__)


_TURN_READ = {"turn_index": int, "output_ids": bytes, "finish_reason": str, "policy_version": int,
              "version_spans": tuple[tuple[int, int], ...] | msgspec.UnsetType}
_Turn = _turn_projection(TurnRecorded, {**_TURN_READ, "prompt_ids": bytes})
_Delta = _turn_projection(TurnDelta, {**_TURN_READ, "shared_tokens": int, "new_prompt_ids": bytes})


class _Undelivered(msgspec.Struct, tag="turn_undelivered"):
    turn_index: int


class _Command(msgspec.Struct, tag="command_ran"):
    command: msgspec.Raw = _RAW
    exit_code: int | None = None
    budget_exceeded: bool = False
    output_tail: msgspec.Raw = _RAW


class _Teacher(msgspec.Struct, tag="teacher_scored"):
    turn_index: int = 0
    log_probs: msgspec.Raw = _RAW
    error: str = ""


class _Snapshot(msgspec.Struct, tag="sandbox_snapshotted"):
    turn_index: int = 0
    bytes: int = 0
    new_bytes: int = 0
    seconds: float = 0.0


class _Resumed(msgspec.Struct, tag="session_resumed"):
    incarnation: int = 0


class _Reward(msgspec.Struct, tag="reward_assigned"):
    reward: Any = None


class _Finished(msgspec.Struct, tag="session_finished"):
    reward: Any = None


class _Aborted(msgspec.Struct, tag="session_aborted"):
    reason: str = ""
    error: msgspec.Raw = _RAW
    traceback: msgspec.Raw = _RAW
    refill: bool = False


class _Dropped(msgspec.Struct, tag="session_dropped"):
    reason: str = ""


class _Policy(msgspec.Struct, tag="policy_updated"):
    step: int = 0
    policy_version: int = 0


_PROJECTIONS = (_Opened, _Started, _Turn, _Delta, _Undelivered, _Command, _Teacher, _Snapshot, _Resumed, _Reward, _Finished,
                _Aborted, _Dropped, _Policy)
_projection_decoder = msgspec.msgpack.Decoder(Union[_PROJECTIONS])  # type: ignore[valid-type]

#: tag -> the field names the projection reads (checked against events.schema.types by a test).
PROJECTED_FIELDS: dict[str, tuple[str, ...]] = {p.__struct_config__.tag: p.__struct_fields__ for p in _PROJECTIONS}


_decode_known = _projection_decoder.decode


def decode_projection(payload: Any) -> Any:
    """Decode a raw event payload into its statistics projection (only the
    fields :class:`RunStats` reads), or an UnknownEvent for a tag this
    version does not know. Raises msgspec.ValidationError for a known tag
    whose fields do not decode, msgspec.DecodeError for a payload that is not
    an event."""
    try:
        return _decode_known(payload)
    except msgspec.ValidationError:
        unknown = as_unknown_event(payload)  # only on failure: the common path pays nothing
        if unknown is None:
            raise
        return unknown
    except RecursionError:  # as decode_body: again on a fresh stack, else a DecodeError
        return decode_deep(_decode_known, payload)


_STATUS_OF = {State.FINISHED: FINISHED, State.ABORTED: ABORTED, State.DROPPED: DROPPED}


class _Live:
    __slots__ = ("life", "group_id", "sample_index", "turns", "tokens_out", "reward", "opened_ts", "health", "resumed")

    def __init__(self, life: SessionLife, body: Any, ts_ns: int, health: SessionHealth) -> None:
        self.life = life
        self.group_id = body.group_id
        self.sample_index = body.sample_index
        self.turns = 0
        self.tokens_out = 0
        self.reward: Any = None
        self.opened_ts = ts_ns
        self.health = health
        self.resumed = False


class RunStats:
    """Incremental run statistics. ``feed(envelope)`` or ``feed_record(lsn,
    session_id, session_seq, ts_ns, body)`` with a full body or a projection;
    ``snapshot()`` gives plain data (JSON-ready; NaN where nothing was measured)."""

    #: Violations kept verbatim (the count covers all).
    KEEP_VIOLATIONS = 10
    #: Recently ended sessions remembered, to tell "after its terminal event" from "never opened".
    ENDED_WINDOW = 4096

    def __init__(self, config: ReduceConfig = DEFAULT_CONFIG, *, confirm_used: ConfirmUsed | None = None) -> None:
        """``confirm_used``: as :class:`~agentlog.reducers.pipeline.Reducer`'s: with it, an id
        filter over every session opened also counts a reuse of an id that ended long ago."""
        #: How groups and rewards are counted: ``min_valid``, ``reward_key``, ``solve_threshold``
        #: and the abort classes' outcomes (a failure joins its group's baseline).
        self.config = config
        self.reward_key = config.reward_key
        self._fold: SessionFold[_Live] = SessionFold(
            opened=self._opened, applied=self._applied, ended=self._terminal, refused=self._violation,
            learner=self._learner, unknown=self._unknown, ended_window=self.ENDED_WINDOW,
            ids=None if confirm_used is None else IdFilter(), confirm_used=confirm_used,
        )
        self._groups = GroupTracker(config.min_valid)
        #: Called with each group as it is released (after the metrics count it).
        self.on_group: Callable[[Group], None] | None = None
        self.metrics = MetricsAccumulator(config.reward_key, config.solve_threshold)
        self.events = 0
        self.first_lsn = -1
        self.first_ts_ns: int | None = None
        self.last_ts_ns: int | None = None
        self.tokens_in = 0
        self.tokens_out = 0
        self.turns = 0
        self.undelivered = 0
        self.interrupted = 0  # turns made by more than one policy version (partial rollouts)
        self.finish_reasons: Counter[str] = Counter()
        self.commands = 0
        self.commands_failed = 0
        self.commands_over_budget = 0
        self.teacher_scored = 0
        self.teacher_failed = 0
        #: Sandbox snapshots (count, bytes, bytes new to the store, seconds the turns waited for them).
        self.snapshots = 0
        self.snapshot_bytes = 0
        self.snapshot_new_bytes = 0
        self.snapshot_seconds = 0.0
        #: Resumes (``session_resumed``: a new incarnation took over) and the sessions resumed at least once.
        self.resumes = 0
        self.sessions_resumed = 0
        #: Per-sample refill: aborts that owed their group a replacement, and replacements opened.
        self.refills_owed = 0
        self.replacements = 0
        #: Aborted members counted as failures by their abort class.
        self.aborted_as_failures = 0
        #: Ended sessions per health flag (:mod:`reducers.health`), and members those flags made untrainable.
        self.flags: Counter[str] = Counter()
        self.untrainable = 0
        self._payload: Any = None  # the stored bytes of the record being folded, when given
        self.policy_updates = 0
        self.policy_version: int | None = None
        self.opened = 0
        self.duration_sum_s = 0.0
        self.duration_max_s = 0.0
        self.ended = 0
        self.groups_skipped = 0
        self.violation_count = 0
        self.violations: list[Violation] = []
        self.violation_kinds: Counter[str] = Counter()
        #: Events of types this version does not know (a newer writer's), by tag.
        self.unknown_events: Counter[str] = Counter()

    @classmethod
    def of(cls, config: ReduceConfig, confirm_used: ConfirmUsed | None = None) -> "RunStats":
        """Statistics that count groups and rewards as ``config`` says (a run's own
        ``min_valid``, ``reward_key`` and ``solve_threshold``); ``confirm_used``: see :meth:`__init__`."""
        return cls(config, confirm_used=confirm_used)

    # ------------------------------------------------------------------ feed

    def feed(self, env: Envelope) -> None:
        """Fold one decoded envelope."""
        self.feed_record(env.lsn, env.session_id, env.session_seq, env.ts_ns, env.body)

    def _violation(self, violation: Violation) -> None:
        self.violation_count += 1
        self.violation_kinds[violation.kind.value] += 1
        if len(self.violations) < self.KEEP_VIOLATIONS:
            self.violations.append(violation)

    @property
    def last_lsn(self) -> int:
        """The highest LSN folded (-1 before any)."""
        return self._fold.next_lsn - 1

    def feed_record(self, lsn: int, session_id: str, session_seq: int, ts_ns: int, body: Any,
                    payload: bytes | memoryview | None = None) -> None:
        """Fold one record; ``body`` is a schema-v1 body or its projection. ``payload``:
        the record's stored bytes, which a turn's projection needs (a session whose turns
        do not extend each other is linearised from them for its ``drift`` flag): a turn's
        projection without them raises TypeError naming the LSN and session, folding nothing."""
        if payload is None and (type(body) is _Turn or type(body) is _Delta):
            raise TypeError(f"RunStats.feed_record: lsn {lsn}, session {session_id!r}: a {body.__struct_config__.tag} projection "
                            "needs its payload (the record's stored bytes), which the session's drift flag may be decided from")
        self.events += 1
        self._payload = payload
        if self.first_lsn < 0:
            self.first_lsn = lsn
        if self.first_ts_ns is None:
            self.first_ts_ns = ts_ns
        self.last_ts_ns = ts_ns
        if type(body) is UnknownEvent:
            self._fold.feed(lsn, session_id, session_seq, body.tag, body, True)  # counted; checked for sequence only
        else:
            self._fold.feed(lsn, session_id, session_seq, body.__struct_config__.tag, body)

    # -- the fold's hooks

    def _unknown(self, lsn: int, session_id: str, tag: str) -> None:
        self.unknown_events[tag] += 1

    def _learner(self, body: Any) -> None:
        self.policy_updates += 1
        self.policy_version = body.policy_version

    def _opened(self, lsn: int, session_id: str, body: Any, life: SessionLife) -> _Live | None:
        try:
            self._groups.open(body.group_id, session_id, body.group_size, body.sample_index, lsn, body.replaces)
        except GroupError as exc:
            self._violation(Violation(lsn, session_id, ViolationKind.GROUP_CONFLICT, str(exc)))
            return None
        self.opened += 1
        if body.replaces:
            self.replacements += 1
        return _Live(life, body, self.last_ts_ns, SessionHealth(session_id, self.config, keep_turns=True))  # type: ignore[arg-type]

    def _applied(self, live: _Live, lsn: int, tag: str, body: Any) -> None:
        live.health.observe(tag, body, self._payload)
        if tag == "turn_recorded" or tag == "turn_delta":
            n_out = len(body.output_ids) // 4
            self.turns += 1
            live.turns += 1
            live.tokens_out += n_out
            # The prompt a delta stands for: the part it shares plus its new tokens.
            self.tokens_in += len(body.prompt_ids) // 4 if tag == "turn_recorded" else body.shared_tokens + len(body.new_prompt_ids) // 4
            self.tokens_out += n_out
            self.finish_reasons[body.finish_reason] += 1
            if body.version_spans is not msgspec.UNSET:
                self.interrupted += 1
        elif tag == "turn_undelivered":
            self.undelivered += 1
        elif tag == "command_ran":
            self.commands += 1
            if body.exit_code != 0:
                self.commands_failed += 1
            if body.budget_exceeded:
                self.commands_over_budget += 1
        elif tag == "teacher_scored":
            if body.error:
                self.teacher_failed += 1
            else:
                self.teacher_scored += 1
        elif tag == "sandbox_snapshotted":
            self.snapshots += 1
            self.snapshot_bytes += body.bytes
            self.snapshot_new_bytes += body.new_bytes
            self.snapshot_seconds += body.seconds
        elif tag == "session_resumed":
            self.resumes += 1
            if not live.resumed:
                live.resumed = True
                self.sessions_resumed += 1
        elif tag == "reward_assigned":
            live.reward = body.reward

    def _terminal(self, live: _Live, lsn: int, sid: str, dest: State, body: Any) -> None:
        status = _STATUS_OF[dest]
        self.ended += 1
        duration = (self.last_ts_ns - live.opened_ts) / 1e9  # type: ignore[operator]
        self.duration_sum_s += duration
        self.duration_max_s = max(self.duration_max_s, duration)
        flags = live.health.flags()
        self.flags.update(flags)
        # The pipeline's rule (reducers.outcome): a member its flags make untrainable is out of the baseline.
        outcome = session_outcome(body, live.reward, flags, self.config)
        if outcome.untrainable:
            self.untrainable += 1
        member = outcome.member(sid, live.sample_index)
        if status == ABORTED:
            if body.refill is True:
                self.refills_owed += 1
            elif outcome.in_baseline:
                self.aborted_as_failures += 1
        self.metrics.observe_session(status, reason=outcome.end_reason, reward=outcome.raw_reward, turns=live.turns,
                                     output_tokens=live.tokens_out)
        group = self._groups.close(live.group_id, member, sid, lsn, refill=status == ABORTED and body.refill is True,
                                   drop_reason=body.reason if status == DROPPED else "")
        if group is not None:
            self.metrics.observe_group(group)
            if self.on_group is not None:
                self.on_group(group)

    # --------------------------------------------------------------- results

    def live_by_state(self) -> dict[str, int]:
        """Sessions in flight, by state (open / running)."""
        c = Counter(str(s.life.state) for s in self._fold.live.values())
        return {"open": c.get("open", 0), "running": c.get("running", 0)}

    def snapshot(self) -> dict[str, Any]:
        """Everything, as plain data."""
        m = self.metrics.snapshot()
        by_status = m["sessions/by_status"]
        live = self.live_by_state()
        span = None
        if self.first_ts_ns is not None and self.last_ts_ns is not None:
            span = {
                "first_ts_ns": self.first_ts_ns,
                "last_ts_ns": self.last_ts_ns,
                "seconds": (self.last_ts_ns - self.first_ts_ns) / 1e9,
            }
        pending = self._groups.pending()
        return {
            "events": self.events,
            "lsn_first": self.first_lsn,
            "lsn_last": self.last_lsn,
            "time_span": span,
            "sessions": {
                "total": self.opened,
                "finished": by_status.get(FINISHED, 0),
                "aborted": by_status.get(ABORTED, 0),
                "dropped": by_status.get(DROPPED, 0),
                "open": live["open"],
                "running": live["running"],
                "duration_mean_s": self.duration_sum_s / self.ended if self.ended else math.nan,
                "duration_max_s": self.duration_max_s if self.ended else math.nan,
                "resumed": self.sessions_resumed,
                "resumes": self.resumes,
            },
            "abort_reasons": m["sessions/abort_reasons"],
            "drop_reasons": m["sessions/drop_reasons"],
            "turns": {
                "total": self.turns,
                "mean_per_session": self.turns / self.opened if self.opened else math.nan,
                "undelivered": self.undelivered,
                "interrupted": self.interrupted,
                "finish_reasons": dict(sorted(self.finish_reasons.items())),
            },
            "tokens": {"prompt": self.tokens_in, "output": self.tokens_out},
            "commands": {"total": self.commands, "failed": self.commands_failed, "over_budget": self.commands_over_budget},
            "teacher": {"scored_turns": self.teacher_scored, "failed_turns": self.teacher_failed},
            "snapshots": {"count": self.snapshots, "bytes": self.snapshot_bytes, "new_bytes": self.snapshot_new_bytes,
                          "seconds": self.snapshot_seconds},
            "reward": {
                "count": m["rollout/reward_count"],
                "mean": m["rollout/reward_mean"],
                "std": m["rollout/reward_std"],
                "min": m["rollout/reward_min"],
                "max": m["rollout/reward_max"],
                "unusable": m["rollout/reward_bad"],
            },
            "groups": {
                "released": m["groups/released"],
                "complete": m["groups/released"] - m["groups/skipped"],
                "skipped": m["groups/skipped"],
                "pending": len(pending),
                "skip_reasons": m["groups/skip_reasons"],
                "solve_rate_mean": m["groups/solve_rate_mean"],
                "refills_owed": self.refills_owed,
                "replacements": self.replacements,
                "aborted_as_failures": self.aborted_as_failures,
                "untrainable_by_flags": self.untrainable,
            },
            "flags": flag_counts(self.flags),
            "policy": {"updates": self.policy_updates, "version": self.policy_version},
            "unknown_events": dict(sorted(self.unknown_events.items())),
            "violations": {
                "count": self.violation_count,
                "by_kind": dict(sorted(self.violation_kinds.items())),
                "first": [
                    {"lsn": v.lsn, "session_id": v.session_id, "kind": v.kind.value, "message": v.message} for v in self.violations
                ],
            },
        }

