"""On-policy distillation in the learner: teacher log-probs batched like the
rollout's, the per-token advantage A - lambda * (rollout - teacher), the top-K
forward KL, the metrics, refusal of unscored samples, and exact zero
contribution of removed rows."""

from __future__ import annotations

import copy
import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from learner_helpers import make_sample, random_samples
from torch.testing import assert_close

from agentlog.learner.batching import make_batches
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.loss import LossInputs, total_loss
from agentlog.learner.model import GPT, token_log_probs, token_stats
from agentlog.reducers.samples import Sample

T = torch.tensor


def with_teacher(sample: Sample, teacher_lp, scored=None, top=None) -> Sample:
    """``sample`` scored by a teacher: log-probs per response token, scored mask
    (default: every token), and optionally ``(ids (L, k), log-probs (L, k))``."""
    n = sample.response_length
    scored = np.ones(n, np.uint8) if scored is None else np.asarray(scored, np.uint8)
    extra = {}
    if top is not None:
        ids, lps = (np.asarray(a) for a in top)
        extra = dict(teacher_top_k=ids.shape[1], teacher_top_ids=ids.astype("<i4").tobytes(),
                     teacher_top_log_probs=lps.astype("<f4").tobytes())
    return msgspec.structs.replace(
        sample, teacher_log_probs=np.asarray(teacher_lp, "<f4").tobytes(), teacher_scored=scored.tobytes(), **extra)


def scored_randomly(samples, rng, *, vocab: int, k: int = 0) -> list[Sample]:
    """Every sample scored on every token with random teacher log-probs (and top-K)."""
    out = []
    for s in samples:
        n = s.response_length
        top = None
        if k:
            ids = np.stack([rng.permutation(vocab)[:k] for _ in range(n)])
            top = ids, np.sort(-rng.random((n, k)) * 4, axis=1)[:, ::-1]
        out.append(with_teacher(s, -rng.random(n) * 3, top=top))
    return out


def tiny_gpt(seed: int = 0, vocab: int = 16, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=vocab, max_seq_len=kw.pop("max_seq_len", 24), n_layer=1, d_model=16, n_head=2, **kw)


# ------------------------------------------------------------------ batching


@pytest.mark.parametrize("packing", [True, False])
def test_teacher_arrays_are_batched_like_the_rollout_log_probs(packing):
    rng = np.random.default_rng(3)
    samples = random_samples(rng, 5, 16)
    samples = scored_randomly(samples[:3], rng, vocab=16, k=3) + scored_randomly(samples[3:4], rng, vocab=16) + samples[4:]
    batches = make_batches(samples, packing=packing, max_tokens_per_batch=40)
    assert len(batches) > 1
    seen = set()
    for b in batches:
        for n, i in enumerate(b.sample_indices):
            s, m = samples[i], samples[i].response_length
            seen.add(i)
            if b.teacher_log_probs is None:
                assert not s.teacher_scored
                continue
            assert b.teacher_log_probs.shape == b.rollout_log_probs.shape == b.teacher_mask.shape
            assert np.array_equal(b.teacher_log_probs[n, :m].numpy(), s.teacher_lp if s.teacher_scored else np.zeros(m))
            assert np.array_equal(b.teacher_mask[n, :m].numpy(), s.teacher_mask if s.teacher_scored else np.zeros(m))
            assert not b.teacher_mask[n, m:].any()
            top = s.teacher_top()
            if b.teacher_top_ids is None:
                assert top is None
                continue
            assert b.teacher_top_ids.shape == (*b.loss_mask.shape, 3)
            if top is None:
                assert not b.teacher_top_mask[n].any()
            else:
                assert np.array_equal(b.teacher_top_ids[n, :m].numpy(), top[0])
                assert np.array_equal(b.teacher_top_log_probs[n, :m].numpy(), top[1])
                assert b.teacher_top_mask[n, :m].all() and not b.teacher_top_mask[n, m:].any()
    assert seen == set(range(5))
    (plain,) = make_batches(samples[4:], packing=packing)
    assert plain.teacher_log_probs is None and plain.teacher_mask is None and plain.teacher_top_ids is None
    moved = batches[0].to("cpu")
    assert torch.equal(moved.teacher_log_probs, batches[0].teacher_log_probs)


def test_misaligned_teacher_arrays_raise_naming_the_sample():
    s = make_sample("g", "s1", [1, 2], [3, 4, 5])
    bad = msgspec.structs.replace(s, teacher_log_probs=np.zeros(2, "<f4").tobytes(), teacher_scored=b"\x01\x01")
    with pytest.raises(ValueError, match=r"sample 0 \(session 's1'.*teacher_log_probs of 12 bytes"):
        make_batches([bad])
    bad_top = msgspec.structs.replace(with_teacher(s, [0.0] * 3), teacher_top_k=2, teacher_top_ids=b"\x00" * 8)
    with pytest.raises(ValueError, match="teacher_top_k 2: expected teacher_top_ids and teacher_top_log_probs of 24"):
        make_batches([bad_top])


def test_token_stats_gathers_the_policy_log_probs_of_the_teacher_top_ids():
    """Top-K id 0 set to the taken token gives back the token's own log-prob, packed or padded."""
    rng = np.random.default_rng(4)
    samples = random_samples(rng, 4, 16)
    scored = []
    for s in samples:
        n, resp = s.response_length, s.token_ids[-s.response_length:]
        ids = np.stack([resp, (resp + 1) % 16], axis=1)
        scored.append(with_teacher(s, np.zeros(n), top=(ids, np.full((n, 2), -1.0))))
    model = tiny_gpt()
    for packing in (True, False):
        (b,) = make_batches(scored, packing=packing)
        stats = token_stats(model, b, with_top=True)
        lp, _ = token_log_probs(model, b)
        real = b.loss_mask.new_zeros(b.loss_mask.shape, dtype=torch.bool).view(-1)
        real[b.slots] = True
        real = real.view(b.loss_mask.shape)
        assert torch.equal(stats.top_log_probs[..., 0][real], lp[real])
        assert not stats.top_log_probs[~real].any()
    bad = [with_teacher(samples[0], np.zeros(samples[0].response_length),
                        top=(np.full((samples[0].response_length, 1), 99), np.zeros((samples[0].response_length, 1))))]
    with pytest.raises(ValueError, match=r"teacher top-K id 99 .* outside the vocabulary \[0, 16\)"):
        token_stats(model, make_batches(bad)[0], with_top=True)


# ------------------------------------------------------------------ the loss, by hand


def test_advantage_shaping_matches_a_hand_computed_example():
    """A_t = A - lambda * (rollout_t - teacher_t) on scored tokens, A elsewhere.

    Dyadic numbers, so every step is exact in float32. At ratio 1 (log_probs ==
    old) the token_mean loss is -sum(mask * A_t) / trained and its gradient
    with respect to each log-prob is -A_t / trained."""
    lam = 0.5
    adv = T([0.5, -1.0])
    rollout = T([[-1.0, -2.0, -0.5], [-0.25, -1.25, 0.0]])
    teacher = T([[-1.5, -1.0, -4.0], [-0.125, -2.25, 0.0]])
    scored = T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # By hand:
    #   row 0: 0.5 - 0.5 * (-1 + 1.5) = 0.25;  0.5 - 0.5 * (-2 + 1) = 1.0;  unscored: 0.5
    #   row 1: -1 - 0.5 * (-0.25 + 0.125) = -0.9375;  -1 - 0.5 * (-1.25 + 2.25) = -1.5;  (not trained)
    shaped = T([[0.25, 1.0, 0.5], [-0.9375, -1.5, 0.0]])
    lp = torch.zeros(2, 3, requires_grad=True)
    inputs = LossInputs(lp, lp.detach(), adv, mask, rollout_log_probs=rollout, teacher_log_probs=teacher,
                        teacher_mask=scored)
    loss, m = total_loss(inputs, LearnerConfig(distill_coef=lam))
    assert torch.equal(loss.detach(), T(-(0.25 + 1.0 + 0.5 - 0.9375 - 1.5)) / 5)
    loss.backward()
    assert_close(lp.grad, -shaped * mask / 5, rtol=0, atol=0)
    # Metrics: reverse KL over the 4 trained scored tokens, scored fraction 4 / 5.
    assert m["distill/reverse_kl"].item() == (0.5 - 1.0 - 0.125 + 1.0) / 4
    assert m["distill/scored_frac"].item() == pytest.approx(4 / 5)
    # lambda = 0: the teacher changes nothing but the metrics.
    lp0 = torch.zeros(2, 3, requires_grad=True)
    inputs0 = LossInputs(lp0, lp0.detach(), adv, mask, rollout_log_probs=rollout, teacher_log_probs=teacher,
                         teacher_mask=scored)
    loss0, m0 = total_loss(inputs0, LearnerConfig())
    assert torch.equal(loss0.detach(), T(-(0.5 * 3 - 1.0 * 2)) / 5)
    assert m0["distill/reverse_kl"] == m["distill/reverse_kl"]


def test_the_shaping_uses_behaviour_log_probs_and_is_not_differentiated():
    """The distillation term is an advantage: the current log-probs enter only
    through the ratio, so with rollout == teacher it vanishes whatever the policy."""
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 4, generator=g)).requires_grad_(True)
    old, rollout = -torch.rand(3, 4, generator=g), -torch.rand(3, 4, generator=g)
    mask, adv = torch.ones(3, 4), T([1.0, 0.0, -1.0])
    kw = dict(rollout_log_probs=rollout, teacher_log_probs=rollout.clone(), teacher_mask=torch.ones(3, 4))
    inputs = LossInputs(lp, old, adv, mask, **kw)
    a, _ = total_loss(inputs, LearnerConfig(distill_coef=2.0))
    b, _ = total_loss(inputs, LearnerConfig())
    assert torch.equal(a, b)
    (ga,) = torch.autograd.grad(a, lp)
    (gb,) = torch.autograd.grad(b, lp)
    assert torch.equal(ga, gb)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), lam=st.floats(0.0, 4.0), estimator=st.sampled_from(["grpo", "dr_grpo", "gspo"]),
       agg=st.sampled_from(["token_mean", "sample_mean"]), dual=st.sampled_from([None, 3.0]))
def test_distillation_is_exactly_a_per_token_advantage(seed, lam, estimator, agg, dual):
    """For any batch, lambda and loss setting: the loss with the teacher equals
    the loss without it given the advantages A - lambda * (rollout - teacher) * scored."""
    t = _distill_tensors(seed)
    kw = dict(estimator=estimator, loss_agg=agg, dual_clip=dual)
    a, _ = total_loss(LossInputs(t["log_probs"], t["old"], t["adv"], t["mask"], rollout_log_probs=t["rollout"],
                                 teacher_log_probs=t["teacher"], teacher_mask=t["scored"]),
                      LearnerConfig(distill_coef=lam, **kw))
    shaped = t["adv"][:, None] - lam * (t["rollout"] - t["teacher"]) * t["scored"]
    b, _ = total_loss(LossInputs(t["log_probs"], t["old"], shaped, t["mask"], rollout_log_probs=t["rollout"]),
                      LearnerConfig(**kw))
    assert torch.equal(a, b)


def test_top_k_forward_kl_matches_a_hand_computed_example():
    """One token, teacher top-2 log-probs log 0.3, log 0.1 (renormalised: 0.75, 0.25),
    policy log-probs log 0.5, log 0.25: KL = 0.75 log(0.75 / 0.5) + 0.25 log(0.25 / 0.25);
    its gradient with respect to the policy's top log-probs is -p_T times the weight.
    A third, absent entry (mask 0) weighs nothing."""
    top = torch.log(T([[[0.5, 0.25, 0.125]]])).requires_grad_(True)
    teacher_top = torch.log(T([[[0.3, 0.1, 0.6]]]))
    real = T([[[True, True, False]]])
    lp = torch.zeros(1, 1, requires_grad=True)
    inputs = LossInputs(lp, lp.detach(), T([0.0]), torch.ones(1, 1), top_log_probs=top,
                        teacher_top_log_probs=teacher_top, teacher_top_mask=real)
    loss, m = total_loss(inputs, LearnerConfig(distill_topk_coef=0.5))
    kl = 0.75 * math.log(1.5)
    assert_close(m["distill/topk_kl"], T(kl))
    assert_close(loss, T(0.5 * kl))
    loss.backward()
    assert_close(top.grad, T([[[-0.75 * 0.5, -0.25 * 0.5, 0.0]]]))
    with pytest.raises(ValueError, match="top_log_probs, teacher_top_log_probs and teacher_top_mask go together"):
        LossInputs(lp, lp.detach(), T([0.0]), torch.ones(1, 1), top_log_probs=top)


def test_missing_inputs_are_named():
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="distill_coef is non-zero but teacher_log_probs or rollout_log_probs"):
        total_loss(LossInputs(lp, lp, T([0.0]), mask, rollout_log_probs=lp), LearnerConfig(distill_coef=0.1))
    with pytest.raises(ValueError, match="teacher_log_probs and teacher_mask go together"):
        LossInputs(lp, lp, T([0.0]), mask, teacher_log_probs=lp)


# ------------------------------------------------------------------ zero contribution


def _distill_tensors(seed: int, n: int = 6, L: int = 7, K: int = 3):
    g = torch.Generator().manual_seed(seed)
    return dict(
        log_probs=-torch.rand(n, L, generator=g) * 2,
        old=-torch.rand(n, L, generator=g) * 2,
        rollout=-torch.rand(n, L, generator=g) * 2,
        teacher=-torch.rand(n, L, generator=g) * 2,
        scored=(torch.rand(n, L, generator=g) > 0.2).float(),
        top=-torch.rand(n, L, K, generator=g) * 3,
        teacher_top=-torch.rand(n, L, K, generator=g) * 3,
        top_mask=torch.rand(n, L, K, generator=g) > 0.3,
        mask=(torch.rand(n, L, generator=g) > 0.3).float(),
        adv=torch.randn(n, generator=g),
    )


def _distill_loss(t, remove, estimator, agg):
    lp = t["log_probs"].clone().requires_grad_(True)
    top = t["top"].clone().requires_grad_(True)
    inputs = LossInputs(
        lp, t["old"], t["adv"], t["mask"], rollout_log_probs=t["rollout"], teacher_log_probs=t["teacher"],
        teacher_mask=t["scored"], top_log_probs=top, teacher_top_log_probs=t["teacher_top"],
        teacher_top_mask=t["top_mask"],
    )
    config = LearnerConfig(estimator=estimator, loss_agg=agg, distill_coef=0.7, distill_topk_coef=0.3, dual_clip=3.0,
                           tis_cap=2.0)
    loss, metrics = total_loss(inputs.without_rows(remove), config)
    loss.backward()
    return loss, metrics, lp.grad, top.grad


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
@pytest.mark.parametrize("agg", ["token_mean", "sample_mean"])
@pytest.mark.parametrize("where", [0, 2, 6])
def test_removed_row_with_teacher_scores_contributes_exactly_nothing(estimator, agg, where):
    """A removed row, with a live mask and large teacher values, changes no loss,
    metric or gradient bit with lambda > 0 and the top-K term on."""
    base = _distill_tensors(seed=9)
    n = len(base["adv"])
    loss0, m0, g0, t0 = _distill_loss(base, None, estimator, agg)
    junk = {}
    for k, v in base.items():
        row = torch.full_like(v[:1], 50.0) if v.is_floating_point() else torch.ones_like(v[:1])
        junk[k] = torch.cat([v[:where], row, v[where:]])
    remove = torch.zeros(n + 1, dtype=torch.bool)
    remove[where] = True
    loss1, m1, g1, t1 = _distill_loss(junk, remove, estimator, agg)
    assert torch.equal(loss0, loss1)
    assert set(m0) == set(m1) and {"distill/reverse_kl", "distill/scored_frac", "distill/topk_kl"} <= set(m0)
    for k in m0:
        assert torch.equal(m0[k], m1[k]), k
    assert torch.equal(g1[~remove], g0) and torch.equal(t1[~remove], t0)
    assert not g1[remove].any() and not t1[remove].any()


@pytest.mark.parametrize("agg", ["token_mean", "sample_mean"])
def test_aborted_sessions_change_nothing_in_a_distillation_step(agg, placeholder):
    """Learner.step with lambda > 0 and top-K on groups with aborted members equals
    the step on the groups without them: every parameter (torch.equal) and metric."""
    rng = np.random.default_rng(5)
    groups = [scored_randomly(random_samples(rng, 4, 16, group=f"g{i}"), rng, vocab=16, k=2) for i in range(3)]
    with_aborts = [groups[0] + [placeholder("g0", "a0")], [placeholder("g1", "a1")] + groups[1], groups[2]]
    model = tiny_gpt()
    cfg = LearnerConfig(loss_agg=agg, distill_coef=0.5, distill_topk_coef=0.2, tis_cap=2.0, num_steps_per_rollout=2)
    a, b = Learner(copy.deepcopy(model), cfg), Learner(copy.deepcopy(model), cfg)
    ma = a.step([s for g in groups for s in g])
    mb = b.step([s for g in with_aborts for s in g])
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert mb["rollout/removed"] == 2 and ma["distill/scored_frac"] == 1.0 and ma["distill/topk_kl"] > 0
    skip = {"rollout/removed", "perf/step_s", "perf/tokens_per_s"}
    assert {k: v for k, v in ma.items() if k not in skip} == {k: v for k, v in mb.items() if k not in skip}


# ------------------------------------------------------------------ the learner


def test_unscored_samples_are_refused_when_distilling_and_trained_otherwise():
    rng = np.random.default_rng(6)
    samples = random_samples(rng, 4, 16)
    scored = scored_randomly(samples[:3], rng, vocab=16)
    partly = with_teacher(samples[3], np.zeros(samples[3].response_length), scored=np.zeros(samples[3].response_length))
    failed = msgspec.structs.replace(scored[0], session_id="f", metadata={"teacher_error": "big: timeout"})
    for extra in (samples[3], partly, failed):
        m = Learner(tiny_gpt(), LearnerConfig(distill_coef=0.5)).step(scored + [extra], advantages=[0.0] * 4)
        assert m["rollout/distill_refused"] == 1.0 and m["rollout/samples"] == 3.0
        m = Learner(tiny_gpt(), LearnerConfig(distill_topk_coef=0.5)).step(scored + [extra], advantages=[0.0] * 4)
        assert m["rollout/distill_refused"] == 1.0
        m = Learner(tiny_gpt(), LearnerConfig()).step(scored + [extra], advantages=[0.0] * 4)
        assert m["rollout/distill_refused"] == 0.0 and m["rollout/samples"] == 4.0
    # Through groups too: the unscored member is refused, the others train.
    m = Learner(tiny_gpt(), LearnerConfig(distill_coef=0.5)).step(scored + [samples[3]])
    assert m["rollout/distill_refused"] == 1.0 and m["rollout/samples"] == 3.0


def test_distill_metrics_do_not_depend_on_the_micro_batching():
    """distill/reverse_kl is the mean over trained scored tokens of the whole step,
    distill/scored_frac scored / trained, however the step is split."""
    rng = np.random.default_rng(8)
    samples = random_samples(rng, 6, 16)
    samples = [with_teacher(s, -rng.random(s.response_length) * 3, scored=rng.integers(0, 2, s.response_length))
               for s in samples]
    trained = np.concatenate([s.mask for s in samples]).astype(bool)
    scored = np.concatenate([s.teacher_mask for s in samples]).astype(bool)
    diff = np.concatenate([s.log_probs - s.teacher_lp for s in samples])
    for budget in (10_000, 12):
        m = Learner(tiny_gpt(), LearnerConfig(max_tokens_per_batch=budget)).step(samples, advantages=[0.0] * 6)
        assert m["perf/micro_batches"] > (1 if budget == 12 else 0)
        assert m["distill/reverse_kl"] == pytest.approx(diff[trained & scored].mean(), rel=1e-5)
        assert m["distill/scored_frac"] == pytest.approx((trained & scored).sum() / trained.sum(), rel=1e-6)


def _exact_kl(student: GPT, teacher: GPT, seqs: torch.Tensor, start: int) -> float:
    """Mean over the response positions of ``seqs`` of the exact KL(student || teacher) of the next token."""
    with torch.no_grad():
        ls = torch.log_softmax(student(seqs)[:, start - 1 : -1], -1)
        lt = torch.log_softmax(teacher(seqs)[:, start - 1 : -1], -1)
        return float((ls.exp() * (ls - lt)).sum(-1).mean())


def test_pure_distillation_moves_the_policy_toward_the_teacher():
    """All rewards equal (advantage 0): lambda = 0 leaves the weights exactly where
    they were; lambda > 0 alone trains the student on its own samples toward a
    sharper, different teacher, and the exact reverse KL falls."""
    V, P, R = 8, 2, 5
    student, teacher = tiny_gpt(0, vocab=V, max_seq_len=12), tiny_gpt(1, vocab=V, max_seq_len=12)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)  # a sharper teacher: a large KL to start from
    teacher.eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [[i % V, (3 * i + 1) % V] for i in range(8)]

    def rollout(model) -> list[Sample]:
        g = model.sample([p for p in prompts for _ in range(4)], R, generator=gen)
        out = []
        for j, (toks, lps) in enumerate(zip(g.tokens, g.log_probs)):
            p = prompts[j // 4]
            s = make_sample(f"g{j // 4}", f"s{j}", p, [int(t) for t in toks], reward=1.0,
                            log_probs=[float(x) for x in lps], sample_index=j % 4)
            (b,) = make_batches([s])
            t_lp = token_log_probs(teacher, b)[0][0].detach().numpy()
            out.append(with_teacher(s, t_lp))
        return out

    eval_seqs = torch.tensor([[*p, *np.random.default_rng(i).integers(0, V, R)] for i, p in enumerate(prompts * 2)])
    frozen = Learner(copy.deepcopy(student), LearnerConfig(lr=1e-2))
    before = {k: v.clone() for k, v in frozen.model.state_dict().items()}
    frozen.step(rollout(frozen.model))
    assert all(torch.equal(before[k], v) for k, v in frozen.model.state_dict().items())

    learner = Learner(student, LearnerConfig(lr=1e-2, distill_coef=1.0))
    kl0 = _exact_kl(student, teacher, eval_seqs, P)
    reverse = []
    for _ in range(15):
        m = learner.step(rollout(student))
        reverse.append(m["distill/reverse_kl"])
    kl1 = _exact_kl(student, teacher, eval_seqs, P)
    assert kl1 < 0.5 * kl0, (kl0, kl1)
    assert np.mean(reverse[-3:]) < 0.5 * np.mean(reverse[:3]), reverse
