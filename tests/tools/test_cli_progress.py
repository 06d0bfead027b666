"""Progress bars on reading more than a few MB (on a terminal); --quiet silences them."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

from cli_helpers import ROOT

sys.path.insert(0, str(ROOT / "tools" / "bench"))
from bench_cli import generate_log  # noqa: E402


def _stderr_on_a_terminal(*args: str) -> tuple[int, str]:
    """Run agentlog ARGS with stderr on a pseudo-terminal; returns (exit code, what it wrote there)."""
    master, slave = pty.openpty()
    # A fresh pty is 0x0; a real terminal has a size (tqdm draws nothing in 0 columns).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tools.cli import main; sys.exit(main())", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=slave,
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 120
    while True:
        # A hung child must fail the test, not hang it: wait for output with a deadline.
        ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            os.close(master)
            raise AssertionError(f"agentlog {' '.join(args)} wrote nothing for 120 s; killed")
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(120), b"".join(chunks).decode("utf-8", "replace")


def test_reading_a_big_log_shows_progress_and_quiet_silences_it(tmp_path):
    import logging

    import structlog

    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        generate_log(tmp_path / "big.log", 6 << 20, quiet=True)
    finally:
        structlog.configure(**saved)
    code, err = _stderr_on_a_terminal("stats", str(tmp_path / "big.log"))
    assert code == 0, err
    assert "stats:" in err and "B/s" in err, err
    code, err = _stderr_on_a_terminal("stats", str(tmp_path / "big.log"), "--quiet")
    assert code == 0 and err == "", err
