"""The report's data: one streaming pass over the log, in bounded memory.

Every envelope goes through the lifecycle fold (:func:`reducers.lifecycle.reduce_lifecycle`,
which owns turns, tokens, rewards and terminal states) and the sample pipeline
(:class:`reducers.pipeline.Reducer`, for the token drill-down and the sample
digest). What the page draws is kept as fixed-size aggregates, never as a
list of every session:

* counts by outcome, abort and drop reasons (distinct reasons beyond
  ``MAX_REASONS`` are counted under "(other)");
* :class:`TimeSeries`: per time bin of session ends, outcomes, reward sum and
  solved count, turns and tokens; a fixed number of bins whose width doubles
  (neighbours merged) when the log outgrows them;
* per policy version (the oldest version that generated a session's turns):
  the same numbers;
* :class:`LogHistogram`: generation latency, command latency, turns and
  tokens per session, session duration; log-spaced buckets give quantiles;
* staleness at the end of each session: the newest policy version the log
  had shown by then minus the session's oldest version;
* ended sessions per health flag (:mod:`reducers.health`, from the sample
  reducer's outputs), and each table row's flags;
* a bounded sessions table (:class:`SessionTable`): the ``worst`` finished
  sessions by reward (a bounded heap), the first ``per_reason`` aborted
  sessions of each reason, and a seeded reservoir sample of the rest. Only
  those rows keep their samples, cut to what the drill-down shows.

Memory: the sessions in flight (as the lifecycle fold), the table, and the
aggregates above; nothing grows with the number of sessions ended.

A partitioned log is folded from its merged stream (``(partition, envelope)``
pairs) with one lifecycle fold and one sample reducer per partition (a
session never spans partitions, and LSNs rise within one only). The
aggregates are over all partitions; :attr:`ReportData.partitions` adds each
partition's events, sessions, outcomes and sample digest (the digest
``agentlog reconstruct`` gives for that partition alone).

This module owns the pass (:func:`collect`) and what it returns
(:class:`ReportData`); the aggregates are :mod:`agentlog.tools.report.aggregates`,
the sessions table :mod:`agentlog.tools.report.session_table`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

import msgspec

from agentlog.tools.cmd_show import SessionWhy
from agentlog.tools.lineage_view import SessionLineages, row_lineages

from .aggregates import LogHistogram, TimeSeries, Totals
from .session_table import MAX_REASONS, SessionRow, SessionTable, drill_sample

#: What reasons past the first MAX_REASONS distinct ones are counted under.
OTHER_REASON = "(other)"
#: Turns with tool calls kept per lineage of a session in flight, to name a subagent's spawning
#: call (a subagent is spawned by one of its parent's latest turns; memory stays bounded).
LINEAGE_CALL_TURNS = 8


class _Live:
    """What the report adds, per session in flight, to the lifecycle fold's track."""

    __slots__ = ("opened_version", "min_version", "why", "lineages")

    def __init__(self, opened_version: int) -> None:
        self.opened_version = opened_version
        #: What explains its score, gathered as its events pass (shown in the drill-down).
        self.why = SessionWhy()
        #: Its lineages (subagents) and the calls that spawned them, for the drill-down's columns.
        self.lineages = SessionLineages(keep_turns=LINEAGE_CALL_TURNS)
        #: The oldest policy version among the session's turns (None before its first turn).
        self.min_version: int | None = None

    @property
    def version(self) -> int:
        """The oldest version that generated the session (its open's version before any turn)."""
        return self.opened_version if self.min_version is None else self.min_version


class ReportData(msgspec.Struct):
    """Everything the page draws; its size does not depend on the number of sessions."""

    log: str
    events: int
    first_ns: int
    last_ns: int
    sessions: int
    outcomes: dict[str, int]  # finished / aborted / dropped / running / open
    abort_reasons: dict[str, int]
    drop_reasons: dict[str, int]
    reward: dict[str, float]  # count, mean, min, max over finished sessions with a usable reward
    groups: dict[str, int]  # released, skipped, pending, refilled (replacements), failures (aborts counted as such)
    time_bin_s: float
    over_time: list[tuple[float, Any]]  # (seconds since first event, Totals)
    by_version: list[tuple[int, Any]]  # (policy version, Totals)
    histograms: dict[str, Any]  # name -> LogHistogram
    staleness: dict[int, int]  # versions behind -> sessions
    table: list[SessionRow]
    table_limits: dict[str, int]
    learner: list[tuple[int, int, dict[str, float]]]  # (policy_version, step, metrics) from the learner log
    learner_log: str
    violations: list[str]
    violation_count: int
    reduce_problem: str
    sample_digest: str
    #: A partitioned log's partitions (``p0003`` -> events, sessions, each
    #: outcome, digest), every listed partition included; {} for one log.
    partitions: dict[str, dict[str, Any]] = {}
    #: Trained tokens (loss mask 1, removed samples left out) per policy version that generated them:
    #: per token, so a turn a weight update interrupted counts under each of its versions.
    trained_tokens_by_version: dict[int, int] = {}
    #: Ended sessions per health flag (every flag, 0 included; :data:`reducers.health.ALL_FLAGS` order).
    flags: dict[str, int] = {}
    #: The flags the run's reduce settings make untrainable (``ReduceConfig.untrainable_flags``).
    untrainable_flags: list[str] = []
    #: Ended sessions resumed at least once (``sessions``) and their resumes in all (``resumes``).
    resumed: dict[str, int] = {}


def _count_reason(counter: Counter, reason: str) -> None:
    if reason in counter or len(counter) < MAX_REASONS:
        counter[reason] += 1
    else:
        counter[OTHER_REASON] += 1


def collect(
    envelopes: Iterable[Any],
    log: str,
    *,
    worst: int = 20,
    per_reason: int = 3,
    sample: int = 30,
    seed: int = 0,
    learner: Iterable[Any] = (),
    learner_log: str = "",
    partitions: list[int] | None = None,
    config: Any = None,
    confirm_for: Any = None,
) -> ReportData:
    """Fold the envelopes (in LSN order) into :class:`ReportData`, in one pass.
    ``learner``: the learner log's envelopes (its PolicyUpdated records), when
    the report is of a run folder. ``partitions``: the partition ids of a
    partitioned log, whose ``envelopes`` are then ``(partition id, Envelope)``
    pairs in merged order (:func:`tools.cli_common.read_tagged`). ``config``: the
    ReduceConfig to fold samples and groups with (None: the reducers' defaults). ``confirm_for(pid)``:
    the ``confirm_used`` of partition ``pid``'s lifecycle fold (:func:`tools.cli_common.id_scans_of`);
    None: the id filter alone says an opening reuses an id."""
    from agentlog.events.schema.types import CommandRan, PolicyUpdated, SessionOpened
    from agentlog.reducers.lifecycle import LifecycleState, SessionSummary, Violation, reduce_lifecycle
    from agentlog.reducers.config import DEFAULT_CONFIG
    from agentlog.reducers.health import flag_counts
    from agentlog.reducers.pipeline import ReduceError, Reducer
    from agentlog.reducers.samples import resolve_reward

    from agentlog.tools.cli_common import record_id

    # One lifecycle fold and one reducer per partition (None: the one log): LSNs rise within a partition only.
    states: dict[int | None, LifecycleState] = {}
    reducers: dict[int | None, Reducer | None] = {}
    table = SessionTable(worst=worst, per_reason=per_reason, sample=sample, seed=seed)
    live: dict[tuple[int | None, str], _Live] = {}
    parts: dict[int, Counter[str]] = {q: Counter() for q in partitions or ()}
    pairs = ((None, env) for env in envelopes) if partitions is None else envelopes
    outcomes: Counter[str] = Counter()
    abort_reasons: Counter[str] = Counter()
    drop_reasons: Counter[str] = Counter()
    versions: dict[int, Any] = {}
    series: TimeSeries | None = None
    hist = {
        "generate_s": LogHistogram(1e-6, 1e5),
        "command_s": LogHistogram(1e-6, 1e5),
        "session_s": LogHistogram(1e-3, 1e6),
        "turns": LogHistogram(1, 1e4, 20),
        "tokens_out": LogHistogram(1, 1e8),
        "tokens_in": LogHistogram(1, 1e9),
    }
    staleness: Counter[int] = Counter()
    token_versions: Counter[int] = Counter()
    flag_count: Counter[str] = Counter()
    newest_version = 0
    reward_n, reward_sum, reward_lo, reward_hi = 0, 0.0, math.inf, -math.inf
    released = skipped = refilled = failures = 0
    resumed_sessions = resumes = 0
    violations: list[str] = []
    violation_count = 0
    problem = ""
    events = 0
    first_ns = last_ns = 0
    for pid, env in pairs:
        if events == 0:
            first_ns = env.ts_ns
            series = TimeSeries(first_ns)
        events += 1
        last_ns = env.ts_ns
        if pid is not None:
            parts.setdefault(pid, Counter())["events"] += 1
        body = env.body
        if isinstance(body, PolicyUpdated):
            newest_version = max(newest_version, body.policy_version)
            continue
        sid = env.session_id
        state = states.get(pid)
        if state is None:
            # Unknown event types shown, not interpreted (a newer writer's); a reused id confirmed by a scan.
            # Its reducer refuses a reused id as reconstruct's does, with the same scan confirming it.
            confirm = confirm_for(pid) if confirm_for is not None else None
            state = states[pid] = LifecycleState(tolerate_unknown=True, confirm_used=confirm)
            reducers[pid] = Reducer(config or DEFAULT_CONFIG, confirm_used=confirm)
        state, out = reduce_lifecycle(state, env)
        summary = None
        bad = False
        for o in out:
            if isinstance(o, Violation):
                bad = True
                violation_count += 1
                if len(violations) < 50:
                    violations.append(f"lsn {record_id(pid, o.lsn)}, session {o.session_id!r}: {o.message}")
            elif isinstance(o, SessionSummary):
                summary = o
        if not bad:
            if isinstance(body, SessionOpened):
                live[pid, sid] = _Live(body.policy_version)
                newest_version = max(newest_version, body.policy_version)
            lv = live.get((pid, sid))
            if lv is not None:
                lv.why.feed(env)  # what explains its score, for the drill-down
                lv.lineages.feed(env)
            # Fields any turn-like or command event carries (whatever its encoding): latency and version.
            if isinstance(body, CommandRan):
                hist["command_s"].add(body.duration_s)
            elif not isinstance(body, SessionOpened):
                gen = getattr(body, "generate_s", None)
                if gen is not None:
                    hist["generate_s"].add(gen)
                    version = getattr(body, "policy_version", 0)
                    newest_version = max(newest_version, version)
                    if lv is not None:
                        lv.min_version = version if lv.min_version is None else min(lv.min_version, version)
        samples: list[Any] = []
        ended_flags: dict[str, tuple[str, ...]] = {}
        reducer = reducers[pid]
        if reducer is not None:
            try:
                res = reducer.feed(env)
            except ReduceError as exc:
                problem = str(exc) if pid is None else f"p{pid:04d}: {exc}"
                reducers[pid] = None
            else:
                samples = res.samples
                ended_flags = res.flags
                for flags in ended_flags.values():
                    flag_count.update(flags)
                for smp in samples:
                    if not smp.remove_sample:
                        token_versions.update(smp.trained_tokens_by_version())
                for g in res.groups:
                    released += 1
                    skipped += bool(g.skipped)
                    refilled += len(g.replaced)
                    failures += sum(1 for m in g.members if m.status == "aborted" and m.valid)
        if summary is None:
            continue
        lv = live.pop((pid, sid), None)
        status = summary.status
        outcomes[status] += 1
        if pid is not None:
            parts[pid][status] += 1
        reward = None
        if status == "finished":
            reward, _ = resolve_reward(summary.reward)
            if reward is not None:
                reward_n += 1
                reward_sum += reward
                reward_lo, reward_hi = min(reward_lo, reward), max(reward_hi, reward)
        elif status == "aborted":
            _count_reason(abort_reasons, summary.reason)
        else:
            _count_reason(drop_reasons, summary.reason)
        version = lv.version if lv is not None else 0
        staleness[max(0, newest_version - version)] += 1
        series.at(env.ts_ns).add(status, reward, summary.turns, summary.tokens_in, summary.tokens_out)  # type: ignore[union-attr]
        versions.setdefault(version, Totals()).add(status, reward, summary.turns, summary.tokens_in, summary.tokens_out)
        hist["session_s"].add(summary.duration_s)
        resumed_sessions += bool(summary.resumes)
        resumes += summary.resumes
        hist["turns"].add(summary.turns)
        hist["tokens_out"].add(summary.tokens_out)
        hist["tokens_in"].add(summary.tokens_in)
        if table.wants(status, reward, summary.reason):
            mine = [s for s in samples if s.session_id == sid]
            row = SessionRow(
                summary.session_id, summary.group_id, summary.sample_index, status, "", summary.reason, summary.error,
                summary.opened_ts_ns, summary.ended_ts_ns, summary.turns, summary.tokens_in, summary.tokens_out,
                summary.reward, version, [drill_sample(s) for s in mine],
                partition="" if pid is None else f"p{pid:04d}",
                explain=lv.why.lines(False, lambda lsn: record_id(pid, lsn)) if lv is not None else [],
                flags=list(ended_flags.get(sid, ())), resumes=summary.resumes,
                lineages=lv.lineages.to_json(row_lineages(mine)) if lv is not None and lv.lineages.shown else [],
            )
            table.add(row, reward)
        else:
            # It cannot enter the table: offered only so that the reservoir counts it.
            table.add(SessionRow(summary.session_id, summary.group_id, summary.sample_index, status, "", summary.reason), reward)
    for pid, state in states.items():
        for t in state.live.values():
            outcomes[str(t.life.state)] += 1
            if pid is not None:
                parts[pid][str(t.life.state)] += 1
    # The one log's digest (an empty log's too); a partitioned log's are per partition.
    reducer = (reducers[None] if None in reducers else Reducer(config or DEFAULT_CONFIG)) if partitions is None else None
    learner_rows = [
        (env.body.policy_version, env.body.step, dict(env.body.metrics))
        for env in learner
        if isinstance(env.body, PolicyUpdated)
    ]
    opened = sum(outcomes.values())
    return ReportData(
        log=log,
        events=events,
        first_ns=first_ns,
        last_ns=last_ns,
        sessions=opened,
        outcomes={o: outcomes.get(o, 0) for o in ("finished", "aborted", "dropped", "running", "open")},
        abort_reasons=dict(abort_reasons.most_common()),
        drop_reasons=dict(drop_reasons.most_common()),
        reward={"count": reward_n, "mean": reward_sum / reward_n if reward_n else math.nan,
                "min": reward_lo if reward_n else math.nan, "max": reward_hi if reward_n else math.nan},
        groups={"released": released, "skipped": skipped, "refilled": refilled, "failures": failures,
                "pending": len({t.group_id for state in states.values() for t in state.live.values()})},
        time_bin_s=(series.width / 1e9) if series is not None else 0.0,
        over_time=series.used() if series is not None else [],
        by_version=sorted(versions.items()),
        histograms=hist,
        staleness=dict(sorted(staleness.items())),
        trained_tokens_by_version=dict(sorted(token_versions.items())),
        flags=flag_counts(flag_count),
        untrainable_flags=list((config or DEFAULT_CONFIG).untrainable_flags),
        resumed={"sessions": resumed_sessions, "resumes": resumes},
        table=table.rows(),
        table_limits={"worst": worst, "per_reason": per_reason, "sample": sample, "seed": seed},
        learner=learner_rows,
        learner_log=learner_log,
        violations=violations,
        violation_count=violation_count,
        reduce_problem=problem,
        sample_digest=reducer.digest.hexdigest() if reducer is not None else "",
        partitions={f"p{q:04d}": _partition_row(parts[q], reducers.get(q, Reducer(config or DEFAULT_CONFIG))) for q in sorted(parts)},
    )


def _partition_row(counts: Counter, reducer: Any) -> dict[str, Any]:
    """One partition's row: events, sessions, each outcome, sample digest ("" when its reducer stopped)."""
    row: dict[str, Any] = {"events": counts["events"], "sessions": sum(counts[o] for o in ("finished", "aborted", "dropped", "running", "open"))}
    row.update({o: counts[o] for o in ("finished", "aborted", "dropped", "running", "open")})
    row["digest"] = reducer.digest.hexdigest() if reducer is not None else ""
    return row
