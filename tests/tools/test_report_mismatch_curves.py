"""`report.html`'s learner panels show the training–inference mismatch: the step's figures over the
tokens of the learner's version, and for a learner log written before them, the all-token mean."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("plotly")

from agentlog.tools.report.render import learner_figure  # noqa: E402


def panels(rows) -> list[str]:
    fig = learner_figure(SimpleNamespace(learner=rows))
    return [a.text for a in fig.layout.annotations]


def test_a_new_learner_log_draws_the_mismatch_mean_and_max_and_skips_steps_without_tokens():
    rows = [(1, 1, {"rollout/reward_mean": 0.1, "stats/train_rollout_logprob_abs_diff": 0.0,
                    "stats/train_rollout_logprob_abs_diff_max": 0.0, "stats/rollout_logprob_abs_diff": 0.0}),
            (2, 2, {"rollout/reward_mean": 0.2, "stats/train_rollout_logprob_abs_diff": math.nan,
                    "stats/train_rollout_logprob_abs_diff_max": math.nan, "stats/rollout_logprob_abs_diff": 0.3})]
    titles = panels(rows)
    assert "train-rollout |Δ log-prob| (stats/train_rollout_logprob_abs_diff)" in titles
    assert "train-rollout |Δ log-prob| max (stats/train_rollout_logprob_abs_diff_max)" in titles
    fig = learner_figure(SimpleNamespace(learner=rows))
    (mean,) = [t for t in fig.data if t.name == "train-rollout |Δ log-prob|"]
    assert list(mean.y) == [0.0, None]  # NaN (only stale tokens) is a gap, not a zero


def test_an_old_learner_log_draws_its_all_token_mean():
    rows = [(1, 1, {"rollout/reward_mean": 0.1, "stats/rollout_logprob_abs_diff": 1e-7})]
    titles = panels(rows)
    assert "train-rollout |Δ log-prob| (stats/rollout_logprob_abs_diff)" in titles
    assert not any("max" in t for t in titles)
