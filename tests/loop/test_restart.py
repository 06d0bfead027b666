"""Crash a loop process mid-run and restart it: exactly-once training, orphans aborted."""

from __future__ import annotations

import signal
from pathlib import Path

from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionOpened
from agentlog.events import read_log
from agentlog.loop.check import check_run
from agentlog.loop.run import start_process
from agentlog.loop.learner_records import read_learner_records

from loop_helpers import freeze_mid_batch, kill_live, learner_version, small_config, wait_for


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _both_exit_cleanly(learner, worker) -> None:
    """The learner reaches its final version and exits 0, then the worker exits 0."""
    wait_for("the final version", lambda: learner.poll() is not None, 180, [worker])
    assert learner.returncode == 0
    worker.wait(timeout=60)
    assert worker.returncode == 0


def _open_sessions(rollout: Path, *, durable_only: bool = True) -> set[str]:
    from agentlog.events import read_log

    opened: set[str] = set()
    # After a kill, frames written but not yet marked durable survive recovery
    # (the page cache outlives the process): count them too.
    for env in read_log(rollout, 0, durable_only=durable_only):
        if isinstance(env.body, SessionOpened):
            opened.add(env.session_id)
        elif isinstance(env.body, (SessionFinished, SessionAborted, SessionDropped)):
            opened.discard(env.session_id)
    return opened


def test_killed_learner_resumes_from_its_log_and_trains_every_group_exactly_once(tmp_path: Path) -> None:
    """SIGKILL the learner after a few steps, start it again: the learner log shows
    each released group consumed once, steps and versions continue without a gap,
    and every online digest still equals the offline reconstruction."""
    cfg = small_config(steps=14)
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    worker = start_process("worker", run)
    learner = start_process("trainer", run)
    try:
        wait_for("learner version 4", lambda: learner_version(run) >= 4, 120, [worker, learner])
        _kill(learner)
        killed_at = learner_version(run)
        learner = start_process("trainer", run)
        _both_exit_cleanly(learner, worker)
    finally:
        kill_live(worker, learner)
    records = read_learner_records(run / "learner")
    assert [r.step for r in records] == list(range(len(records)))
    trained = [r for r in records if r.groups]
    assert [r.policy_version for r in trained] == list(range(1, cfg.steps + 1))
    assert killed_at < cfg.steps
    check = check_run(run, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.steps == len(records) - 1 and check.digests_equal == check.steps
    # One warm-up record only: the restart resumed, it did not start over.
    assert sum(1 for r in records if r.step == 0) == 1


def test_killed_worker_restart_aborts_orphans_with_engine_restart_and_training_goes_on(tmp_path: Path) -> None:
    """SIGKILL the rollout worker mid-batch, start it again: every session it left
    open ends aborted with reason engine_restart, their groups are released and
    consumed, and the learner reaches its final version."""
    cfg = small_config(steps=10, max_lag=2)
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    learner = start_process("trainer", run)
    worker = start_process("worker", run)
    orphans: set[str] = set()
    try:
        wait_for("learner version 2", lambda: learner_version(run) >= 2, 120, [worker, learner])
        frozen_with = freeze_mid_batch(worker, lambda: _open_sessions(run / "rollout", durable_only=False), [worker, learner])
        _kill(worker)
        orphans = _open_sessions(run / "rollout", durable_only=False)
        assert orphans == frozen_with, (orphans, frozen_with)  # a kill of a frozen process writes nothing more
        worker = start_process("worker", run)
        _both_exit_cleanly(learner, worker)
    finally:
        kill_live(worker, learner)
    reasons = {}
    for env in read_log(run / "rollout", 0):
        if isinstance(env.body, SessionAborted):
            reasons[env.session_id] = env.body.reason
    assert orphans and all(reasons.get(sid) == "engine_restart" for sid in orphans), {
        sid: reasons.get(sid) for sid in orphans
    }
    assert learner_version(run) == cfg.steps
    check = check_run(run, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    consumed = {g for r in read_learner_records(run / "learner") for g in list(r.groups) + list(r.skipped)}
    orphan_groups = {sid.rsplit("-s", 1)[0] for sid in orphans}
    assert orphan_groups & consumed, "the orphans' groups must still be released and trained (or skipped)"
