"""End to end with the real agent CLIs from npm: Claude Code and Codex.

Each CLI runs through the harness registry in a LocalSandbox, pointed at the
gateway on loopback. The backend is scripted (it asks for one shell command,
then answers from the tool result; for Claude Code's subagents, it calls the
``Agent`` tool and answers each subagent): the gateway is what is under test. The
CLIs are installed once per machine, outside the repo, by ``.ci/run`` (through
``tools/gateway_clis.sh``, with a time bound); these tests only look for them
in ``$AGENTLOG_CLI_DIR`` and skip with the reason when they are missing, a
skip that fails the run under CI=true (marker ``required``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from msgspec import UNSET

from agentlog.engine import LocalSandbox, harness
from agentlog.gateway import agents
from agentlog.events.schema.lineage import turn_lineage
from agentlog.events.schema.types import CommandRan
from gateway_helpers import ScriptedBackend, open_running, rig, run, turns_of
from agentlog.reducers.pipeline import reduce_log, session_trajectory

pytestmark = pytest.mark.agent_cli

SHELL_CMD = "echo gateway-roundtrip > out.txt && cat out.txt"


#: Upper bound on one `CLI --version` probe.
PROBE_TIMEOUT_S = 60


def _run_bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """Run ``cmd`` in its own process group; None if it outlives ``timeout``.
    The whole group is killed then: a CLI's children may hold the output
    pipes, so killing only the direct child would leave us waiting on them."""
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def cli_dir() -> Path:
    """The bin folder of the CLIs that ``.ci/run`` installed (``tools/gateway_clis.sh``
    into ``$AGENTLOG_CLI_DIR``, default ``~/.cache/agentlog-clis``), or skip with the
    reason. The tests never install anything themselves; under CI=true the skip
    fails the run (marker ``required``)."""
    bin_dir = agents.DEFAULT_CLI_DIR / "node_modules" / ".bin"
    missing = [name for name in ("claude", "codex") if not (bin_dir / name).exists()]
    if missing:
        pytest.skip(f"agent CLIs {missing} not installed in {agents.DEFAULT_CLI_DIR}: run tools/gateway_clis.sh (.ci/run does)")
    if shutil.which("node") is None:
        pytest.skip("node not present: the installed agent CLIs need it")
    # Both CLIs ship their native binary as an optional npm dependency; when
    # that one failed to install, the package's stub is left in place.
    for name in ("claude", "codex"):
        probe = _run_bounded([str(bin_dir / name), "--version"], PROBE_TIMEOUT_S)
        if probe is None or probe.returncode != 0:
            why = "timed out" if probe is None else (probe.stderr or probe.stdout).strip()[-300:]
            pytest.skip(f"the installed {name} CLI does not run on this machine ({name} --version: {why})")
    return bin_dir


def _reply(prompt: str) -> str:
    if "<tool>\n" in prompt:
        return "The command printed gateway-roundtrip."
    if '"name": "Bash"' in prompt:
        return '<tool_call>{"name": "Bash", "arguments": {"command": "%s", "description": "write and read a file"}}</tool_call>' % SHELL_CMD
    if '"name": "exec_command"' in prompt:
        return '<tool_call>{"name": "exec_command", "arguments": {"cmd": "%s"}}</tool_call>' % SHELL_CMD
    return "No shell tool was offered."


@pytest.mark.required
@pytest.mark.parametrize("agent", ["claude-code", "codex"])
def test_agent_cli_completes_a_tool_round_trip_and_every_turn_is_recorded(agent, cli_dir, tmp_path):
    binary = {"claude-code": "claude", "codex": "codex"}[agent]
    cli = cli_dir / binary
    assert cli.exists(), f"{cli} missing after install"

    async def body():
        backend = ScriptedBackend(_reply)
        async with rig(backend) as (gw, engine, log):
            sid = f"e2e-{agent}"
            h = await open_running(engine, sid)
            runner = harness.get(agent)(gw.url, cli=str(cli), budget_s=120)
            sandbox = LocalSandbox(tmp_path / "work")
            key = gw.session_key(sid)
            res = await runner.run(h, sandbox, "Use the shell to run the command you need, then report its output.", api_key=key)
            assert res.exit_code == 0, res.output_tail[-2000:]
            assert (tmp_path / "work" / "out.txt").read_text().strip() == "gateway-roundtrip"
            assert "gateway-roundtrip" in res.output_tail
            turns = turns_of(log, sid)
            assert len(turns) >= 2, [t.response_message for t in turns]
            first, last = turns[0], turns[-1]
            (call,) = first.response_message["tool_calls"]
            assert call["name"] in ("Bash", "exec_command") and SHELL_CMD in json.dumps(call["arguments"])
            # the tool result comes back routed under the call that asked for it
            i = last.messages.index(first.response_message)
            tool_msg = last.messages[i + 1]
            assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == call["id"]
            assert "gateway-roundtrip" in tool_msg["content"]
            assert last.response_message == {"role": "assistant", "content": "The command printed gateway-roundtrip."}
            (ran,) = [e.body for e in log.read() if isinstance(e.body, CommandRan)]
            assert ran.exit_code == 0 and binary in ran.command
            assert key not in ran.command and key not in ran.output_tail  # the key is never recorded
            await h.finish(reward=1.0)
            traj = session_trajectory(log.read(), sid)
            assert traj.decisions[-1].drift == "clean" and traj.decisions[-1].routing in ("mounted", "matched")
            (sample,) = reduce_log(log).samples
            assert int(sample.mask.sum()) == len(first.output_tokens) + len(last.output_tokens)

    run(body(), timeout=240)


#: The two subagents the scripted parent spawns at once through Claude Code's ``Agent`` tool: one runs
#: a shell command before it answers (its prompt over 32 characters, the marker telling its requests
#: apart); one answers at once (a short prompt, which the engine matches as the last line of the
#: subagent's first user message, where Claude Code puts it after its <system-reminder> block).
SUBAGENT_MARK = "SUBAGENT-TASK-7f3c"
SHELL_SUBAGENT = f"{SUBAGENT_MARK}: run one shell command, then report the sum of two and two as a word."
SHORT_SUBAGENT = "Say six."
SUBAGENT_SHELL = "echo sub-shell-ok"
SUBAGENT_ANSWERS = {SHELL_SUBAGENT: "SUBAGENT-RESULT four", SHORT_SUBAGENT: "six"}
PARENT_ANSWER = "The subagents answered four and six."


def _spawning_reply(prompt: str) -> str:
    """The parent calls its subagent tool (``Agent`` in Claude Code 2.x) twice in one answer; the
    first subagent runs one shell command, then answers, the second answers at once; the parent
    answers from their results."""
    if SUBAGENT_ANSWERS[SHELL_SUBAGENT] in prompt:  # the parent, given the Agent calls' results
        return PARENT_ANSWER
    if "sub-shell-ok" in prompt:  # the shell subagent, given its command's result
        return SUBAGENT_ANSWERS[SHELL_SUBAGENT]
    if SUBAGENT_MARK in prompt:  # the shell subagent's first request: its first user message ends with its prompt
        return '<tool_call>{"name": "Bash", "arguments": {"command": "%s", "description": "check the shell"}}</tool_call>' % SUBAGENT_SHELL
    if SHORT_SUBAGENT in prompt:  # the short subagent (the parent's first request holds no prompt yet)
        return SUBAGENT_ANSWERS[SHORT_SUBAGENT]
    if '"name": "Agent"' in prompt:
        # one call a line, as the chat template renders them back: the answer then extends exactly
        return "\n".join("<tool_call>" + json.dumps({"name": "Agent", "arguments": {
            "description": f"subagent {i}", "prompt": p, "subagent_type": "general-purpose"}}) + "</tool_call>"
            for i, p in enumerate(SUBAGENT_ANSWERS))
    return "No subagent tool was offered."


@pytest.mark.required
def test_claude_code_subagents_become_lineages_spawned_by_their_agent_calls(cli_dir, tmp_path):
    """Claude Code's subagent tool (``Agent``, input ``description``/``prompt``/``subagent_type``)
    runs a conversation per call under the same key, in parallel: its own system prompt, its first
    user message the call's ``prompt`` after Claude Code's <system-reminder> block. The engine
    records each as a lineage of its own, spawned by its call, and reducing gives one row per
    lineage with every generated token trained once, as generated. Side requests Claude Code may
    add would be lineages of their own: only the parent and the spawned lineages are pinned."""

    async def body():
        backend = ScriptedBackend(_spawning_reply)
        async with rig(backend) as (gw, engine, log):
            sid = "e2e-claude-subagents"
            h = await open_running(engine, sid)
            runner = harness.get("claude-code")(gw.url, cli=str(cli_dir / "claude"), budget_s=60, tools=["Agent", "Bash"])
            res = await runner.run(h, LocalSandbox(tmp_path / "work"), "Delegate the arithmetic to subagents.", api_key=gw.session_key(sid))
            assert res.exit_code == 0, res.output_tail[-2000:]
            assert PARENT_ANSWER in res.output_tail
            turns = turns_of(log, sid)
            by_lineage: dict[str, list] = {}
            for t in turns:
                by_lineage.setdefault(turn_lineage(t), []).append(t)
            spawning = [t for t in turns if any(c["name"] == "Agent" for c in (t.response_message.get("tool_calls") or ()))]
            assert len(spawning) == 1, [t.response_message for t in turns]
            parent = spawning[0]
            calls = {c["arguments"]["prompt"]: c for c in parent.response_message["tool_calls"]}
            assert list(calls) == list(SUBAGENT_ANSWERS)
            parent_id = turn_lineage(parent)
            # the parent's turns: the spawning one, then the one answering from both results
            last = by_lineage[parent_id][-1]
            assert last.response_message == {"role": "assistant", "content": PARENT_ANSWER}
            results = {m["tool_call_id"]: m["content"] for m in last.messages if m["role"] == "tool"}
            for prompt, call in calls.items():
                assert results[call["id"]].startswith(SUBAGENT_ANSWERS[prompt]), results
            # each subagent: a lineage of its own, its parent matched to its Agent call by its prompt
            spawned = {ts[0].lineage.spawn_call: lid for lid, ts in by_lineage.items()
                       if ts[0].lineage is not UNSET and ts[0].lineage.parent == parent_id}
            subs = {prompt: by_lineage[spawned[call["id"]]] for prompt, call in calls.items()}
            for prompt, sub in subs.items():
                origin = sub[0].lineage
                assert (origin.parent_turn, origin.how) == (parent.turn_index, "tool_call"), origin
                first_user = next(m["content"] for m in sub[0].messages if m["role"] == "user")
                assert first_user.endswith("\n" + prompt) and first_user != prompt  # after Claude Code's reminder block
                assert parent.messages[0]["role"] == sub[0].messages[0]["role"] == "system"
                assert parent.messages[0]["content"] != sub[0].messages[0]["content"]  # its own system prompt
                assert sub[-1].response_message == {"role": "assistant", "content": SUBAGENT_ANSWERS[prompt]}
            shell_sub = subs[SHELL_SUBAGENT]
            assert len(shell_sub) == 2 and len(subs[SHORT_SUBAGENT]) == 1
            (sub_call,) = shell_sub[0].response_message["tool_calls"]  # the subagent ran its own shell command
            assert {"role": "tool", "content": "sub-shell-ok", "tool_call_id": sub_call["id"]} in shell_sub[1].messages
            await h.finish(reward=1.0)
            samples = reduce_log(log).samples
            assert sorted(s.metadata["lineage"] for s in samples) == sorted(by_lineage), [s.metadata for s in samples]
            row = {s.metadata["lineage"]: s for s in samples}
            for call in calls.values():
                meta = row[spawned[call["id"]]].metadata
                assert {k: meta.get(k) for k in ("parent_lineage", "parent_turn", "spawn_call", "spawn_match")} == {
                    "parent_lineage": parent_id, "parent_turn": parent.turn_index, "spawn_call": call["id"], "spawn_match": "tool_call"}, meta
            for lid, ts in by_lineage.items():  # every generated token trained once, in its lineage's row, as generated
                s, generated = row[lid], np.concatenate([t.output_tokens for t in ts])
                trained = s.mask.astype(bool)
                assert np.array_equal(s.token_ids[s.prompt_length :][trained], generated), lid
                assert np.all(s.log_probs[trained] == np.float32(-0.25)), lid

    run(body(), timeout=120)


def test_cli_harnesses_are_registered():
    assert {"claude-code", "codex"} <= set(harness.names())
    cmd = harness.get("codex")("http://127.0.0.1:1234", cli="/bin/codex").command(Path("/w/k"), Path("/w"), "do it")
    assert 'base_url="http://127.0.0.1:1234/v1"' in cmd and 'OPENAI_API_KEY="$(cat /w/k)"' in cmd and "< /dev/null" in cmd
    cmd = harness.get("claude-code")("http://127.0.0.1:1234", cli="/bin/claude").command(Path("/w/k"), Path("/w"), "do it")
    assert 'ANTHROPIC_API_KEY="$(cat /w/k)"' in cmd and "ANTHROPIC_BASE_URL=http://127.0.0.1:1234" in cmd and "CLAUDE_CODE_MAX_RETRIES=0" in cmd
    assert " --bare " in cmd and "--safe-mode" not in cmd
    # --bare would drop the subagent tool without a word: a tool set beyond Bash, Edit and Read runs --safe-mode.
    cmd = harness.get("claude-code")("http://127.0.0.1:1234", cli="/bin/claude", tools=["Agent", "Bash"]).command(Path("/w/k"), Path("/w"), "do it")
    assert " --safe-mode " in cmd and "--bare" not in cmd and "--tools Agent,Bash" in cmd
    # A sandbox behind HTTP(S)_PROXY still reaches the gateway directly.
    for name in ("codex", "claude-code"):
        cmd = harness.get(name)("http://gw.internal:1234", cli="/bin/x").command(Path("/w/k"), Path("/w"), "do it")
        assert re.search(r"\bNO_PROXY=\S*gw\.internal", cmd) and re.search(r"\bno_proxy=\S*gw\.internal", cmd), cmd
    assert os.path.basename(agents.DEFAULT_CLI_DIR) == "agentlog-clis" or "AGENTLOG_CLI_DIR" in os.environ


@pytest.mark.parametrize("agent, variable", [("claude-code", "ANTHROPIC_API_KEY"), ("codex", "OPENAI_API_KEY")])
def test_cli_harness_hands_the_session_key_to_the_cli_and_never_records_it(agent, variable, tmp_path):
    """Runs without node: a stand-in CLI reports the key it was given. The
    recorded command_ran holds neither the key nor the session id as a key,
    and the key file is gone afterwards."""
    fake = tmp_path / "fake-cli"
    fake.write_text(f'#!/bin/sh\nprintf %s "${variable}" > "$HOME/seen-key"\n')
    fake.chmod(0o755)

    async def body():
        async with rig(ScriptedBackend(_reply)) as (gw, engine, log):
            h = await open_running(engine, "s")
            key = gw.session_key("s")
            runner = harness.get(agent)(gw.url, cli=str(fake), budget_s=30)
            res = await runner.run(h, LocalSandbox(tmp_path / "work"), "hi", api_key=key)
            assert res.exit_code == 0, res.output_tail
            home = tmp_path / "work" / runner.home_dir
            assert (home / "seen-key").read_text() == key
            assert not (home / ".agentlog-api-key").exists()
            (ran,) = [e.body for e in log.read() if isinstance(e.body, CommandRan)]
            assert key not in ran.command and f"{variable}=s " not in ran.command
            await h.finish(reward=0.0)

    run(body())


def _alive(marker: str) -> list[str]:
    """The processes whose command line holds ``marker`` (pgrep itself left out)."""
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if "pgrep" not in ln]


@pytest.mark.required
@pytest.mark.parametrize("agent, tool", [("claude-code", "Bash"), ("codex", "exec_command")])
def test_a_cli_agent_past_its_budget_leaves_no_process_running(agent, tool, cli_dir, tmp_path):
    """The sandbox kills the run's process group at the budget, but both CLIs start their tools'
    shells in sessions of their own: a tool's `sleep` used to outlive the session. Each run's
    processes carry a tag in their environment, and every one carrying it is killed at its end."""
    binary = {"claude-code": "claude", "codex": "codex"}[agent]
    marker = f"sleep {300 + (uuid.uuid4().int % 1000) / 1000:.3f}"  # a unique command line to look for
    key = "command" if tool == "Bash" else "cmd"

    def reply(prompt: str) -> str:
        return ('<tool_call>{"name": "%s", "arguments": {"%s": "touch started; %s; echo done", "description": "wait"}}</tool_call>'
                % (tool, key, marker))

    async def body():
        async with rig(ScriptedBackend(reply)) as (gw, engine, log):
            h = await open_running(engine, "s")
            runner = harness.get(agent)(gw.url, cli=str(cli_dir / binary), budget_s=6)
            return await runner.run(h, LocalSandbox(tmp_path / "work"), "wait", api_key=gw.session_key("s"))

    try:
        res = run(body(), timeout=60)
        assert res.budget_exceeded, res.output_tail[-1500:]
        assert (tmp_path / "work" / "started").exists(), "the tool's command never started: nothing was checked"
        time.sleep(0.5)
        assert not _alive(marker), f"{agent}: processes outlived the budget kill: {_alive(marker)}"
    finally:
        for ln in _alive(marker):  # without the fix: not left behind the test either
            os.kill(int(ln.split()[0]), signal.SIGKILL)


#: What a user's environment may hold that a CLI must never be handed.
USER_SECRETS = {
    "ANTHROPIC_AUTH_TOKEN": "user-real-anthropic-token",  # Claude Code sends it as Authorization: Bearer
    "AWS_SECRET_ACCESS_KEY": "user-real-aws-secret",  # the policy's shell commands could print it into the log
    "AGENTLOG_ADMIN_TOKEN": "user-real-admin-token",  # the gateway's admin credential
    "CLAUDE_CODE_USE_BEDROCK": "1",  # would send the turns to Bedrock, not the gateway
}


@pytest.mark.parametrize("agent", ["claude-code", "codex"])
def test_a_cli_agent_is_not_handed_the_users_secrets(agent, tmp_path, monkeypatch):
    """The CLI ran with the user's whole environment; it now gets only PATH, locale, terminal,
    proxy and CA settings, and what the harness sets."""
    fake = tmp_path / "fake-cli"
    fake.write_text('#!/bin/sh\nenv > "$HOME/seen-env"\n')
    fake.chmod(0o755)
    for k, v in USER_SECRETS.items():
        monkeypatch.setenv(k, v)

    async def body():
        async with rig(ScriptedBackend(lambda p: "ok")) as (gw, engine, log):
            h = await open_running(engine, "s")
            runner = harness.get(agent)(gw.url, cli=str(fake), budget_s=30)
            res = await runner.run(h, LocalSandbox(tmp_path / "work"), "hi", api_key=gw.session_key("s"))
            assert res.exit_code == 0, res.output_tail
            return (tmp_path / "work" / runner.home_dir / "seen-env").read_text()

    seen = run(body())
    leaked = [k for k in USER_SECRETS if f"\n{k}=" in "\n" + seen]
    assert not leaked, f"{agent} was handed the user's {leaked}"
    assert "\nPATH=" in "\n" + seen  # what it needs still arrives


@pytest.mark.required
def test_claude_code_writes_nothing_into_the_users_config_dir_or_tmp(cli_dir, tmp_path, monkeypatch):
    """With the user's CLAUDE_CONFIG_DIR set, Claude Code wrote its config and session transcripts
    there, and it left folders in the user's temp dir."""
    user_cfg, user_tmp = tmp_path / "users-claude-config", tmp_path / "users-tmp"
    user_cfg.mkdir()
    user_tmp.mkdir()
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(user_cfg))
    monkeypatch.setenv("TMPDIR", str(user_tmp))

    async def body():
        async with rig(ScriptedBackend(lambda p: "All done.")) as (gw, engine, log):
            h = await open_running(engine, "s")
            runner = harness.get("claude-code")(gw.url, cli=str(cli_dir / "claude"), budget_s=60)
            res = await runner.run(h, LocalSandbox(tmp_path / "work"), "say done", api_key=gw.session_key("s"))
            assert res.exit_code == 0, res.output_tail[-2000:]

    run(body(), timeout=90)
    assert sorted(p.name for p in user_cfg.rglob("*")) == [], "Claude Code wrote into the user's config dir"
    assert sorted(p.name for p in user_tmp.rglob("*")) == [], "Claude Code left files in the user's temp dir"


@pytest.mark.parametrize("agent", ["claude-code", "codex"])
def test_a_cli_given_as_a_relative_path_runs_from_the_sandbox(agent, tmp_path, monkeypatch):
    """``[agent] cli = "bin/fake-cli"`` passed check_ready (relative to the worker's folder), then
    every session failed with exit 127: the CLI runs from the sandbox's workdir."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "fake-cli"
    fake.write_text("#!/bin/sh\necho ran-the-cli\n")
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)

    async def body():
        async with rig(ScriptedBackend(lambda p: "ok")) as (gw, engine, log):
            h = await open_running(engine, "s")
            runner = harness.get(agent)(gw.url, cli="bin/fake-cli", budget_s=30)
            runner.check_ready()  # the run's preflight accepts it
            return await runner.run(h, LocalSandbox(tmp_path / "work"), "hi", api_key=gw.session_key("s"))

    res = run(body())
    assert res.exit_code == 0 and "ran-the-cli" in res.output_tail, res.output_tail


def test_claude_codes_result_reader_answers_none_for_garbage_output(tmp_path):
    """A CLI that exits 1 printing JSON-like garbage nested 3,000 deep: ``model_stopped`` raised
    RecursionError out of the rollout; it says None (a crash, recorded agent_crashed:exit_1)."""
    fake = tmp_path / "fake-claude"
    fake.write_text("#!/bin/sh\nprintf '%s' '{\"a\":'; head -c 3000 /dev/zero | tr '\\0' '['; echo; exit 1\n")
    fake.chmod(0o755)

    async def body():
        async with rig(ScriptedBackend(lambda p: "ok")) as (gw, engine, log):
            h = await open_running(engine, "s")
            runner = harness.get("claude-code")(gw.url, cli=str(fake), budget_s=30)
            return runner, await runner.run(h, LocalSandbox(tmp_path / "work"), "hi", api_key=gw.session_key("s"))

    runner, res = run(body())
    assert res.exit_code == 1 and runner.model_stopped(res) is None
