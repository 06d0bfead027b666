"""The log-growth benchmark at a tiny size: sessions of 2 and 4 SWE-shaped turns and a 4-turn one that
compacts its history every 2 turns (a new lineage), each recorded through the engine (deltas) and as full
turns, reduced to the same digest; its table and its two GOAL lines printed."""

from __future__ import annotations

import math
import re

import pytest

from agentlog.tools.bench import bench_growth

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x \(goal (<=) ([\d.]+)x\) (PASS|MISS)$", re.M)


def test_the_benchmark_prints_its_table_and_its_two_goal_lines_last(capsys):
    argv = ["--quick", "--turns", "2,4", "--goal-turns", "4", "--compact-every", "2"]
    assert bench_growth.main(argv) == 0  # it exits on a digest mismatch between the two encodings
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["log_bytes_vs_final_trajectory_4_turns", "reducer_cpu_per_token_4_vs_2_turns"], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in goals), out
    # Bytes are deterministic (the CPU goal depends on the machine): the delta log stays near the trajectory.
    # Each row: trajectory, full and delta log MB, then the two logs' bytes against the trajectory.
    rows = re.findall(r"^ +(\d+ turns(?:, fork/\d+)?) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)x +([\d.]+)x ", out, re.M)
    assert [r[0] for r in rows] == ["2 turns", "4 turns", "4 turns, fork/2"], out
    full_x, delta_x = [float(r[4]) for r in rows], [float(r[5]) for r in rows]
    # Full turns repeat the context, deltas do not; a compacted history is written again as new.
    assert all(d < f for d, f in zip(delta_x, full_x)) and full_x[0] < full_x[1] and delta_x[2] > delta_x[1], out
    assert float(goals[0][1]) == delta_x[1] and goals[0][4] == "PASS", out


def test_a_goal_session_that_is_not_among_the_sessions_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_growth.main(["--turns", "2,4", "--goal-turns", "3"])
    assert stop.value.code == 2
    assert "--goal-turns 3 is not one of --turns [2, 4]" in capsys.readouterr().err
