"""The compressed-batches benchmark at a tiny size: two concurrent 2-turn SWE-shaped sessions recorded through
the engine into a zstd and an uncompressed log (the same records in both), replayed, appended durably against
a raw write + fdatasync, and eight random-token events for the information line; its three GOAL lines printed."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_compression

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x \(goal (<=|>=) ([\d.]+)x\) (PASS|MISS)$", re.M)


def test_the_benchmark_prints_its_figures_and_its_three_goal_lines_last(capsys, tmp_path):
    argv = ["--quick", "--sessions", "2", "--turns", "2", "--random-events", "8", "--dir", str(tmp_path)]
    assert bench_compression.main(argv) == 0  # it asserts that both logs hold the same records
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["log_bytes_vs_final_trajectory_2_turns_compressed", "replay_compressed_vs_uncompressed",
                                     "durable_append_compressed_vs_raw_fdatasync_of_uncompressed_bytes"], out
    assert out.rstrip().splitlines()[-3:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in goals), out
    # Bytes are deterministic, times are not: only the bytes goal must pass (the engine's batching moves it by 0.01x).
    assert goals[0][4] == "PASS", out
    # Per session: opened, started, 2 turns, finished; one append batch per round of the two sessions.
    # Byte counts follow the encoding, so they are checked against each other, not as numbers.
    traj = re.search(r"^2 concurrent 2-turn sessions through the engine \([\d.]+ s for both logs\), 10 events, all kept; "
                     r"trajectories ([\d,]+) B$", out, re.M)
    disk = re.search(r"^  log on disk: uncompressed ([\d,]+) B \(([\d.]+)x\), zstd ([\d,]+) B", out, re.M)
    append = re.search(r"^  append of 5 batches of 2 events \(frames ([\d,]+) B; on disk none ([\d,]+) B, zstd [\d,]+ B\)", out, re.M)
    assert traj and disk and append, out
    trajectories, uncompressed, zstd = (int(g.replace(",", "")) for g in (traj[1], disk[1], disk[3]))
    frames, appended = (int(g.replace(",", "")) for g in (append[1], append[2]))
    assert float(disk[2]) == round(uncompressed / trajectories, 2) and zstd < uncompressed, out
    assert appended == uncompressed and frames < uncompressed, out  # the same records appended again; a segment header more
    assert "info, random token ids (8 x 2048-token events, batches of 32): " in out, out
    assert "the most any writer that compresses each batch can reach here: " in out, out
    bound = re.search(r"can reach here: ([0-9.]+)x", out)
    checked = re.search(r"also checks each batch as the log must can reach: ([0-9.]+)x \(the write-time check, check_bodies, ([0-9.]+) s", out)
    assert bound and checked and float(checked[2]) > 0, out
    assert float(checked[1]) <= float(bound[1]), out  # the check only adds to what the bound counts
    assert list(tmp_path.iterdir()) == [], "the benchmark left its logs behind"
