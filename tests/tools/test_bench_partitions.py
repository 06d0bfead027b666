"""The partitions benchmark at a tiny size: one batch of 32 groups played through the SessionEngine, copied
into 1, 4 and 16 partition logs and consumed by the learner's path and the single-log anchor, then the real
loop with two local worker processes for one step of 2 groups x 2; its tables and its GOAL line."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_partitions

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x \(goal (<=) (1\.2)x\) (PASS|MISS)$", re.M)
TINY = ["--events", "1", "--repeats", "1", "--workers", "2", "--steps", "1", "--groups-per-step", "2", "--group-size", "2"]


def test_the_benchmark_merges_every_layout_runs_the_loop_and_prints_its_goal_line_last(capsys, tmp_path):
    assert bench_partitions.main([*TINY, "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["merge_16_vs_1_partition_cost_per_event"], out
    assert out.rstrip().splitlines()[-1:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    ratio = float(goals[0][1])
    assert ratio > 0 and math.isfinite(ratio), out
    # Deterministic figures: the one seeded batch's events (every layout consumed them all, the script asserts
    # it), and the loop's one step releasing its two groups, each with a release -> step latency.
    assert re.search(r"^learner consumption: 1,260 events \(32 groups of 8, lookup task, 5% aborted\)", out, re.M), out
    for k in (1, 4, 16):
        assert re.search(rf"^follow_logs \+ StepCutter/PartitionFold, {k} partition\(s\) +[\d.]+ +[\d.]+ +[\d.]+x$", out, re.M), out
    assert re.search(r"^anchor: read_log \+ Reducer, one log +[\d.]+ +[\d.]+ +[\d.]+x$", out, re.M), out
    assert re.search(r"^rollout: the real loop \(learner \+ N local worker processes\), lookup task, 2 groups x 2 per step, 1 steps", out, re.M), out
    row = re.search(r"^ +2 +[\d.]+ +[\d.]+ +(\d+) +[\d.]+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +\d+ +\d+ +(\d+)$", out, re.M)
    assert row is not None and int(row[1]) >= 4 and int(row[2]) == 2, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop-2", "merge-1", "merge-16", "merge-4"]
