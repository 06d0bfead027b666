"""Policy loss against hand-computed tensors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from agentlog.learner.config import LearnerConfig
from agentlog.learner.loss import (
    METRICS, TERMS, Aggregation, LossInputs, distill_advantages, entropy_bonus, kl_loss, kl_penalty,
    policy_gradient_loss, topk_distill_loss, total_loss,
)

T = torch.tensor


def leaf(values):
    return T(values, dtype=torch.float32, requires_grad=True)


def ratios_to_log_probs(ratios):
    """log-probs whose ratio against zeros is ``ratios``."""
    return leaf([[math.log(r) for r in row] for row in ratios])


def test_ppo_clip_acts_on_both_sides_with_asymmetric_ranges():
    lp = ratios_to_log_probs([[1.5, 0.5, 1.1, 0.9], [1.5, 0.5, 1.1, 0.9]])
    old = torch.zeros(2, 4)
    adv = T([1.0, -1.0])
    loss, m = total_loss(LossInputs(lp, old, adv, torch.ones(2, 4)), LearnerConfig())
    # A > 0: -min(r, clip(r)); 1.5 clips at 1 + 0.28. A < 0: max(r, clip(r)); 0.5 clips at 1 - 0.2.
    per_token = T([[-1.28, -0.5, -1.1, -0.9], [1.5, 0.8, 1.1, 0.9]])
    assert_close(loss, per_token.mean())
    assert_close(m["stats/clip_frac"], T(2 / 8))
    loss.backward()
    # clipped tokens carry no gradient; the others d/dlogp(-A r) = -A r / 8
    assert_close(lp.grad, T([[0.0, -0.5, -1.1, -0.9], [1.5, 0.0, 1.1, 0.9]]) / 8)


def test_clip_range_is_configurable_per_side():
    lp = ratios_to_log_probs([[1.25, 0.85]])
    loss, m = total_loss(LossInputs(lp, torch.zeros(1, 2), T([1.0]), torch.ones(1, 2)),
                         LearnerConfig(eps_clip=0.1, eps_clip_high=0.2))
    assert_close(loss, T((-1.2 - 0.85) / 2))
    assert_close(m["stats/clip_frac"], T(0.5))


def test_dual_clip_caps_the_loss_of_negative_advantages():
    lp = ratios_to_log_probs([[5.0, 2.0], [5.0, 2.0]])
    adv = T([-1.0, 1.0])
    loss, m = total_loss(LossInputs(lp, torch.zeros(2, 2), adv, torch.ones(2, 2)), LearnerConfig(dual_clip=3.0))
    # A < 0: min(max(r, clip(r)), c) -> [3, 2]; A > 0 untouched: -1.28 each
    assert_close(loss, T([3.0, 2.0, -1.28, -1.28]).mean())
    assert_close(m["stats/dual_clip_frac"], T(1 / 4))
    loss_plain, _ = total_loss(LossInputs(lp, torch.zeros(2, 2), adv, torch.ones(2, 2)), LearnerConfig())
    assert_close(loss_plain, T([5.0, 2.0, -1.28, -1.28]).mean())


def test_gspo_uses_the_masked_sequence_mean_log_ratio():
    lp = leaf([[0.1, 0.3, 5.0], [0.5, 0.5, 0.5]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = T([1.0, 1.0])
    loss, m = total_loss(LossInputs(lp, torch.zeros(2, 3), adv, mask), LearnerConfig(estimator="gspo"))
    s0 = math.exp(0.2)  # inside the clip range
    # row 1: exp(0.5) = 1.65 > 1.28, clipped
    assert_close(loss, T((-s0 * 2 - 1.28 * 3) / 5))
    assert_close(m["stats/clip_frac"], T(3 / 5))
    loss.backward()
    # d/dlogp_t of -s * (2 tokens) / 5 with s = exp(mean) : -s * (1/2) * 2 / 5 per valid token
    assert_close(lp.grad, T([[-s0 / 5, -s0 / 5, 0.0], [0.0, 0.0, 0.0]]))


def test_truncated_importance_sampling_caps_the_weight():
    lp = leaf([[0.0, 0.0]])
    old = torch.zeros(1, 2)
    rollout = T([[-math.log(3.0), math.log(2.0)]])  # pi_old / pi_rollout = [3, 0.5]
    loss, m = total_loss(LossInputs(lp, old, T([1.0]), torch.ones(1, 2), rollout_log_probs=rollout),
                         LearnerConfig(tis_cap=2.0))
    assert_close(loss, T(-(2.0 + 0.5) / 2))
    assert_close(m["stats/tis_clip_frac"], T(0.5))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        total_loss(LossInputs(lp, old, T([1.0]), torch.ones(1, 2)), LearnerConfig(tis_cap=2.0))


@pytest.mark.parametrize("kl_type, per_token", [
    ("k1", [0.5, -0.5]),
    ("k2", [0.125, 0.125]),
    ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5]),
])
def test_kl_estimators_to_the_reference_policy(kl_type, per_token):
    lp = leaf([[0.0, 0.0]])
    ref = T([[-0.5, 0.5]])
    assert_close(kl_penalty(lp.detach(), ref, kl_type), T([per_token]))
    loss, m = total_loss(LossInputs(lp, lp.detach(), T([0.0]), torch.ones(1, 2), ref_log_probs=ref),
                         LearnerConfig(kl_coef=0.1, kl_type=kl_type))
    assert_close(loss, T(0.1 * sum(per_token) / 2))
    assert_close(m["loss/kl"], T(sum(per_token) / 2))


def test_unknown_kl_type_raises():
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_entropy_bonus_lowers_the_loss():
    lp = leaf([[0.0, 0.0]])
    ent = T([[1.0, 2.0]], requires_grad=True)
    loss, m = total_loss(LossInputs(lp, lp.detach(), T([0.0]), torch.ones(1, 2), entropy=ent),
                         LearnerConfig(entropy_coef=0.01))
    assert_close(loss, T(-0.01 * 1.5))
    assert_close(m["stats/entropy"], T(1.5))
    loss.backward()
    assert_close(ent.grad, T([[-0.005, -0.005]]))


def test_token_mean_and_sample_mean_aggregations():
    lp = leaf([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = T([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = T([1.0, -2.0])  # ratio 1: per-token loss -A -> row 0: [-1], row 1: [2, 2, 2]
    tok, _ = total_loss(LossInputs(lp, lp.detach(), adv, mask), LearnerConfig(loss_agg="token_mean"))
    smp, _ = total_loss(LossInputs(lp, lp.detach(), adv, mask), LearnerConfig(loss_agg="sample_mean"))
    assert_close(tok, T((-1.0 + 6.0) / 4))
    assert_close(smp, T((-1.0 + 2.0) / 2))


def test_per_token_advantages_are_accepted():
    lp = leaf([[0.0, 0.0]])
    loss, _ = total_loss(LossInputs(lp, lp.detach(), T([[1.0, 3.0]]), torch.ones(1, 2)), LearnerConfig())
    assert_close(loss, T(-2.0))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "gspo"])
@pytest.mark.parametrize("loss_agg", ["token_mean", "sample_mean"])
def test_fully_masked_rows_never_give_nan(estimator, loss_agg):
    lp = leaf([[0.3, -0.2], [0.1, 0.0]])
    mask = torch.zeros(2, 2)
    inputs = LossInputs(lp, torch.zeros(2, 2), T([1.0, -1.0]), mask, rollout_log_probs=torch.zeros(2, 2),
                        ref_log_probs=torch.zeros(2, 2), entropy=torch.ones(2, 2))
    loss, m = total_loss(inputs, LearnerConfig(estimator=estimator, loss_agg=loss_agg, tis_cap=2.0, kl_coef=0.1,
                                               entropy_coef=0.01, dual_clip=3.0))
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in m.values())
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(2, 2))
    # and a fully masked row next to a live one changes nothing
    mask = T([[0.0, 0.0], [1.0, 1.0]])
    config = LearnerConfig(estimator=estimator, loss_agg=loss_agg)
    both, _ = total_loss(LossInputs(lp, torch.zeros(2, 2), T([1.0, -1.0]), mask), config)
    alone, _ = total_loss(LossInputs(lp[1:], torch.zeros(1, 2), T([-1.0]), mask[1:]), config)
    assert_close(both, alone)


def test_vectorised_loss_matches_a_plain_loop():
    """Element by element against a per-token Python loop (PPO-clip, dual clip, TIS, token mean)."""
    g = torch.Generator().manual_seed(3)
    N, L = 5, 7
    lp = (torch.randn(N, L, generator=g) * 0.3)
    old = torch.randn(N, L, generator=g) * 0.3
    roll = old + torch.randn(N, L, generator=g) * 0.5
    adv = torch.randn(N, generator=g)
    mask = (torch.rand(N, L, generator=g) > 0.3).float()
    loss, _ = total_loss(LossInputs(lp, old, adv, mask, rollout_log_probs=roll), LearnerConfig(dual_clip=2.0, tis_cap=1.5))
    total, count = 0.0, 0
    for i in range(N):
        for t in range(L):
            if not mask[i, t]:
                continue
            r = math.exp(lp[i, t] - old[i, t])
            a = float(adv[i])
            ell = max(-r * a, -min(max(r, 0.8), 1.28) * a)
            if a < 0:
                ell = min(ell, -2.0 * a)
            ell *= min(math.exp(old[i, t] - roll[i, t]), 1.5)
            total += ell
            count += 1
    assert_close(loss, T(total / count), rtol=1e-5, atol=1e-6)


def test_unknown_names_and_bad_shapes_raise():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="estimator"):
        total_loss(LossInputs(z, z, T([0.0]), z), LearnerConfig(estimator="ppo2"))
    with pytest.raises(ValueError, match="loss_agg"):
        total_loss(LossInputs(z, z, T([0.0]), z), LearnerConfig(loss_agg="sum"))
    with pytest.raises(ValueError, match=r"\(N, L\)"):
        total_loss(LossInputs(z, torch.zeros(1, 3), T([0.0]), z), LearnerConfig())
    with pytest.raises(ValueError, match="ref_log_probs"):
        total_loss(LossInputs(z, z, T([0.0]), z), LearnerConfig(kl_coef=0.1))


def _loop_loss(lp, old, adv, mask, roll, ref, ent, *, estimator, agg, dual, tis, kl_coef, ent_coef, remove):
    """The whole loss one token at a time, in plain Python floats."""
    rows = [i for i in range(len(lp)) if not remove[i]]
    n_tok = sum(mask[i][t] for i in rows for t in range(len(lp[i])))
    n_smp = sum(1 for i in rows if any(mask[i]))
    total = 0.0
    for i in rows:
        live = [t for t in range(len(lp[i])) if mask[i][t]]
        if not live:
            continue
        seq = sum(lp[i][t] - old[i][t] for t in live) / len(live)
        row = 0.0
        for t in live:
            r = math.exp(seq if estimator == "gspo" else lp[i][t] - old[i][t])
            a = adv[i]
            ell = max(-r * a, -min(max(r, 0.8), 1.28) * a)
            if dual is not None and a < 0:
                ell = min(ell, -dual * a)
            if tis is not None:
                ell *= min(math.exp(old[i][t] - roll[i][t]), tis)
            x = lp[i][t] - ref[i][t]
            ell += kl_coef * (math.exp(-x) - 1 + x) - ent_coef * ent[i][t]
            row += ell
        total += row / n_tok if agg == "token_mean" else row / len(live) / n_smp
    return total


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000), n=st.integers(1, 6), length=st.integers(1, 7),
    estimator=st.sampled_from(["grpo", "dr_grpo", "gspo"]), agg=st.sampled_from(["token_mean", "sample_mean"]),
    dual=st.sampled_from([None, 2.0, 3.0]), tis=st.sampled_from([None, 1.2, 2.0]),
    kl_coef=st.sampled_from([0.0, 0.1]), ent_coef=st.sampled_from([0.0, 0.01]),
)
def test_loss_matches_a_token_by_token_loop_for_every_option(seed, n, length, estimator, agg, dual, tis,
                                                             kl_coef, ent_coef):
    g = torch.Generator().manual_seed(seed)
    lp, old, roll, ref = (torch.randn(n, length, generator=g, dtype=torch.float64) * 0.4 for _ in range(4))
    ent = torch.rand(n, length, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, length, generator=g) > 0.3).double()
    remove = torch.rand(n, generator=g) > 0.7
    inputs = LossInputs(lp, old, adv, mask, rollout_log_probs=roll, ref_log_probs=ref, entropy=ent)
    loss, _ = total_loss(inputs.without_rows(remove), LearnerConfig(
        estimator=estimator, loss_agg=agg, dual_clip=dual, tis_cap=tis, kl_coef=kl_coef, entropy_coef=ent_coef))
    want = _loop_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), roll.tolist(), ref.tolist(),
                      ent.tolist(), estimator=estimator, agg=agg, dual=dual, tis=tis, kl_coef=kl_coef,
                      ent_coef=ent_coef, remove=remove.tolist())
    assert_close(loss, T(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def _all_inputs(seed: int, n: int = 5, length: int = 6, k: int = 3) -> LossInputs:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return -torch.rand(*shape, generator=g, dtype=torch.float64) * 2

    return LossInputs(
        r(n, length).requires_grad_(True), r(n, length), torch.randn(n, generator=g, dtype=torch.float64),
        (torch.rand(n, length, generator=g) > 0.3).double(), rollout_log_probs=r(n, length),
        ref_log_probs=r(n, length), entropy=-r(n, length), teacher_log_probs=r(n, length),
        teacher_mask=(torch.rand(n, length, generator=g) > 0.2).double(), top_log_probs=r(n, length, k),
        teacher_top_log_probs=r(n, length, k), teacher_top_mask=torch.rand(n, length, k, generator=g) > 0.3,
    )


@pytest.mark.parametrize("agg", ["token_mean", "sample_mean"])
def test_total_loss_is_its_terms_composed_in_order(agg):
    """Each term computed on its own, summed with the config's weights, gives total_loss bit for bit."""
    x = _all_inputs(seed=4)
    config = LearnerConfig(estimator="gspo", loss_agg=agg, dual_clip=3.0, tis_cap=2.0, kl_coef=0.05, kl_type="k2",
                           entropy_coef=0.01, distill_coef=0.5, distill_topk_coef=0.3)
    total, metrics = total_loss(x, config)

    a = Aggregation(x.loss_mask, x.log_probs.dtype, agg)
    shaped = distill_advantages(x, x.advantages.unsqueeze(-1), config.distill_coef)
    pg, pg_metrics = policy_gradient_loss(x, shaped, a, config)
    kl, _ = kl_loss(x, a, config)
    topk, _ = topk_distill_loss(x, a, config)
    entropy, _ = entropy_bonus(x, a, config)
    assert list(TERMS) == ["kl", "distill_topk", "entropy"]
    assert torch.equal(total, pg + 0.05 * kl + 0.3 * topk - 0.01 * entropy)
    assert all(torch.equal(metrics[k], v) for k, v in pg_metrics.items())
    assert list(metrics) == list(METRICS) + ["distill/reverse_kl", "distill/scored_frac", "distill/topk_kl"]


def test_a_term_is_measured_without_weight_and_enters_the_loss_only_with_one():
    x = _all_inputs(seed=8)
    plain, m = total_loss(x, LearnerConfig())
    pg, _ = policy_gradient_loss(x, x.advantages.unsqueeze(-1), Aggregation(x.loss_mask, x.log_probs.dtype,
                                                                            "token_mean"), LearnerConfig())
    assert torch.equal(plain, pg)
    assert m["loss/kl"] > 0 and m["loss/entropy"] > 0 and m["distill/topk_kl"] > 0


def test_missing_inputs_of_a_weighted_term_are_named_but_top_k_data_is_optional():
    x = _all_inputs(seed=2)
    bare = LossInputs(x.log_probs, x.old_log_probs, x.advantages, x.loss_mask)
    with pytest.raises(ValueError, match="entropy_coef is non-zero but entropy was not given"):
        total_loss(bare, LearnerConfig(entropy_coef=0.01))
    # top-K data comes where a teacher gave it: a batch without it trains without the term
    loss, m = total_loss(bare, LearnerConfig(distill_topk_coef=0.5))
    assert torch.equal(loss, total_loss(bare, LearnerConfig())[0]) and "distill/topk_kl" not in m


def test_without_rows_drops_the_rows_of_every_input():
    x = _all_inputs(seed=6)
    remove = torch.tensor([False, True, False, False, True])
    kept = x.without_rows(remove)
    for f in dataclasses.fields(LossInputs):
        assert torch.equal(getattr(kept, f.name), getattr(x, f.name)[~remove]), f.name
    assert x.without_rows(torch.zeros(5, dtype=torch.bool)) is x and x.without_rows(None) is x
