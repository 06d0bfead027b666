"""The run's progress bar: the warm-up is a phase of its own (its steps, read
from the learner's process log as the real warm-up writes it), and in RL the
bar measures the stop rule (the nearer of the step and time limits), so it is
not stuck at 0/400 while the warm-up runs, nor at 30/400 when the reward
target stops the run."""

from __future__ import annotations

import io
import re

from agentlog.engine.tasks import select_task
from agentlog.events.schema.types import PolicyUpdated
from agentlog.loop.config import FaultConfig, LoopConfig
from agentlog.loop.demo.warmup import supervised_warmup
from agentlog.loop.policy import build_model
from agentlog.tools.progress import LoopProgress
from agentlog.loop.runlog import configure_process_logging, restore_logging


def _record(step: int, reward: float, final: bool = False) -> PolicyUpdated:
    metrics = {"rollout/reward_mean": reward, "loop/final": 1.0 if final else 0.0}
    return PolicyUpdated(step=step, policy_version=step, checkpoint="", metrics=metrics,
                         groups=[] if step == 0 else ["g0"])


def test_the_bar_shows_the_warm_up_then_rl_against_the_stop_rule(tmp_path):
    cfg = LoopConfig(warmup_steps=20, warmup_batch=4, warmup_threads=1, steps=400, time_budget_s=150.0, stop_reward=0.9, stop_window=2,
                     faults=FaultConfig.none(), d_model=16, n_layer=1, n_head=2)
    console = io.StringIO()
    bar = LoopProgress(cfg, tmp_path, "agentlog train", console)
    # The learner's warm-up, logging as in its own process (logs/learner.jsonl).
    with restore_logging():
        configure_process_logging(tmp_path, "learner")
        task = select_task(cfg.task)
        supervised_warmup(build_model(cfg, task), task, cfg)
    bar.tick()
    assert bar.phase == "warm-up" and bar.bar.n == bar.bar.total == 20
    assert "agentlog train warm-up" in console.getvalue() and "20/20" in console.getvalue(), console.getvalue()

    bar.policy(_record(0, 0.0), "")  # the warm-up's checkpoint: RL starts
    assert bar.phase == "RL" and bar.bar.total == 100
    bar.policy(_record(1, 0.2), "reward 0.200")
    last = console.getvalue().split("\r")[-1]
    assert "agentlog train RL" in last, last
    assert "v1/400 steps" in last and re.search(r"\d+/150 s", last) and "reward(2) 0.20 -> 0.9" in last, last
    assert bar.bar.n < 100, last

    bar.policy(_record(2, 1.0, final=True), "reward 1.000")  # stopped by the reward target at v2
    last = console.getvalue().split("\r")[-1]
    assert bar.bar.n == 100 and "100%" in last and "reward(2) 0.60 -> 0.9" in last, last
    bar.close()


def test_the_rl_bar_follows_the_nearer_limit(tmp_path):
    cfg = LoopConfig(warmup_steps=0, steps=10, time_budget_s=0, faults=FaultConfig.none())
    bar = LoopProgress(cfg, tmp_path, "agentlog demo", io.StringIO())
    assert bar.phase == "RL"
    bar.policy(_record(0, 0.0), "")
    bar.policy(_record(4, 0.5), "")
    assert bar.fraction() == 0.4 and bar.bar.n == 40  # no time budget: the step limit alone
    bar.close()
