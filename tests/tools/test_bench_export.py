"""The export-dataset benchmark at a tiny size: a 12-session log of tool-calling sessions generated, then
reconstruct and the three exports (jsonl, hf, hf with tokens) run in process on it; its table and its GOAL line."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_export

SESSIONS = 12
GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+) \(goal <= ([\d.]+)\) (PASS|MISS)$", re.M)


def test_the_benchmark_exports_the_whole_log_three_ways_and_prints_its_goal_line_last(capsys, tmp_path):
    assert bench_export.main(["--sessions", str(SESSIONS), "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == [f"export_dataset_{SESSIONS}_sessions_s"], out
    assert out.rstrip().splitlines()[-1].startswith("GOAL "), out
    measured, target = float(goals[0][1]), float(goals[0][2])
    assert math.isfinite(measured) and measured > 0, out
    assert target == 120.0 * SESSIONS / 100_000, out  # the 100k-session goal scaled to the log's size

    log = re.search(rf"^log: {SESSIONS} sessions, (\d+) events", out, re.M)
    assert log, out
    # A session is opened, started and dropped (3 events), or runs 1-3 turns of a turn and a command, then ends (<= 9).
    assert 3 * SESSIONS <= int(log[1]) <= 9 * SESSIONS, out
    samples = re.search(r"^anchor: reconstruct -o samples.jsonl .* MB  (\d+) samples$", out, re.M)
    exports = {fmt: re.search(rf"^export-dataset --format {fmt} .* MB  (\d+) rows of (\d+) sessions$", out, re.M)
               for fmt in ("jsonl", "hf", "hf --tokens")}
    assert samples and all(exports.values()), out
    # Every export holds every session, and the same rows whichever the format.
    assert {int(m[2]) for m in exports.values()} == {SESSIONS}, out
    assert len({int(m[1]) for m in exports.values()}) == 1 and int(samples[1]) > 0, out
    assert re.search(r"^hf export / reconstruct on the same log: [\d.]+x$", out, re.M), out
