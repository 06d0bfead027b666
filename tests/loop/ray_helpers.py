"""Ray clusters for the loop tests: on loopback, small, bounded in time.

``ray_cluster(...)`` starts a ``ray.cluster_utils.Cluster`` (a head node with
no rollout resources, plus worker nodes that offer the custom resource the
rollout actors request), connects this process to it, and always shuts both
down. Every wait here has a timeout.

Measured on the 2-core CI box (ray 2.60): a local ``ray.init`` takes ~3.7 s;
a head + 2 worker nodes ~8-10 s; after ``remove_node(..., allow_graceful=False)``
an actor with ``max_restarts`` answers from the other node after ~1.8 s with
the health-check settings below (Ray's defaults take ~17 s), while the old
actor process lingers ~0.5 s more (it still holds its partition's lock).
Three nodes with two idle actors: ~1.1 GB RSS.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator

import pytest


def ray_test_env() -> None:
    """Environment of a Ray test, set before ``ray`` is imported (it reads it at
    import): every node and driver on 127.0.0.1, no token file written to $HOME."""
    # Ray then takes the loopback address as this machine's (services.get_node_ip_address).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Token auth (Ray's default since 2.5x) would generate ~/.ray/auth_token; a loopback test cluster needs none.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


ray_test_env()
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[dev]')")

from ray.cluster_utils import Cluster  # noqa: E402

#: The custom resource rollout actors request (LoopConfig's [rollout] resources default).
ROLLOUT_RESOURCE = "agentlog_rollout"
#: Per-node object store: the actors pass only small status structs.
OBJECT_STORE_BYTES = 80 * 1024 * 1024
#: Detect a lost node in ~1.5 s instead of Ray's ~15 s (period x threshold).
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@contextlib.contextmanager
def ray_cluster(worker_nodes: int = 2, *, rollout_per_node: float = 2, cpus_per_node: int = 2,
                timeout_s: float = 90.0) -> Iterator[tuple[Cluster, list[Any]]]:
    """(cluster, worker nodes): a head node (no CPUs, no rollout resource: nothing
    schedules there) and ``worker_nodes`` nodes each offering ``rollout_per_node``
    of the rollout resource, all on 127.0.0.1, with this process connected as
    the driver. Shut down on exit, whatever happened."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, node_ip_address="127.0.0.1",
        _system_config=FAST_HEALTH_CHECKS,
    ))
    try:
        nodes = [cluster.add_node(num_cpus=cpus_per_node, resources={ROLLOUT_RESOURCE: rollout_per_node},
                                  object_store_memory=OBJECT_STORE_BYTES, node_ip_address="127.0.0.1")
                 for _ in range(worker_nodes)]
        ray.init(address=cluster.address, namespace="agentlog-test", logging_level="WARNING")
        cluster.wait_for_nodes(timeout=timeout_s)
        yield cluster, nodes
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()


def get(ref: Any, timeout: float = 30.0) -> Any:
    """``ray.get`` with a timeout (never an unbounded wait in a test)."""
    return ray.get(ref, timeout=timeout)


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 60.0, every: float = 0.1) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` on timeout."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


@pytest.fixture(scope="module")
def loopback_cluster() -> Iterator[tuple[Cluster, list[Any]]]:
    """One :func:`ray_cluster` (head + 2 worker nodes, 2 rollout slots and 2 CPUs
    each) shared by a test module, this process connected as its driver. A test
    that removes a node leaves one: each test must need no more than one node."""
    with ray_cluster(2, rollout_per_node=2, cpus_per_node=2) as cluster_and_nodes:
        yield cluster_and_nodes
