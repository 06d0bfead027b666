"""LocalSandbox and the done-marker protocol: exit codes, markers that are not
done, budgets that kill the whole process group, capped output."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from agentlog.engine.sandbox import LocalSandbox, read_done_marker


def live_processes_with(token: str) -> list[int]:
    """PIDs (not zombies) whose command line contains ``token``."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if token.encode() in cmd and state != "Z" and int(d.name) != os.getpid():
            pids.append(int(d.name))
    return pids


@pytest.mark.parametrize("code", [0, 1, 7, 255])
def test_exit_code_is_read_from_the_done_marker(arun, tmp_path, code):
    res = arun(LocalSandbox(tmp_path).run_command(f"echo hi; exit {code}", 10))
    assert res.exit_code == code and not res.budget_exceeded
    assert res.output_tail == "hi\n"
    assert list((tmp_path / ".agentlog-cmd").iterdir()) == []  # control files cleaned up


@pytest.mark.parametrize("content", [None, b"", b"\n", b"   ", b"abc", b"12abc", b"1.5", b"0x1", b"--3"])
def test_marker_that_is_missing_empty_or_not_an_integer_means_not_done(tmp_path, content):
    path = tmp_path / "m.done"
    if content is not None:
        path.write_bytes(content)
    assert read_done_marker(path) is None


@pytest.mark.parametrize("content, code", [(b"0\n", 0), (b" 3 ", 3), (b"137", 137), (b"-1\n", -1)])
def test_marker_with_a_complete_integer_gives_the_exit_code(tmp_path, content, code):
    path = tmp_path / "m.done"
    path.write_bytes(content)
    assert read_done_marker(path) == code


def test_command_that_dies_before_its_marker_is_written_reports_no_exit_code(arun, tmp_path):
    """The wrapper is killed before it can publish the exit code: no crash, exit_code None."""
    res = arun(LocalSandbox(tmp_path).run_command("echo partial; kill -9 $PPID; sleep 5", 10))
    assert res.exit_code is None and not res.budget_exceeded
    assert "partial" in res.output_tail
    assert res.duration_s < 5


def test_budget_exceeded_kills_the_whole_process_group(arun, tmp_path):
    token = "31.4159265"
    cmd = f"sleep {token} & (sleep {token}; echo never) & echo started; sleep {token}"
    t0 = time.monotonic()
    res = arun(LocalSandbox(tmp_path).run_command(cmd, 0.5))
    assert res.budget_exceeded and res.exit_code is None
    assert 0.5 <= res.duration_s < 5 and time.monotonic() - t0 < 5
    assert res.output_tail == "started\n"
    deadline = time.monotonic() + 2
    while live_processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live_processes_with(token) == []


def test_background_leftovers_are_killed_after_a_normal_exit(arun, tmp_path):
    token = "27.1828182"
    res = arun(LocalSandbox(tmp_path).run_command(f"sleep {token} & exit 0", 10))
    assert res.exit_code == 0
    deadline = time.monotonic() + 2
    while live_processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live_processes_with(token) == []


def test_cancelling_a_command_kills_its_process_group(arun, tmp_path):
    token = "16.1803398"

    async def go():
        t = asyncio.create_task(LocalSandbox(tmp_path).run_command(f"sleep {token}", 60))
        await asyncio.sleep(0.3)
        assert live_processes_with(token)
        t0 = time.monotonic()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return time.monotonic() - t0

    waited = arun(go())
    assert waited < 5  # killed, not waited out (the sleep lasts 16 s)
    assert live_processes_with(token) == []


def test_output_tail_is_capped_to_the_last_characters(arun, tmp_path):
    cmd = "for i in $(seq 1 20000); do echo line-$i; done; echo LAST >&2"
    res = arun(LocalSandbox(tmp_path, tail_chars=300).run_command(cmd, 20))
    assert res.exit_code == 0
    assert len(res.output_tail) == 300
    assert res.output_tail.endswith("line-20000\nLAST\n")


@pytest.mark.parametrize("budget", [0, -1, float("nan"), float("inf"), "5"])
def test_invalid_budget_is_refused_with_the_value(arun, tmp_path, budget):
    with pytest.raises(ValueError, match="budget_s: expected a finite number > 0"):
        arun(LocalSandbox(tmp_path).run_command("true", budget))


def test_commands_run_in_the_working_directory(arun, tmp_path):
    (tmp_path / "here.txt").write_text("x")
    res = arun(LocalSandbox(tmp_path).run_command("ls here.txt && pwd", 10))
    assert res.exit_code == 0 and str(tmp_path) in res.output_tail


def test_a_relative_working_directory_still_reports_the_exit_code(arun, tmp_path, monkeypatch):
    # The command writes its done marker from inside the workdir: a relative
    # workdir must not make the marker path relative to itself.
    monkeypatch.chdir(tmp_path)
    box = LocalSandbox("runs/sandbox")
    res = arun(box.run_command("echo ok; exit 3", budget_s=30))
    assert res.exit_code == 3 and res.output_tail.strip() == "ok"
