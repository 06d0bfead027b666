"""The report's fixed-size aggregates over ended sessions: :class:`Totals`
(outcome counts, reward sum and solved count, turns and tokens of a set of
sessions), :class:`TimeSeries` (Totals per time bin of session ends, in a
fixed number of bins whose width doubles as the log grows) and
:class:`LogHistogram` (log-spaced buckets, from which quantiles come).
None of them grows with the number of sessions;
:func:`agentlog.tools.report.data.collect` fills them.
"""

from __future__ import annotations

import math

#: Bins of the time series (their width doubles as the log grows).
TIME_BINS = 120
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
