"""The on-policy distillation benchmark at its smallest: one seed, a 5-step warm-up, both arms (RL alone, and OPD
with the demo's teacher built) through the real two-process loop for 10 steps of 4 prompts x 4; its table and its
GOAL line."""

from __future__ import annotations

import math
import re

import pytest

from agentlog.tools.bench import bench_distill

MAX_STEPS, WARMUP_STEPS = 10, 5
NEVER = MAX_STEPS + 1  # what a run that never reaches the target counts


# Slow: two runs of the loop start four processes that each import torch, and the OPD arm builds
# the demo's teacher (trained until it solves the task); even at this size that is ~20 s of CPU.
@pytest.mark.slow
def test_the_benchmark_runs_both_arms_from_one_warmup_and_prints_its_goal_line_last(capsys, tmp_path):
    argv = ["--seeds", "1", "--max-steps", str(MAX_STEPS), "--warmup-steps", str(WARMUP_STEPS),
            "--groups-per-step", "4", "--group-size", "4", "--keep", str(tmp_path)]
    assert bench_distill.main(argv) == 0
    out = capsys.readouterr().out
    goals = re.findall(r"^GOAL ([\w.]+): ([\d.]+)x \(goal <= 0.5x\) (PASS|MISS)$", out, re.M)
    assert [g[0] for g in goals] == ["opd_steps_to_0.9_vs_rl"], out
    assert out.rstrip().splitlines()[-1].startswith("GOAL "), out
    ratio = float(goals[0][1])
    assert math.isfinite(ratio) and ratio > 0, out

    # One warm-up for the seed, shared by both arms.
    assert len(re.findall(rf"^seed 0 warm-up: {WARMUP_STEPS} steps, loss [\d.]+", out, re.M)) == 1, out
    assert f"4 prompts x 4 samples per step, one shared warm-up of {WARMUP_STEPS} steps per seed" in out, out
    assert "seeds 0..0, OPD lambda" in out and f"(never: {NEVER})" in out, out
    steps = {}
    for arm in ("rl", "opd"):
        run = re.search(rf"^seed 0 {arm:<3} steps to 0.9: +(>{MAX_STEPS}|\d+) +trained +(\d+) ", out, re.M)
        assert run, out
        steps[arm] = NEVER if run[1] == f">{MAX_STEPS}" else int(run[1])
        assert steps[arm] <= NEVER and 1 <= int(run[2]) <= MAX_STEPS, out
        # The table's median, min and max of one seed are that seed's steps; reached says whether it got there.
        row = re.search(rf"^{arm:<5} +([\d.]+) +(\d+) +(\d+) +(\d)/1 ", out, re.M)
        assert row and float(row[1]) == int(row[2]) == int(row[3]) == steps[arm], out
        assert int(row[4]) == (steps[arm] < NEVER), out
    assert re.search(r"^seed 0 opd .* teacher build [\d.]+ s  reverse KL [\d.]+ -> [\d.]+$", out, re.M), out
    assert ratio == round(steps["opd"] / steps["rl"], 2), out
