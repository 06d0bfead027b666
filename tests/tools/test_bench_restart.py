"""The restart benchmark at a tiny size: a 1k- and a 2k-event log, each restarted by the learner (from its
low-water LSN and from 0) and, written by an engine child checkpointing every 1,024 records then SIGKILLed,
by fresh engine processes; its tables and its two GOAL lines."""

from __future__ import annotations

import math
import re

import pytest

from agentlog.tools.bench import bench_restart

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x \(goal (<=) 2x(?:; FileLog\.open \+ SessionEngine\.open)?\) (PASS|MISS)$", re.M)


def test_the_benchmark_restarts_the_learner_and_the_engine_and_prints_its_two_goal_lines_last(capsys, tmp_path):
    argv = ["--short", "1000", "--long", "2000", "--repeat", "1", "--checkpoint-every", "1024", "--dir", str(tmp_path)]
    assert bench_restart.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["restart_2k_vs_1k_events", "engine_restart_2k_vs_1k_events"], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in goals), out
    # The learner's side is seeded and has no clock in it: its learner records and where each restart reads from.
    assert "1,000 events: log and 2 learner records written" in captured.err, captured.err
    assert "2,000 events: log and 5 learner records written" in captured.err, captured.err
    learner = re.findall(r"^\s+([\d,]+)\s+[\d.]+ ms\s+([\d,]+)\s+[\d.]+ ms$", out, re.M)
    assert learner == [("1,000", "489"), ("2,000", "1,062")], out
    # The engine's side: killed past its log's events, 512 records (half the interval) after its last checkpoint,
    # which the restart folds; unless that checkpoint was not written in time, which the script notes.
    engine = re.findall(r"^\s+([\d,]+)\s+[\d.]+ ms\s+[\d.]+ ms\s+[\d.]+ MiB\s+[\d.]+ ms\s+([\d,]+)\s+[\d.]+ ms$", out, re.M)
    assert len(engine) == 2 and int(engine[0][0].replace(",", "")) >= 1000 and int(engine[1][0].replace(",", "")) >= 2000, out
    if "NOTE: killed" not in captured.err:
        assert [folded for _, folded in engine] == ["512", "512"], out
    assert re.search(r"^anchor: the restart from LSN 0 grows [\d.]+x over the same logs \(learner\), [\d.]+x \(engine\)$", out, re.M), out


def test_a_checkpoint_interval_the_engine_would_not_keep_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        bench_restart.main(["--checkpoint-every", "400"])
    assert refused.value.code == 2
    assert "--checkpoint-every: at least 1024" in capsys.readouterr().err
