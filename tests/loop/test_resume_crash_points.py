"""A session killed at any point resumes consistently or is aborted; never onto a sandbox from another turn.

One reference session of the ``resume-steps`` task runs to its end through
the real rollout (GatewayRollout, the Python agent, a LocalSandbox, the
snapshot store). A crash at record ``cut`` leaves the log's first ``cut``
records and the store as it was: every snapshot written, including ones
whose event never made it (a crash between a snapshot and its event, or
mid-command, or mid-turn). A damaged store is the crash mid-snapshot (the
newest manifest never written) or a corrupted object. A new engine adopts
the orphan and :func:`loop.resume.decide_orphans` decides it.

The task's verifier rewards 1 only when the sandbox saw every step exactly
once: a resume onto a sandbox from another turn would write a step twice or
miss one and finish with reward 0. So the outcome is exactly: finished with
reward 1 when the log names a sound snapshot of its last durable turn, else
aborted ``engine_restart`` saying why.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from pathlib import Path

from hypothesis import given, settings, strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionAborted, SessionFinished, SessionOpened, SessionStarted
from agentlog.loop.config import AgentConfig
from agentlog.loop.gateway_rollout import GatewayRollout
from agentlog.loop.resume import SessionSnapshots, decide_orphans
from agentlog.reducers.resume import resume_points
from agentlog.tools.bench.resume_steps import ScriptedModel, StepsTask

_REFERENCE: dict = {}


async def _play(log: MemoryLog, store: Path, sandboxes: Path, *, adopt: bool) -> None:
    """The reference session (``adopt`` False), or the orphans of ``log`` decided (True)."""
    engine = await SessionEngine.open(log, drain_s=0.2, adopt_orphans=adopt)
    rollout = GatewayRollout(engine, ScriptedModel(0.0), agent=AgentConfig(budget_s=60), sandbox_root=sandboxes,
                             snapshots=SessionSnapshots(store, keep_aborted_s=0))
    await rollout.start()
    task = StepsTask()
    episode = task.new_episode(random.Random(0))
    try:
        if adopt:
            await decide_orphans(engine, rollout, lambda point: (task, episode), max_resumes=2, restore_timeout_s=30,
                                 worker="w1")
        else:
            await rollout.run_session(task, episode, session_id="s", group_id="g", group_size=1, sample_index=0)
    finally:
        await rollout.close()
        await engine.close()


def _reference() -> tuple[list, Path]:
    if not _REFERENCE:
        root = Path(tempfile.mkdtemp(prefix="resume-ref-"))
        log = MemoryLog()
        asyncio.run(_play(log, root / "store", root / "sb", adopt=False))
        envs = list(log.read(0))
        assert isinstance(envs[-1].body, SessionFinished) and envs[-1].body.reward == 1.0
        _REFERENCE.update(envs=envs, store=root / "store")
    return _REFERENCE["envs"], _REFERENCE["store"]


def _damage(store: Path, digest: str, how: str) -> None:
    """``missing``: the snapshot's manifest never written (a crash mid-snapshot); ``corrupt``:
    one byte of one of its file objects flipped."""
    from agentlog.engine.snapshots import SnapshotStore

    s = SnapshotStore(store, keep_aborted_s=0)
    if how == "missing":
        next(store.glob(f"manifests/{digest[:2]}/{digest[2:]}*")).unlink()
        return
    obj = next(e for e in s.manifest(digest) if e.kind == "file" and e.size)
    path = next(store.glob(f"objects/{obj.digest[:2]}/{obj.digest[2:]}*"))
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


@settings(max_examples=14, deadline=None)
@given(data=st.data())
def test_a_crash_anywhere_resumes_consistently_or_aborts_never_onto_another_turns_sandbox(data):
    envs, store = _reference()
    cut = data.draw(st.integers(1, len(envs) - 1), label="records before the crash")
    prefix = envs[:cut]
    point = resume_points(prefix, ["s"])["s"]
    needed = point.snapshot_to_resume()
    later = [d for t, d in sorted(point.snapshots.items()) if t > point.snapshot_turn]
    choices = ["none"] + (["needed-missing", "needed-corrupt"] if needed else []) + (["later-missing"] if later else [])
    damage = data.draw(st.sampled_from(choices), label="damage")
    work = Path(tempfile.mkdtemp(prefix="resume-cut-"))
    try:
        shutil.copytree(store, work / "store")
        if damage.startswith("needed"):
            _damage(work / "store", needed, damage.split("-")[1])
        elif damage == "later-missing":
            _damage(work / "store", later[0], "missing")
        log = MemoryLog()
        log.append_batch([(e.session_id, e.session_seq, e.body) for e in prefix])
        asyncio.run(_play(log, work / "store", work / "sb", adopt=True))
        ends = [e.body for e in log.read(0) if isinstance(e.body, (SessionFinished, SessionAborted))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    started = any(isinstance(e.body, SessionStarted) for e in prefix)
    assert len(ends) == 1, ends  # exactly one terminal event
    if started and needed and not damage.startswith("needed"):
        assert isinstance(ends[0], SessionFinished) and ends[0].reward == 1.0, (cut, damage, ends[0])
    else:
        assert isinstance(ends[0], SessionAborted) and ends[0].reason == "engine_restart", (cut, damage, ends[0])
        why = ends[0].error
        if not started:
            assert "never started" in why
        elif not needed:
            assert f"no sandbox snapshot of turn {point.snapshot_turn}" in why
        else:
            assert ("damaged" in why or "Damaged" in why) if damage.endswith("corrupt") else "Missing" in why, why


def test_the_reference_session_opens_once_and_snapshots_before_every_turn():
    envs, _ = _reference()
    assert sum(isinstance(e.body, SessionOpened) for e in envs) == 1
    point = resume_points(envs, ["s"])["s"]
    assert sorted(point.snapshots) == list(range(point.durable_turns)) and point.durable_turns == 6
