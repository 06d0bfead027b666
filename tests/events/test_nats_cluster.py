"""The 3-node JetStream cluster that the JetStream log stands on (tests/nats_cluster.py).

Checks what the log backend will rely on, on the real server: a replicas-3
file-storage stream, ``Nats-Msg-Id`` duplicate suppression inside an explicit
``duplicate_window`` (and only inside it), and no loss nor duplicate of an
acknowledged message when the stream leader is SIGKILLed mid-stream. Also the
cluster's own lifecycle: kill, restart, stop by PID, errors naming the node.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from nats_cluster import NatsCluster, NatsClusterError, find_nats_server
from nats_helpers import nats_client, run

pytestmark = pytest.mark.required

MSG_ID = "Nats-Msg-Id"


async def _add_r3_stream(js, name: str, duplicate_window: float):
    """A replicas-3, file-storage stream on subjects ``<name>.>``, with the given dedup window (s)."""
    from nats.js.api import StorageType, StreamConfig

    return await js.add_stream(
        StreamConfig(
            name=name,
            subjects=[f"{name}.>"],
            storage=StorageType.FILE,
            num_replicas=3,
            duplicate_window=duplicate_window,
        )
    )


def _unanswered() -> tuple[type[BaseException], ...]:
    """What a publish nobody answered raises (no stream had its subject yet): it stored nothing."""
    import nats.errors
    import nats.js.errors

    return nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError


async def _publish(js, subject: str, data: bytes, msg_id: str, *, retry_on: tuple[type[BaseException], ...] | None = None,
                   within_s: float = 10.0, timeout: float | None = None):
    """``js.publish`` with a ``Nats-Msg-Id``, tried again with the same id for up to ``within_s``
    while it raises one of ``retry_on``. By default only :func:`_unanswered`: a new replicas-3
    stream takes a moment to elect its leader and spread its subjects' interest over the cluster,
    and a publish nobody answered cannot make a duplicate; a timeout might have, and is raised.
    A test that counts on the dedup window to absorb retries passes every error."""
    retry_on = retry_on or _unanswered()
    deadline, last_error = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        try:
            return await js.publish(subject, data, timeout=timeout, headers={MSG_ID: msg_id})
        except retry_on as exc:
            last_error = exc
            await asyncio.sleep(0.05)
    raise AssertionError(f"publish of {msg_id} not acknowledged within {within_s} s; last error: {last_error!r}")


async def _stored_ids(js, stream: str) -> list[str]:
    """The ``Nats-Msg-Id`` of every message in ``stream``, in sequence order."""
    info = await js.stream_info(stream)
    ids = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        ids.append((msg.headers or {}).get(MSG_ID))
    return ids


def test_cluster_starts_three_nodes_with_own_ports_and_stores(nats_cluster: NatsCluster):
    """Three running servers, distinct ports and store folders, one meta leader among them."""
    nodes = nats_cluster.nodes
    assert len(nodes) == 3 and all(n.pid for n in nodes)
    ports = [p for n in nodes for p in (n.client_port, n.cluster_port, n.monitor_port)]
    assert len(set(ports)) == 9
    assert len({n.store_dir for n in nodes}) == 3
    assert nats_cluster.meta_leader() in {n.name for n in nodes}
    for n in nodes:
        jsz = n.monitor("jsz")
        assert jsz["meta_cluster"]["cluster_size"] == 3, (n.describe(), jsz)
        assert jsz["config"]["store_dir"].startswith(str(n.store_dir)), (n.describe(), jsz["config"])


def test_msg_id_duplicates_are_suppressed_only_within_the_window(nats_cluster: NatsCluster):
    """A retried publish with the same Nats-Msg-Id is acked as a duplicate at the same
    sequence inside duplicate_window, and stored anew once the window has passed."""
    window = 1.0

    async def body():
        async with nats_client(nats_cluster) as nc:
            js = nc.jetstream()
            info = await _add_r3_stream(js, "DEDUP", duplicate_window=window)
            assert info.config.num_replicas == 3 and info.config.duplicate_window == window
            first = await _publish(js, "DEDUP.p0", b"a", "p0-e1-l1")
            again = await _publish(js, "DEDUP.p0", b"a", "p0-e1-l1")
            other = await _publish(js, "DEDUP.p0", b"b", "p0-e1-l2")
            assert not first.duplicate and again.duplicate and again.seq == first.seq
            assert other.seq == first.seq + 1 and not other.duplicate
            await asyncio.sleep(window * 1.5)
            late = await _publish(js, "DEDUP.p0", b"a", "p0-e1-l1")
            assert not late.duplicate and late.seq == other.seq + 1
            assert await _stored_ids(js, "DEDUP") == ["p0-e1-l1", "p0-e1-l2", "p0-e1-l1"]

    run(body())


def test_stream_leader_sigkill_loses_no_acknowledged_message(nats_cluster: NatsCluster):
    """SIGKILL the R3 stream's leader during a stream of publishes (each retried with its
    Nats-Msg-Id until acked): publishing resumes on a new leader, and every acknowledged
    message is in the stream exactly once."""
    import nats.errors

    total, kill_at = 120, 40
    timings: dict[str, float] = {}

    async def wait_new_leader(js, killed: str, t_kill: float) -> float:
        """Seconds from the kill until stream info names a leader other than ``killed``."""
        while time.monotonic() - t_kill < 30:
            try:
                leader = (await js.stream_info("FAILOVER")).cluster.leader
            except (nats.errors.Error, asyncio.TimeoutError):
                leader = None  # no stream leader to answer yet: that is what is being timed
            if leader not in (None, killed):
                return time.monotonic() - t_kill
            await asyncio.sleep(0.05)
        raise AssertionError(f"no new leader of stream FAILOVER within 30 s of killing {killed}")

    async def body():
        async with nats_client(nats_cluster) as nc:
            js = nc.jetstream()
            await _add_r3_stream(js, "FAILOVER", duplicate_window=120.0)
            acked: dict[int, int] = {}
            killed = None
            for i in range(total):
                if i == kill_at:
                    killed = (await js.stream_info("FAILOVER")).cluster.leader
                    assert killed in {n.name for n in nats_cluster.nodes}
                    await asyncio.to_thread(nats_cluster.kill, killed)
                    t_kill = time.monotonic()
                    # Its own context with a short request timeout: a request stuck on the dead
                    # leader would otherwise cost the default 5 s and blur the figure.
                    election = asyncio.create_task(wait_new_leader(nc.jetstream(timeout=0.25), killed, t_kill))
                # The dedup window (120 s) absorbs a retry of a publish that was stored: every error is retried.
                ack = await _publish(js, f"FAILOVER.p{i % 4}", f"event {i}".encode(), f"m-{i}",
                                     retry_on=(nats.errors.Error, asyncio.TimeoutError), within_s=30, timeout=1.0)
                acked[i] = ack.seq
                if i == kill_at:
                    timings["first_ack_after_kill_s"] = time.monotonic() - t_kill
            timings["new_leader_s"] = await election
            info = await js.stream_info("FAILOVER")
            assert info.cluster.leader not in (None, killed), info.cluster
            assert info.state.messages == total, info.state
            ids = await _stored_ids(js, "FAILOVER")
            assert sorted(ids, key=lambda s: int(s.split("-")[1])) == [f"m-{i}" for i in range(total)]
            assert len(set(acked.values())) == total

            # The killed node comes back on its ports and store and catches up.
            timings["restart_s"] = await asyncio.to_thread(nats_cluster.restart, killed)
            deadline = time.monotonic() + 20
            while True:
                info = await js.stream_info("FAILOVER")
                replicas = {r.name: r for r in info.cluster.replicas or []}
                if killed in replicas and replicas[killed].current:
                    break
                assert time.monotonic() < deadline, f"node {killed} not current after restart: {info.cluster}"
                await asyncio.sleep(0.1)

    run(body())
    print(f"\nFIGURE nats_failover new_leader_s={timings['new_leader_s']:.3f} "
          f"first_ack_after_kill_s={timings['first_ack_after_kill_s']:.3f} "
          f"restart_s={timings['restart_s']:.3f} start_s={nats_cluster.start_seconds:.3f}")


def test_kill_restart_and_stop_are_by_pid(tmp_path):
    """kill() SIGKILLs one node's process, restart() brings it back on the same
    ports, stop() ends every process; a dead node's error names it and its log."""
    cluster = NatsCluster(tmp_path, size=3)
    cluster.start()
    try:
        node = cluster.nodes[1]
        old_pid = node.pid
        assert cluster.kill(node.name) == old_pid and node.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)
        with pytest.raises(NatsClusterError, match=rf"node {node.name} .*not running"):
            cluster.kill(node.name)
        cluster.restart(node.name)
        assert node.pid not in (None, old_pid)
        assert node.monitor("healthz").get("status") == "ok"
    finally:
        pids = [n.pid for n in cluster.nodes]
        cluster.stop()
    assert all(n.pid is None for n in cluster.nodes)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_node_that_cannot_start_is_named_with_its_port_and_log(tmp_path):
    """A node whose client port is taken fails the start with an error naming the node,
    the port and its log file; the other nodes are stopped."""
    import socket

    cluster = NatsCluster(tmp_path, size=3, ready_timeout=10)
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", cluster.nodes[2].client_port))
    blocker.listen()
    try:
        with pytest.raises(NatsClusterError) as err:
            cluster.start()
    finally:
        blocker.close()
    text = str(err.value)
    assert "node n3" in text and str(cluster.nodes[2].client_port) in text and str(cluster.nodes[2].log_path) in text
    assert all(n.pid is None for n in cluster.nodes)


def test_missing_binary_is_reported_with_where_it_looked(monkeypatch, tmp_path):
    """$AGENTLOG_NATS_SERVER pointing nowhere is refused by name."""
    monkeypatch.setenv("AGENTLOG_NATS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="AGENTLOG_NATS_SERVER"):
        find_nats_server()
