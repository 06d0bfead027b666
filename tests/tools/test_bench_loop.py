"""The online-loop benchmark at a tiny size (2 groups x 2 sessions): the real two-process loop for two
steps, the worker alone on fixed weights for one batch, and the worker's batches through the SessionEngine
over a FileLog against a null engine; its tables and its GOAL line."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_loop

GOAL_RE = re.compile(r"^GOAL (\w+): (-?[\d.]+)% of worker time per turn \(goal (<) (5)%\) (PASS|MISS)$", re.M)
TINY = ["--steps", "2", "--off-batches", "1", "--overhead-batches", "1", "--overhead-repeats", "1",
        "--groups-per-step", "2", "--group-size", "2"]


def test_the_benchmark_runs_the_loop_the_worker_alone_and_the_overhead_and_prints_its_goal_line_last(capsys, tmp_path):
    assert bench_loop.main([*TINY, "--keep", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["logging_overhead"], out
    assert out.rstrip().splitlines()[-1:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    # The overhead is 1 - (null time / real time): finite and under 100% whenever both times are positive.
    overhead = float(goals[0][1])
    assert math.isfinite(overhead) and overhead < 100, out
    per_turn = re.findall(r"^(?:engine \+ FileLog \(fsync batch\)|events discarded \(null engine\)) +([\d.]+)$", out, re.M)
    assert len(per_turn) == 2 and all(float(us) > 0 for us in per_turn), out
    # Deterministic figures: the run's shape, its two learner steps of two groups each, and the learner-off
    # run's one seeded batch: 4 sessions, two of them planned to time out (a 50 ms budget) before their second
    # turn, so 4 turns of the two whole sessions plus 0 or 1 of each timed-out one, as the machine's speed has it.
    assert re.search(r"^online loop: lookup task, 2 groups x 2 sessions per step, default faults, 1 thread per process; "
                     r"learner on: 2 steps in [\d.]+ s wall$", out, re.M), out
    assert re.search(r"^learner: 2 steps, idle fraction -?[\d.]+%; .* over 4 groups$", out, re.M), out
    assert re.search(r"^learner on +\d+ +\d+ +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out
    off = re.search(r"^learner off +(\d+) +(\d+) +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M)
    assert off is not None and int(off[1]) == 4 and 4 <= int(off[2]) <= 6, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["off", "on", "ov"]
