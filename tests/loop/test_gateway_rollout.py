"""Text tasks in the online loop: rollouts through the gateway, played by an agent harness.

The loop test runs the real worker and learner (in this process, as the
package docstring's example does) on a small text task defined here, with
the built-in Python agent and the built-in GPT behind the in-process
TorchBackend. The session tests drive :class:`GatewayRollout` over a real
engine, gateway and sandbox with a scripted backend, to reach each way a
session can end.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any, Sequence

import pytest

from agentlog.engine import SessionEngine, SessionTimeout
from agentlog.engine.tasks import TextEpisode, TextTask, register_task, verdict_of_command
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.turn import turn_server
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import CommandRan, SessionAborted, SessionDropped, SessionFinished, SessionOpened, TurnRecorded
from agentlog.gateway import Backend, BackendError, ByteChatTemplate, Generation, SamplingParams
from agentlog.loop import FaultConfig, LoopConfig, LoopLearner, RolloutWorker, check_run
from agentlog.events import read_log
from agentlog.loop.config import AgentConfig, ConfigError
from agentlog.loop.gateway_rollout import GatewayRollout

WORDS = ("apple", "river", "stone", "cloud")
T = ByteChatTemplate()


class EchoWordTask(TextTask):
    """Write the asked word into answer.txt; the verifier greps for it."""

    name = "echo-word-test"
    max_turns = 3
    max_new_tokens = 24
    session_budget_s = 60.0
    command_budget_s = 10.0

    def new_episode(self, rng: random.Random) -> TextEpisode:
        word = rng.choice(WORDS)
        return TextEpisode(messages=[{"role": "user", "content": f"Write {word} into answer.txt"}], label=word, state={"word": word})

    async def setup(self, episode: TextEpisode, sandbox: Any) -> None:
        (Path(sandbox.workdir) / "README").write_text("put the word in answer.txt\n")

    async def verify(self, episode: TextEpisode, sandbox: Any):
        return verdict_of_command(await sandbox.run_command(f"grep -qx {episode.state['word']} answer.txt", self.command_budget_s))


register_task("echo-word-test")(EchoWordTask)


# ---------------------------------------------------------------- the loop


@pytest.mark.parametrize("fleet", [False, True], ids=["one-backend", "in-process-fleet"])
def test_text_task_trains_through_the_gateway_with_the_python_agent(fleet, tmp_path):
    """Two RL steps; every session ends once; turns come through the gateway;
    offline reconstruction equals the online digests; turns after the first
    reload record policy_version 1. With a fleet of two in-process replicas
    routed by group, each group's turns name one replica and both replicas
    serve, each at the batch's version."""
    inference: dict = {"context_length": 512}
    if fleet:
        inference |= {"servers": ["in-process", "in-process"], "route_by": "group"}
    cfg = LoopConfig(task="echo-word-test", steps=2, groups_per_step=2, group_size=2, warmup_steps=0, faults=FaultConfig.none(),
                     stop_reward=0, time_budget_s=0, max_lag=0, d_model=32, n_layer=1, n_head=2,
                     agent={"harness": "python-agent", "budget_s": 60}, inference=inference)
    run_dir = tmp_path / "run"

    async def train() -> None:
        await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), RolloutWorker(run_dir, cfg).run()), 120)

    asyncio.run(train())
    envs = list(read_log(run_dir / "rollout", 0))
    opened = [e.session_id for e in envs if isinstance(e.body, SessionOpened)]
    terminal = [e.session_id for e in envs if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped))]
    assert len(opened) == 8 and sorted(terminal) == sorted(opened), (opened, terminal)  # exactly one terminal event each
    assert all(isinstance(e.body, SessionFinished) for e in envs if e.session_id in terminal and
               isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped))), [e.body for e in envs if isinstance(e.body, SessionAborted)]
    turns = [e for e in full_turns(envs) if isinstance(e.body, TurnRecorded)]
    assert len(turns) >= len(opened)
    assert all(t.body.sampling["api"] == "chat" and t.body.sampling["temperature"] == cfg.temperature for t in turns)
    versions = {(e.session_id[:6], e.body.policy_version) for e in turns}
    assert versions == {("b00000", 0), ("b00001", 1)}, versions
    placed = {}
    for t in turns:
        placed.setdefault(t.session_id.rsplit("-", 1)[0], set()).add(turn_server(t.body)[0])
    if fleet:
        assert all(len(names) == 1 for names in placed.values()), placed  # a group shares one replica
        assert set().union(*placed.values()) == {"in-process-0", "in-process-1"}, placed
    else:
        assert set().union(*placed.values()) == {""}  # one backend: no server recorded
    check = check_run(run_dir, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.digests_equal == check.steps == 2


def test_agent_and_inference_tables_are_checked_by_name(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('task = "echo-word-test"\nhf_model = "tiny-llama"\n[agent]\nharness = "claude-code"\nbudget_s = 90\nmax_tool_calls = 4\n'
                    '[inference]\nbackend = "sglang"\nurl = "http://127.0.0.1:30000"\n')
    cfg = LoopConfig.load(toml)
    assert (cfg.agent.harness, cfg.agent.budget_s, cfg.agent.max_tool_calls) == ("claude-code", 90, 4)
    assert (cfg.inference.backend, cfg.inference.url) == ("sglang", "http://127.0.0.1:30000")
    with pytest.raises(ConfigError, match=r"\[agent\] harness: expected one of"):
        LoopConfig(agent={"harness": "aider"})
    with pytest.raises(ConfigError, match=r"\[inference\] url: backend 'sglang' needs"):
        LoopConfig(inference={"backend": "sglang"})
    with pytest.raises(ConfigError, match=r"\[agent\] max_tokens: expected an int >= 1 \(0: the task's max_new_tokens\), found -1"):
        LoopConfig(agent={"max_tokens": -1})
    with pytest.raises(ConfigError, match=r"\[agent\] unknown key\(s\) \['budget'\]"):
        LoopConfig.from_dict({"agent": {"budget": 3}})
    cfg = LoopConfig.from_dict({"agent": {"harness": "codex", "budget_s": 30}, "inference": {"backend": "vllm", "url": "http://h:1", "served_dir": "/m"},
                                "hf_model": "tiny-llama"})
    assert LoopConfig.from_dict(cfg.to_dict()) == cfg and cfg.agent == AgentConfig(harness="codex", budget_s=30)


# ---------------------------------------------------------------- one session, each way it can end


class Scripted(Backend):
    """Replies by a function of the decoded prompt; ``hang`` never answers; ``fail`` raises."""

    name = "scripted"

    def __init__(self, reply=lambda p: "done", hang: bool = False, fail: bool = False) -> None:
        self.reply, self.hang, self.fail = reply, hang, fail
        self.called = asyncio.Event()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.called.set()
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise BackendError(self.name, "the model server went away")
        ids = T.encode_text(self.reply(T.decode(list(prompt_ids))))[: params.max_new_tokens - 1] + [T.EOS]
        return Generation(ids, [-0.1] * len(ids), "stop", 0, 0.001)


async def _session(tmp_path, backend: Backend, *, task: TextTask | None = None, agent: dict | None = None, cancel: bool = False):
    """Play one session; returns (what run_session raised or None, the log)."""
    log = MemoryLog()
    engine = await SessionEngine.open(log, drain_s=0.2)
    rollout = GatewayRollout(engine, backend, agent=AgentConfig(**(agent or {})), sandbox_root=tmp_path / "sb")
    await rollout.start()
    task = task or EchoWordTask()
    ep = task.new_episode(random.Random(0))
    outcome: BaseException | None = None
    try:
        job = asyncio.ensure_future(rollout.run_session(task, ep, session_id="s0", group_id="g0", group_size=1, sample_index=0))
        if cancel:
            await asyncio.wait_for(backend.called.wait(), 10)
            job.cancel()
        try:
            await asyncio.wait_for(job, 30)
        except (asyncio.CancelledError, SessionTimeout) as exc:
            outcome = exc
    finally:
        await rollout.close()
        await engine.close()
    return outcome, log


def _end(log: MemoryLog) -> Any:
    (end,) = [e.body for e in log.read() if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped))]
    return end


def test_a_session_runs_the_agents_tool_call_then_the_verifier_and_finishes_with_its_reward(tmp_path):
    def reply(prompt: str) -> str:
        word = next(w for w in WORDS if f"Write {w}" in prompt)
        if "exit code 0" in prompt:
            return "done"
        return '<tool_call>{"name": "bash", "arguments": {"command": "echo %s > answer.txt"}}</tool_call>' % word

    class Roomy(EchoWordTask):
        max_new_tokens = 128  # room for the whole tool call

    outcome, log = asyncio.run(_session(tmp_path, Scripted(reply), task=Roomy()))
    assert outcome is None
    end = _end(log)
    assert isinstance(end, SessionFinished) and end.reward == 1.0 and end.metadata["agent"]["stop_reason"] == "answered"
    commands = [e.body.command for e in log.read() if isinstance(e.body, CommandRan)]
    assert commands[0].startswith("echo ") and commands[1].startswith("grep -qx")  # the agent's, then the verifier's
    assert len([e for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]) == 2
    assert not (tmp_path / "sb" / "s0").exists()  # the sandbox is removed with the session


def test_an_agent_crash_aborts_the_session_with_a_reason_naming_it(tmp_path):
    outcome, log = asyncio.run(_session(tmp_path, Scripted(fail=True)))
    end = _end(log)
    assert outcome is None and isinstance(end, SessionAborted)
    assert end.reason == "agent_crashed:InternalServerError" and "502" in end.error and "Traceback" in end.traceback


def test_a_cli_agent_that_exits_non_zero_aborts_with_its_exit_code(tmp_path):
    fake = tmp_path / "fake-codex"
    fake.write_text("#!/bin/sh\necho 'codex: cannot reach the model' >&2\nexit 3\n")
    fake.chmod(0o755)
    outcome, log = asyncio.run(_session(tmp_path, Scripted(), agent={"harness": "codex", "cli": str(fake)}))
    end = _end(log)
    assert outcome is None and end.reason == "agent_crashed:exit_3" and "cannot reach the model" in end.error


def test_a_session_over_its_budget_is_aborted_wall_clock_timeout(tmp_path):
    class Quick(EchoWordTask):
        session_budget_s = 0.5

    outcome, log = asyncio.run(_session(tmp_path, Scripted(hang=True), task=Quick()))
    end = _end(log)
    assert isinstance(outcome, SessionTimeout) and isinstance(end, SessionAborted) and end.reason == "wall_clock_timeout"


def test_a_cancelled_session_is_dropped(tmp_path):
    outcome, log = asyncio.run(_session(tmp_path, Scripted(hang=True), cancel=True))
    end = _end(log)
    assert isinstance(outcome, asyncio.CancelledError) and isinstance(end, SessionDropped) and end.reason == "cancelled"


def test_a_failing_setup_aborts_before_the_agent_starts(tmp_path):
    class Broken(EchoWordTask):
        async def setup(self, episode, sandbox):
            raise OSError("disk full")

    backend = Scripted()
    outcome, log = asyncio.run(_session(tmp_path, backend, task=Broken()))
    end = _end(log)
    assert outcome is None and end.reason == "setup_failed:OSError" and "disk full" in end.error
    assert not backend.called.is_set()


def test_a_verifier_that_returns_no_verdict_aborts_naming_the_task(tmp_path):
    class Sloppy(EchoWordTask):
        async def verify(self, episode, sandbox):
            return 1.0

    outcome, log = asyncio.run(_session(tmp_path, Scripted(), task=Sloppy()))
    end = _end(log)
    assert outcome is None and end.reason == "verifier_failed:TypeError" and "'echo-word-test': verify() returned float" in end.error


@pytest.mark.agent_cli
@pytest.mark.required
def test_claude_code_plays_a_text_task_session_whose_every_model_call_is_a_recorded_turn(tmp_path):
    """The real Claude Code CLI as the harness (installed by .ci/run; skipped
    with the reason when missing, which fails under CI=true). The backend is
    scripted: the CLI and the rollout are under test, not the model."""
    import shutil

    from agentlog.gateway import agents

    cli = agents.DEFAULT_CLI_DIR / "node_modules" / ".bin" / "claude"
    if not cli.exists() or shutil.which("node") is None:
        pytest.skip(f"Claude Code not installed in {agents.DEFAULT_CLI_DIR} (or no node): run tools/gateway_clis.sh (.ci/run does)")

    def reply(prompt: str) -> str:
        word = next((w for w in WORDS if f"Write {w} into answer.txt" in prompt), None)
        if "<tool>\n" in prompt:
            return "Done."
        if word is not None and '"name": "Bash"' in prompt:
            return '<tool_call>{"name": "Bash", "arguments": {"command": "echo %s > answer.txt", "description": "write"}}</tool_call>' % word
        return "No shell tool was offered."

    class Roomy(EchoWordTask):
        max_new_tokens = 256
        session_budget_s = 180.0

    outcome, log = asyncio.run(_session(tmp_path, Scripted(reply), task=Roomy(), agent={"harness": "claude-code", "cli": str(cli)}))
    end = _end(log)
    assert outcome is None and isinstance(end, SessionFinished), end
    assert end.reward == 1.0, end
    turns = [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]
    assert len(turns) >= 2 and turns[0].response_message["tool_calls"][0]["name"] == "Bash"
    (cli_run, verifier) = [e.body for e in log.read() if isinstance(e.body, CommandRan)]
    assert "claude" in cli_run.command and cli_run.exit_code == 0 and verifier.command.startswith("grep -qx")


def _fake_claude(tmp_path, result: dict, exit_code: int) -> Path:
    """A stand-in for Claude Code: records its arguments and output allowance, prints ``result`` as its JSON result."""
    fake = tmp_path / "fake-claude"
    (tmp_path / "result.json").write_text(json.dumps(result))
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/args\necho "$CLAUDE_CODE_MAX_OUTPUT_TOKENS" > {tmp_path}/max_out\n'
                    f'cat {tmp_path}/result.json\nexit {exit_code}\n')
    fake.chmod(0o755)
    return fake


def test_claude_code_giving_up_on_over_long_answers_finishes_with_the_verifiers_reward(tmp_path):
    """Claude Code exits 1 after the model's answers kept hitting the output allowance: the policy's
    doing, so the verifier judges the sandbox (not an abort, which would hide it from training).
    The CLI gets --bare, the configured tools and system prompt, and the task's allowance."""
    result = {"type": "result", "subtype": "success", "is_error": True, "api_error_status": None,
              "result": "API Error: Claude's response exceeded the 24 output token maximum. To configure this behavior, set ..."}
    fake = _fake_claude(tmp_path, result, 1)
    agent = {"harness": "claude-code", "cli": str(fake), "cli_tools": ["Bash", "Read"], "system_prompt": "Be brief."}
    outcome, log = asyncio.run(_session(tmp_path, Scripted(), agent=agent))
    end = _end(log)
    assert outcome is None and isinstance(end, SessionFinished) and end.reward == 0.0, end
    assert end.metadata["agent"] == {"exit_code": 1, "stop_reason": "max_output_tokens"}
    assert end.metadata["gateway"] == {"requests": 0, "turns": 0}
    args = (tmp_path / "args").read_text().splitlines()
    assert "--bare" in args and args[args.index("--tools") + 1] == "Bash,Read" and args[args.index("--allowedTools") + 1] == "Bash,Read"
    assert args[args.index("--system-prompt") + 1] == "Be brief."
    assert (tmp_path / "max_out").read_text().strip() == str(EchoWordTask.max_new_tokens)


def test_claude_code_ending_on_an_api_error_is_aborted(tmp_path):
    result = {"type": "result", "subtype": "success", "is_error": True, "api_error_status": 400,
              "result": "API Error: 400 prompt is too long: 9000 tokens, and the model's context is 4096 tokens"}
    outcome, log = asyncio.run(_session(tmp_path, Scripted(), agent={"harness": "claude-code", "cli": str(_fake_claude(tmp_path, result, 1))}))
    end = _end(log)
    assert outcome is None and isinstance(end, SessionAborted) and end.reason == "agent_crashed:exit_1" and "prompt is too long" in end.error


def test_cli_tools_and_system_prompt_are_claude_code_options_checked_by_name():
    cfg = LoopConfig.from_dict({"agent": {"harness": "claude-code", "cli_tools": ["Bash"], "system_prompt": "Short."}})
    assert (cfg.agent.cli_tools, cfg.agent.system_prompt) == (["Bash"], "Short.")
    assert LoopConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # config.json round trip
    with pytest.raises(ConfigError, match=r"\[agent\] cli_tools: only the claude-code harness takes it \(harness is 'codex'\)"):
        LoopConfig.from_dict({"agent": {"harness": "codex", "cli_tools": ["Bash"]}})
    with pytest.raises(ConfigError, match=r"\[agent\] system_prompt: only the claude-code harness"):
        LoopConfig.from_dict({"agent": {"system_prompt": "Short."}})
    with pytest.raises(ConfigError, match=r"\[agent\] cli_tools: expected a list of tool names"):
        LoopConfig.from_dict({"agent": {"harness": "claude-code", "cli_tools": ["Bash,Read"]}})
