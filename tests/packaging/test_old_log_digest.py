"""A log written before the `agentlog` namespace change reconstructs to the
same samples as it did then.

``tests/fixtures/pre_namespace_log`` is the rollout log of a short demo run
(``agentlog demo`` with tests/short_demo.py's flags, seed 0) made by commit
2355648, the last one with bare ``events``/``tools`` packages. That commit's
``agentlog reconstruct`` printed the digest pinned below (45 samples from 274
events, 12 groups); it is the canonical bytes of every sample, so equal digests
mean byte-identical samples.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "pre_namespace_log"
DIGEST_BEFORE = "digest sha256:4c9649965adf2eb4331eefce8a50349ab183c1cd36f4cacf1fb37193f3b56f8e"


def test_a_log_written_before_the_namespace_change_reconstructs_to_the_same_digest(tmp_path: Path) -> None:
    log = tmp_path / "log"
    shutil.copytree(FIXTURE, log)  # reading takes no lock, but keep the fixture untouched all the same
    proc = subprocess.run(
        [sys.executable, "-m", "agentlog.tools.cli", "reconstruct", str(log), "--out", str(tmp_path / "s.jsonl"), "--quiet"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "45 samples (jsonl) from 274 events; 12 groups released" in proc.stdout, proc.stdout
    assert lines[-1] == DIGEST_BEFORE, proc.stdout
