"""Why did a session score 0? `show` and the report's drill-down say it the same
way (one source, tools.cmd_show.SessionWhy): the label, the verifier's detail,
the error, and the output of a text task's test command. A command that
reported no exit code is said to have none, never printed as ``exit None``."""

from __future__ import annotations

import html
from pathlib import Path

import pytest

from cli_helpers import agentlog

from agentlog.events import FileLog
from agentlog.events.schema.types import CommandRan, SessionAborted, SessionFinished, SessionOpened, SessionStarted

TEST_CMD = "python3 test_adder.py"
TEST_OUTPUT = "FAIL: test_add\nAssertionError: add(2, 2) returned 5, expected 4"


@pytest.fixture(scope="module")
def text_log(tmp_path_factory) -> Path:
    """Three sessions as a text task records them: one whose tests failed (reward 0, the test
    output in its last command), one aborted by its verifier, one whose command left no exit code."""
    path = tmp_path_factory.mktemp("why") / "log"
    log = FileLog.open(path, fsync="never")
    failed_tests = [
        SessionOpened(group_id="g", group_size=3, sample_index=0, label="adder: off by one", agent="repo-fix"),
        SessionStarted(harness="python-agent"),
        CommandRan(command="printf ... > test_adder.py", exit_code=0, duration_s=0.01),
        CommandRan(command=TEST_CMD, exit_code=1, duration_s=0.2, output_tail=TEST_OUTPUT),
        SessionFinished(reward=0.0, metadata={"success": False, "command": TEST_CMD, "exit_code": 1}),
    ]
    crashed = [
        SessionOpened(group_id="g", group_size=3, sample_index=1, label="adder: off by one", agent="repo-fix"),
        SessionStarted(harness="python-agent"),
        SessionAborted(reason="verifier_failed:ZeroDivisionError", error="ZeroDivisionError: division by zero",
                       traceback="Traceback (most recent call last):\n  File \"task.py\", line 9, in verify\nZeroDivisionError: division by zero"),
    ]
    no_exit = [
        SessionOpened(group_id="g", group_size=3, sample_index=2, label="adder: off by one", agent="repo-fix"),
        SessionStarted(harness="python-agent"),
        CommandRan(command=TEST_CMD, exit_code=None, budget_exceeded=True, duration_s=60.0),
        SessionFinished(reward=0.0, metadata={"success": False, "command": TEST_CMD, "exit_code": None}),
    ]
    for sid, bodies in (("tests-failed", failed_tests), ("verifier-crashed", crashed), ("no-exit", no_exit)):
        log.append_batch([(sid, seq, body) for seq, body in enumerate(bodies)])
    log.close()
    return path


def test_show_names_the_test_command_and_its_output_and_never_prints_exit_none(text_log):
    res = agentlog("show", str(text_log), "tests-failed")
    assert res.returncode == 0, res.stderr
    assert "label    adder: off by one" in res.stdout
    assert f"test     $ {TEST_CMD}  -> exit 1" in res.stdout, res.stdout
    assert "AssertionError: add(2, 2) returned 5, expected 4" in res.stdout
    res = agentlog("show", str(text_log), "no-exit")
    assert res.returncode == 0, res.stderr
    assert "exit None" not in res.stdout, res.stdout
    assert "no exit code (killed: BUDGET EXCEEDED)" in res.stdout, res.stdout


def test_the_report_drill_down_says_why_each_session_scored_0_as_show_does(text_log, tmp_path):
    from agentlog.events import read_log
    from agentlog.tools.report.data import collect

    data = collect(read_log(text_log), str(text_log), worst=5, per_reason=5, sample=0)
    rows = {r.session_id: r for r in data.table}
    failed = rows["tests-failed"]
    # The same lines as `agentlog show` prints under the outcome (one source).
    shown = agentlog("show", str(text_log), "tests-failed").stdout.splitlines()
    assert failed.explain and all(line in shown for line in failed.explain), (failed.explain, shown)
    assert any("label    adder: off by one" == line for line in failed.explain)
    assert any(line.startswith("verifier ") and '"exit_code"' not in line and "exit_code=1" in line for line in failed.explain)
    assert any("AssertionError: add(2, 2) returned 5" in line for line in failed.explain)
    crashed = rows["verifier-crashed"]
    assert crashed.error == "ZeroDivisionError: division by zero"
    assert any("line 9, in verify" in line for line in crashed.explain), crashed.explain

    out = tmp_path / "report.html"
    res = agentlog("report", str(text_log), "-o", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    page = out.read_text()
    for text in ("label    adder: off by one", TEST_CMD, "AssertionError: add(2, 2) returned 5, expected 4",
                 "error: ZeroDivisionError: division by zero", "line 9, in verify"):
        assert html.escape(text) in page, text
