"""The learner side of the loop in-process: skipped groups and staleness handling."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import numpy as np
import torch

from agentlog.engine.tasks import select_task
from agentlog.learner.batching import make_batches
from agentlog.learner.model import token_log_probs
from agentlog.reducers.samples import COMPLETED, Sample, digest_samples
from agentlog.loop.policy import GenerationBatcher, build_model
from agentlog.reducers.partitioned import ReleasedGroup
from agentlog.loop.trainer import LoopLearner
from agentlog.loop.learner_records import step_digest

from loop_helpers import build_groups, small_config

GOOD = [("finish", 1.0, 0, -0.1), ("finish", 0.0, 0, -0.1), ("finish", 1.0, 0, -0.1), ("finish", 0.0, 0, -0.1)]


def released(*groups):
    """The groups as the learner's partition fold hands them over (partition 0)."""
    return [ReleasedGroup(0, g, ()) for g in groups]


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_all_aborted_group_is_skipped_with_its_reason_and_trains_nothing(tmp_path: Path) -> None:
    """A group whose members all aborted is recorded as skipped with the reducer's
    reason; alone it takes no optimiser step (same version, same weights)."""
    groups = build_groups({"dead": [("abort", 0.0, 0, 0.0)] * 4})
    dead = groups["dead"]
    assert dead.skipped
    ll = LoopLearner(tmp_path, small_config())
    before = _params(ll.model)
    rec = ll.train_step(1, released(dead), 0, dead.lsn_released, {})
    assert rec.groups == [] and rec.skipped == {"dead": dead.skip_reason}
    assert "valid" in dead.skip_reason
    assert rec.policy_version == 0 and ll.learner.policy_version == 0
    assert rec.metrics["learner/skipped"] == 1.0
    assert rec.metrics["rollout/aborted"] == 4.0
    assert math.isnan(rec.metrics["rollout/reward_mean"])
    assert rec.sample_digest == digest_samples([])
    after = _params(ll.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not list((tmp_path / "checkpoints").glob("*.pt"))


def test_all_aborted_group_next_to_a_trained_one_changes_nothing_in_the_step(tmp_path: Path) -> None:
    """With a normal group beside it, the all-aborted group is skipped: the step
    trains the normal group only, with the same weights as training it alone."""
    groups = build_groups({"dead": [("abort", 0.0, 0, 0.0)] * 4, "ok": GOOD})
    a = LoopLearner(tmp_path / "a", small_config())
    rec = a.train_step(1, released(groups["dead"], groups["ok"]), 0, 10, {})
    b = LoopLearner(tmp_path / "b", small_config())
    b.train_step(1, released(groups["ok"]), 0, 10, {})
    assert rec.groups == ["ok"] and list(rec.skipped) == ["dead"]
    assert rec.policy_version == 1
    assert rec.sample_digest == step_digest([groups["ok"]])
    pa, pb = _params(a.model), _params(b.model)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_stale_group_is_dropped_with_reason_in_drop_mode(tmp_path: Path) -> None:
    """staleness_mode=drop: a group generated more than max_staleness versions ago
    is skipped with reason ``stale``; a fresh group in the same step trains."""
    groups = build_groups({
        "old": [(o, r, 0, lp) for o, r, _, lp in GOOD],
        "new": [(o, r, 3, lp) for o, r, _, lp in GOOD],
    })
    ll = LoopLearner(tmp_path, small_config(staleness_mode="drop", max_staleness=1))
    ll.learner.policy_version = 3
    rec = ll.train_step(4, released(groups["old"], groups["new"]), 0, 10, {})
    assert rec.groups == ["new"]
    assert rec.skipped["old"].startswith("stale:") and "3 versions behind" in rec.skipped["old"]
    assert rec.metrics["rollout/staleness_max"] == 3.0
    assert rec.policy_version == 4


def test_stale_group_is_importance_corrected_in_correct_mode(tmp_path: Path) -> None:
    """staleness_mode=correct (the default): the stale group trains with truncated
    importance sampling against its rollout log-probs: weights beyond the cap are
    clipped (the rollout policy gave these tokens far less mass than ours)."""
    groups = build_groups({
        "old": [(o, r, 0, -100.0) for o, r, _, _ in GOOD],
        "new": [(o, r, 3, -0.1) for o, r, _, _ in GOOD],
    })
    cfg = small_config(max_staleness=1)
    assert cfg.staleness_mode == "correct"
    ll = LoopLearner(tmp_path, cfg)
    assert ll.learner.config.tis_cap == cfg.tis_cap
    ll.learner.policy_version = 3
    rec = ll.train_step(4, released(groups["old"], groups["new"]), 0, 10, {})
    assert rec.groups == ["old", "new"] and rec.skipped == {}
    assert rec.metrics["rollout/stale_corrected"] == 1.0
    assert rec.metrics["stats/tis_clip_frac"] > 0.0


def test_drop_mode_trains_without_importance_correction(tmp_path: Path) -> None:
    """Without correct mode the learner config carries no TIS cap."""
    ll = LoopLearner(tmp_path, small_config(staleness_mode="drop"))
    assert ll.learner.config.tis_cap is None


def test_training_stops_once_the_moving_reward_reaches_the_target(tmp_path: Path) -> None:
    """stop_reward: the step whose window mean reaches the target is marked final."""
    ll = LoopLearner(tmp_path, small_config(steps=100, stop_reward=0.5, stop_window=3))
    assert ll.stop_reason() == ""
    ll.recent_rewards = [0.1, 0.5, 0.6]
    assert ll.stop_reason() == ""
    ll.recent_rewards.append(0.6)  # window [0.5, 0.6, 0.6]
    assert ll.stop_reason() == "reward"
    groups = build_groups({"ok": GOOD})
    ll.recent_rewards = [0.5, 0.5]
    rec = ll.train_step(1, released(groups["ok"]), 0, 10, {})  # this step's reward is 0.5
    assert rec.metrics["loop/final"] == 1.0 and rec.metrics["loop/stopped_by_reward"] == 1.0


def test_a_group_sampled_with_top_p_is_skipped_with_the_sampling_reason(tmp_path: Path) -> None:
    """Rows sampled with top_p < 1 cannot be trained (no kept-token sets): a group
    made only of them is reported skipped with that reason, not counted as trained."""
    groups = build_groups({"cut": GOOD, "ok": GOOD}, sampling={"cut": {"temperature": 1.0, "top_p": 0.9}})
    ll = LoopLearner(tmp_path, small_config())
    rec = ll.train_step(1, released(groups["cut"], groups["ok"]), 0, 10, {})
    assert rec.groups == ["ok"] and list(rec.skipped) == ["cut"]
    assert rec.skipped["cut"].startswith("sampling: session cut-s0 row 0: sampled with top_p=0.9")
    assert rec.sample_digest == step_digest([groups["ok"]]) and rec.policy_version == 1


def test_the_rollout_temperature_drives_the_sampler_and_its_log_probs() -> None:
    """LoopConfig.temperature reaches the worker's sampler: the log-probs it returns
    are those of logits / temperature (what the turn records and the learner retakes)."""
    cfg = small_config(temperature=0.6, embedding_init_std=0.1)
    task = select_task(cfg.task)
    model = build_model(cfg, task)
    batcher = GenerationBatcher(model, task, seed=0, temperature=cfg.temperature)
    prompt = list(task.new_episode(random.Random(0)).prompt_ids)

    async def one():
        batcher.register()
        try:
            return await batcher.generate(prompt)
        finally:
            batcher.unregister()
            await batcher.close()

    gen = asyncio.run(one())
    out = [int(t) for t in gen.tokens]
    sample = Sample("g", "s", 0, np.asarray(prompt + out, "<i4").tobytes(), len(out), b"\x01" * len(out),
                    np.asarray(gen.log_probs, "<f4").tobytes(), 1.0, COMPLETED, temperature=cfg.temperature)
    (batch,) = make_batches([sample])
    np.testing.assert_allclose(token_log_probs(model, batch)[0][0].detach().numpy(), gen.log_probs, atol=1e-5)
    assert not np.allclose(token_log_probs(model, batch, 1.0)[0][0].detach().numpy(), gen.log_probs, atol=1e-3)
