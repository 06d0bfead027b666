"""The training–inference mismatch metrics: slime's definitions, counted on the trained
tokens of the learner's own version only, and the warning past a bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from learner_helpers import make_sample
from structlog.testing import capture_logs

from agentlog._logging import get_logger
from agentlog.learner import mismatch
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.mismatch import MismatchStats, warn_past
from agentlog.learner.model import GPT


def test_the_figures_follow_slimes_definitions_on_a_hand_built_batch():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -9.0]])
    rollout = torch.tensor([[-1.2, -2.0, -0.4], [-2.0, -0.1, -1.0]])
    counted = torch.tensor([[True, True, True], [True, False, False]])  # a padded tail and an untrained token
    stats = MismatchStats()
    stats.add(train[:1], rollout[:1], counted[:1])  # two micro-batches: they add up
    stats.add(train[1:], rollout[1:], counted[1:])
    m = stats.metrics()
    d = np.array([0.2, 0.0, -0.1, -1.0])  # train - rollout on the counted tokens
    assert m[mismatch.TOKENS] == 4
    assert m[mismatch.ABS_DIFF] == pytest.approx(np.abs(d).mean(), abs=1e-7)
    assert m[mismatch.ABS_DIFF_MAX] == pytest.approx(1.0, abs=1e-7)
    # slime's compute_approx_kl(rollout, train, "low_var_kl"): log_ratio = -(rollout - train); exp(r) - 1 - r, clamped
    assert m[mismatch.KL] == pytest.approx(np.mean(np.clip(np.exp(d) - 1 - d, -10, 10)), abs=1e-7)


def test_the_kl_estimate_is_clamped_per_token_as_slime_does():
    stats = MismatchStats()
    stats.add(torch.tensor([[0.0, -1.0]]), torch.tensor([[-20.0, -1.0]]), torch.tensor([[True, True]]))
    assert stats.metrics()[mismatch.KL] == pytest.approx(10.0 / 2)


def test_no_counted_token_gives_nan_figures_and_zero_tokens():
    stats = MismatchStats()
    stats.add(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    m = stats.metrics()
    assert m[mismatch.TOKENS] == 0.0 and all(math.isnan(m[k]) for k in (mismatch.ABS_DIFF, mismatch.ABS_DIFF_MAX, mismatch.KL))


def test_shapes_that_do_not_line_up_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"\(2, 3\), \(2, 4\), \(2, 3\)"):
        MismatchStats().add(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))


def _rows(model: GPT, versions: list[int], token_versions: list[list[int]] | None = None):
    """Two sampled rows of a group, recorded at ``versions`` (and per token, a partial rollout)."""
    import msgspec

    out = model.sample([[1, 2, 3], [4, 5]], 6, generator=torch.Generator().manual_seed(0))
    rows = []
    for i, v in enumerate(versions):
        s = make_sample("g", f"s{i}", [[1, 2, 3], [4, 5]][i], out.tokens[i].tolist(), reward=float(i),
                        log_probs=out.log_probs[i].tolist(), sample_index=i)
        tv = b"" if token_versions is None else np.asarray(token_versions[i][: s.response_length], "<i4").tobytes()
        rows.append(msgspec.structs.replace(s, policy_version=v, token_versions=tv))
    return rows


def test_only_trained_tokens_of_the_learners_version_are_counted():
    """A step at version v counts the tokens version v generated: every token of fresh rows, none
    of stale ones, the second half of a partial rollout; the all-token stat still sees everything."""
    torch.manual_seed(0)
    model = GPT(vocab_size=16, max_seq_len=32, n_layer=1, d_model=32, n_head=2)

    def step_at(version: int, rows) -> dict[str, float]:
        learner = Learner(GPT.from_state_dict(model.state_dict(), {"n_head": 2}), LearnerConfig(tis_cap=2.0))
        learner.policy_version = version
        return learner.step(rows)

    fresh = step_at(1, _rows(model, [1, 1]))
    assert fresh[mismatch.TOKENS] == fresh["perf/trained_tokens"] == 12 and fresh[mismatch.ABS_DIFF_MAX] == 0.0
    stale = step_at(2, _rows(model, [1, 1]))
    assert stale[mismatch.TOKENS] == 0 and math.isnan(stale[mismatch.ABS_DIFF])
    assert stale["stats/rollout_logprob_abs_diff"] == 0.0  # same weights: over every token, still measured
    partial = step_at(3, _rows(model, [2, 3], token_versions=[[2, 2, 2, 3, 3, 3], [3] * 6]))
    assert partial[mismatch.TOKENS] == 3 + 6 and partial[mismatch.ABS_DIFF_MAX] == 0.0


def test_past_the_bound_a_structured_warning_names_the_figures_and_the_metric_is_one():
    log = get_logger("agentlog.test", component="learner")
    figures = {mismatch.ABS_DIFF: 0.2, mismatch.ABS_DIFF_MAX: 1.5, mismatch.KL: 0.03, mismatch.TOKENS: 100.0}
    with capture_logs() as logs:
        assert warn_past(figures, 0.05, log.warning, step=7, backend="sglang") == {mismatch.WARNED: 1.0}
        assert warn_past(figures, 0.2, log.warning, step=8) == {mismatch.WARNED: 0.0}  # at the bound: within
        assert warn_past({**figures, mismatch.ABS_DIFF: math.nan}, 0.05, log.warning) == {}  # nothing measured
    (event,) = logs
    assert event["event"] == "learner.train_rollout_mismatch" and event["log_level"] == "warning"
    assert event["abs_diff"] == 0.2 and event["abs_diff_max"] == 1.5 and event["bound"] == 0.05
    assert event["step"] == 7 and event["backend"] == "sglang"
