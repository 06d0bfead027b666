"""Rollout workers as Ray actors: `agentlog train` on a local Ray, and the loss
of a node mid-run on a loopback cluster (head + 2 worker nodes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_helpers import OBJECT_STORE_BYTES, loopback_cluster, ray  # noqa: F401  (sets the loopback env before ray is imported; a fixture)
from ray.cluster_utils import Cluster

from agentlog.events.log.format import read_fence
from agentlog.events.log.partitions import list_partitions, partition_dir
from agentlog.events.schema.types import SessionOpened
from agentlog.events import read_log
from agentlog.loop.check import check_run
from agentlog.loop.config import RolloutConfig
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.ray_rollout import RayRollouts, local_ray_init_kwargs
from agentlog.loop.run import start_process

from loop_helpers import learner_version, small_config


def _agentlog(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "agentlog"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.required
def test_train_with_the_ray_backend_runs_two_actors_and_reconstructs_equal(tmp_path: Path) -> None:
    """`agentlog train --config` with `[rollout] workers = 2, backend = "ray"`
    starts a local Ray, runs one rollout actor per partition, stops them and
    Ray; both partitions hold sessions, and the offline reconstruction of the
    run folder equals every online digest. A stranger's Ray head already
    running on the machine (another test's, under xdist) is not joined: the
    run starts a Ray of its own."""
    config = tmp_path / "ray.toml"
    config.write_text(
        "steps = 3\ngroups_per_step = 4\ngroup_size = 4\nwarmup_steps = 0\nseed = 0\n"
        '[rollout]\nworkers = 2\nbackend = "ray"\n'
    )
    run = tmp_path / "run"
    bystander = Cluster(initialize_head=True, connect=False, head_node_args=dict(
        num_cpus=0, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, node_ip_address="127.0.0.1"))
    try:
        res = _agentlog("train", "--config", str(config), "--out", str(run), "--quiet", "--no-report", "--timeout", "180")
    finally:
        bystander.shutdown()
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "EQUAL (3/3 steps equal" in res.stdout, res.stdout[-2000:]
    assert "ray_driver.started" in res.stderr and "ray_driver.stopped" in res.stderr
    assert list_partitions(run / "rollout") == [0, 1]
    for pid in (0, 1):
        groups = {e.body.group_id for e in read_log(partition_dir(run / "rollout", pid)) if isinstance(e.body, SessionOpened)}
        assert groups and all(int(g.rsplit("-g", 1)[1]) % 2 == pid for g in groups), (pid, groups)
    again = _agentlog("reconstruct", str(run), "-o", str(tmp_path / "samples.jsonl"), "--quiet")
    assert again.returncode == 0, again.stderr
    assert "EQUAL (3/3 steps equal" in again.stdout, again.stdout
    # The driver shut down the Ray it started: no raylet of that session is left.
    assert "ray_driver.stopped" in res.stderr


@pytest.mark.required
def test_train_with_ray_actors_on_jetstream_logs_reconstructs_equal(tmp_path: Path, nats_server) -> None:
    """`[rollout] backend = "ray"` with `[log] backend = "nats"`: the actors
    write their partitions as subjects of the run's stream (nothing under
    `rollout/`), and the offline check of the run folder, reading the stream
    its config.json names, equals every online digest."""
    from agentlog.events.log.jetstream_read import JetStreamRun
    from agentlog.loop.run_folder import Run

    config = tmp_path / "ray-nats.toml"
    config.write_text(
        "steps = 3\ngroups_per_step = 4\ngroup_size = 4\nwarmup_steps = 0\nseed = 0\n"
        '[rollout]\nworkers = 2\nbackend = "ray"\n'
        f'[log]\nbackend = "nats"\nurl = "{nats_server.url}"\nstream = "ray-nats"\n'
    )
    run = tmp_path / "run"
    res = _agentlog("train", "--config", str(config), "--out", str(run), "--quiet", "--no-report", "--timeout", "180")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "EQUAL (3/3 steps equal" in res.stdout, res.stdout[-2000:]
    assert not (run / "rollout").exists() and not (run / "learner").exists()
    with JetStreamRun.open(nats_server.url, "ray-nats") as stream:
        assert stream.names() == ["learner", "p0000", "p0001"]
    with Run.open(run) as run_logs:
        for pid, src in run_logs.rollout_logs().items():
            groups = {e.body.group_id for e in src.read() if isinstance(e.body, SessionOpened)}
            assert groups and all(int(g.rsplit("-g", 1)[1]) % 2 == pid for g in groups), (pid, groups)
    check = check_run(run)
    assert check.ok and check.digests_equal == check.steps == 3


def _drive(rollouts: RayRollouts, learner, what: str, predicate, timeout: float) -> None:
    """Watch the actors (restarting the rollouts of any Ray restarted) until ``predicate``."""
    t0 = time.monotonic()
    while not predicate():
        rollouts.poll()
        if learner.poll() not in (None, 0):
            pytest.fail(f"while waiting for {what}: the learner exited with {learner.returncode}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what} (actors: {rollouts.statuses})")
        time.sleep(0.1)


def test_a_worker_failing_in_its_actor_is_reported_with_its_partition_and_error(tmp_path: Path, loopback_cluster) -> None:
    """Never silent: a rollout worker that raises inside its actor (here: its
    partition directory holds a stranger's file) makes the driver's poll raise
    a LoopError naming the partition and the error, and the actor's log holds
    it at error level. A resource no node offers is refused at once, by name;
    a run folder the nodes cannot see is named by the actor that looked."""
    from agentlog.loop.ray_rollout import RayBackendError, probe_address
    from agentlog.loop.run import LoopError

    probe_address(loopback_cluster[0].address)  # a real head's GCS passes the check that refuses other listeners
    cfg = small_config(steps=2, rollout=RolloutConfig(workers=2, backend="ray"))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    p1 = partition_dir(run / "rollout", 1)
    p1.mkdir(parents=True)
    (p1 / "notes.txt").write_text("not a log segment\n")
    elsewhere = small_config(steps=2, rollout=RolloutConfig(workers=2, backend="ray", resources={"agentlog_gpu_rollout": 1}))
    t0 = time.monotonic()
    with pytest.raises(RayBackendError, match=r"requests agentlog_gpu_rollout=1, but the Ray cluster offers 0; start rollout nodes with"):
        RayRollouts(elsewhere, run).start()
    assert time.monotonic() - t0 < 10
    unshared = RayRollouts(cfg, tmp_path / "not-shared", start_timeout_s=60)
    try:
        with pytest.raises(RayBackendError, match=r"p0000 could not be created: agentlog.loop.ray_rollout.RayBackendError: rollout partition 0: .*not-shared/config.json is not visible on this node"):
            unshared.start()
    finally:
        unshared.stop()
    rollouts = RayRollouts(cfg, run, start_timeout_s=90)
    try:
        rollouts.start()
        t0 = time.monotonic()
        with pytest.raises(LoopError, match=r"rollout actor p0001 \(node \w+, pid \d+\) failed: NotALog: .*p0001: not an agentlog log directory"):
            while time.monotonic() - t0 < 60:
                assert rollouts.poll() is None
                time.sleep(0.1)
    finally:
        rollouts.stop()
    assert ray.is_initialized(), "the driver shut down a Ray it did not start"
    failed = [line for line in (run / "logs" / "worker-p0001.jsonl").read_text().splitlines() if "ray_actor.worker_failed" in line]
    assert failed and '"level": "error"' in failed[0] and "NotALog" in failed[0], failed


@pytest.mark.required
def test_node_loss_restarts_the_actor_on_the_other_node_with_a_new_epoch_and_loses_nothing(tmp_path: Path, loopback_cluster) -> None:
    """Head (no rollout resources) + 2 worker nodes on loopback, 2 rollout
    actors. Hard-remove the node of partition 1's actor mid-run: Ray restarts
    the actor on the other node, the driver starts its rollouts again, it
    reopens its partition with a higher writer epoch and writes on; every
    record acknowledged before the loss is still there unchanged; training
    reaches the final version; the offline reconstruction equals the online
    digests."""
    deadline = time.monotonic() + 150
    cfg = small_config(steps=10, max_lag=2, rollout=RolloutConfig(workers=2, backend="ray", max_restarts=2))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    p1 = partition_dir(run / "rollout", 1)
    cluster, nodes = loopback_cluster
    learner = start_process("trainer", run)
    rollouts = RayRollouts(cfg, run, call_timeout_s=20, start_timeout_s=90)
    try:
        rollouts.start()
        # Partition 0's worker alone can bring the learner to version 2 (its groups fill steps
        # too): wait for partition 1's worker to have opened its log as well.
        _drive(rollouts, learner, "learner version 2 and partition 1 opened",
               lambda: learner_version(run) >= 2 and read_fence(p1) >= 1, deadline - time.monotonic())
        before = rollouts.watch(force=True)[1]
        assert before.state == "running" and before.epoch == read_fence(p1) >= 1
        victim = next(n for n in nodes if n.node_id == before.node_id)
        acknowledged = [(e.lsn, e.session_id, e.body) for e in read_log(p1, 0)]
        cluster.remove_node(victim, allow_graceful=False)
        _drive(rollouts, learner, "p0001 running again after its node was removed",
               lambda: rollouts.restarts[1] >= 1 and rollouts.statuses[1].state in ("running", "done"), deadline - time.monotonic())
        _drive(rollouts, learner, "the final version", lambda: learner.poll() == 0, deadline - time.monotonic())
        assert rollouts.wait(30), rollouts.statuses
        after_status = rollouts.watch(force=True)
    finally:
        rollouts.stop()
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    moved = after_status[1]
    assert moved.restarted and moved.node_id != victim.node_id and moved.pid != before.pid, (before, moved)
    assert moved.epoch == read_fence(p1) > before.epoch
    after = [(e.lsn, e.session_id, e.body) for e in read_log(p1, 0)]
    assert after[: len(acknowledged)] == acknowledged, "a record acknowledged before the node loss changed or vanished"
    assert len(after) > len(acknowledged), "the restarted actor wrote nothing to its partition"
    assert learner_version(run) == cfg.steps
    check = check_run(run, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    trained = [r for r in read_learner_records(run / "learner") if r.step > 0]
    assert {ref.partition for r in trained for ref in r.batch} == {0, 1}
    assert time.monotonic() < deadline, "the node-loss run took longer than its time bound"


def test_the_ray_backend_without_ray_installed_is_refused_before_the_run_folder_exists(tmp_path: Path, monkeypatch, capsys) -> None:
    """Ray missing: `agentlog train` exits 2 saying to install agentlog[ray] and
    leaves no run folder; the driver raises the same advice as a LoopError."""
    from agentlog.loop.ray_rollout import RayBackendError, import_ray
    from agentlog.tools.cli import main as cli_main

    monkeypatch.setitem(sys.modules, "ray", None)  # what an absent package looks like to import and find_spec
    config = tmp_path / "ray.toml"
    config.write_text('steps = 1\nwarmup_steps = 0\n[rollout]\nworkers = 2\nbackend = "ray"\n')
    assert cli_main(["train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "needs Ray, which is not installed; install it with: pip install 'agentlog[ray]'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(RayBackendError, match=r"needs Ray, which is not installed .*pip install 'agentlog\[ray\]'"):
        import_ray()


def test_a_ray_address_where_nothing_listens_is_refused_at_once(tmp_path: Path, capsys) -> None:
    """`[rollout] address` with no cluster behind it: exit 2 in seconds naming
    the address and how to start a head (ray.init would retry for minutes)."""
    import socket

    from agentlog.tools.cli import main as cli_main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    config = tmp_path / "ray.toml"
    config.write_text(f'steps = 1\nwarmup_steps = 0\n[rollout]\nworkers = 2\nbackend = "ray"\naddress = "127.0.0.1:{port}"\n')
    t0 = time.monotonic()
    assert cli_main(["train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet"]) == 2
    assert time.monotonic() - t0 < 15
    err = capsys.readouterr().err
    assert f"[rollout] address '127.0.0.1:{port}': nothing accepts connections there" in err, err
    assert f"ray start --head --port={port}" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("listener", ["http", "silent"])
def test_a_ray_address_where_something_else_listens_exits_2_naming_what_answered(tmp_path: Path, listener: str) -> None:
    """`[rollout] address` where a plain HTTP server (or a socket that accepts and
    says nothing) listens: the TCP probe alone would pass and ray.init retry for
    minutes; `agentlog train` exits 2 well within 30 s with one line naming the
    address and what answered there."""
    import http.server
    import socket
    import threading

    if listener == "http":
        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the test's output stays the CLI's
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port, stop = server.server_port, server.shutdown
        answered = "an HTTP server answers there (HTTP/1.0 200 OK, Server: SimpleHTTP/"
    else:
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port, stop = silent.getsockname()[1], silent.close
        answered = "something there accepts connections and says nothing"
    config = tmp_path / "ray.toml"
    config.write_text(f'steps = 1\nwarmup_steps = 0\n[rollout]\nworkers = 2\nbackend = "ray"\naddress = "127.0.0.1:{port}"\n')
    try:
        t0 = time.monotonic()
        done = _agentlog("train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet", timeout=60)
        took = time.monotonic() - t0
    finally:
        stop()
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and took < 30, (done.returncode, took, done.stderr)
    assert len(lines) == 1, done.stderr
    assert f"[rollout] address '127.0.0.1:{port}': not Ray: {answered}" in lines[0], lines[0]
    assert "ray.rpc.NodeInfoGcsService/GetClusterId" in lines[0] and not (tmp_path / "run").exists()


def test_a_local_ray_starts_with_fractional_rollout_resources_per_actor() -> None:
    """A local Ray (no ``[rollout] address``) offers every actor its ``resources``. Half a rollout slot
    times three workers is 1.5, which a Ray node refuses ("Resource quantities must all be whole
    numbers": a raw ValueError out of ``ray.init`` in ``RayRollouts.start``). The totals are rounded up."""
    cfg = small_config(rollout=RolloutConfig(workers=3, backend="ray", num_cpus=0.5, resources={"agentlog_rollout": 0.5}))
    if ray.is_initialized():
        ray.shutdown()
    ray.init(**local_ray_init_kwargs(cfg))  # what RayRollouts.start calls without an address
    try:
        have = ray.cluster_resources()
        assert have.get("agentlog_rollout", 0.0) >= 0.5 * 3, have
        assert have.get("CPU", 0.0) >= 0.5 * 3, have
    finally:
        ray.shutdown()
