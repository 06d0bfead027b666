"""The verify-tokens benchmark at a tiny size: two chat sessions of two turns sampled from the tiny
Hugging Face model into a log, read back, retokenized and rescored in process; its figures and its GOAL line."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_verify_tokens

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d,.]+) turns/s \(goal (>=) (200)\) (PASS|MISS)$", re.M)


def test_the_benchmark_verifies_every_recorded_turn_and_prints_its_goal_line_last(capsys, tmp_path):
    argv = ["--sessions", "2", "--turns", "2", "--dir", str(tmp_path)]
    assert bench_verify_tokens.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["verify_tokens_turns_per_s_in_process"], out
    assert out.rstrip().splitlines()[-1:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    rate = float(goals[0][1].replace(",", ""))
    assert rate > 0 and math.isfinite(rate), out
    # Deterministic figures: every turn written is checked, each retokenizes to its recorded ids, scores agree.
    assert re.search(r"^4 turns \(2 sessions x 2\), [\d,]+ output tokens, mean prompt \d+ tokens$", out, re.M), out
    assert "retokenized 4, differ 0; verdict OK" in out, out
    assert (tmp_path / "model").is_dir() and (tmp_path / "log").is_dir()
