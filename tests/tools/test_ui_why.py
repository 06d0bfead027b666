"""`agentlog ui` says why: the session view's "why" lines are those of `agentlog show`
and of the static report's drill-down, with the verifier's verdict and the abort's
error and traceback beside them; the group view names who was excluded from the
baseline, who was refilled and by whom. Every expected value is written here by
hand or read from the other commands, never from the code under test."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ui_helpers import start_ui

TEST_CMD = "python3 test_adder.py"
TEST_OUTPUT = "FAIL: test_add\nAssertionError: add(2, 2) returned 5, expected 4"
VERDICT = {"success": False, "command": TEST_CMD, "exit_code": 1}
TRACEBACK = "Traceback (most recent call last):\n  File \"task.py\", line 9, in verify\nZeroDivisionError: division by zero"


def _ok(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _show(log: Path, sid: str) -> list[str]:
    """`agentlog show LOG SID --full` (run in this process), its lines."""
    from agentlog.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["show", str(log), sid, "--full", "--quiet"])
    assert rc == 0, out.getvalue()[-500:]
    return out.getvalue().splitlines()


@pytest.fixture(scope="module")
def text_log(tmp_path_factory) -> Path:
    """A text task's sessions: one whose tests failed (reward 0, the verdict in its finish, the
    test output in its last command), one its verifier crashed (aborted with a traceback)."""
    from agentlog.events import FileLog
    from agentlog.events.schema.types import CommandRan, SessionAborted, SessionFinished, SessionOpened, SessionStarted

    path = tmp_path_factory.mktemp("ui-why") / "log"
    log = FileLog.open(path, fsync="never")
    failed = [SessionOpened(group_id="g", group_size=2, sample_index=0, label="adder: off by one"),
              SessionStarted(harness="python-agent"),
              CommandRan(command=TEST_CMD, exit_code=1, duration_s=0.2, output_tail=TEST_OUTPUT),
              SessionFinished(reward=0.0, metadata=VERDICT)]
    crashed = [SessionOpened(group_id="g", group_size=2, sample_index=1, label="adder: off by one"),
               SessionStarted(harness="python-agent"),
               SessionAborted(reason="verifier_failed:ZeroDivisionError", error="ZeroDivisionError: division by zero",
                              traceback=TRACEBACK)]
    for sid, bodies in (("tests-failed", failed), ("verifier-crashed", crashed)):
        log.append_batch([(sid, seq, body) for seq, body in enumerate(bodies)])
    log.close()
    return path


def test_the_session_view_says_why_as_show_and_the_reports_drill_down_do(text_log, tmp_path):
    from agentlog.events import read_log
    from agentlog.tools.report.data import collect

    drill_down = {r.session_id: r.explain for r in collect(read_log(text_log), str(text_log), worst=5, per_reason=5,
                                                            sample=0).table}
    url, stop = start_ui(text_log, index_path=tmp_path / "ix.sqlite")
    try:
        failed = _ok(f"{url}/api/session/tests-failed")
        crashed = _ok(f"{url}/api/session/verifier-crashed")
    finally:
        stop()
    for view in (failed, crashed):
        sid = view["session_id"]
        assert view["why"] and view["why"] == drill_down[sid], (sid, view["why"], drill_down[sid])
        shown = _show(text_log, sid)
        assert all(line in shown for line in view["why"]), (sid, view["why"], shown)
    # The verifier's verdict and detail; the test command's output.
    assert failed["verdict"] == VERDICT and failed["error"] is None and failed["traceback"] is None
    assert "label    adder: off by one" in failed["why"]
    assert any(line.startswith("verifier ") and "exit_code=1" in line for line in failed["why"]), failed["why"]
    assert f"test     $ {TEST_CMD}  -> exit 1  lsn 2" in failed["why"], failed["why"]
    assert failed["commands"][0]["output"] == TEST_OUTPUT
    # The abort: its error and its whole traceback.
    assert crashed["status"] == "aborted" and crashed["reason"] == "verifier_failed:ZeroDivisionError"
    assert crashed["error"] == "ZeroDivisionError: division by zero" and crashed["traceback"] == TRACEBACK
    assert crashed["verdict"] is None and "    File \"task.py\", line 9, in verify" in crashed["why"]


def test_the_group_view_names_exclusions_refills_and_replacements(tmp_path):
    """g-s0 aborted for an infrastructure reason and is refilled by g-s2; g-s1 timed out and is excluded."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.reducers.config import ReduceConfig

    log = tmp_path / "log"

    async def write() -> None:
        with FileLog.open(log) as fl:
            eng = await SessionEngine.open(fl, groups=ReduceConfig(abort_outcomes={"infrastructure": "refill"}),
                                           checkpoint_every=0)
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

    asyncio.run(write())
    url, stop = start_ui(log, index_path=tmp_path / "ix.sqlite")
    try:
        group = _ok(f"{url}/api/group/g")
        why = {sid: _ok(f"{url}/api/session/{sid}")["why"] for sid in ("g-s0", "g-s2")}
    finally:
        stop()
    members = {m["session_id"]: m for m in group["members"]}
    assert set(members) == {"g-s0", "g-s1", "g-s2"}, group
    s0, s1, s2 = members["g-s0"], members["g-s1"], members["g-s2"]
    assert (s0["status"], s0["in_baseline"], s0["excluded_why"], s0["refilled_by"]) == \
        ("aborted", False, "setup_failed:OSError", "g-s2"), s0
    assert (s1["status"], s1["in_baseline"], s1["excluded_why"], s1["refilled_by"]) == \
        ("aborted", False, "wall_clock_timeout", None), s1
    assert (s2["status"], s2["in_baseline"], s2["refill_of"], s2["reward"]) == ("finished", True, "g-s0", 1.0), s2
    assert s2["advantage"] is not None and s0["advantage"] is None and s1["advantage"] is None
    assert group["step"] is None  # a bare rollout log: no learner trained it
    assert "refill   replaces g-s0, an aborted member of its group (per-sample refill)" in why["g-s2"], why
    assert any(line.startswith("refill   its group is owed a replacement") for line in why["g-s0"]), why
