"""Helpers for the loop tests: small configs and waiting on run folders."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest

from tools.loop.config import FaultConfig, LoopConfig
from tools.loop.trainer import read_learner_records


def small_config(**overrides) -> LoopConfig:
    """A loop that runs in seconds: no warm-up, 8 groups of 4 per step."""
    values = dict(
        steps=12, groups_per_step=8, group_size=4, warmup_steps=0, min_valid=2,
        faults=FaultConfig(exception_rate=0.05, timeout_rate=0.05, drop_rate=0.05, straggler_rate=0.05, empty_marker_rate=0.0),
    )
    values.update(overrides)
    return LoopConfig(**values)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 60.0, procs=()) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` (and any dead process) on timeout."""
    t0 = time.monotonic()
    while not predicate():
        for p in procs:
            if p.poll() not in (None, 0):
                pytest.fail(f"while waiting for {what}: process {p.args} exited with {p.returncode}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def learner_version(run_dir: Path) -> int:
    """Newest policy version in a run's learner log (-1 before any)."""
    recs = read_learner_records(Path(run_dir) / "learner")
    return recs[-1].policy_version if recs else -1
