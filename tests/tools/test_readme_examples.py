"""The README's shell examples run as written.

Every line that starts with ``agentlog `` inside a fenced ```sh or ```bash
block of README.md is run (its ``# comment`` dropped) in a folder that holds
the short demo run of tests/conftest.py at ``runs/demo``, and must exit 0.
Two kinds of line are treated specially, each for a stated reason:

* ``agentlog demo``: the full demo takes minutes; its flags are parsed (so a
  wrong flag still fails) and the run it describes is the fixture's, made
  with the same ``--out`` plus flags that shorten it.
* ``agentlog serve`` / ``tail``: they run until interrupted; each must start
  (print its first line), then stop cleanly on SIGINT. ``serve`` gets
  ``--port 0`` appended: a test must not hold a fixed port.
* the JetStream examples (``nats://localhost:4222/...``): they run in order,
  in one test, against the ``nats_server`` fixture's server (its address
  substituted: a test must not hold a fixed port), and what their comments
  claim (the same digests as the demo run's folder) is checked.
* ``agentlog train --config jetstream.toml``: tests/loop/test_jetstream_loop.py
  runs it, with the README's ``jetstream.toml`` block, against a test server.

Usage synopses with placeholders (LOG, SESSION) are in ```text blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cli_helpers import ROOT

README = ROOT / "README.md"
LONG_RUNNING = {"serve": "listening on", "tail": "session_opened"}


def readme_commands(text: str) -> list[list[str]]:
    """The ``agentlog`` command lines of the README's sh/bash blocks, as argument lists."""
    out = []
    for block in re.findall(r"^```(?:sh|bash)[ \t]*\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            if line.startswith("agentlog "):
                out.append(shlex.split(line, comments=True))
    return out


#: The server the README's JetStream examples name; the test substitutes its own server's address.
README_NATS = "nats://localhost:4222"
ALL_COMMANDS = readme_commands(README.read_text())
#: The JetStream examples (they need a server, and each builds on the one before: run in order, in one test).
NATS_COMMANDS = [c for c in ALL_COMMANDS if any(a.startswith(README_NATS) for a in c)]
#: Run by tests/loop/test_jetstream_loop.py with the README's jetstream.toml and a test server's address.
TRAIN_ON_JETSTREAM = [c for c in ALL_COMMANDS if "jetstream.toml" in c]
COMMANDS = [c for c in ALL_COMMANDS if c not in NATS_COMMANDS and c not in TRAIN_ON_JETSTREAM]


def test_the_readme_has_runnable_examples_of_the_debugging_commands():
    assert len(TRAIN_ON_JETSTREAM) == 1, "the README's train-on-JetStream example is what test_jetstream_loop runs"
    names = {cmd[1] for cmd in COMMANDS}
    assert {"demo", "replay", "show"} <= names, COMMANDS
    # Synopses with placeholders must not sit in a runnable block.
    for cmd in COMMANDS:
        assert not any(a in ("LOG", "SESSION", "ID") for a in cmd), cmd


def _run_until_first_line(args: list[str], cwd: Path, needle: str, timeout: float = 90) -> tuple[int, str]:
    """Start ``agentlog ARGS``; once ``needle`` shows on stdout, SIGINT it; (exit code, stdout + stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentlog.tools.cli", *args], cwd=cwd, env=dict(os.environ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen = threading.Event()
    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        started = seen.wait(timeout)
        assert started or proc.poll() is not None, f"agentlog {shlex.join(args)}: no {needle!r} within {timeout} s"
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    return code, "".join(lines) + proc.stderr.read()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[" ".join(c[1:3]) for c in COMMANDS])
def test_each_readme_example_runs_as_written(cmd, short_demo_run, tmp_path):
    cwd, _ = short_demo_run
    args = cmd[1:]
    if args[0] == "demo":
        from agentlog.tools.cli import build_parser

        parsed = build_parser(args).parse_args(args)  # a wrong flag fails here
        # The run the other examples read is the fixture's, at runs/demo: the demo's default folder is
        # linked there (tools.cli_loop._link_latest, tested in test_cli_first_run.py).
        assert parsed.out in (None, Path("runs/demo")) and (cwd / "runs" / "demo" / "config.json").exists()
        return
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)  # what the examples write (runs/gw, report.html) stays here
    (work / "runs" / "demo").symlink_to(cwd / "runs" / "demo", target_is_directory=True)
    if args[0] in LONG_RUNNING:
        if args[0] == "serve":
            args = [*args, "--port", "0"]
        code, out = _run_until_first_line(args, work, LONG_RUNNING[args[0]])
        assert code in (0, 130) and "Traceback" not in out, (code, out)
        return
    res = subprocess.run(
        [sys.executable, "-m", "agentlog.tools.cli", *args], cwd=work, env=dict(os.environ),
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, (shlex.join(cmd), res.stdout[-2000:], res.stderr[-2000:])
    assert res.stdout.strip(), shlex.join(cmd)


def _agentlog(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentlog.tools.cli", *args], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.required
def test_the_readme_jetstream_examples_run_in_order(short_demo_run, nats_server, tmp_path):
    cwd, _ = short_demo_run
    assert [c[1] for c in NATS_COMMANDS][:1] == ["import"] and {"export", "verify", "reconstruct", "tail"} <= {c[1] for c in NATS_COMMANDS}
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    (work / "runs" / "demo").symlink_to(cwd / "runs" / "demo", target_is_directory=True)
    outputs = {}
    for cmd in NATS_COMMANDS:
        args = [a.replace(README_NATS, nats_server.url) for a in cmd[1:]]
        if args[0] in LONG_RUNNING:
            code, out = _run_until_first_line(args, work, LONG_RUNNING[args[0]])
            assert code in (0, 130) and "Traceback" not in out, (code, out)
            continue
        res = _agentlog(args, work)
        assert res.returncode == 0, (shlex.join(cmd), res.stdout[-2000:], res.stderr[-2000:])
        assert res.stdout.strip(), shlex.join(cmd)
        outputs[args[0]] = res.stdout
    # What the comments claim: the stream's digests are the run folder's.
    here = _agentlog(["verify", "--digest", "runs/demo"], work)
    assert here.returncode == 0, here.stderr
    digests = [line.split("records ")[1] for line in here.stdout.splitlines() if "records sha256:" in line]
    assert digests and digests == [line.split("records ")[1] for line in outputs["verify"].splitlines() if "records sha256:" in line]
    here = _agentlog(["reconstruct", "runs/demo", "-o", "here.msgpack"], work)
    assert here.returncode == 0 and here.stdout.splitlines()[-1] == outputs["reconstruct"].splitlines()[-1]
    assert "every log EQUAL" in outputs["import"] and "every log EQUAL" in outputs["export"]
