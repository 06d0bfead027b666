"""The resume benchmark at a tiny size: in each arm (resume, abort) a real learner and scripted rollout worker
on one group of two three-turn sessions, the worker SIGKILLed a turn in and restarted; its two arms' lines
and its two GOAL lines. Six processes import torch, so it takes far longer than the other bench smoke tests."""

from __future__ import annotations

import math
import re

import pytest

from agentlog.tools.bench import bench_resume

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)(x?) \(goal (>=|<=) ([\d.]+)x?\) (PASS|MISS)$", re.M)


# Six processes that each import torch (a learner and two workers per arm): about 20 s, over the default
# suite's budget for a smoke run (tests/loop/test_resume_worker.py covers the resume itself there).
@pytest.mark.slow
def test_both_arms_kill_and_restart_the_worker_and_the_goal_lines_come_last(capsys, tmp_path, monkeypatch):
    # main sets the task's steps in os.environ for the processes it starts; setenv first so the test undoes it.
    monkeypatch.setenv("AGENTLOG_STEPS_STEPS", "1")
    argv = ["--groups", "1", "--group-size", "2", "--steps", "1", "--kill-after", "1", "--gen-s", "0.2", "--data-mb", "0",
            "--dir", str(tmp_path)]
    assert bench_resume.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["resumed_fraction_after_worker_kill", "generation_seconds_lost_per_crash_resume_vs_abort"], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in goals), out
    # Both sessions are orphans in each arm; every one resumed and scored 1 in the resume arm, none in the abort
    # arm: the fraction, and its verdict, do not depend on the machine (the lost seconds do).
    arms = re.findall(r"^(resume|abort ): (\d+) orphans with (\d+) durable turns; (\d+) resumed and finished with reward 1; "
                      r"generation lost [\d.]+ s; restart to all ended [\d.]+ s$", out, re.M)
    assert [(arm, orphans, resumed) for arm, orphans, _, resumed in arms] == [("resume", "2", "2"), ("abort ", "2", "0")], out
    assert all(int(durable) >= 2 for _, _, durable, _ in arms), out
    assert goals[0][1:] == ("1.000", "", ">=", "0.95", "PASS") and goals[1][2] == "x", out
    assert list(tmp_path.iterdir()) == [], "the arms' runs are removed"
