"""kill -9 a rollout worker mid-batch; the restarted worker resumes its sessions from their last durable turn.

The worker is the real one (tools/bench/scripted_worker.py: RolloutWorker, its
engine, gateway, Python agent, sandboxes and snapshot store) with a scripted
model; the learner is the real ``agentlog.loop.trainer`` process. The task's
verifier rewards 1 only when the sandbox saw each step exactly once, so a
session resumed onto a sandbox from another turn would score 0.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import msgspec
import pytest

from agentlog.events import read_log
from agentlog.events.schema.types import (
    SandboxSnapshotted, SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionResumed, TurnDelta, TurnRecorded,
)
from agentlog.loop import FaultConfig, LoopConfig, check_run
from agentlog.loop.run import start_process
from agentlog.reducers.pipeline import reduce_log
from agentlog.tools.bench import scripted_worker
from agentlog.tools.bench.resume_steps import STEPS

from loop_helpers import kill_live, learner_version, wait_for

TERMINAL = (SessionFinished, SessionAborted, SessionDropped)
_encode = msgspec.msgpack.Encoder().encode


def _running_with(run: Path, at_least: int, *, version: int) -> dict[str, int]:
    return {sid: n for sid, n in scripted_worker.running_turns(run, version=version).items() if n >= at_least}


def _start_worker(run: Path) -> subprocess.Popen:
    return scripted_worker.start(run, AGENTLOG_STEPS_GEN_S="0.25")


@pytest.mark.required
def test_a_killed_worker_resumes_its_sessions_and_the_run_reconstructs_equal(tmp_path: Path) -> None:
    cfg = LoopConfig(task="resume-steps", task_modules=["agentlog.tools.bench.resume_steps"], steps=3, groups_per_step=2,
                     group_size=4, warmup_steps=0, faults=FaultConfig.none(), stop_reward=0, time_budget_s=0, max_lag=1,
                     d_model=32, n_layer=1, n_head=2, agent={"harness": "python-agent", "budget_s": 600},
                     inference={"context_length": 2048})
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    cfg.save(run / "config.json")
    learner = start_process("trainer", run)
    worker = _start_worker(run)
    try:
        # Killed once the learner published a version past the first: a restarted worker must play on with it, not
        # with the weights it starts with.
        wait_for("sessions two turns in, by version 1 or newer", lambda: len(_running_with(run, 2, version=1)) >= 4, 120,
                 [learner, worker])
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        # What was acknowledged before the kill: every record the log marks durable.
        acknowledged = {e.lsn: _encode(e.body) for e in read_log(run / "rollout", 0, durable_only=True)}
        orphans = set(scripted_worker.running_turns(run))
        worker = _start_worker(run)
        wait_for("the final version", lambda: learner.poll() is not None, 240, [worker])
        assert learner.returncode == 0
        worker.wait(timeout=60)
        assert worker.returncode == 0
    finally:
        kill_live(learner, worker)
    envs = list(read_log(run / "rollout", 0))
    # Every acknowledged record is still there, unchanged.
    now = {e.lsn: _encode(e.body) for e in envs}
    assert all(now.get(lsn) == body for lsn, body in acknowledged.items())
    # Every session ends exactly once.
    opened = [e.session_id for e in envs if isinstance(e.body, SessionOpened)]
    ends = [e.session_id for e in envs if isinstance(e.body, TERMINAL)]
    assert sorted(ends) == sorted(opened) and len(set(opened)) == len(opened)
    resumed = {e.session_id for e in envs if isinstance(e.body, SessionResumed)}
    finished = {e.session_id: e.body.reward for e in envs if isinstance(e.body, SessionFinished)}
    assert orphans, "the kill left no session running"
    done = [sid for sid in orphans if sid in resumed and finished.get(sid) == 1.0]
    assert len(done) >= 0.95 * len(orphans), {sid: (sid in resumed, finished.get(sid)) for sid in orphans}
    # Each resume restored the snapshot its session's log names for its last durable turn.
    snapshots: dict[tuple[str, int], str] = {}
    for e in envs:
        if isinstance(e.body, SandboxSnapshotted):
            snapshots[(e.session_id, e.body.turn_index)] = e.body.digest
        elif isinstance(e.body, SessionResumed):
            assert snapshots[(e.session_id, e.body.snapshot_turn)] == e.body.snapshot, e
    # A resumed session's turns are made by the policy it was played with before the kill, or a newer one.
    for sid in resumed:
        turns = [(e.lsn, e.body.policy_version) for e in envs if e.session_id == sid and isinstance(e.body, (TurnRecorded, TurnDelta))]
        at = next(e.lsn for e in envs if e.session_id == sid and isinstance(e.body, SessionResumed))
        before, after = [v for lsn, v in turns if lsn < at], [v for lsn, v in turns if lsn > at]
        assert not before or not after or min(after) >= max(before) >= 1, (sid, before, after)
    # A resumed session trains as one linear trajectory of all its turns: the conversation the
    # agent sent again re-encoded to the recorded prompt (no fork, no re-alignment at the resume).
    rows: dict[str, list] = {}
    for sample in reduce_log(read_log(run / "rollout", 0), cfg.reduce_config()).samples:
        rows.setdefault(sample.session_id, []).append(sample)
    assert all(len(rows[sid]) == 1 and rows[sid][0].turns == STEPS + 2 for sid in done), {sid: [r.turns for r in rows[sid]] for sid in done}
    assert learner_version(run) == cfg.steps
    check = check_run(run, cfg)
    assert check.ok and check.digests_equal == check.steps, (check.mismatches, check.duplicates, check.missing, check.unknown)
