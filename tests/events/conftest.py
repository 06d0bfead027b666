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


# The JetStream fixtures (tests/events/nats_helpers.py), for every test module here: a
# 3-node cluster, and one server for the JetStreamLog tests.
from nats_helpers import nats_cluster, nats_cluster_module, nats_server  # noqa: E402, F401
