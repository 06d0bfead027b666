"""`agentlog show` of a distilled session: each teacher's scoring (or failure)
in the transcript, and per trained token the rollout and teacher log-probs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentlog.engine import SessionEngine
from agentlog.events import FileLog

from cli_helpers import agentlog


def _write(path: Path) -> None:
    async def run():
        log = FileLog.open(path)
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s-teach", group_id="g", group_size=1)
        await h.start()
        await h.record_turn(prompt_ids=[1, 2], output_ids=[30, 31], output_log_probs=[-1.5, -0.75], sampling={"temperature": 0.5})
        await h.record_turn(prompt_ids=[1, 2, 30, 31, 5], output_ids=[40], output_log_probs=[-2.0], sampling={"temperature": 0.5})
        await h.record_teacher_scores(0, teacher="big", teacher_version="sha256:1f", temperature=0.5, log_probs=[-0.25, -0.5])
        await h.record_teacher_failure(1, teacher="big", teacher_version="sha256:1f", error="timeout after 2 s")
        await h.finish(reward=1.0)
        await eng.close()
        log.close()

    asyncio.run(run())


def test_show_puts_teacher_log_probs_beside_the_rollout_ones(tmp_path: Path) -> None:
    _write(tmp_path / "log")
    res = agentlog("show", str(tmp_path / "log"), "s-teach", "--quiet")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "teacher big@sha256:1f scored turn 0 tokens 0..1 at temperature 0.5" in out
    assert "teacher big@sha256:1f FAILED on turn 1: timeout after 2 s" in out
    assert "teachers  big@sha256:1f  [big@sha256:1f: timeout after 2 s]" in out
    assert "log-probs token:rollout/teacher  30:-1.50/-0.25 31:-0.75/-0.50 40:-2.00/-" in out


def test_the_report_drill_down_shows_teacher_log_probs_per_token(tmp_path: Path) -> None:
    """Each trained response token of the report's drill-down carries its
    rollout log-prob and, where a teacher scored it, the teacher's."""
    _write(tmp_path / "log")
    out = tmp_path / "report.html"
    res = agentlog("report", str(tmp_path / "log"), "-o", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    page = out.read_text()
    assert 'title="rollout -1.500 / teacher -0.250">30<' in page
    assert 'title="rollout -2.000">40<' in page


def test_stats_counts_scored_and_failed_turns(tmp_path: Path) -> None:
    _write(tmp_path / "log")
    res = agentlog("stats", str(tmp_path / "log"), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "teacher    1 turns scored, 1 failed" in res.stdout
