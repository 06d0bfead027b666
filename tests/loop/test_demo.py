"""The demo end to end.

The default suite runs a deterministic smoke test (a 2-step run, shared per
session through the ``short_demo_run`` fixture of tests/conftest.py): the
pipeline ran end to end, every step was recorded, online digests equal
offline, the chart and report were written. Whether it *learns* is a
statistical claim that can flake on a loaded machine: those tests are
``slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentlog.tools.cli import main as cli_main
from agentlog.loop.check import check_run
from agentlog.loop.run import reward_curve, summarise_rollout
from agentlog.loop.learner_records import read_learner_records


def test_short_demo_runs_end_to_end_and_online_digests_equal_offline(short_demo_run) -> None:
    """Two RL steps after 5 warm-up steps, faults on: both steps recorded by the learner, the
    offline reconstruction equals both online digests, every released group consumed once,
    reward.png and report.html written. No claim about the reward's value."""
    cwd, printed = short_demo_run
    out = cwd / "runs" / "demo"
    records = read_learner_records(out / "learner")
    assert [r.step for r in records] == [0, 1, 2], [r.step for r in records]  # the warm-up, then 2 RL steps
    assert all(r.groups or r.skipped for r in records[1:])
    check = check_run(out)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.digests_equal == check.steps == 2
    assert check.groups_consumed >= 2 * 4  # groups_per_step groups per step
    assert "EQUAL (2/2 steps equal" in printed, printed
    _, sessions, turns, _, events = summarise_rollout(out)
    assert sessions >= 2 * 4 * 4 and turns > 0 and events > sessions
    assert (out / "reward.png").stat().st_size > 1000
    assert (out / "report.html").stat().st_size > 10_000


@pytest.mark.slow
def test_short_demo_learns_with_faults_and_online_digests_equal_offline(tmp_path: Path, capsys) -> None:
    """`agentlog demo` (30 RL steps after the documented warm-up): reward over the last
    steps exceeds the first steps by >= 0.3, the rollout log holds aborted and dropped
    sessions, and the offline reconstruction equals every online per-step digest."""
    out = tmp_path / "run"
    rc = cli_main(["demo", "--steps", "30", "--stop-reward", "0", "--seed", "0", "--out", str(out), "--quiet", "--no-report", "--timeout", "240"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    records = read_learner_records(out / "learner")
    curve = reward_curve(records)
    assert len(curve) >= 28
    first = [r for _, r, _ in curve[:5]]
    last = [r for _, r, _ in curve[-5:]]
    assert max(first) <= 0.35, f"the warm-up must leave the reward low, first steps {first}"
    assert sum(last) / 5 - sum(first) / 5 >= 0.3, f"first {first} last {last}"
    for _, reward, solve in curve:
        assert 0.0 <= solve <= 1.0 and 0.0 <= reward <= 1.0

    outcomes, sessions, turns, _, _ = summarise_rollout(out)
    assert outcomes["aborted: exception:InjectedFault"] > 0
    assert outcomes["aborted: wall_clock_timeout"] > 0
    assert outcomes["dropped: cancelled"] > 0
    assert turns > sessions  # multi-turn: two generated turns per finished session

    check = check_run(out)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.digests_equal == check.steps == 30
    assert "EQUAL (30/30 steps equal" in printed
    assert (out / "reward.png").stat().st_size > 1000
    # Straggler turns were attempted and refused by the engine, never logged.
    worker_log = [json.loads(line) for line in (out / "logs" / "worker-w0.jsonl").read_text().splitlines()]
    assert any(e["event"] == "session.straggler_refused" for e in worker_log)
    stopped = [e for e in worker_log if e["event"] == "worker.stopped"]
    assert stopped and stopped[-1].get("straggler_refused", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_default_demo_reaches_a_reward_of_090_on_every_seed(tmp_path: Path, seed: int) -> None:
    """The demo must learn on any seed, not on lucky ones; defaults (120 steps, faults on)."""
    out = tmp_path / f"seed{seed}"
    assert cli_main(["demo", "--seed", str(seed), "--out", str(out), "--quiet", "--no-report"]) == 0
    curve = reward_curve(read_learner_records(out / "learner"))
    first = [r for _, r, _ in curve[:5]]
    last = [r for _, r, _ in curve[-10:]]
    assert sum(first) / 5 <= 0.3
    assert sum(last) / 10 >= 0.9, f"seed {seed}: last rewards {last}"
