"""Log-probs at each sample's recorded temperature, refusal of what cannot be
reproduced, and several optimiser steps per rollout (the trust region)."""

from __future__ import annotations

import copy

import msgspec
import numpy as np
import pytest
import torch
from learner_helpers import make_sample, random_samples

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import GPT
from agentlog.reducers.pipeline import reduce_log


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=32, max_seq_len=48, n_layer=1, d_model=32, n_head=2)


def sampled_log(model: GPT, temperatures: list[float], recorded: list[dict] | None = None) -> MemoryLog:
    """One group; member i is one turn drawn by ``GPT.sample`` at ``temperatures[i]``,
    recorded with ``recorded[i]`` as its sampling dict (default: the truth)."""
    log = MemoryLog(clock=lambda: 0)
    gen = torch.Generator().manual_seed(1)
    records = []
    for i, t in enumerate(temperatures):
        prompt = [1 + i, 2, 3 + i]
        out = model.sample([prompt], 10, temperature=t, generator=gen)
        sid = f"s{i}"
        records += [
            (sid, 0, SessionOpened(group_id="g", group_size=len(temperatures), sample_index=i)),
            (sid, 1, SessionStarted()),
            (sid, 2, TurnRecorded(turn_index=0, prompt_ids=prompt, output_ids=out.tokens[0].tolist(),
                                  output_log_probs=out.log_probs[0].tolist(), finish_reason=out.finish_reasons[0],
                                  sampling=recorded[i] if recorded else {"temperature": t})),
            (sid, 3, SessionFinished(reward=float(i % 2))),
        ]
    log.append_batch(records)
    return log


# ------------------------------------------------------------------ temperature


@pytest.mark.parametrize("packing", [True, False])
def test_samples_drawn_at_their_temperatures_are_reproduced_exactly_at_the_first_update(packing):
    model = tiny_gpt()
    temps = [0.7, 0.7, 1.3, 0.7]  # mixed temperatures share one micro-batch
    groups = reduce_log(sampled_log(model, temps)).groups
    assert [s.temperature for g in groups for s in g.samples] == temps
    m = Learner(copy.deepcopy(model), LearnerConfig(packing=packing, tis_cap=2.0)).step(groups)
    # Recorded rollout log-probs equal the learner's own within float tolerance: the TIS weight is 1.
    assert m["stats/rollout_logprob_abs_diff"] < 1e-5
    assert m["stats/clip_frac"] == 0.0 and m["stats/approx_kl"] == 0.0


def test_the_same_tokens_taken_at_temperature_one_are_not_reproduced():
    # What the learner computed before samples carried their temperature.
    model = tiny_gpt()
    groups = reduce_log(sampled_log(model, [0.7, 0.7])).groups
    at_one = [msgspec.structs.replace(s, temperature=1.0) for g in groups for s in g.samples]
    m = Learner(copy.deepcopy(model), LearnerConfig()).step(at_one, advantages=[1.0, -1.0])
    assert m["stats/rollout_logprob_abs_diff"] > 1e-2


def test_reference_and_entropy_use_the_sample_temperature():
    # With kl_coef the reference is the initial policy: at the first step KL is 0 only if
    # the reference's log-probs are taken at the same temperature as the policy's.
    model = tiny_gpt()
    groups = reduce_log(sampled_log(model, [0.5, 0.5])).groups
    m = Learner(copy.deepcopy(model), LearnerConfig(kl_coef=0.1)).step(groups)
    assert m["loss/kl"] == pytest.approx(0.0, abs=1e-7)
    hot = Learner(copy.deepcopy(model), LearnerConfig()).step(
        [msgspec.structs.replace(s, temperature=3.0) for g in groups for s in g.samples], advantages=[1.0, -1.0]
    )
    assert hot["stats/entropy"] > m["stats/entropy"]  # a hotter distribution has more entropy


# ------------------------------------------------------------------ refusal


def test_truncated_sampling_recorded_by_a_backend_is_refused_with_its_reason():
    model = tiny_gpt()
    recorded = [{"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 5},
                {"temperature": 1.0}]
    groups = reduce_log(sampled_log(model, [1.0] * 4, recorded)).groups
    refused = [s for g in groups for s in g.samples if s.remove_sample]
    assert [s.session_id for s in refused] == ["s0", "s2"]
    assert all("kept-token sets" in s.metadata["sampling_error"] for s in refused)
    m = Learner(copy.deepcopy(model), LearnerConfig()).step(groups)
    assert m["rollout/sampling_refused"] == 2.0 and m["rollout/samples"] == 2.0
    assert m["rollout/valid_members"] == 4.0  # their rewards still form the baseline


def test_hand_built_truncated_samples_are_refused_by_the_learner():
    samples = random_samples(np.random.default_rng(3), 4, 32)
    samples[1] = msgspec.structs.replace(samples[1], top_p=0.95)
    learner = Learner(tiny_gpt())
    m = learner.step(samples, advantages=[1.0, 1.0, -1.0, -1.0])
    assert m["rollout/sampling_refused"] == 1.0 and m["rollout/samples"] == 3.0
    only = Learner(tiny_gpt())
    m = only.step([samples[1]], advantages=[1.0])
    assert m["learner/skipped"] == 1.0 and only.policy_version == 0


# ------------------------------------------------------------------ several steps per rollout


def _bandit(n: int = 8) -> tuple[list, list[float]]:
    samples = [make_sample("g", f"s{i}", [1, 2, 3], [4 + i % 3, 5, 6], reward=float(i % 2), sample_index=i)
               for i in range(n)]
    return samples, [1.0 if i % 2 else -1.0 for i in range(n)]


def test_clip_acts_only_with_several_steps_per_rollout():
    samples, adv = _bandit()
    # StatelessAdam moves every weight by about lr: after the first mini-batch the ratio must leave [0.8, 1.28].
    cfg = dict(optimizer="stateless_adam", lr=0.3, grad_clip=None)
    one = Learner(tiny_gpt(), LearnerConfig(num_steps_per_rollout=1, **cfg)).step(samples, adv)
    four = Learner(tiny_gpt(), LearnerConfig(num_steps_per_rollout=4, **cfg)).step(samples, adv)
    assert one["stats/clip_frac"] == 0.0 and one["learner/optimizer_steps"] == 1.0
    assert four["stats/clip_frac"] > 0.0 and four["learner/optimizer_steps"] == 4.0


def test_each_mini_batch_is_one_optimiser_step_and_one_policy_version():
    samples, adv = _bandit(6)
    learner = Learner(tiny_gpt(), LearnerConfig(num_steps_per_rollout=3, warmup_steps=10))
    learner.step(samples, adv)
    assert learner.scheduler.last_epoch == 3 and learner.policy_version == 1
    assert learner.optimizer.state[learner.optimizer.param_groups[0]["params"][0]]["step"] == 3
    few = Learner(tiny_gpt(), LearnerConfig(num_steps_per_rollout=10))
    assert few.step(samples[:2], adv[:2])["learner/optimizer_steps"] == 2.0  # never an empty mini-batch


def test_the_first_mini_batch_trains_like_a_step_on_it_alone():
    samples, adv = _bandit(8)
    # Zero advantages in the second half: its mini-batch has zero gradient, and
    # StatelessAdam (no momentum) then leaves the weights where the first left them.
    quiet = adv[:4] + [0.0] * 4
    model = tiny_gpt()
    cfg = dict(optimizer="stateless_adam", lr=0.05, grad_clip=None)
    split = Learner(copy.deepcopy(model), LearnerConfig(num_steps_per_rollout=2, **cfg))
    alone = Learner(copy.deepcopy(model), LearnerConfig(**cfg))
    assert split.step(samples, quiet)["learner/optimizer_steps"] == 2.0
    alone.step(samples[:4], adv[:4])
    for (name, p), q in zip(split.model.named_parameters(), alone.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=name)
    assert any(not torch.equal(p, p0) for p, p0 in zip(split.model.parameters(), model.parameters()))


def test_a_non_finite_gradient_in_a_later_mini_batch_leaves_the_step_unapplied():
    samples, adv = _bandit(6)
    adv[4] = float("inf")  # only the third mini-batch sees it
    learner = Learner(tiny_gpt(), LearnerConfig(num_steps_per_rollout=3, warmup_steps=5))
    learner.step(samples[:2], [1.0, -1.0])  # some optimiser state to restore
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    moments = copy.deepcopy(learner.optimizer.state_dict())
    epoch = learner.scheduler.last_epoch
    with pytest.raises(FloatingPointError, match="mini-batch 3 of 3.*no update of this step was applied"):
        learner.step(samples, adv)
    assert all(torch.equal(v, weights[k]) for k, v in learner.model.state_dict().items())
    after = learner.optimizer.state_dict()
    for key, state in moments["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value)), (key, name)
    assert learner.scheduler.last_epoch == epoch and learner.policy_version == 1 and learner.steps == 1
    learner.step(samples[:2], [1.0, -1.0])  # and it trains on afterwards
    assert learner.policy_version == 2


def test_a_plain_sample_list_keeps_a_sampling_refused_member_in_the_baseline_as_its_groups_do():
    """A row refused for its sampling (top_p, top_k) is not trained, but its session's reward stays in the
    baseline. step(groups) did so; step(samples), the documented alternative, took the member out."""
    model = tiny_gpt()
    recorded = [{"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.0}, {"temperature": 1.0, "top_k": 5},
                {"temperature": 1.0}]
    groups = reduce_log(sampled_log(model, [1.0] * 4, recorded)).groups
    learner = Learner(copy.deepcopy(model), LearnerConfig())
    s_groups, adv_groups, m_groups = learner.prepare(groups)
    s_plain, adv_plain, m_plain = learner.prepare([s for g in groups for s in g.samples])
    assert [s.session_id for s in s_plain] == [s.session_id for s in s_groups] == ["s1", "s3"]
    assert m_plain["rollout/valid_members"] == m_groups["rollout/valid_members"] == 4.0
    assert torch.equal(adv_plain, adv_groups)


@pytest.mark.parametrize("rewards, estimator", [([1e308, 1e308, 0.0], "grpo"), ([1e200, -1e200, 0.0, 0.0], "grpo"),
                                                ([1e39, 0.0], "dr_grpo")])
def test_rewards_too_large_to_normalise_are_refused_naming_the_group(rewards, estimator):
    """Finite rewards whose sum or squares leave float64 gave NaN advantages (an error about the gradient norm
    much later) or, through an infinite std, a silent 0; past float32, dr_grpo gave inf."""
    from agentlog.learner.advantages import compute_advantages

    with pytest.raises(ValueError, match=r"group 7 are too large to normalise"):
        compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor([7] * len(rewards)),
                           torch.tensor([True] * len(rewards)), estimator, dtype=torch.float32)  # as the learner asks
