"""Runs with several rollout workers on this machine: one log partition each,
a learner that merges them, and a killed worker that comes back."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentlog.events.log.format import FENCE_NAME, read_fence
from agentlog.events.log.partitions import list_partitions, partition_dir
from agentlog.events.schema.types import SessionAborted, SessionOpened
from agentlog.events import read_log
from agentlog.loop.check import check_run
from agentlog.loop.config import RolloutConfig
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.run import start_process

from loop_helpers import freeze_mid_batch, kill_live, learner_version, small_config, wait_for
from short_demo import SHORT_DEMO_ARGS


def _agentlog(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "agentlog"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.required
def test_demo_with_three_workers_writes_three_partitions_and_reconstructs_equal(tmp_path: Path) -> None:
    """`agentlog demo --workers 3`: three local worker processes, one partition
    each; every group's sessions sit in one partition; the learner's records
    name groups from several partitions; the demo's offline check and
    `agentlog reconstruct` of the run folder both say EQUAL."""
    run = tmp_path / "run"
    res = _agentlog(*SHORT_DEMO_ARGS, "--workers", "3", "--out", str(run))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "EQUAL" in res.stdout and "DIFFERENT" not in res.stdout
    assert list_partitions(run / "rollout") == [0, 1, 2]
    group_partition: dict[str, int] = {}
    for pid in range(3):
        for env in read_log(partition_dir(run / "rollout", pid)):
            if isinstance(env.body, SessionOpened):
                g = int(env.body.group_id.rsplit("-g", 1)[1])
                assert g % 3 == pid, f"group {env.body.group_id} ran on partition {pid}"
                assert group_partition.setdefault(env.body.group_id, pid) == pid
    trained = [r for r in read_learner_records(run / "learner") if r.step > 0]
    assert {ref.partition for r in trained for ref in r.batch} == {0, 1, 2}
    assert all(set(r.frontier) == {0, 1, 2} for r in trained)
    again = _agentlog("reconstruct", str(run), "-o", str(tmp_path / "samples.jsonl"), "--quiet")
    assert again.returncode == 0, again.stderr
    assert f"EQUAL ({len(trained)}/{len(trained)} steps equal" in again.stdout


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _open_sessions(path: Path) -> set[str]:
    from agentlog.events import read_log
    from agentlog.events.schema.types import TERMINAL_EVENT_TYPES

    opened: set[str] = set()
    for env in read_log(path, 0, durable_only=False):
        if isinstance(env.body, SessionOpened):
            opened.add(env.session_id)
        elif isinstance(env.body, TERMINAL_EVENT_TYPES):
            opened.discard(env.session_id)
    return opened


def test_a_killed_worker_restarts_on_its_partition_with_a_new_epoch_and_loses_nothing(tmp_path: Path) -> None:
    """SIGKILL one of two workers mid-batch and start it again: it reopens its
    own partition with a higher writer epoch, every record that was durable
    before the kill is still there unchanged, the sessions it left open are
    aborted with engine_restart, their groups are consumed, the other
    partition is untouched, and the run reconstructs EQUAL."""
    cfg = small_config(steps=10, max_lag=2, rollout=RolloutConfig(workers=2))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    p1 = partition_dir(run / "rollout", 1)
    learner = start_process("trainer", run)
    workers = {pid: start_process("worker", run, "--partition", str(pid)) for pid in (0, 1)}
    orphans: set[str] = set()
    try:
        wait_for("learner version 2", lambda: learner_version(run) >= 2, 120, [learner, *workers.values()])
        epoch_before = read_fence(p1)
        frozen_with = freeze_mid_batch(workers[1], lambda: _open_sessions(p1), [learner, *workers.values()])
        _kill(workers[1])
        acknowledged = [(e.lsn, e.session_id, e.body) for e in read_log(p1, 0)]
        orphans = _open_sessions(p1)
        assert orphans == frozen_with, (orphans, frozen_with)  # a kill of a frozen process writes nothing more
        workers[1] = start_process("worker", run, "--partition", "1")
        wait_for("the final version", lambda: learner.poll() is not None, 180, list(workers.values()))
        assert learner.returncode == 0
        for w in workers.values():
            w.wait(timeout=60)
            assert w.returncode == 0
    finally:
        kill_live(learner, *workers.values())
    assert (p1 / FENCE_NAME).is_file() and read_fence(p1) > epoch_before
    after = [(e.lsn, e.session_id, e.body) for e in read_log(p1, 0)]
    assert after[: len(acknowledged)] == acknowledged, "a record acknowledged before the kill changed or vanished"
    reasons = {e.session_id: e.body.reason for e in read_log(p1, 0) if isinstance(e.body, SessionAborted)}
    assert all(reasons.get(sid) == "engine_restart" for sid in orphans), {sid: reasons.get(sid) for sid in orphans}
    assert learner_version(run) == cfg.steps
    check = check_run(run, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    consumed = {(ref.partition, ref.group_id) for r in read_learner_records(run / "learner") for ref in r.batch}
    orphan_groups = {(1, sid.rsplit("-s", 1)[0]) for sid in orphans}
    assert orphan_groups & consumed, "the orphans' groups must still be released and consumed"


def test_a_partition_that_never_writes_is_declared_lost_recorded_and_training_goes_on(tmp_path: Path) -> None:
    """Two partitions, but only worker p0000 ever starts: after lost_after_s of
    silence the learner declares p0001 lost, records why in its log, cuts its
    steps from the live worker's share of each batch, reaches its final
    version, and the run still reconstructs EQUAL."""
    cfg = small_config(steps=4, rollout=RolloutConfig(workers=2, lost_after_s=2.0))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    learner = start_process("trainer", run)
    worker = start_process("worker", run, "--partition", "0")
    try:
        wait_for("the final version", lambda: learner.poll() is not None, 120, [worker])
        assert learner.returncode == 0
        worker.wait(timeout=60)
        assert worker.returncode == 0
    finally:
        kill_live(learner, worker)
    records = [r for r in read_learner_records(run / "learner") if r.step > 0]
    declared = [r for r in records if r.lost_partitions]
    assert len(declared) == 1 and set(declared[0].lost_partitions) == {1}
    assert "p0001 wrote nothing" in declared[0].lost_partitions[1]
    assert records[-1].policy_version == cfg.steps
    later = records[records.index(declared[0]) + 1:]
    assert later and all(len(r.batch) == cfg.groups_per_step // 2 for r in later)
    check = check_run(run, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
