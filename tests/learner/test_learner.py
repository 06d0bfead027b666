"""Learner.step end to end: parameters move, a bandit is learnt, groups, checkpoints, micro-batches."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from learner_helpers import make_sample, random_samples
from torch.testing import assert_close

from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner, load_weights, save_weights
from agentlog.learner.model import GPT
from agentlog.reducers.groups import Group, GroupMember
from agentlog.reducers.samples import aborted_placeholder


def tiny_gpt(seed=0, vocab=32):
    torch.manual_seed(seed)
    return GPT(vocab_size=vocab, max_seq_len=32, n_layer=1, d_model=32, n_head=2)


def test_one_step_changes_every_trained_parameter():
    model = tiny_gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(model, LearnerConfig())
    samples = random_samples(np.random.default_rng(0), 8, 32)
    metrics = learner.step(samples)
    assert learner.policy_version == 1 and metrics["learner/policy_version"] == 1.0
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p)]
    assert "tok_emb.weight" in changed and "blocks.0.attn.qkv.weight" in changed
    assert np.isfinite(metrics["loss/policy"]) and metrics["stats/grad_norm"] > 0
    for key in ("loss/policy", "stats/clip_frac", "stats/approx_kl", "stats/entropy", "stats/tis_clip_frac",
                "rollout/reward_mean", "perf/tokens_per_s"):
        assert key in metrics


def _bandit(seed: int, steps: int, abort_rate: float = 0.0) -> list[float]:
    """Contextual one-turn bandit: prompt token k in 1..4, reward 1 for answering k + 6 (chance 1/12)."""
    model = tiny_gpt(seed, vocab=12)
    learner = Learner(model, LearnerConfig(lr=1e-2))
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    history = []
    for step in range(steps):
        keys = torch.randint(1, 5, (8,), generator=g).tolist()
        prompts = [[k] for k in keys for _ in range(8)]
        gen = model.sample(prompts, max_new_tokens=1, generator=g)
        samples, rewards = [], []
        for i, (p, tok, lp) in enumerate(zip(prompts, gen.tokens, gen.log_probs)):
            gid, sid = f"{step}/{i // 8}", f"{step}/{i}"
            if rng.random() < abort_rate:
                samples.append(aborted_placeholder(gid, sid, i % 8, "timeout"))
                continue
            reward = float(int(tok[0]) == p[0] + 6)
            rewards.append(reward)
            samples.append(make_sample(gid, sid, p, tok.tolist(), reward=reward, log_probs=lp.tolist(),
                                       sample_index=i % 8))
        learner.step(samples)
        history.append(float(np.mean(rewards)))
    return history


@pytest.mark.parametrize("seed, abort_rate", [(0, 0.0), (1, 0.0), (2, 0.2)])
def test_a_few_dozen_steps_on_a_one_turn_bandit_raise_mean_reward(seed, abort_rate):
    history = _bandit(seed, steps=40, abort_rate=abort_rate)
    first, last = np.mean(history[:5]), np.mean(history[-5:])
    assert first < 0.3
    assert last > first + 0.5, history


def test_released_groups_train_like_their_samples():
    """Skipped groups and invalid members (aborted or without a usable reward) train nothing."""
    rng = np.random.default_rng(4)
    live = random_samples(rng, 3, 32, group="live")
    extra = random_samples(rng, 1, 32, group="live")[0]

    def member(s, valid=True, reward=None):
        return GroupMember(s.session_id, s.sample_index, "finished", valid,
                           s.reward if reward is None else reward, samples=(s,))

    ph = aborted_placeholder("live", "ab", 7, "timeout")
    group = Group(group_id="live", group_size=6,
                  members=(member(live[0]), member(live[1]), member(live[2]),
                           GroupMember("ab", 7, "aborted", False, None, "timeout", (ph,)),
                           member(extra, valid=False, reward=None)),
                  dropped=("dropped-1",), skipped=False, skip_reason="", release_index=0, lsn_released=10)
    skipped_samples = random_samples(rng, 2, 32, group="skip")
    skipped = Group(group_id="skip", group_size=2, members=tuple(member(s) for s in skipped_samples), dropped=(),
                    skipped=True, skip_reason="1 valid member(s) < 2", release_index=1, lsn_released=11)

    model = tiny_gpt()
    a, b = Learner(copy.deepcopy(model)), Learner(copy.deepcopy(model))
    ma = a.step([group, skipped])
    mb = b.step(live)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert ma["rollout/groups_skipped"] == 1.0 and ma["rollout/removed"] == 2.0
    assert ma["rollout/samples"] == mb["rollout/samples"] == 3.0
    assert ma["rollout/reward_mean"] == mb["rollout/reward_mean"]


def test_rows_of_one_session_share_its_advantage_and_count_once_in_the_baseline():
    """A session that forked into two rows is one member of its group."""
    s = [make_sample("g", "a", [1], [2, 3], reward=1.0, row_index=0),
         make_sample("g", "a", [1, 2, 3, 4], [5], reward=1.0, row_index=1),
         make_sample("g", "b", [1], [6], reward=0.0)]
    learner = Learner(tiny_gpt())
    samples, adv, metrics = learner.prepare(s)
    assert metrics["rollout/valid_members"] == 2.0
    assert adv[0] == adv[1] > 0 > adv[2]
    bad = s + [make_sample("g", "a", [1], [7], reward=0.5, row_index=2)]
    with pytest.raises(ValueError, match="session 'a' .*different rewards"):
        learner.prepare(bad)


def test_non_finite_reward_is_rejected_naming_the_session():
    s = [make_sample("g", "ok", [1], [2], reward=1.0), make_sample("g", "nanny", [1], [3], reward=float("nan"))]
    with pytest.raises(ValueError, match="session 'nanny'.*non-finite"):
        Learner(tiny_gpt()).step(s)


def test_explicit_advantages_train_a_plain_sample_list():
    s = random_samples(np.random.default_rng(5), 4, 32)
    learner = Learner(tiny_gpt())
    m = learner.step(s, advantages=[1.0, -1.0, 0.5, -0.5])
    assert m["rollout/samples"] == 4.0 and learner.policy_version == 1
    with pytest.raises(ValueError, match="4 samples but 3 advantages"):
        learner.step(s, advantages=[1.0, 2.0, 3.0])


@pytest.mark.parametrize("loss_agg", ["token_mean", "sample_mean"])
@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_give_the_same_update_as_one_batch(loss_agg, packing):
    """Gradient accumulation uses the step's global denominators."""
    samples = random_samples(np.random.default_rng(6), 12, 32, max_prompt=8, max_response=10)
    model = tiny_gpt()
    # eps >> |g| makes StatelessAdam an SGD step of size lr * g: the update shows the gradient itself.
    cfg = dict(loss_agg=loss_agg, packing=packing, optimizer="stateless_adam", lr=1.0, adam_eps=1.0, grad_clip=None)
    one = Learner(copy.deepcopy(model), LearnerConfig(max_tokens_per_batch=100_000, **cfg))
    many = Learner(copy.deepcopy(model), LearnerConfig(max_tokens_per_batch=48, **cfg))
    m1, m2 = one.step(samples), many.step(samples)
    assert m1["perf/micro_batches"] == 1 and m2["perf/micro_batches"] > 2
    for k in ("loss/policy", "stats/entropy", "stats/approx_kl"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-7), k
    for (n, p1), p2, p0 in zip(one.model.named_parameters(), many.model.parameters(), model.parameters()):
        assert_close(p1 - p0, p2 - p0, rtol=1e-4, atol=1e-6, msg=n)
    assert any((p1 - p0).abs().max() > 1e-3 for p1, p0 in zip(one.model.parameters(), model.parameters()))


def test_several_steps_per_rollout_move_the_ratio_off_one():
    samples = random_samples(np.random.default_rng(8), 8, 32)
    learner = Learner(tiny_gpt(), LearnerConfig(num_steps_per_rollout=4, lr=5e-2))
    m = learner.step(samples)
    assert m["stats/approx_kl"] > 0 and learner.policy_version == 1 and learner.steps == 1


def test_kl_penalty_uses_a_frozen_copy_of_the_initial_policy():
    model = tiny_gpt()
    initial = copy.deepcopy(model)
    learner = Learner(model, LearnerConfig(kl_coef=0.1, lr=1e-2))
    samples = random_samples(np.random.default_rng(9), 8, 32)
    m1 = learner.step(samples)
    m2 = learner.step(samples)
    assert m1["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at first
    assert m2["loss/kl"] > 0
    for p, q in zip(learner.ref_model.parameters(), initial.parameters()):
        assert torch.equal(p, q) and not p.requires_grad


def test_checkpoint_resumes_exactly(tmp_path):
    samples = random_samples(np.random.default_rng(10), 8, 32)
    cfg = LearnerConfig(warmup_steps=3, kl_coef=0.05)
    a = Learner(tiny_gpt(), cfg)
    a.step(samples)
    path = a.save_checkpoint(tmp_path / "ckpt" / "step1.pt")
    b = Learner(tiny_gpt(seed=123), cfg)
    b.load_checkpoint(path)
    assert b.policy_version == 1 and b.steps == 1
    ma, mb = a.step(samples), b.step(samples)
    assert ma["learner/lr"] == mb["learner/lr"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert not list(tmp_path.glob("ckpt/*.tmp"))  # written atomically


def test_rollout_workers_load_weights_from_either_file(tmp_path):
    learner = Learner(tiny_gpt())
    learner.step(random_samples(np.random.default_rng(11), 4, 32))
    worker = tiny_gpt(seed=5)
    load_weights(worker, learner.save_checkpoint(tmp_path / "c.pt"))
    assert all(torch.equal(p, q) for p, q in zip(worker.parameters(), learner.model.parameters()))
    other = tiny_gpt(seed=6)
    load_weights(other, save_weights(learner.model, tmp_path / "w.pt"))
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), learner.model.parameters()))
    assert other.lm_head.weight is other.tok_emb.weight  # tying survives loading


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_loading_a_checkpoint_never_unpickles_code(tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    torch.save({"format": "agentlog.learner.v1", "model": _Exploit()}, evil)
    with pytest.raises(ValueError, match="evil.pt.*weights-only"):
        Learner(tiny_gpt()).load_checkpoint(evil)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(ValueError, match="raw.pkl"):
        load_weights(tiny_gpt(), raw)
    assert "pwned" not in capsys.readouterr().out


def test_a_file_of_the_wrong_kind_is_rejected(tmp_path):
    p = save_weights(tiny_gpt(), tmp_path / "w.pt")
    with pytest.raises(ValueError, match="not a learner checkpoint"):
        Learner(tiny_gpt()).load_checkpoint(p)
