"""A learner step that trains nothing (every group of its batch skipped) does not stall the loop.

Such a step publishes a record without a new version (``learner/skipped``).
The worker paces itself by the learner's steps, not its versions, so it runs
the next batch on the version it has; with ``max_lag = 0`` pacing by version
would wait for a version that only that next batch can produce.
"""

from __future__ import annotations

import asyncio

import pytest

from agentlog.engine.tasks import register_task
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import SessionAborted, SessionFinished, SessionOpened, TurnRecorded
from agentlog.loop import FaultConfig, LoopConfig, LoopLearner, RolloutWorker, check_run
from agentlog.events import read_log
from agentlog.loop.learner_records import read_learner_records

from test_gateway_rollout import EchoWordTask


class FirstBatchFailsTask(EchoWordTask):
    """echo-word, whose sandbox set-up fails for the first ``failures`` sessions (all of batch 0)."""

    name = "echo-word-first-batch-fails"
    failures = 4

    async def setup(self, episode, sandbox):
        cls = type(self)
        if cls.failures > 0:
            cls.failures -= 1
            raise OSError("the sandbox image is not there yet")
        await super().setup(episode, sandbox)


register_task(FirstBatchFailsTask.name)(FirstBatchFailsTask)


@pytest.mark.required
def test_a_step_whose_every_group_was_skipped_does_not_stall_the_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(FirstBatchFailsTask, "failures", 4)
    cfg = LoopConfig(task=FirstBatchFailsTask.name, steps=2, groups_per_step=2, group_size=2, warmup_steps=0, faults=FaultConfig.none(),
                     stop_reward=0, time_budget_s=0, max_lag=0, d_model=32, n_layer=1, n_head=2,
                     agent={"harness": "python-agent", "budget_s": 60}, inference={"context_length": 512})
    run_dir = tmp_path / "run"

    async def train() -> None:
        await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), RolloutWorker(run_dir, cfg).run()), 60)

    asyncio.run(train())
    records = read_learner_records(run_dir / "learner")
    assert [(r.step, r.policy_version, len(r.skipped)) for r in records] == [(0, 0, 0), (1, 0, 2), (2, 1, 0), (3, 2, 0)]
    envs = list(read_log(run_dir / "rollout", 0))
    ends = {e.session_id: e.body for e in envs if isinstance(e.body, (SessionFinished, SessionAborted))}
    assert len([e for e in envs if isinstance(e.body, SessionOpened)]) == len(ends) == 12
    assert {sid[:6] for sid, end in ends.items() if isinstance(end, SessionAborted) and end.reason == "setup_failed:OSError"} == {"b00000"}
    versions = {(e.session_id[:6], e.body.policy_version) for e in full_turns(envs) if isinstance(e.body, TurnRecorded)}
    assert versions == {("b00001", 0), ("b00002", 1)}, versions  # batch 1 ran on the version it had
    check = check_run(run_dir, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
