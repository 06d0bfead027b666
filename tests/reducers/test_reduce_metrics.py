"""Metrics: odd rewards are counted, not averaged; aborted sessions stay out."""

from __future__ import annotations

import math

import pytest
from reduce_streams import Script, msg, reduce_scripts

from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.metrics import reward_stats


def test_reward_stats_on_mixed_int_bool_dict_none_nan():
    values = [1, True, {"score": 0.5}, None, math.nan, {"x": 1.0, "y": 3.0}, "oops", 0, math.inf, False]
    stats = reward_stats(values)
    usable = [1.0, 1.0, 0.5, 0.0, 0.0]
    assert stats["count"] == 5 and stats["bad"] == 5
    assert stats["bad_kinds"] == {"dict": 1, "inf": 1, "nan": 1, "none": 1, "str": 1}
    assert stats["mean"] == pytest.approx(sum(usable) / 5)
    assert stats["std"] == pytest.approx(math.sqrt(sum((u - 0.5) ** 2 for u in usable) / 5))
    assert (stats["min"], stats["max"]) == (0.0, 1.0)


def test_reward_stats_with_key_resolves_multi_entry_dicts():
    stats = reward_stats([{"x": 1.0, "y": 3.0}, {"y": 1.0}], reward_key="y")
    assert (stats["count"], stats["bad"], stats["mean"]) == (2, 0, 2.0)


def test_reward_stats_of_nothing_usable_is_nan_not_a_crash():
    stats = reward_stats([None, math.nan, {}])
    assert stats["count"] == 0 and stats["bad"] == 3 and math.isnan(stats["mean"]) and math.isnan(stats["std"])


def _member(sid, index, size=4):
    s = Script(sid, group_size=size, sample_index=index)
    s.turn([msg("user", "u")], [1, 2], [3, 4], response=msg("assistant", "a"))
    return s


def test_run_metrics_count_statuses_reasons_tokens_turns_and_solve_rate():
    result = reduce_scripts(
        _member("a", 0).finish(1),
        _member("b", 1).finish(True),
        _member("c", 2).finish({"pass": 0.0}),
        _member("d", 3).abort("timeout"),
        config=ReduceConfig(),
    )
    m = result.metrics
    # The aborted member's 0.0 placeholder reward is not a reward.
    assert m["rollout/reward_count"] == 3 and m["rollout/reward_mean"] == pytest.approx(2 / 3)
    assert m["sessions/by_status"] == {"aborted": 1, "finished": 3}
    assert m["sessions/abort_reasons"] == {"timeout": 1}
    assert m["samples/by_status"] == {"aborted": 1, "completed": 3}
    assert (m["tokens/output"], m["tokens/trained"], m["turns/total"]) == (8, 6, 4)
    assert m["groups/released"] == 1 and m["groups/mixed"] == 1
    assert m["groups/solve_rate_mean"] == pytest.approx(2 / 3)


def test_run_metrics_count_unusable_finished_rewards_as_bad():
    result = reduce_scripts(_member("a", 0, size=2).finish(None), _member("b", 1, size=2).finish({"p": 1.0, "q": 0.0}))
    m = result.metrics
    assert (m["rollout/reward_count"], m["rollout/reward_bad"]) == (0, 2)
    assert math.isnan(m["rollout/reward_mean"])
    assert m["groups/skipped"] == 1 and m["groups/skip_reasons"] == {"0 valid member(s) < min_valid 2": 1}
