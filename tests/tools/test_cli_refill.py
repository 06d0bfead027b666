"""`stats`, `show` and `report` name the abort-class decisions a log recorded: refills owed, replacements, failures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from cli_helpers import agentlog

from agentlog.engine import SessionEngine
from agentlog.events.log.writer import FileLog
from agentlog.reducers.config import ReduceConfig


def _write(path: Path) -> None:
    rules = ReduceConfig(abort_outcomes={"infrastructure": "refill", "policy": "fail"})

    async def go() -> None:
        with FileLog.open(path) as log:
            eng = await SessionEngine.open(log, groups=rules, checkpoint_every=0)
            a = await eng.open_session("g-s0", group_id="g", group_size=2, sample_index=0)
            await a.start()
            await a.abort("setup_failed:OSError", error="no sandbox")
            b = await eng.open_session("g-s1", group_id="g", group_size=2, sample_index=1)
            await b.start()
            await b.abort("wall_clock_timeout")
            r = await eng.open_session("g-s2", group_id="g", group_size=2, replaces="g-s0")
            await r.start()
            await r.finish(reward=1.0)
            await eng.close()

    asyncio.run(go())


def test_stats_show_and_the_report_name_the_refill_and_the_replacement(tmp_path: Path) -> None:
    log = tmp_path / "log"
    _write(log)
    stats = json.loads(agentlog("stats", str(log), "--json").stdout)["groups"]
    # Folded with the reducers' defaults (a bare log): the timeout is excluded, not a failure.
    assert (stats["refills_owed"], stats["replacements"], stats["aborted_as_failures"], stats["released"]) == (1, 1, 0, 1)
    text = agentlog("stats", str(log)).stdout
    assert "aborts     1 refilled (1 replacements opened), 0 counted as failures" in text, text
    shown = agentlog("show", str(log), "g-s2").stdout
    assert "refill   replaces g-s0, an aborted member of its group (per-sample refill)" in shown, shown
    shown = agentlog("show", str(log), "g-s0").stdout
    assert "refill   its group is owed a replacement" in shown, shown
    html = tmp_path / "report.html"
    assert agentlog("report", str(log), "-o", str(html)).returncode == 0
    assert "<span id='refills'>members refilled 1 · aborts counted as failures 0</span>" in html.read_text()


def test_reconstruct_with_a_config_that_does_not_load_exits_2_naming_it(tmp_path: Path) -> None:
    log = tmp_path / "log"
    _write(log)
    res = agentlog("reconstruct", str(log), "--config", str(tmp_path / "missing.json"))
    assert res.returncode == 2 and f"--config: {tmp_path / 'missing.json'}: cannot read the config" in res.stderr, res.stderr
    (tmp_path / "bad.toml").write_text("[groups]\npolicy = 'retry'\n")
    res = agentlog("reconstruct", str(log), "--config", str(tmp_path / "bad.toml"))
    assert res.returncode == 2 and "class 'policy' gets 'retry'; expected one of exclude, fail, refill" in res.stderr, res.stderr
