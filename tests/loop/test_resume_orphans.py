"""What a restarted worker does with each orphan besides resuming it (loop/resume.py).

* A refused orphan's snapshots and sandbox go, as any ended session's.
* A resumed session under distillation has every durable turn scored once per
  teacher before it ends: the turns before the crash too, and never again
  those the dead incarnation had scored (a crash while it recorded them).
* A snapshot still running when its session ends (its turn cancelled) leaves
  no ref behind.
* An orphan whose group the run's config no longer draws is refused, saying why.

The session is the ``resume-steps`` task's, through the real rollout (GatewayRollout,
the Python agent, a LocalSandbox, the snapshot store), as in test_resume_crash_points.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import pytest

from agentlog.engine import LocalSandbox, SessionEngine
from agentlog.engine.snapshots import SnapshotStore
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import SessionAborted, SessionFinished, SessionResumed, TeacherScored
from agentlog.loop.config import AgentConfig, DistillConfig, LoopConfig
from agentlog.loop.gateway_rollout import GatewayRollout
from agentlog.loop.resume import SessionSnapshots, decide_orphans, episode_of
from agentlog.loop.teacher import TeacherScores
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.resume import ResumePoint
from agentlog.reducers.samples import distill_problem
from agentlog.tools.bench.resume_steps import ScriptedModel, StepsTask


class ConstantTeacher:
    """A teacher whose every log-prob is -1."""

    name = "const"
    version = "v1"

    async def score(self, prompt_ids: Sequence[int], output_ids: Sequence[int], *, temperature: float,
                    top_k: int = 0) -> TeacherScores:
        return TeacherScores(np.full(len(output_ids), -1.0, dtype=np.float32))

    async def close(self) -> None:
        pass


async def _play(log: MemoryLog, root: Path, *, adopt: bool, teachers: Sequence = (), max_resumes: int = 2) -> dict:
    """The reference session ``s`` played to its end (``adopt`` False), or the orphans of ``log`` decided."""
    engine = await SessionEngine.open(log, drain_s=0.2, adopt_orphans=adopt)
    rollout = GatewayRollout(engine, ScriptedModel(0.0), agent=AgentConfig(budget_s=60), sandbox_root=root / "sb",
                             snapshots=SessionSnapshots(root / "store", keep_aborted_s=0), teachers=teachers,
                             distill=DistillConfig())
    await rollout.start()
    task = StepsTask()
    episode = task.new_episode(random.Random(0))
    try:
        if adopt:
            return await decide_orphans(engine, rollout, lambda point: (task, episode), max_resumes=max_resumes,
                                        restore_timeout_s=30, worker="w1")
        await rollout.run_session(task, episode, session_id="s", group_id="g", group_size=1, sample_index=0)
        return {}
    finally:
        await rollout.close()
        await engine.close()


def _crashed_at(envs: list, cut: int) -> MemoryLog:
    log = MemoryLog()
    log.append_batch([(e.session_id, e.session_seq, e.body) for e in envs[:cut]])
    return log


def test_a_refused_orphan_leaves_no_snapshots_and_no_sandbox(tmp_path):
    ref = MemoryLog()
    asyncio.run(_play(ref, tmp_path / "ref", adopt=False))
    envs = list(ref.read(0))
    # The dead incarnation's ref and sandbox, as a kill leaves them.
    sandbox = tmp_path / "run" / "sb" / "s"
    sandbox.mkdir(parents=True)
    (sandbox / "progress.txt").write_text("step0\n")
    SnapshotStore(tmp_path / "run" / "store").snapshot(sandbox, "s", turn_index=0)
    log = _crashed_at(envs, len(envs) // 2)
    counts = asyncio.run(_play(log, tmp_path / "run", adopt=True, max_resumes=0))
    assert counts == {"resumed": 0, "resume_refused": 1}
    ends = [e.body for e in log.read(0) if isinstance(e.body, SessionAborted)]
    assert len(ends) == 1 and "max_resumes = 0" in ends[0].error
    assert SnapshotStore(tmp_path / "run" / "store").refs() == {}
    assert not sandbox.exists()


@pytest.mark.parametrize("crash", ["mid-session", "mid-scoring"])
def test_a_resumed_session_has_every_turn_scored_once_by_each_teacher(tmp_path, crash):
    ref = MemoryLog()
    asyncio.run(_play(ref, tmp_path / "ref", adopt=False, teachers=[ConstantTeacher()]))
    envs = list(ref.read(0))
    scored = [i for i, e in enumerate(envs) if isinstance(e.body, TeacherScored)]
    assert len(scored) >= 3
    # Mid-session: turns durable, none scored yet. Mid-scoring: the agent had answered; some scores recorded.
    cut = scored[0] - 4 if crash == "mid-session" else scored[1] + 1
    log = _crashed_at(envs, cut)
    counts = asyncio.run(_play(log, tmp_path / "ref", adopt=True, teachers=[ConstantTeacher()]))
    assert counts == {"resumed": 1, "resume_refused": 0}
    after = list(log.read(0))
    assert any(isinstance(e.body, SessionResumed) for e in after)
    assert isinstance(after[-1].body, SessionFinished) and after[-1].body.reward == 1.0
    turns = sorted(e.body.turn_index for e in after if type(e.body).__name__ in ("TurnRecorded", "TurnDelta"))
    pairs = sorted((e.body.turn_index, e.body.teacher) for e in after if isinstance(e.body, TeacherScored))
    assert pairs == [(t, "const") for t in turns]  # each turn once, none twice
    samples = reduce_log(log).samples
    assert samples and all(distill_problem(s) == "" for s in samples), [distill_problem(s) for s in samples]


def test_a_snapshot_running_when_its_session_ends_leaves_no_ref(tmp_path):
    entered, gate, finished = threading.Event(), threading.Event(), threading.Event()

    class SlowSandbox(LocalSandbox):
        """Its snapshot's thread waits for ``gate`` (as a big sandbox's would take its time)."""

        async def snapshot(self, store, session_id, turn_index=None):
            def slow():
                entered.set()
                gate.wait(10)
                try:
                    return store.snapshot(self.workdir, session_id, turn_index=turn_index)
                finally:
                    finished.set()

            return await asyncio.to_thread(slow)

    async def go() -> None:
        engine = await SessionEngine.open(MemoryLog())
        snaps = SessionSnapshots(tmp_path / "store", keep_aborted_s=0)
        h = await engine.open_session("s", group_id="g", group_size=1)
        await h.start()
        hook = asyncio.ensure_future(snaps.before_turn(h, SlowSandbox(tmp_path / "sb"))(0))
        await asyncio.to_thread(entered.wait, 10)
        hook.cancel()  # the turn's client went away (its session's budget ran out)
        await h.abort("wall_clock_timeout")
        ended = asyncio.ensure_future(snaps.session_ended("s", State.ABORTED))
        await asyncio.sleep(0.05)
        gate.set()
        await ended
        assert await asyncio.to_thread(finished.wait, 10)
        assert snaps.store.refs() == {}  # however long the thread took, no ref outlives its session
        await engine.close()

    asyncio.run(go())


def test_two_snapshots_of_one_session_at_once_are_both_awaited_at_its_end(tmp_path):
    """An agent that sends turns concurrently (subagents) snapshots one session twice at once. The
    second used to replace the first in the in-progress map, so the session's end waited only for it
    and the first wrote a ref after the session's went: a ref never collected."""
    gate, finished = threading.Event(), threading.Event()

    class FirstSlow(LocalSandbox):
        """Its first snapshot's thread waits for ``gate``; later ones run at once."""

        calls = 0

        async def snapshot(self, store, session_id, turn_index=None):
            FirstSlow.calls += 1
            slow = FirstSlow.calls == 1

            def run():
                if slow:
                    gate.wait(10)
                try:
                    return store.snapshot(self.workdir, session_id, turn_index=turn_index)
                finally:
                    if slow:
                        finished.set()

            return await asyncio.to_thread(run)

    async def go() -> None:
        engine = await SessionEngine.open(MemoryLog())
        snaps = SessionSnapshots(tmp_path / "store", keep_aborted_s=0)
        h = await engine.open_session("s", group_id="g", group_size=1)
        await h.start()
        hook = snaps.before_turn(h, FirstSlow(tmp_path / "sb"))
        first = asyncio.ensure_future(hook(0))
        await asyncio.sleep(0.05)
        await hook(0)  # the concurrent request's snapshot (before the same next turn), done while the first runs
        first.cancel()  # its client went away
        await h.finish(reward=1.0)
        ended = asyncio.ensure_future(snaps.session_ended("s", State.FINISHED))
        await asyncio.sleep(0.1)
        assert not ended.done(), "the session's end did not wait for its first snapshot still in progress"
        gate.set()
        await ended
        assert finished.is_set() and snaps.store.refs() == {}  # no ref outlives its session
        await engine.close()

    asyncio.run(go())


def test_an_orphan_whose_group_the_config_no_longer_draws_is_refused_saying_why():
    cfg = LoopConfig(task="resume-steps", task_modules=["agentlog.tools.bench.resume_steps"], groups_per_step=2, group_size=4)
    drawn: list[int] = []

    def draw(batch: int):
        drawn.append(batch)
        return lambda g, k: [f"b{batch}-g{g}-r{k}-m{i}" for i in range(4)]

    worker = SimpleNamespace(cfg=cfg, task="the task", draw=draw)
    draws: dict = {}
    point = ResumePoint("b3-g5-s0", "b3-g5", 4, 0)
    why = episode_of(worker, point, draws)
    assert isinstance(why, str) and "group 5 of 4 members" in why and "the config changed" in why
    assert "the config changed" in episode_of(worker, ResumePoint("b3-g1-s0", "b3-g1", 8, 0), draws)
    # Orphans of one batch draw it once.
    assert episode_of(worker, ResumePoint("b3-g1-s2", "b3-g1", 4, 2), draws) == ("the task", "b3-g1-r0-m2")
    assert episode_of(worker, ResumePoint("b3-g0-r1-s3", "b3-g0-r1", 4, 3), draws) == ("the task", "b3-g0-r1-m3")
    assert drawn == [3]
    # A replacement plays the prompt of the member it replaces; a replacement of a replacement is not drawn again.
    assert episode_of(worker, ResumePoint("b3-g1-s4", "b3-g1", 4, 4, replaces="b3-g1-s2"), draws) == ("the task", "b3-g1-r0-m2")
    assert "itself a replacement" in episode_of(worker, ResumePoint("b3-g1-s5", "b3-g1", 4, 5, replaces="b3-g1-s4"), draws)


def test_only_a_harness_registered_resumable_resumes_its_orphans(tmp_path):
    """The CLI harnesses are registered without ``resumable``: their orphans are aborted naming the
    harness; a user's harness registered ``resumable=True`` is resumed like the Python agent."""
    import msgspec

    from agentlog.engine import harness
    from agentlog.events.schema.types import SessionStarted

    assert harness.is_resumable("python-agent") and not harness.is_resumable("claude-code")
    assert not harness.is_resumable("codex")
    ref = MemoryLog()
    asyncio.run(_play(ref, tmp_path / "ref", adopt=False))
    envs = list(ref.read(0))

    def crashed_under(name: str) -> MemoryLog:
        log = MemoryLog()
        log.append_batch([(e.session_id, e.session_seq, msgspec.structs.replace(e.body, harness=name)
                           if isinstance(e.body, SessionStarted) else e.body) for e in envs[:len(envs) // 2]])
        return log

    log = crashed_under("claude-code")
    assert asyncio.run(_play(log, tmp_path / "cli", adopt=True)) == {"resumed": 0, "resume_refused": 1}
    (end,) = [e.body for e in log.read(0) if isinstance(e.body, SessionAborted)]
    assert "harness 'claude-code' is not resumable" in end.error

    harness.register("mine-resumable-test", resumable=True)(harness.get("python-agent"))
    try:
        assert harness.is_resumable("mine-resumable-test")
        log = crashed_under("mine-resumable-test")
        assert asyncio.run(_play(log, tmp_path / "ref", adopt=True)) == {"resumed": 1, "resume_refused": 0}  # the snapshots are in ref/store
    finally:
        harness.unregister("mine-resumable-test")
    (end,) = [e.body for e in log.read(0) if isinstance(e.body, SessionFinished)]
    assert end.reward == 1.0
