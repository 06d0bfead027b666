"""The tools on a log with a partial rollout (a turn a weight update
interrupted): `show` marks where the turn changed version, `stats` counts
interrupted turns, and the report gives trained tokens per policy version."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentlog.engine import SessionEngine
from agentlog.events import FileLog
from agentlog.events.schema.turn import canonical_version_spans

from cli_helpers import agentlog


def _write(path: Path) -> None:
    async def run():
        log = FileLog.open(path)
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s-part", group_id="g", group_size=1)
        await h.start()
        version, spans = canonical_version_spans([(0, 3), (2, 4)], 5)
        await h.record_turn(prompt_ids=[1, 2], output_ids=[30, 31, 32, 33, 34], output_log_probs=[-1.0] * 5,
                            policy_version=version, version_spans=spans, sampling={"weight_update": "resubmit"})
        await h.record_turn(prompt_ids=[1, 2, 30, 31, 32, 33, 34, 5], output_ids=[40, 41], output_log_probs=[-2.0] * 2,
                            policy_version=4)
        await h.finish(reward=1.0)
        await eng.close()
        log.close()

    asyncio.run(run())


def test_show_marks_where_a_turn_changed_version_and_stats_counts_it(tmp_path: Path) -> None:
    _write(tmp_path / "log")
    shown = agentlog("show", str(tmp_path / "log"), "s-part", "--quiet")
    assert shown.returncode == 0, shown.stderr
    turn0 = next(line for line in shown.stdout.splitlines() if line.lstrip().startswith("turn 0 "))
    assert turn0.endswith("policy v3 -> v4 at token 2 (resubmit)"), turn0
    turn1 = next(line for line in shown.stdout.splitlines() if line.lstrip().startswith("turn 1 "))
    assert "policy v" not in turn1
    stats = agentlog("stats", str(tmp_path / "log"), "--quiet")
    assert stats.returncode == 0, stats.stderr
    assert "interrupted by a weight update 1," in stats.stdout


def test_the_report_counts_trained_tokens_per_version(tmp_path: Path) -> None:
    """7 trained tokens: 2 by version 3, 5 by version 4 (3 of the interrupted turn, 2 of the next)."""
    from agentlog.events import read_log
    from agentlog.tools.report.data import collect

    _write(tmp_path / "log")
    data = collect(read_log(tmp_path / "log"), str(tmp_path / "log"))
    assert data.trained_tokens_by_version == {3: 2, 4: 5}
    out = tmp_path / "report.html"
    res = agentlog("report", str(tmp_path / "log"), "-o", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    assert "token-versions" in out.read_text()
