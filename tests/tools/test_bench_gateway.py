"""The gateway benchmark at a tiny size: the built-in GPT behind the real gateway (FileLog, HTTP client in a
process of its own), its added latency against direct calls on the recorded prompts, two throughput runs
against the backend alone; the table and the two GOAL lines printed, the log removed after."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_gateway

GOAL_RE = re.compile(r"^GOAL (\w+): (-?[\d.]+)x? \(goal (>=|<=) ([\d.]+)x?\) (PASS|MISS)$", re.M)


def test_the_benchmark_measures_latency_and_throughput_and_prints_its_two_goal_lines(capsys, tmp_path):
    argv = ["--max-tokens", "4", "--sessions", "1", "3", "--turns", "2", "--repeats", "1", "--latency-turns", "3",
            "--dir", str(tmp_path)]
    assert bench_gateway.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["gateway_added_latency_p50_ms", "gateway_vs_backend_turns_per_s_at_3_sessions"], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    # The added latency is a difference of timings (it may come out below 0 on a quiet machine); the ratio is positive.
    assert math.isfinite(float(goals[0][1])) and math.isfinite(float(goals[1][1])) and float(goals[1][1]) > 0, out
    # Deterministic figures: one throughput row per session count (each turn read back from the log by its
    # session and index, or the run fails), one pair each.
    rows = re.findall(r"^ +(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M)
    assert rows == ["1", "3"], out
    assert "max_tokens 4, FileLog fsync=batch" in out and "(medians of 1 back-to-back pairs" in out, out
    assert list(tmp_path.iterdir()) == [], "the benchmark left its log behind"
