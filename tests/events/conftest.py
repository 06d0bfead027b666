"""Fixtures for the events tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from agentlog.events.log import framecodec


@pytest.fixture
def fast_tmp(tmp_path):
    """A scratch directory on tmpfs when there is one. Loops that reopen a log
    hundreds of times (every-byte truncation, every-bit flips) test recovery
    logic, not the disk, and fsync on a busy shared disk costs milliseconds."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="agentlog-test-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


@pytest.fixture(params=["compiled", "pure"])
def codec(request, monkeypatch):
    """Run a test under each frame codec (events.log.framecodec): the compiled
    one and the pure-Python fallback. Child processes inherit the choice
    through AGENTLOG_PURE_PYTHON. The contract and fault suites use it
    (``pytestmark = pytest.mark.usefixtures("codec")``), so both paths pass
    the same tests. Without a built extension the compiled variant skips,
    saying why."""
    pure = request.param == "pure"
    if not pure and not framecodec.available():
        pytest.skip(framecodec.unavailable_reason())
    saved = framecodec.native
    framecodec.use_native(not pure)
    monkeypatch.setenv(framecodec.ENV_VAR, "1" if pure else "0")
    try:
        yield request.param
    finally:
        framecodec.native = saved

