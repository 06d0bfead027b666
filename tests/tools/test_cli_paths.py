"""Where a log is expected: a run folder stands for its rollout/ log, any other directory gets a
"did you mean", an unreadable one a one-line error (exit 2)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from cli_helpers import agentlog, on_a_terminal

#: Every reading command, with LOG where the log goes ({OUT}: a fresh output file).
READERS = {
    "replay": ["replay", "{LOG}", "--session", "b00000-g00-s1"],
    "show": ["show", "{LOG}", "b00000-g00-s1"],
    "stats": ["stats", "{LOG}"],
    "reconstruct": ["reconstruct", "{LOG}", "-o", "{OUT}.jsonl"],
    "report": ["report", "{LOG}", "-o", "{OUT}.html"],
    "trace": ["trace", "{LOG}", "-o", "{OUT}.json"],
    "verify": ["verify", "{LOG}"],
}


def _args(cmd: str, log: Path, out: Path) -> list[str]:
    return [a.replace("{LOG}", str(log)).replace("{OUT}", str(out)) for a in READERS[cmd]]


@pytest.mark.parametrize("cmd", sorted(READERS))
def test_a_run_folder_reads_as_its_rollout_log(short_demo_run, tmp_path, cmd):
    run = short_demo_run[0] / "runs" / "demo"
    by_folder = agentlog(*_args(cmd, run, tmp_path / "a"))
    direct = agentlog(*_args(cmd, run / "rollout", tmp_path / "b"))
    assert by_folder.returncode == 0, by_folder.stderr
    assert direct.returncode == 0, direct.stderr
    # The same output, up to the path printed and the output file named.
    norm = lambda text, out: text.replace(str(run / "rollout"), "LOG").replace(str(run), "LOG").replace(str(out), "OUT")  # noqa: E731
    assert norm(by_folder.stdout, tmp_path / "a") == norm(direct.stdout, tmp_path / "b")
    assert by_folder.stdout.strip()


def test_tail_on_a_run_folder_follows_its_rollout_log(short_demo_run):
    run = short_demo_run[0] / "runs" / "demo"
    code, text = on_a_terminal("tail", str(run), stdout=True, until=lambda t: "b00000-g00-s1" in t, timeout=60)
    assert "session_opened" in text and "b00000-g00-s1" in text, text
    assert code in (0, 130), (code, text)


def test_a_directory_above_logs_gets_a_did_you_mean(short_demo_run, run_log, tmp_path):
    top = tmp_path / "experiments"
    shutil.copytree(short_demo_run[0] / "runs" / "demo", top / "june" / "demo", ignore=shutil.ignore_patterns("LOCK", "sandbox"))
    shutil.copytree(run_log[0], top / "gateway" / "log", ignore=shutil.ignore_patterns("LOCK"))
    (top / "notes.txt").write_text("x")
    for cmd in ("stats", "replay", "verify", "show"):
        args = [cmd, str(top)] + (["s"] if cmd == "show" else [])
        res = agentlog(*args)
        assert res.returncode == 2, (cmd, res.stderr)
        (line,) = res.stderr.strip().splitlines()
        assert f"{top}: not an agentlog log directory" in line, line
        # The run folder is named itself (it stands for its rollout log), the plain log by its path.
        assert f"did you mean {top / 'gateway' / 'log'} or {top / 'june' / 'demo'}?" in line, line
    # A directory with no log below it: no suggestion.
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    res = agentlog("stats", str(tmp_path / "empty"))
    assert res.returncode == 2 and "did you mean" not in res.stderr, res.stderr


def _unreadable_dir(path: Path, monkeypatch) -> None:
    """Make ``path`` unlistable: chmod 000 when that binds (not root); as root, which
    reads through any mode, the OS refusal is injected into the calls that list it."""
    if os.geteuid() != 0:
        path.chmod(0)
        return
    real_listdir, real_scandir = os.listdir, os.scandir

    def refuse(real):
        def call(p=".", *a, **k):
            if Path(p) == path:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
            return real(p, *a, **k)

        return call

    monkeypatch.setattr(os, "listdir", refuse(real_listdir))
    monkeypatch.setattr(os, "scandir", refuse(real_scandir))


@pytest.mark.parametrize("cmd", ["replay", "stats", "show", "reconstruct", "report", "trace", "verify", "tail"])
def test_an_unreadable_log_directory_is_one_line_exit_2(run_log, tmp_path, monkeypatch, capsys, cmd):
    from agentlog.tools.cli import main as cli_main

    log = tmp_path / "locked.log"
    shutil.copytree(run_log[0], log, ignore=shutil.ignore_patterns("LOCK"))
    _unreadable_dir(log, monkeypatch)
    try:
        args = {"show": [cmd, str(log), "fin-0"], "reconstruct": [cmd, str(log), "-o", str(tmp_path / "o.jsonl")],
                "report": [cmd, str(log), "-o", str(tmp_path / "o.html")],
                "trace": [cmd, str(log), "-o", str(tmp_path / "o.json")]}.get(cmd, [cmd, str(log)])
        rc = cli_main(args)
    finally:
        log.chmod(0o755)
    err = capsys.readouterr().err
    assert rc == 2, err
    (line,) = err.strip().splitlines()
    assert line == f"agentlog: error: {log}: cannot read: Permission denied", line


@pytest.mark.parametrize("cmd", ["replay", "stats", "show", "reconstruct", "report", "trace"])
def test_a_segment_that_cannot_be_read_is_one_line_exit_2(run_log, tmp_path, cmd):
    """A segment path that is a directory: the read fails with EISDIR (works as root too)."""
    from agentlog.events.log.format import list_segments, segment_name

    log = tmp_path / "bad.log"
    shutil.copytree(run_log[0], log, ignore=shutil.ignore_patterns("LOCK"))
    seg = log / segment_name(list_segments(log)[0])
    seg.unlink()
    seg.mkdir()
    args = {"show": [cmd, str(log), "fin-0"], "reconstruct": [cmd, str(log), "-o", str(tmp_path / "o.jsonl")],
            "report": [cmd, str(log), "-o", str(tmp_path / "o.html")],
            "trace": [cmd, str(log), "-o", str(tmp_path / "o.json")]}.get(cmd, [cmd, str(log)])
    res = agentlog(*args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"agentlog: error: {log}") and "Is a directory" in line, line
