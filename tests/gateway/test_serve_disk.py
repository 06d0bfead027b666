"""`agentlog serve` on a disk that refuses writes: one line, exit 2, never a
traceback. A nearly full disk is a real file-size limit (RLIMIT_FSIZE: every
write past it fails with EFBIG, as ENOSPC would) in the serve process."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from agentlog.engine.restart import CHECKPOINT_NAME
from agentlog.events import FileLog

REPO = Path(__file__).resolve().parents[2]


def _serve(logdir: Path, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentlog.tools.cli", "serve", "--log", str(logdir), "--port", "0", "--admin-token", "tok"],
        cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=preexec_fn,
    )


def _one_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr, res.stdout[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentlog: error: "), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    return lines[0]


def test_serve_with_a_directory_in_place_of_the_engine_checkpoint_exits_2_with_one_line(tmp_path):
    logdir = tmp_path / "log"
    FileLog.open(logdir).close()
    (logdir / CHECKPOINT_NAME).mkdir()
    line = _one_line(_serve(logdir))
    assert f"cannot write the engine checkpoint {logdir / CHECKPOINT_NAME}: IsADirectoryError" in line
    assert f"remove what is at {logdir / CHECKPOINT_NAME}" in line
    assert (logdir / CHECKPOINT_NAME).is_dir()  # reported, never removed by serve


def test_serve_on_a_nearly_full_disk_exits_2_with_one_line_and_leaves_no_partial_file(tmp_path):
    logdir = tmp_path / "log"
    room = 256 << 10  # the log's small files fit; the engine checkpoint (~1 MiB) does not

    def nearly_full() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (room, room))

    line = _one_line(_serve(logdir, nearly_full))
    assert f"cannot write the engine checkpoint {logdir / CHECKPOINT_NAME}" in line and "File too large" in line
    assert "free disk space" in line
    assert not [p.name for p in logdir.iterdir() if p.name.startswith(".")]  # no partial temp file holds the space
    with FileLog.open(logdir) as log:  # the log itself is sound
        assert log.next_lsn == 0
