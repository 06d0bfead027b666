"""The engine memory benchmark at a tiny size: the 8k-token context in its own child process, a small
warm-up wave then eight sessions left live on a FileLog in tmp_path; its table row and its GOAL line."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_engine_memory

GOAL_RE = re.compile(r"^GOAL (\w+): (-?[\d.]+) \(goal (<=) ([\d.]+)\) (PASS|MISS)$", re.M)


def test_the_benchmark_measures_the_goal_context_in_a_child_and_prints_its_goal_line_last(capsys, tmp_path):
    argv = ["--contexts", "8192", "--sessions", "8", "--wave", "8", "--dir", str(tmp_path)]
    assert bench_engine_memory.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["rss_per_live_session_8k_ctx_kb"], out
    assert out.rstrip().splitlines()[-1:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    kb = float(goals[0][1])
    # Eight sessions' memory is within the allocator's noise: only a number is certain.
    assert math.isfinite(kb) and goals[0][3] == "64", out
    # The context's row: its live sessions, its RSS per session (the GOAL's figure), the context's int32 size.
    rows = re.findall(r"^\s+([\d,]+)\s+(\d+)\s+(-?[\d.]+) kB\s+([\d.]+) kB$", out, re.M)
    assert rows == [("8,192", "8", goals[0][1], "32.0")], out
    assert list(tmp_path.iterdir()) == [], "each child removes its log"
