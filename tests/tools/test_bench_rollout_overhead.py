"""The rollout-overhead benchmark at a tiny size: Python-agent sessions (the ``openai`` client over HTTP) through
the real gateway, engine and FileLog to the built-in GPT, one stream alone then three at once, against the same
backend called directly with the prompts read back from the log; its lines and its two GOAL lines printed."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_rollout_overhead

GOAL_RE = re.compile(r"^GOAL (\w+): (-?[\d.]+) ms \(goal <= ([\d.]+) ms\) (PASS|MISS)$", re.M)


def test_the_benchmark_runs_one_stream_then_three_and_prints_its_two_goal_lines(capsys, tmp_path):
    argv = ["--max-tokens", "4", "--streams", "3", "--sessions", "2", "1", "--repeats", "1", "--dir", str(tmp_path)]
    assert bench_rollout_overhead.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [(g[0], g[2]) for g in goals] == [("rollout_added_ms_per_turn_1", "25"), ("rollout_added_ms_per_turn_3", "10")], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    # Each added time is a difference of two walls of a few turns (a scheduler stall flips its sign): only its
    # being a number is certain.
    assert all(math.isfinite(float(g[1])) for g in goals), out
    # Deterministic figures: one turn per session (the random-weight model calls no tool), each read back from the log.
    assert re.search(r"^  1 session\(s\): 2 turns, through gateway [\d.]+s, direct [\d.]+s, ", out, re.M), out
    assert re.search(r"^  3 session\(s\): 3 turns, through gateway [\d.]+s, direct [\d.]+s, ", out, re.M), out
    assert list(tmp_path.iterdir()) == [], "the benchmark left a log or a sandbox behind"
