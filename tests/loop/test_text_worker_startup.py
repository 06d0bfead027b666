"""A text-task worker at start-up and shutdown: what cannot run is refused before any
session, resources are released however start-up ends, and an agent error after the
engine ended its session (or the finish that follows) does not
escape the rollout."""

from __future__ import annotations

import asyncio
import random

import pytest

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionDropped, SessionOpened
from agentlog.loop import FaultConfig, LoopConfig, RolloutWorker
from agentlog.events import FileLog
from agentlog.loop.config import AgentConfig, ConfigError
from agentlog.loop.gateway_rollout import GatewayRollout

from test_gateway_rollout import EchoWordTask, Scripted  # noqa: F401  (registers echo-word-test)


def _cfg(**kw) -> LoopConfig:
    base = dict(task="echo-word-test", steps=1, groups_per_step=1, group_size=2, warmup_steps=0, faults=FaultConfig.none(),
                stop_reward=0, time_budget_s=0, max_lag=0, d_model=16, n_layer=1, n_head=2, inference={"context_length": 256})
    base.update(kw)
    return LoopConfig(**base)


def test_a_served_model_needs_an_hf_model():
    with pytest.raises(ConfigError, match=r"\[inference\] backend 'sglang': needs hf_model"):
        _cfg(inference={"backend": "sglang", "url": "http://127.0.0.1:30000"})
    assert _cfg(inference={"backend": "sglang", "url": "http://127.0.0.1:30000"}, hf_model="tiny-llama").hf_model == "tiny-llama"


def test_fault_config_says_whether_any_fault_is_on():
    assert not FaultConfig.none().any_enabled()
    assert FaultConfig().any_enabled() and FaultConfig(0, 0, 0, 0.5, 0).any_enabled()


def test_a_missing_agent_cli_stops_the_worker_before_any_session_and_releases_the_log(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(agent={"harness": "claude-code", "cli": str(tmp_path / "no-such-claude")})
    worker = RolloutWorker(run_dir, cfg)
    with pytest.raises(FileNotFoundError, match=r"harness 'claude-code': the CLI .*no-such-claude.* is not an executable file"):
        asyncio.run(asyncio.wait_for(worker.run(max_batches=1), 60))
    # Nothing was opened, and the log's writer lock was released: another writer opens it.
    log = FileLog.open(run_dir / "rollout", fsync=cfg.fsync)
    try:
        assert not [e for e in log.read(0) if isinstance(e.body, SessionOpened)]
    finally:
        log.close()


def test_the_python_agent_without_openai_is_refused_at_start_up(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_openai(name, *a, **kw):
        if name == "openai" or name.startswith("openai."):
            raise ImportError("No module named 'openai'")
        return real_import(name, *a, **kw)

    async def body():
        engine = await SessionEngine.open(MemoryLog(), drain_s=0.1)
        try:
            rollout = GatewayRollout(engine, Scripted(), agent=AgentConfig(harness="python-agent"), sandbox_root=tmp_path)
            rollout.preflight()  # openai is installed here
            monkeypatch.setattr(builtins, "__import__", no_openai)
            with pytest.raises(ImportError, match=r"pip install 'agentlog\[agent\]'"):
                rollout.preflight()
        finally:
            monkeypatch.setattr(builtins, "__import__", real_import)
            await engine.close()

    asyncio.run(body())


def test_an_agent_error_after_the_engine_dropped_the_session_does_not_escape(tmp_path):
    """The engine drops a live session at shutdown while the agent waits on a model call;
    the agent's error that follows is logged, and the rollout returns as the drop left it."""

    async def body():
        log = MemoryLog()
        engine = await SessionEngine.open(log, drain_s=0.1)
        backend = Scripted(hang=True)
        rollout = GatewayRollout(engine, backend, agent=AgentConfig(harness="python-agent"), sandbox_root=tmp_path / "sb")
        await rollout.start()
        task = EchoWordTask()
        job = asyncio.ensure_future(rollout.run_session(task, task.new_episode(random.Random(0)), session_id="s0", group_id="g0",
                                                        group_size=1, sample_index=0))
        await asyncio.wait_for(backend.called.wait(), 10)
        await engine.get("s0").drop("shutdown")
        try:
            await asyncio.wait_for(job, 30)
        finally:
            await rollout.close()
            await engine.close()
        return log

    log = asyncio.run(body())
    (end,) = [e.body for e in log.read() if isinstance(e.body, SessionDropped)]
    assert end.reason == "shutdown"


class _VerifyWaits(EchoWordTask):
    """Its verifier judges, then waits to be let go before it answers: the engine can end the session meanwhile."""

    def __init__(self) -> None:
        self.verifying, self.go = asyncio.Event(), asyncio.Event()

    async def verify(self, episode, sandbox):
        verdict = await super().verify(episode, sandbox)
        self.verifying.set()
        await self.go.wait()
        return verdict


def test_a_finish_after_the_engine_dropped_the_session_does_not_escape(tmp_path):
    """The agent ended and the verifier runs when the engine drops the session (shutdown);
    the rollout's finish then finds the session ended: run_session returns, the drop is the
    session's only ending, and nothing counts the session as finished."""

    async def body():
        log = MemoryLog()
        engine = await SessionEngine.open(log, drain_s=0.1)
        rollout = GatewayRollout(engine, Scripted(), agent=AgentConfig(harness="python-agent"), sandbox_root=tmp_path / "sb")
        await rollout.start()
        task = _VerifyWaits()
        job = asyncio.ensure_future(rollout.run_session(task, task.new_episode(random.Random(0)), session_id="s0", group_id="g0",
                                                        group_size=1, sample_index=0))
        await asyncio.wait_for(task.verifying.wait(), 30)
        dropping = asyncio.ensure_future(engine.get("s0").drop("shutdown"))
        await asyncio.sleep(0)  # the drop holds the session's lock, its acknowledgement not yet in
        task.go.set()
        try:
            await asyncio.wait_for(job, 30)
            await dropping
        finally:
            await rollout.close()
            await engine.close()
        return log, rollout.counts

    log, counts = asyncio.run(body())
    ends = [e.body for e in log.read() if type(e.body).__name__ in ("SessionFinished", "SessionAborted", "SessionDropped")]
    assert [type(b).__name__ for b in ends] == ["SessionDropped"] and ends[0].reason == "shutdown"
    assert "finished" not in counts


class _VerifyFinishesItself(EchoWordTask):
    """A verifier that ends the session itself (a bug of the task's): the rollout's finish is a second one."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def verify(self, episode, sandbox):
        verdict = await super().verify(episode, sandbox)
        await self.engine.get("s0").finish(reward=0.25)
        return verdict


def test_a_second_finish_of_the_rollouts_own_side_is_raised_not_hidden(tmp_path):
    """Only an ending of the engine's (a drop, the budget) makes the rollout's finish a no-op:
    a session its own side already finished raises SessionClosed out of run_session."""
    from agentlog.events.schema.lifecycle import SessionClosed

    async def body():
        log = MemoryLog()
        engine = await SessionEngine.open(log, drain_s=0.1)
        rollout = GatewayRollout(engine, Scripted(), agent=AgentConfig(harness="python-agent"), sandbox_root=tmp_path / "sb")
        await rollout.start()
        task = _VerifyFinishesItself(engine)
        try:
            with pytest.raises(SessionClosed, match="already finished"):
                await rollout.run_session(task, task.new_episode(random.Random(0)), session_id="s0", group_id="g0",
                                          group_size=1, sample_index=0)
        finally:
            await rollout.close()
            await engine.close()
        return log

    log = asyncio.run(body())
    ends = [e.body for e in log.read() if type(e.body).__name__ in ("SessionFinished", "SessionAborted", "SessionDropped")]
    assert [(type(b).__name__, b.reward) for b in ends] == [("SessionFinished", 0.25)]
