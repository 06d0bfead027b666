"""Pruning checkpoints never deletes the one the learner log's newest record names (the resume point)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentlog.loop import FaultConfig, LoopLearner, RolloutWorker
from agentlog.loop import trainer as trainer_mod
from agentlog.loop.learner_records import read_learner_records

from loop_helpers import small_config


def test_a_failed_publish_leaves_the_last_published_checkpoint_in_place(tmp_path, monkeypatch):
    """With keep_checkpoints = 1 the learner pruned the previous version's checkpoint (the one the learner
    log's newest record names: the resume point) before appending the new record; a publish that then
    fails (a failed fsync, a kill) left a learner log whose resume point is gone."""
    cfg = small_config(steps=3, groups_per_step=2, group_size=2, faults=FaultConfig.none(), stop_reward=0, time_budget_s=0,
                       max_lag=0, d_model=32, n_layer=1, n_head=2, keep_checkpoints=1)
    run_dir = tmp_path / "run"
    real_publish = trainer_mod.publish

    def failing_publish(llog, record, weights=None):
        if record.step == 2:
            raise OSError(5, "Input/output error (injected: the learner log's fsync failed)")
        return real_publish(llog, record, weights)

    monkeypatch.setattr(trainer_mod, "publish", failing_publish)

    async def train() -> None:
        learner = asyncio.ensure_future(LoopLearner(run_dir, cfg).run())
        worker = asyncio.ensure_future(RolloutWorker(run_dir, cfg).run())
        try:
            with pytest.raises(OSError):
                await asyncio.wait_for(learner, 60)
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    asyncio.run(train())
    records = read_learner_records(run_dir / "learner")
    assert records[-1].step == 1
    assert Path(records[-1].checkpoint).exists(), (
        f"the learner log's newest record (the resume point) names {records[-1].checkpoint}, deleted by a step that never published")
    # ...and a restarted learner resumes from it.
    monkeypatch.setattr(trainer_mod, "publish", real_publish)

    async def resume() -> None:
        await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), RolloutWorker(run_dir, cfg).run()), 60)

    asyncio.run(resume())
    assert read_learner_records(run_dir / "learner")[-1].policy_version == 3
