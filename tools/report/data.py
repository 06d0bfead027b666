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
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from typing import Any, Iterable

import msgspec

from agentlog.tools.cmd_show import SessionWhy

#: Bins of the time series (their width doubles as the log grows).
TIME_BINS = 120
#: Distinct abort / drop reasons counted by name; the rest go to "(other)".
MAX_REASONS = 40
OTHER_REASON = "(other)"
#: Response tokens kept per drill-down row (and prompt tokens at each end).
DRILL_RESPONSE_TOKENS = 4000
DRILL_PROMPT_HEAD = 32
DRILL_PROMPT_TAIL = 16
#: Sessions with this reward or more count as solved (as reducers.metrics).
SOLVE_THRESHOLD = 1.0


class LogHistogram:
    """Counts in log-spaced buckets from ``lo`` to ``hi`` (``per_decade``
    buckets a decade), plus one for values below ``lo`` (zero included)
    and one above ``hi``; exact count, sum, min and max. Quantiles come from
    the buckets (geometric bucket midpoint, so within one bucket's width)."""

    __slots__ = ("lo", "hi", "per_decade", "counts", "n", "total", "min", "max")

    def __init__(self, lo: float, hi: float, per_decade: int = 10) -> None:
        self.lo, self.hi, self.per_decade = lo, hi, per_decade
        self.counts = [0] * (int(round(math.log10(hi / lo) * per_decade)) + 2)
        self.n = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float) -> None:
        """Count one value (NaN is ignored)."""
        if value != value:
            return
        self.n += 1
        self.total += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)
        if value < self.lo:
            i = 0
        elif value >= self.hi:
            i = len(self.counts) - 1
        else:
            i = 1 + int(math.log10(value / self.lo) * self.per_decade)
            i = min(i, len(self.counts) - 2)
        self.counts[i] += 1

    def edges(self, i: int) -> tuple[float, float]:
        """The [low, high) value range of bucket ``i``."""
        if i == 0:
            return (min(self.min, 0.0) if self.n else 0.0, self.lo)
        if i == len(self.counts) - 1:
            return (self.hi, max(self.max, self.hi))
        step = 10 ** (1 / self.per_decade)
        return (self.lo * step ** (i - 1), self.lo * step**i)

    def quantile(self, q: float) -> float:
        """An estimate of the ``q`` quantile (NaN when empty), clamped to [min, max]."""
        if not self.n:
            return math.nan
        target = q * (self.n - 1)
        seen = 0
        for i, c in enumerate(self.counts):
            if c and seen + c > target:
                a, b = self.edges(i)
                mid = math.sqrt(a * b) if a > 0 else (a + b) / 2
                return min(max(mid, self.min), self.max)
            seen += c
        return self.max

    def mean(self) -> float:
        """The exact mean (NaN when empty)."""
        return self.total / self.n if self.n else math.nan

    def buckets(self) -> list[tuple[float, float, int]]:
        """Non-empty buckets as (low, high, count)."""
        return [(*self.edges(i), c) for i, c in enumerate(self.counts) if c]


class Totals:
    """Sums over a set of ended sessions: a time bin or a policy version."""

    __slots__ = ("finished", "aborted", "dropped", "rewarded", "reward_sum", "solved", "turns", "tokens_in", "tokens_out", "sessions")

    def __init__(self) -> None:
        self.finished = self.aborted = self.dropped = 0
        self.rewarded = 0
        self.reward_sum = 0.0
        self.solved = 0
        self.turns = self.tokens_in = self.tokens_out = self.sessions = 0

    def add(self, status: str, reward: float | None, turns: int, tokens_in: int, tokens_out: int) -> None:
        """Count one ended session."""
        self.sessions += 1
        setattr(self, status, getattr(self, status) + 1)
        if reward is not None:
            self.rewarded += 1
            self.reward_sum += reward
            self.solved += reward >= SOLVE_THRESHOLD
        self.turns += turns
        self.tokens_in += tokens_in
        self.tokens_out += tokens_out

    def merge(self, other: "Totals") -> None:
        """Add ``other``'s sums to these."""
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.rewarded if self.rewarded else math.nan

    @property
    def solve_rate(self) -> float:
        return self.solved / self.rewarded if self.rewarded else math.nan


class TimeSeries:
    """:class:`Totals` per time bin of session ends, in at most ``bins`` bins
    from the first event: when a time falls past the last bin, neighbouring
    bins are merged pairwise and the width doubles, so memory stays fixed and
    the bins always cover the whole log."""

    def __init__(self, t0_ns: int, bins: int = TIME_BINS, width_ns: int = 1_000_000) -> None:
        self.t0 = t0_ns
        self.width = width_ns
        self.bins: list[Totals] = [Totals() for _ in range(bins)]

    def at(self, ts_ns: int) -> Totals:
        """The bin holding ``ts_ns`` (growing the width as needed)."""
        i = max(0, ts_ns - self.t0) // self.width
        while i >= len(self.bins):
            n = len(self.bins)
            merged = []
            for k in range(0, n, 2):
                a = self.bins[k]
                if k + 1 < n:
                    a.merge(self.bins[k + 1])
                merged.append(a)
            merged.extend(Totals() for _ in range(n - len(merged)))
            self.bins = merged
            self.width *= 2
            i = max(0, ts_ns - self.t0) // self.width
        return self.bins[i]

    def used(self) -> list[tuple[float, Totals]]:
        """(bin start in seconds since t0, totals) up to the last non-empty bin."""
        last = max((i for i, b in enumerate(self.bins) if b.sessions), default=-1)
        return [(i * self.width / 1e9, self.bins[i]) for i in range(last + 1)]


class DrillSample(msgspec.Struct):
    """One sample, cut to what the drill-down shows."""

    row_index: int
    status: str
    remove_sample: bool
    reward: float
    response_length: int
    trained: int
    prompt_length: int
    prompt_head: list[int]
    prompt_tail: list[int]
    response: list[int]
    mask: list[int]
    #: Per shown response token: the rollout log-prob, and the teacher's (None where no teacher scored it).
    rollout_lp: list[float] = []
    teacher_lp: list[float | None] = []


def drill_sample(s: Any) -> DrillSample:
    """Cut a :class:`reducers.samples.Sample` to a :class:`DrillSample`."""
    toks = s.token_ids
    n_prompt = s.prompt_length
    mask = s.mask
    prompt = toks[:n_prompt]
    if n_prompt > DRILL_PROMPT_HEAD + DRILL_PROMPT_TAIL * 3:
        head, tail = prompt[:DRILL_PROMPT_HEAD].tolist(), prompt[-DRILL_PROMPT_TAIL:].tolist()
    else:
        head, tail = prompt.tolist(), []
    return DrillSample(
        row_index=s.row_index, status=s.status, remove_sample=s.remove_sample, reward=float(s.reward),
        response_length=s.response_length, trained=int(mask.sum()), prompt_length=n_prompt,
        prompt_head=head, prompt_tail=tail,
        response=toks[n_prompt : n_prompt + DRILL_RESPONSE_TOKENS].tolist(), mask=mask[:DRILL_RESPONSE_TOKENS].tolist(),
        rollout_lp=[round(float(x), 4) for x in s.log_probs[:DRILL_RESPONSE_TOKENS]],
        teacher_lp=([round(float(x), 4) if ok else None for x, ok in zip(s.teacher_lp[:DRILL_RESPONSE_TOKENS], s.teacher_mask)]
                    if s.teacher_scored else []),
    )


class SessionRow(msgspec.Struct):
    """One row of the sessions table."""

    session_id: str
    group_id: str
    sample_index: int
    status: str  # finished / aborted / dropped / open / running
    why: str  # worst / aborted / sample / in flight
    reason: str = ""
    error: str = ""
    opened_ns: int = 0
    ended_ns: int | None = None
    turns: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    reward: Any = None
    policy_version: int = 0
    samples: list[DrillSample] = []
    #: Its partition (``p0003``) in a partitioned log, else "".
    partition: str = ""
    #: Why it scored so, as ``agentlog show`` says it (:class:`tools.cmd_show.SessionWhy`): label, reward
    #: and its source, verifier detail, the test command's output, traceback.
    explain: list[str] = []


class SessionTable:
    """The bounded sessions table, filled as sessions end.

    ``worst``: the finished sessions with the lowest reward (a max-heap of
    size ``worst``; a later session replaces a kept one only when strictly
    lower, so ties keep the first). ``per_reason``: the first aborted
    sessions of each abort reason (for at most MAX_REASONS reasons).
    ``sample``: a reservoir sample (Algorithm R, seeded) over every other
    ended session, so each is equally likely to be shown."""

    def __init__(self, *, worst: int = 20, per_reason: int = 3, sample: int = 30, seed: int = 0) -> None:
        self.worst_n, self.per_reason_n, self.sample_n = worst, per_reason, sample
        self._worst: list[tuple[float, int, SessionRow]] = []  # (-reward, -order, row)
        self._aborted: dict[str, list[SessionRow]] = {}
        self._sample: list[SessionRow] = []
        self._seen_for_sample = 0
        self._rng = random.Random(seed)
        #: The reservoir's draw for the next session offered to it: made by wants() or _offer_sample(), used once.
        self._peek: int | None = None
        self._order = 0

    def wants(self, status: str, reward: float | None, reason: str) -> bool:
        """Whether a session ending like this could enter the table now (so
        the caller cuts its samples only when they may be shown)."""
        if status == "finished" and reward is not None and self.worst_n:
            if len(self._worst) < self.worst_n or reward < -self._worst[0][0]:
                return True
        if status == "aborted" and self.per_reason_n:
            kept = self._aborted.get(reason)
            if kept is None and len(self._aborted) < MAX_REASONS or kept is not None and len(kept) < self.per_reason_n:
                return True
        return self.sample_n > 0 and (
            self._seen_for_sample < self.sample_n or self._rng_peek() < self.sample_n
        )

    def _rng_peek(self) -> int:
        if self._peek is None:
            self._peek = self._rng.randrange(self._seen_for_sample + 1)
        return self._peek

    def add(self, row: SessionRow, reward: float | None) -> None:
        """Offer an ended session to the table."""
        self._order += 1
        if row.status == "finished" and reward is not None and self.worst_n:
            item = (-reward, -self._order, row)
            if len(self._worst) < self.worst_n:
                heapq.heappush(self._worst, item)
                row.why = "worst"
                return
            if reward < -self._worst[0][0]:
                out = heapq.heapreplace(self._worst, item)[2]
                row.why = "worst"
                self._offer_sample(out)
                return
        if row.status == "aborted" and self.per_reason_n:
            kept = self._aborted.get(row.reason)
            if kept is None and len(self._aborted) < MAX_REASONS:
                kept = self._aborted[row.reason] = []
            if kept is not None and len(kept) < self.per_reason_n:
                row.why = "aborted"
                kept.append(row)
                return
        self._offer_sample(row)

    def _offer_sample(self, row: SessionRow) -> None:
        if not self.sample_n:
            return
        row.why = "sample"
        if self._seen_for_sample < self.sample_n:
            self._sample.append(row)
        else:
            j = self._rng_peek()
            if j < self.sample_n:
                self._sample[j] = row
        self._peek = None
        self._seen_for_sample += 1

    def rows(self) -> list[SessionRow]:
        """The table: worst first (lowest reward), then aborted by reason, then the sample."""
        worst = [r for _, _, r in sorted(self._worst, key=lambda t: (-t[0], -t[1]))]
        aborted = [r for reason in sorted(self._aborted) for r in self._aborted[reason]]
        sample = sorted(self._sample, key=lambda r: (r.opened_ns, r.session_id))
        return worst + aborted + sample


class _Live:
    """What the report adds, per session in flight, to the lifecycle fold's track."""

    __slots__ = ("opened_version", "min_version", "why")

    def __init__(self, opened_version: int) -> None:
        self.opened_version = opened_version
        #: What explains its score, gathered as its events pass (shown in the drill-down).
        self.why = SessionWhy()
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
    groups: dict[str, int]  # released, skipped, pending
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
) -> ReportData:
    """Fold the envelopes (in LSN order) into :class:`ReportData`, in one pass.
    ``learner``: the learner log's envelopes (its PolicyUpdated records), when
    the report is of a run folder. ``partitions``: the partition ids of a
    partitioned log, whose ``envelopes`` are then ``(partition id, Envelope)``
    pairs in merged order (:func:`tools.cli_common.read_tagged`). ``config``: the
    ReduceConfig to fold samples and groups with (None: the reducers' defaults)."""
    from agentlog.events.schema.types import CommandRan, PolicyUpdated, SessionOpened
    from agentlog.reducers.lifecycle import LifecycleState, SessionSummary, Violation, reduce_lifecycle
    from agentlog.reducers.config import DEFAULT_CONFIG
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
    newest_version = 0
    reward_n, reward_sum, reward_lo, reward_hi = 0, 0.0, math.inf, -math.inf
    released = skipped = 0
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
            state = states[pid] = LifecycleState(tolerate_unknown=True)  # shown, not interpreted: a newer writer's event types
            reducers[pid] = Reducer(config or DEFAULT_CONFIG)
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
        reducer = reducers[pid]
        if reducer is not None:
            try:
                res = reducer.feed(env)
            except ReduceError as exc:
                problem = str(exc) if pid is None else f"p{pid:04d}: {exc}"
                reducers[pid] = None
            else:
                samples = res.samples
                for g in res.groups:
                    released += 1
                    skipped += bool(g.skipped)
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
        hist["turns"].add(summary.turns)
        hist["tokens_out"].add(summary.tokens_out)
        hist["tokens_in"].add(summary.tokens_in)
        if table.wants(status, reward, summary.reason):
            row = SessionRow(
                summary.session_id, summary.group_id, summary.sample_index, status, "", summary.reason, summary.error,
                summary.opened_ts_ns, summary.ended_ts_ns, summary.turns, summary.tokens_in, summary.tokens_out,
                summary.reward, version, [drill_sample(s) for s in samples if s.session_id == sid],
                partition="" if pid is None else f"p{pid:04d}",
                explain=lv.why.lines(False, lambda lsn: record_id(pid, lsn)) if lv is not None else [],
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
        groups={"released": released, "skipped": skipped,
                "pending": len({t.group_id for state in states.values() for t in state.live.values()})},
        time_bin_s=(series.width / 1e9) if series is not None else 0.0,
        over_time=series.used() if series is not None else [],
        by_version=sorted(versions.items()),
        histograms=hist,
        staleness=dict(sorted(staleness.items())),
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
