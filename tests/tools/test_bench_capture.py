"""The capture benchmark at a tiny size: its CPU arms (``tools/bench/capture_cpu.py``) record their turns
through the engine and a FileLog, measure them and count the garbage collector's share; and its ``main``
runs two throughput runs (the real gateway with its HTTP client in a process of its own, against the fake
backend called directly) and both CPU arms, and prints its tables and its three GOAL lines."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import re
import tempfile

from agentlog.tools.bench import bench_capture, capture_cpu

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x? \(goal (>=|<=) ([\d.]+)x?\) (PASS|MISS)(  \[.*\])?$", re.M)


def test_the_capture_cpu_arms_record_their_turns_and_count_the_collector():
    args = argparse.Namespace(cpu_turns=2)
    (one,) = asyncio.run(capture_cpu.cpu_per_turn(args, [600]))
    assert one["tokens"] >= 600 and one["capture"] > 0 and one["hf_full"] > 0 and one["byte_inc"] > 0
    many = asyncio.run(capture_cpu.cpu_concurrent(args, 600, 4))
    assert many["tokens"] >= 600 and many["turns"] == 2 * 4 and many["capture"] > 0 and many["main"] > 0
    assert 0 <= many["gc"] <= many["gc_round"] + 1e-9
    assert len(many["collections"].split("/")) == 3
    assert not [cb for cb in gc.callbacks if isinstance(cb, capture_cpu._GcClock)], "the collector's clock was left registered"


def test_the_benchmark_runs_both_throughput_runs_and_both_cpu_arms_and_prints_its_three_goal_lines(capsys, tmp_path, monkeypatch):
    # Every log the benchmark writes goes to a temporary folder it removes itself: put them under tmp_path to see that.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # main sets these for the Hugging Face tokenizer; they go back to what they were after the test.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    argv = ["--runs", "2:1000:2", "3:1000:2", "--system-tokens", "200", "--output-tokens", "40", "--decode-ms", "0.01",
            "--prefill-ms", "0.0001", "--cpu-turns", "2", "--cpu-sessions", "3", "--contexts", "1000"]
    assert bench_capture.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["capture_throughput_vs_direct_2_sessions_1k_ctx", "capture_throughput_vs_direct_3_sessions",
                                     "capture_cpu_us_per_turn_1k_ctx"], out
    assert out.rstrip().splitlines()[-3:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in goals), out
    # Deterministic figures: each run's sessions, context and turns; the CPU arms' context reached (the built-in
    # template's tokens of the same conversation every time), their turns and sessions.
    assert re.search(r"^ +2 +1000 +2 +[\d.]+ +[\d.]+ ", out, re.M) and re.search(r"^ +3 +1000 +2 +[\d.]+ +[\d.]+ ", out, re.M), out
    assert "one session: the median of 2 turns; 3 sessions: the mean of 2 rounds" in out, out
    one = re.search(r"^ +(\d+) +\d+ +\d+ +\d+ +\d+ +\d+ +\d+ +\d+$", out, re.M)
    many = re.search(r"^ +(\d+) +\d+ +\d+  <- 3 sessions recording at once .* collections by generation \d+/\d+/\d+ in 6 turns\)$",
                     out, re.M)
    assert one and many and int(one[1]) == int(many[1]) >= 1000, out  # both grown alike past the 1k context
    assert list(tmp_path.iterdir()) == [], "the benchmark left a log behind"
