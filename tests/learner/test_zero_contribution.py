"""An aborted placeholder contributes exactly nothing: same loss, same gradients (torch.equal)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from learner_helpers import random_samples

from agentlog.learner.advantages import compute_advantages
from agentlog.learner.batching import make_batches
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.loss import LossInputs, total_loss
from agentlog.learner.model import GPT, token_log_probs

ESTIMATORS = ["grpo", "dr_grpo", "gspo"]
AGGS = ["token_mean", "sample_mean"]
EXTRAS = dict(dual_clip=3.0, tis_cap=2.0, kl_coef=0.05, entropy_coef=0.01)


def _batch_tensors(seed: int, n: int = 6, L: int = 9):
    g = torch.Generator().manual_seed(seed)
    return dict(
        log_probs=-torch.rand(n, L, generator=g) * 2,
        old=-torch.rand(n, L, generator=g) * 2,
        rollout=-torch.rand(n, L, generator=g) * 2,
        ref=-torch.rand(n, L, generator=g) * 2,
        entropy=torch.rand(n, L, generator=g),
        mask=(torch.rand(n, L, generator=g) > 0.3).float(),
        rewards=torch.randint(0, 3, (n,), generator=g).float(),
        groups=torch.tensor([0, 1, 0, 1, 0, 1][:n]),
    )


def _loss_and_grads(t, valid, remove, estimator, agg):
    lp = t["log_probs"].clone().requires_grad_(True)
    ent = t["entropy"].clone().requires_grad_(True)
    adv = compute_advantages(t["rewards"], t["groups"], valid, estimator)
    inputs = LossInputs(lp, t["old"], adv, t["mask"], rollout_log_probs=t["rollout"], ref_log_probs=t["ref"],
                        entropy=ent)
    loss, metrics = total_loss(inputs.without_rows(remove), LearnerConfig(estimator=estimator, loss_agg=agg, **EXTRAS))
    loss.backward()
    return loss, metrics, lp.grad, ent.grad


@pytest.mark.parametrize("estimator, agg", list(itertools.product(ESTIMATORS, AGGS)))
@pytest.mark.parametrize("where", [0, 3, 6])
def test_aborted_row_gives_identical_loss_and_gradients(estimator, agg, where):
    """The placeholder row (mask 0, reward 0, log-probs 0) inserted at any position changes nothing."""
    base = _batch_tensors(seed=11)
    n = len(base["rewards"])
    ones = torch.ones(n, dtype=torch.bool)
    loss0, m0, g0, e0 = _loss_and_grads(base, ones, None, estimator, agg)

    def insert(t, row):
        return torch.cat([t[:where], row.unsqueeze(0), t[where:]])

    L = base["mask"].shape[1]
    zeros = torch.zeros(L)
    # The placeholder's group (0) is a live group: it must also stay out of the baseline.
    withp = {
        "log_probs": insert(base["log_probs"], zeros), "old": insert(base["old"], zeros),
        "rollout": insert(base["rollout"], zeros), "ref": insert(base["ref"], zeros),
        "entropy": insert(base["entropy"], zeros), "mask": insert(base["mask"], zeros),
        "rewards": insert(base["rewards"], torch.tensor(0.0)), "groups": insert(base["groups"], torch.tensor(0)),
    }
    valid = insert(ones, torch.tensor(False))
    loss1, m1, g1, e1 = _loss_and_grads(withp, valid, ~valid, estimator, agg)

    assert torch.equal(loss0, loss1)
    for k in m0:
        assert torch.equal(m0[k], m1[k]), k
    keep = valid
    assert torch.equal(g1[keep], g0) and torch.equal(e1[keep], e0)
    assert torch.equal(g1[~keep], torch.zeros(1, L)) and torch.equal(e1[~keep], torch.zeros(1, L))


@pytest.mark.parametrize("estimator, agg", list(itertools.product(ESTIMATORS, AGGS)))
def test_removed_row_is_ignored_even_with_live_mask_and_garbage_values(estimator, agg):
    """Removal is structural, not a side effect of a zero mask."""
    base = _batch_tensors(seed=5)
    n, L = base["mask"].shape
    ones = torch.ones(n, dtype=torch.bool)
    loss0, m0, g0, _ = _loss_and_grads(base, ones, None, estimator, agg)
    junk = {k: torch.cat([v, v[:1] * 0 + (50.0 if v.is_floating_point() else 0)]) for k, v in base.items()}
    junk["mask"][-1] = 1.0
    valid = torch.cat([ones, torch.tensor([False])])
    loss1, m1, g1, _ = _loss_and_grads(junk, valid, ~valid, estimator, agg)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    assert torch.equal(g1[:n], g0) and torch.equal(g1[n], torch.zeros(L))


@pytest.mark.parametrize("estimator, agg", list(itertools.product(ESTIMATORS, AGGS)))
def test_aborted_session_yields_zero_gradient_through_the_learner(estimator, agg, placeholder):
    """Learner.step on groups with aborted members == on the groups without them: every parameter and metric."""
    rng = np.random.default_rng(7)
    groups = [random_samples(rng, 4, 32, group=f"g{i}") for i in range(3)]
    with_aborts = [list(groups[0]) + [placeholder("g0", "a0")], [placeholder("g1", "a1")] + list(groups[1]),
                   list(groups[2])]
    torch.manual_seed(0)
    model = GPT(vocab_size=32, max_seq_len=32, n_layer=1, d_model=32, n_head=2)
    cfg = LearnerConfig(estimator=estimator, loss_agg=agg, kl_coef=0.05, tis_cap=2.0, entropy_coef=0.01,
                        dual_clip=3.0, num_steps_per_rollout=2, weight_decay=0.01)
    a, b = Learner(copy.deepcopy(model), cfg), Learner(copy.deepcopy(model), cfg)
    ma = a.step([s for g in groups for s in g])
    mb = b.step([s for g in with_aborts for s in g])
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert mb["rollout/removed"] == 2 and ma["rollout/removed"] == 0
    skip = {"rollout/removed", "perf/step_s", "perf/tokens_per_s"}
    assert {k: v for k, v in ma.items() if k not in skip} == {k: v for k, v in mb.items() if k not in skip}


def test_placeholder_costs_no_forward_pass(placeholder):
    """remove_sample rows are dropped before batching: no row, no token of them reaches the model."""
    rng = np.random.default_rng(1)
    samples = random_samples(rng, 3, 16)
    batches = make_batches(samples + [placeholder("g")], packing=False)
    assert sum(b.input_ids.shape[0] for b in batches) == 3
    assert [i for b in batches for i in b.sample_indices] == [0, 1, 2]

    calls = []

    class Counting(GPT):
        def forward(self, input_ids, *args, **kwargs):
            calls.append(input_ids.shape)
            return super().forward(input_ids, *args, **kwargs)

    model = Counting(vocab_size=16, max_seq_len=16, n_layer=1, d_model=16, n_head=2)
    before = [p.detach().clone() for p in model.parameters()]
    learner = Learner(model, LearnerConfig(weight_decay=0.1))
    metrics = learner.step([placeholder("g", "a"), placeholder("g", "b")])
    assert calls == []
    assert metrics["learner/skipped"] == 1.0 and learner.policy_version == 0
    assert all(torch.equal(p0, p) for p0, p in zip(before, model.parameters()))


def test_token_log_probs_of_kept_rows_do_not_depend_on_the_placeholder(placeholder):
    rng = np.random.default_rng(2)
    samples = random_samples(rng, 4, 16)
    model = GPT(vocab_size=16, max_seq_len=16, n_layer=1, d_model=16, n_head=2)
    for packing in (True, False):
        (b0,) = make_batches(samples, packing=packing)
        (b1,) = make_batches(samples[:2] + [placeholder("g")] + samples[2:], packing=packing)
        assert torch.equal(token_log_probs(model, b0)[0], token_log_probs(model, b1)[0])


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 8), length=st.integers(1, 12),
       estimator=st.sampled_from(ESTIMATORS), agg=st.sampled_from(AGGS), data=st.data())
def test_any_set_of_removed_rows_is_invisible(seed, n, length, estimator, agg, data):
    """Property: for random batches and any removed rows, loss, metrics and kept gradients are bit-identical."""
    removed = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    g = torch.Generator().manual_seed(seed)
    lp, old, roll, ref = (-torch.rand(n, length, generator=g) * 3 for _ in range(4))
    ent = torch.rand(n, length, generator=g)
    mask = (torch.rand(n, length, generator=g) > 0.4).float()
    rewards = torch.randint(0, 3, (n,), generator=g).float()
    groups = torch.randint(0, 3, (n,), generator=g)
    rm = torch.tensor(removed)
    keep = ~rm

    def run(sel, remove):
        x = lp[sel].clone().requires_grad_(True)
        adv = compute_advantages(rewards[sel], groups[sel], ~remove if remove is not None else
                                 torch.ones(int(sel.sum()), dtype=torch.bool), estimator)
        inputs = LossInputs(x, old[sel], adv, mask[sel], rollout_log_probs=roll[sel], ref_log_probs=ref[sel],
                            entropy=ent[sel])
        loss, m = total_loss(inputs.without_rows(remove), LearnerConfig(estimator=estimator, loss_agg=agg, **EXTRAS))
        loss.backward()
        return loss, m, x.grad

    full = torch.ones(n, dtype=torch.bool)
    loss1, m1, g1 = run(full, rm)
    loss0, m0, g0 = run(keep, None)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    assert torch.equal(g1[keep], g0)
    assert torch.equal(g1[rm], torch.zeros(int(rm.sum()), length))
