"""The built-in Python tool-calling agent through the real gateway.

The backend is scripted (the gateway and the agent are under test, not the
model): it asks for a shell command, then answers from the tool result. The
agent is the real one, the openai client over HTTP on loopback, and its
commands run in a real LocalSandbox through the engine.
"""

from __future__ import annotations

import json

import pytest

from agentlog.engine import LocalSandbox, harness
from agentlog.events.schema.types import CommandRan
from agentlog.gateway import GatewayConfig
from agentlog.gateway.python_agent import BASH_TOOL, PythonAgent
from agentlog.reducers.pipeline import reduce_log
from gateway_helpers import ScriptedBackend, open_running, rig, run, turns_of


async def play(agent, *args):
    """``agent.run(*args)``, then close the agent's shared client."""
    try:
        return await agent.run(*args)
    finally:
        await agent.close()


def call(command: str, name: str = "bash") -> str:
    return '<tool_call>{"name": "%s", "arguments": {"command": "%s"}}</tool_call>' % (name, command)


def test_python_agent_runs_each_tool_call_in_the_sandbox_and_every_model_call_is_a_recorded_turn(tmp_path):
    def reply(prompt: str) -> str:
        if "exit code 0\nhello" in prompt:
            return "The file says hello."
        return call("echo hello > answer.txt && cat answer.txt")

    async def body():
        async with rig(ScriptedBackend(reply)) as (gw, engine, log):
            h = await open_running(engine, "py-1")
            agent = harness.get("python-agent")(gw.url, max_turns=4)
            sandbox = LocalSandbox(tmp_path / "work")
            res = await play(agent, h, sandbox, [{"role": "user", "content": "write hello to answer.txt"}], gw.session_key("py-1"))
            assert (res.stop_reason, res.turns, res.tool_calls) == ("answered", 2, 1)
            assert (tmp_path / "work" / "answer.txt").read_text() == "hello\n"
            first, last = turns_of(log, "py-1")
            (tc,) = first.response_message["tool_calls"]
            assert tc["name"] == "bash" and tc["arguments"] == {"command": "echo hello > answer.txt && cat answer.txt"}
            # The agent echoed the recorded response exactly, and the tool result follows it.
            i = last.messages.index(first.response_message)
            assert last.messages[i + 1] == {"role": "tool", "content": "exit code 0\nhello\n", "tool_call_id": tc["id"]}
            assert last.response_message == {"role": "assistant", "content": "The file says hello."}
            (ran,) = [e.body for e in log.read() if isinstance(e.body, CommandRan)]
            assert ran.exit_code == 0 and "answer.txt" in ran.command
            await h.finish(reward=1.0)
            (sample,) = reduce_log(log).samples
            assert int(sample.mask.sum()) == len(first.output_tokens) + len(last.output_tokens)

    run(body())


def test_python_agent_ends_the_episode_on_an_ill_formed_tool_call_which_is_recorded_as_such(tmp_path):
    """The parser's ill-formed call comes back as plain content: a final answer, nothing runs."""

    async def body():
        async with rig(ScriptedBackend(lambda p: '<tool_call>{"name": "bash", "arguments": {oops</tool_call>')) as (gw, engine, log):
            h = await open_running(engine, "py-bad")
            res = await play(PythonAgent(gw.url), h, LocalSandbox(tmp_path / "w"), "do it", gw.session_key("py-bad"))
            assert (res.stop_reason, res.turns, res.tool_calls) == ("answered", 1, 0)
            (turn,) = turns_of(log, "py-bad")
            assert turn.ill_formed and "tool_calls" not in turn.response_message
            assert not [e for e in log.read() if isinstance(e.body, CommandRan)]

    run(body())


def test_python_agent_answers_a_bash_call_without_a_command_with_an_error_and_goes_on(tmp_path):
    def reply(prompt: str) -> str:
        if "error: bash arguments" in prompt:
            return "giving up"
        return '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>'

    async def body():
        async with rig(ScriptedBackend(reply)) as (gw, engine, log):
            h = await open_running(engine, "py-args")
            res = await play(PythonAgent(gw.url), h, LocalSandbox(tmp_path / "w"), "do it", gw.session_key("py-args"))
            assert (res.stop_reason, res.turns, res.tool_calls) == ("answered", 2, 1)
            tool = res.messages[-2]
            assert tool["role"] == "tool" and tool["content"].startswith('error: bash arguments: expected {"command"')
            assert not turns_of(log, "py-args")[0].ill_formed
            assert not [e for e in log.read() if isinstance(e.body, CommandRan)]

    run(body())


@pytest.mark.parametrize("cap, expected", [("max_tool_calls", ("max_tool_calls", 3, 2)), ("max_turns", ("max_turns", 3, 3)),
                                           ("gateway", ("turn_cap", 2, 2))])
def test_python_agent_stops_at_its_caps_and_at_the_gateways_turn_cap(tmp_path, cap, expected):
    async def body():
        cfg = GatewayConfig(max_turns=2) if cap == "gateway" else None
        async with rig(ScriptedBackend(lambda p: call("true")), config=cfg) as (gw, engine, log):
            h = await open_running(engine, "py-cap")
            kw = {"max_tool_calls": 2} if cap == "max_tool_calls" else {"max_turns": 3} if cap == "max_turns" else {}
            res = await play(PythonAgent(gw.url, **kw), h, LocalSandbox(tmp_path / "w"), "loop", gw.session_key("py-cap"))
            assert (res.stop_reason, res.turns, res.tool_calls) == expected
            assert len(turns_of(log, "py-cap")) == res.turns
            assert len([e for e in log.read() if isinstance(e.body, CommandRan)]) == res.tool_calls

    run(body())


def test_python_agent_stops_when_the_conversation_outgrows_the_context(tmp_path):
    async def body():
        # Each tool result adds ~2 KB of text; a 3000-token context holds one round.
        backend = ScriptedBackend(lambda p: call("yes | head -c 1500"), context_length=3000)
        async with rig(backend) as (gw, engine, log):
            h = await open_running(engine, "py-ctx")
            res = await play(PythonAgent(gw.url, max_tokens=128), h, LocalSandbox(tmp_path / "w"), "x", gw.session_key("py-ctx"))
            assert res.stop_reason == "context_exhausted" and res.turns >= 1

    run(body())


def test_python_agent_refuses_a_missing_key_and_a_bad_prompt_by_name(tmp_path):
    async def body():
        async with rig(ScriptedBackend(lambda p: "")) as (gw, engine, log):
            h = await open_running(engine, "py-key")
            with pytest.raises(ValueError, match="api_key: expected the session's key"):
                await play(PythonAgent(gw.url), h, LocalSandbox(tmp_path / "w"), "x", "")
            with pytest.raises(ValueError, match=r"messages\[0\]: expected a chat message"):
                await play(PythonAgent(gw.url), h, LocalSandbox(tmp_path / "w"), ["hi"], gw.session_key("py-key"))

    run(body())


def test_all_three_harnesses_share_the_factory_and_run_signature():
    import inspect

    for name in ("python-agent", "claude-code", "codex"):
        agent = harness.get(name)("http://127.0.0.1:9", budget_s=5.0)
        params = list(inspect.signature(agent.run).parameters)
        assert params == ["handle", "sandbox", "prompt_or_messages", "api_key"], (name, params)
    assert json.loads(json.dumps(BASH_TOOL))["function"]["parameters"]["required"] == ["command"]


def test_cli_harnesses_take_the_tasks_messages_as_one_prompt():
    from agentlog.gateway.agents import prompt_text

    msgs = [{"role": "system", "content": "You fix repos."}, {"role": "user", "content": "Fix test_x."},
            {"role": "assistant", "content": "ignored"}]
    assert prompt_text(msgs) == "You fix repos.\n\nFix test_x."
    assert prompt_text("as is") == "as is"
    with pytest.raises(ValueError, match="agent prompt: expected a str or chat messages"):
        prompt_text([{"role": "assistant", "content": "only"}])
