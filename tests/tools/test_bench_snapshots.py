"""The snapshot store's benchmark at a tiny size: real commands through a LocalSandbox,
a snapshot and a collection per turn, its figures and its two GOAL lines printed."""

from __future__ import annotations

import re

from agentlog.tools.bench import bench_snapshots


def test_the_benchmark_runs_a_session_and_prints_its_two_goal_lines(capsys, tmp_path):
    argv = ["--files", "12", "--file-kb", "4", "--turns", "2", "--repeat", "1", "--quiet", "--dir", str(tmp_path)]
    assert bench_snapshots.main(argv) == 0
    out = capsys.readouterr().out
    goals = re.findall(r"^GOAL (\w+): ([\d.]+)x? \(goal <= ([\d.]+)x?\) (PASS|MISS)$", out, re.M)
    assert [g[0] for g in goals] == ["snapshot_overhead_vs_sandbox_time", "snapshot_store_bytes_vs_one_copy"], out
    assert all(float(g[1]) > 0 for g in goals), out
    assert re.search(r"^working directory: 12 files", out, re.M) and "full restore of the last snapshot" in out, out
