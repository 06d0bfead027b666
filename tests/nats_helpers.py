"""A 3-node NATS JetStream cluster on loopback for the JetStream log tests.

``nats_cluster_module`` starts one cluster per test module (about half a
second) from the pip-installed ``nats-server`` (extra ``nats``, part of
``dev``); it skips with the reason when the binary is missing, and a test
marked ``required`` turns that skip into a failure under CI=true.
``nats_cluster`` hands the same cluster to each test with every node running
and one meta leader again, so a test that killed a node does not leave the
next test a 2-node cluster.

They are registered for the whole suite by tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from nats_cluster import NatsCluster, find_nats_server


@pytest.fixture(scope="module")
def nats_cluster_module(tmp_path_factory) -> NatsCluster:
    """A running 3-node JetStream cluster shared by the tests of one module; stopped by PID at the end."""
    with _running_cluster(tmp_path_factory, 3) as cluster:
        yield cluster


@contextlib.contextmanager
def _running_cluster(tmp_path_factory, size: int):
    """A started :class:`NatsCluster` of ``size`` nodes (skips without the server binary), stopped on exit."""
    try:
        binary = find_nats_server()
    except FileNotFoundError as e:
        pytest.skip(f"no NATS server: {e}")
    cluster = NatsCluster(tmp_path_factory.mktemp(f"nats{size}"), size=size, binary=binary)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def nats_cluster(nats_cluster_module: NatsCluster) -> NatsCluster:
    """The module's cluster with every node running and one meta leader among them."""
    for node in nats_cluster_module.nodes:
        if node.pid is None:
            nats_cluster_module.restart(node.name)
    nats_cluster_module.wait_ready()
    return nats_cluster_module


@contextlib.asynccontextmanager
async def nats_client(cluster: NatsCluster, **options) -> AsyncIterator:
    """A nats-py client given every node's URL, reconnecting quickly and without limit
    (the failover tests kill the node it may be connected to)."""
    import nats

    nc = await nats.connect(
        servers=cluster.urls,
        reconnect_time_wait=0.1,
        max_reconnect_attempts=-1,
        connect_timeout=2,
        **options,
    )
    try:
        yield nc
    finally:
        await nc.close()


def run(coro):
    """Run a test coroutine to completion (the suite does not use pytest-asyncio)."""
    return asyncio.run(coro)




def raw(url: str, coro_fn):
    """Run ``coro_fn(js)`` on a fresh plain nats-py connection to ``url`` (what another client
    would do: a foreign stream, a deleted or foreign message); returns its result."""
    import nats

    async def main():
        nc = await nats.connect(url)
        try:
            return await coro_fn(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(main())


def pause(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP the server ``pid`` and return once every one of its threads is stopped: the signal
    is only queued when ``kill`` returns, and a loaded machine can let a thread answer one more
    request before it stops (a test that expects the server silent would then flake)."""
    import os
    import signal
    import time
    from pathlib import Path

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(FileNotFoundError):  # a thread that exited meanwhile
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nats-server pid {pid}: threads not all stopped {timeout_s}s after SIGSTOP: {states}")
        time.sleep(0.001)


class SingleServer:
    """One JetStream server (a 1-node :class:`NatsCluster`): ``url`` to connect."""

    def __init__(self, cluster: NatsCluster) -> None:
        self.cluster = cluster
        self.url = cluster.urls[0]

    @property
    def pid(self) -> int:
        """The server's PID (the tests pause it with SIGSTOP)."""
        return self.cluster.nodes[0].pid


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory) -> SingleServer:
    """One local JetStream server for this module (the JetStreamLog tests;
    skips without the ``nats`` extra); stopped by PID at the end."""
    pytest.importorskip("nats", reason="JetStreamLog needs the nats extra: pip install 'agentlog[nats]'")
    with _running_cluster(tmp_path_factory, 1) as cluster:
        yield SingleServer(cluster)
