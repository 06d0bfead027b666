"""The `agentlog report` benchmark at a tiny size: logs of 40 and 20 generated sessions, the report of each
run in process and the previous report (read from git) on the smaller one; the Chromium check is skipped
(a browser's start takes seconds), so its goal reads 0; the three GOAL lines printed."""

from __future__ import annotations

import math
import re
import sys

import pytest

from agentlog.tools.bench import bench_report

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+) \(goal (<=|==) ([\d.]+)\) (PASS|MISS)$", re.M)


@pytest.fixture
def anchor_modules_dropped():
    """The anchor's modules (loaded from the test's folder) leave the interpreter with the test."""
    yield
    for name in [m for m in sys.modules if m == "anchor_report" or m.startswith("anchor_report.")]:
        del sys.modules[name]


def test_the_benchmark_reports_both_logs_and_prints_its_three_goal_lines_last(capsys, tmp_path, anchor_modules_dropped):
    argv = ["--sessions", "40", "--anchor-sessions", "20", "--no-render", "--dir", str(tmp_path)]
    assert bench_report.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["report_40_size_mb", "report_40_seconds", "report_40_renders"], out
    assert out.rstrip().splitlines()[-3:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    size, seconds, renders = goals
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in (size, seconds)), out
    # The page's size does not depend on the machine (its time does); Chromium did not run, so no render.
    assert size[4] == "PASS" and (renders[1], renders[4]) == ("0", "MISS"), out
    assert re.search(r"^logs: 40 and 20 sessions written in [\d.]+ s$", out, re.M), out
    assert re.search(r"^new report, 20 sessions: [\d.]+ s wall, [\d.]+ MB$", out, re.M), out
    # The anchor is read from git: a checkout without that commit says so instead of measuring it.
    assert (re.search(rf"^anchor \(previous report, {bench_report.ANCHOR_COMMIT}\), 20 sessions: [\d.]+ s wall", out, re.M)
            or re.search(rf"^anchor: git show {bench_report.ANCHOR_COMMIT}:tools/report/__init__.py failed", out, re.M)), out
    assert re.search(r"^new report, 40 sessions: [\d.]+ s wall, [\d.]+ s CPU, [\d.]+ MB", out, re.M), out
    assert "chromium: not run (--no-render)" in out, out
