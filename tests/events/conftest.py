"""Fixtures for the events tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest



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
