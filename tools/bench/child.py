"""A measure taken in a fresh interpreter: what a benchmark runs in a child process
prints its figures as JSON on its last line of standard output."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def json_from_child(args: list[str], *, timeout: float | None = None) -> Any:
    """Run ``python ARGS`` in a fresh interpreter and return the JSON value of the last line it
    printed. A child that fails raises RuntimeError with its exit status and the end of its stderr."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the benchmark's child process {args[:2]} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
