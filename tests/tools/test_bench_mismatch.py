"""The mismatch benchmark at a tiny size: one supervised warm-up step, then one RL step of the lookup task
(the worker and the learner in this process, faults on) on each numeric path, the batch-invariant one and
torch's kernels; its table and its two GOAL lines printed, the runs' folders removed after."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_mismatch

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.e+-]+)x? \(goal (==|<=) ([\d.]+)x?\) (PASS|MISS)(    anchor, .*)?$", re.M)


def test_the_benchmark_trains_both_arms_and_prints_its_two_goal_lines(capsys, tmp_path):
    argv = ["--rounds", "1", "--steps", "1", "--groups", "1", "--group-size", "2", "--warmup-steps", "1", "--dir", str(tmp_path)]
    assert bench_mismatch.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["train_rollout_logprob_abs_diff_max_in_process", "in_process_rl_cpu_vs_torch_kernels"], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    mismatch, cpu = goals
    # Deterministic: the batch-invariant path samples and trains on the same numbers, so not one log-prob differs.
    assert (float(mismatch[1]), mismatch[4]) == (0.0, "PASS"), out
    assert math.isfinite(float(cpu[1])) and float(cpu[1]) > 0, out
    assert out.startswith("lookup task in-process: 1 RL steps of 1 groups x 2 after 1 warm-up steps, max_lag 0"), out
    # Both arms sample the same two rollouts from the same seed and measure every trained token.
    ours = re.search(r"^ours {20} +(\d+) +0 +0 +0 +[\d.]+$", out, re.M)
    anchor = re.search(r"^torch kernels \(anchor\) +(\d+) +[\d.e+-]+ +[\d.e+-]+ +[\d.e+-]+ +[\d.]+$", out, re.M)
    assert ours and anchor and int(ours[1]) == int(anchor[1]) > 0, out
    assert list(tmp_path.iterdir()) == [], "the benchmark left a run's folder behind"
