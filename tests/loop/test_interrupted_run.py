"""Ctrl-C on `agentlog train`/`demo` leaves a run folder marked incomplete
(``INCOMPLETE``, with the reason), says so on exit (status 130), and the reading
commands note it; a run that ends normally leaves no marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentlog.loop.run_marker import INCOMPLETE_MARKER

ROOT = Path(__file__).resolve().parents[2]


def test_ctrl_c_marks_the_run_incomplete_and_the_reading_commands_say_so(tmp_path: Path):
    run = tmp_path / "run"
    # Long enough that it is still running when interrupted; no warm-up, so RL starts at once.
    cmd = [sys.executable, "-m", "agentlog.tools.cli", "demo", "--out", str(run), "--steps", "400", "--warmup-steps", "0",
           "--groups-per-step", "2", "--group-size", "2", "--no-faults", "--quiet", "--no-report"]
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches every process of the loop.
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "learner").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        assert (run / INCOMPLETE_MARKER).read_text().split(" ", 1)[1].startswith("running"), "marked while it runs"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out, err)
    lines = [line for line in err.splitlines() if line.startswith("agentlog: error: ")]
    assert len(lines) == 1 and "interrupted; the run is incomplete" in lines[0] and INCOMPLETE_MARKER in lines[0], err
    assert "Traceback" not in err, err
    assert "interrupted (SIGINT, Ctrl-C)" in (run / INCOMPLETE_MARKER).read_text()

    res = subprocess.run([sys.executable, "-m", "agentlog.tools.cli", "verify", str(run)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert f"agentlog: note: {run} is an incomplete run (" in res.stderr and "interrupted" in res.stderr, res.stderr
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds an incomplete run" in again.stderr, again.stderr
