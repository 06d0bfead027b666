"""The `agentlog ui` benchmark at a tiny size: the log generated, real `agentlog ui` processes built and
started on it, every filter's total checked against the generator, the 200-turn session viewed, a live
session followed to /api/stream; the table and the four GOAL lines printed."""

from __future__ import annotations

import re

from agentlog.tools.bench import bench_ui


def test_the_benchmark_runs_every_measure_and_prints_its_four_goal_lines(capsys, tmp_path):
    assert bench_ui.main(["--sessions", "40", "--samples", "1", "--starts", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    goals = re.findall(r"^GOAL (\w+): ([\d.]+) \(goal <= ([\d.]+)\) (PASS|MISS)$", out, re.M)
    assert [g[0] for g in goals] == ["ui_first_page_40_ms", "ui_filter_40_ms", "ui_session_view_200_turns_ms",
                                     "ui_live_lag_s"], out
    assert all(float(g[1]) > 0 for g in goals), out
    assert re.search(r"^index build from nothing \(41 sessions\)", out, re.M), out
    assert re.search(r"^filter q=synthetic \(15% of transcripts\) \[\d+\]", out, re.M), out
    assert re.search(r"^/api/session/long-200 \(median of 5; [\d.]+ MB JSON\)", out, re.M), out
    assert re.search(r"^live: durable -> /api/stream", out, re.M), out
