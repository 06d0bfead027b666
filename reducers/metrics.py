"""Run metrics that never crash on odd rewards.

Rewards may arrive as int, bool, float, dict, None or NaN (from logs written
by other tools, or before validation existed). :func:`reward_stats` turns
each into a float through :func:`reducers.samples.resolve_reward` and counts
the ones it cannot use instead of averaging them. Aborted and dropped
sessions never enter reward statistics; they are counted by reason.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

from .groups import ABORTED, DROPPED, FINISHED, Group
from .samples import resolve_reward


def reward_stats(values: Iterable[Any], reward_key: str | None = None) -> dict[str, Any]:
    """Mean, std (population), min and max over the usable rewards in ``values``.

    ``count`` is how many were usable, ``bad`` how many were not (None, NaN,
    infinite, non-numeric, ambiguous dict); bad values are never averaged.
    The statistics are NaN when nothing was usable.
    """
    acc = _RewardAccumulator()
    for v in values:
        acc.add(v, reward_key)
    return acc.snapshot()


class _RewardAccumulator:
    """Welford running mean/variance plus min/max and bad-value counts."""

    __slots__ = ("count", "mean", "m2", "lo", "hi", "bad", "bad_kinds")

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.lo = math.inf
        self.hi = -math.inf
        self.bad = 0
        self.bad_kinds: Counter[str] = Counter()

    def add(self, value: Any, reward_key: str | None) -> None:
        reward, _problem = resolve_reward(value, reward_key)
        if reward is None:
            self.bad += 1
            self.bad_kinds[_bad_kind(value)] += 1
            return
        self.add_float(reward)

    def add_float(self, reward: float) -> None:
        self.count += 1
        delta = reward - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (reward - self.mean)
        self.lo = min(self.lo, reward)
        self.hi = max(self.hi, reward)

    def snapshot(self) -> dict[str, Any]:
        n = self.count
        return {
            "count": n,
            "bad": self.bad,
            "bad_kinds": dict(sorted(self.bad_kinds.items())),
            "mean": self.mean if n else math.nan,
            "std": math.sqrt(self.m2 / n) if n else math.nan,
            "min": self.lo if n else math.nan,
            "max": self.hi if n else math.nan,
        }


def _bad_kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return "nan" if value != value else "inf"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


class MetricsAccumulator:
    """Incremental run metrics: fed one terminal session / released group at a time."""

    def __init__(self, reward_key: str | None = None, solve_threshold: float = 1.0) -> None:
        self.reward_key = reward_key
        self.solve_threshold = solve_threshold
        self.rewards = _RewardAccumulator()
        self.sessions: Counter[str] = Counter()
        self.abort_reasons: Counter[str] = Counter()
        self.drop_reasons: Counter[str] = Counter()
        self.samples_by_status: Counter[str] = Counter()
        self.turns = 0
        self.output_tokens = 0
        self.trained_tokens = 0
        self.groups_released = 0
        self.groups_skipped = 0
        self.skip_reasons: Counter[str] = Counter()
        self._solve = _RewardAccumulator()
        self.groups_all_solved = 0
        self.groups_none_solved = 0
        self.groups_mixed = 0

    def observe_session(
        self,
        status: str,
        *,
        reason: str = "",
        reward: Any = None,
        turns: int = 0,
        output_tokens: int = 0,
        samples: Iterable[Any] = (),
    ) -> None:
        """One session reached ``status``; only finished sessions feed reward stats."""
        self.sessions[status] += 1
        self.turns += turns
        self.output_tokens += output_tokens
        if status == FINISHED:
            self.rewards.add(reward, self.reward_key)
        elif status == ABORTED:
            self.abort_reasons[reason] += 1
        elif status == DROPPED:
            self.drop_reasons[reason] += 1
        for s in samples:
            self.samples_by_status[s.status] += 1
            if not s.remove_sample:
                self.trained_tokens += s.loss_mask.count(1)

    def observe_group(self, group: Group) -> None:
        """One group was released."""
        self.groups_released += 1
        if group.skipped:
            self.groups_skipped += 1
            # The reason text carries counts; bucket by its head only.
            self.skip_reasons[group.skip_reason.split(" (")[0]] += 1
        rate = group.solve_rate(self.solve_threshold)
        if rate == rate:  # not NaN: at least one valid member
            self._solve.add_float(rate)
            if rate == 1.0:
                self.groups_all_solved += 1
            elif rate == 0.0:
                self.groups_none_solved += 1
            else:
                self.groups_mixed += 1

    def snapshot(self) -> dict[str, Any]:
        """All metrics as plain data, namespaced like ``rollout/reward_mean``."""
        r = self.rewards.snapshot()
        solve = self._solve.snapshot()
        return {
            "rollout/reward_mean": r["mean"],
            "rollout/reward_std": r["std"],
            "rollout/reward_min": r["min"],
            "rollout/reward_max": r["max"],
            "rollout/reward_count": r["count"],
            "rollout/reward_bad": r["bad"],
            "rollout/reward_bad_kinds": r["bad_kinds"],
            "sessions/by_status": dict(sorted(self.sessions.items())),
            "sessions/abort_reasons": dict(sorted(self.abort_reasons.items())),
            "sessions/drop_reasons": dict(sorted(self.drop_reasons.items())),
            "samples/by_status": dict(sorted(self.samples_by_status.items())),
            "tokens/output": self.output_tokens,
            "tokens/trained": self.trained_tokens,
            "turns/total": self.turns,
            "turns/mean": self.turns / sum(self.sessions.values()) if self.sessions else math.nan,
            "groups/released": self.groups_released,
            "groups/skipped": self.groups_skipped,
            "groups/skip_reasons": dict(sorted(self.skip_reasons.items())),
            "groups/solve_rate_mean": solve["mean"],
            "groups/all_solved": self.groups_all_solved,
            "groups/none_solved": self.groups_none_solved,
            "groups/mixed": self.groups_mixed,
        }
