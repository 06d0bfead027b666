"""The engine's benchmark at a tiny size: 24 sessions through the SessionEngine and straight to a FileLog in
two alternated rounds, the restart fold, the MemoryLog and the scaling runs at 4 and 16 in flight, memory per
open session, eight live sessions' resident memory in a child process, the decide costs; its table and its
three GOAL lines."""

from __future__ import annotations

import math
import re

import asyncio

import pytest

from agentlog.events.log.api import MemoryLog
from agentlog.tools.bench import bench_engine

GOAL_RE = re.compile(r"^GOAL ([\w.]+): (-?[\d.]+)(x?) \(goal (<=) ([\d.]+)\3\) (PASS|MISS)$", re.M)


def test_the_benchmark_runs_every_measure_and_prints_its_three_goal_lines_last(capsys, tmp_path):
    argv = ["--sessions", "24", "--concurrency", "4", "--rounds", "2", "--tokens", "16", "--scale-low", "4",
            "--scale-high", "16", "--scale-sessions", "16", "--live-sessions", "8", "--live-wave", "8",
            "--decide-ops", "50", "--dir", str(tmp_path)]
    assert bench_engine.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["engine_vs_raw_append", "rss_per_live_session_8k_ctx_kb",
                                     "per_session_cost_0.016k_vs_0.004k_concurrent"], out
    assert out.rstrip().splitlines()[-3:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    ratio, rss, scale = (float(g[1]) for g in goals)
    assert ratio > 0 and scale > 0 and math.isfinite(ratio) and math.isfinite(scale), out
    # Eight live sessions' resident memory is within the allocator's noise (it can come out below zero):
    # only a finite number is certain.
    assert math.isfinite(rss) and goals[1][4] == "64", out

    # Two rounds of 12 sessions, each 3 turns + open, start, finish: the restart fold reads round one's 72 events.
    assert re.search(r"^bench_engine: 24 sessions x \(open, start, 3 turns x 16 tokens, finish\), 4 concurrent", captured.err, re.M)
    assert re.findall(r"^  round (\d)/2: ", captured.err, re.M) == ["1", "2"], captured.err
    assert re.search(r"^engine / raw, per round +[\d.]+ [\d.]+ +median ", out, re.M), out
    assert re.search(r"^restart fold from lsn 0 \(SessionEngine\.open\) +[\d,]+ events/s +72 events ", out, re.M), out
    assert re.search(r"^engine / raw over MemoryLog \(CPU only\) .* 24 sessions$", out, re.M), out
    assert re.search(r"^engine over MemoryLog, 4 / 16 concurrent .* 16 sessions x 2 each$", out, re.M), out
    assert re.search(r"^engine over MemoryLog, collector off, 4 / 16 +[\d.]+ / [\d.]+ us/session +[\d.]+x +16 sessions x 2 each$", out, re.M), out
    raw_scale = re.search(r"^raw appends over MemoryLog, 4 / 16 +[\d.]+ / [\d.]+ us/session +([\d.]+)x ", out, re.M)
    assert raw_scale, out
    # What the engine adds to the interpreter's own scaling: the goal's ratio over the anchor's (both rounded).
    over = re.search(r"^engine's scaling over the anchor's, over MemoryLog +([\d.]+)x +\(information", out, re.M)
    assert over and float(over.group(1)) == pytest.approx(scale / float(raw_scale.group(1)), rel=0.05, abs=0.02), out
    assert re.search(r"^resident memory per live session, 8,192-token context +-?[\d.]+ kB +8 live sessions ", out, re.M), out
    assert re.search(r"^decide: transitions models, 4 / 16 live ", out, re.M), out
    # The engine log of round one stays for the fold, the open sessions' log for the memory; every other log
    # (the raw arms, round two, the scaling runs, the child's) is removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine0", "mem"]


def test_the_scaling_is_measured_in_a_fresh_interpreter_with_every_arm_at_both_concurrencies():
    """The scaling rows come from a child process (the main run's heap is not what they measure): its
    three arms at both concurrencies, each the seconds of two runs."""
    got = bench_engine.scaling_in_child(8, 2, 4, 1, 16)
    assert sorted(got) == ["engine", "engine_no_gc", "raw"]
    for arm, by_concurrency in got.items():
        assert sorted(by_concurrency) == [2, 4], (arm, by_concurrency)
        assert all(0 < t < 60 and math.isfinite(t) for t in by_concurrency.values()), (arm, by_concurrency)


@pytest.mark.parametrize("arm", [bench_engine.run_raw, bench_engine.run_engine], ids=["raw", "engine"])
def test_both_arms_over_a_memory_log_hold_every_session_in_flight_at_once(arm, monkeypatch):
    # The scaling goal compares sessions in flight together: over a MemoryLog, whose append never suspends,
    # an anchor awaiting append ran its sessions one after another. With 8 sessions and 8 in flight, each
    # session's opening must come before any session's second record.
    logs: list[MemoryLog] = []
    monkeypatch.setattr(bench_engine, "_open_log", lambda path: logs.append(MemoryLog()) or logs[-1])
    toks, lps = bench_engine._payload(4)
    asyncio.run(arm(None, 8, 8, 2, toks, lps))
    records = list(logs[0].read())
    assert len(records) == 8 * 5
    assert sorted(r.session_id for r in records[:8]) == [f"s{i}" for i in range(8)]
    assert all(r.session_seq == 0 for r in records[:8])
