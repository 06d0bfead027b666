"""End to end, a real CLI agent in the loop: `agentlog train`
with the tiny HF model and the real Claude Code CLI as every session's agent.

The CLI is installed by ``.ci/run`` (``tools/gateway_clis.sh`` into
``$AGENTLOG_CLI_DIR``), never by the test; when it is missing the test skips
with the reason, which fails the run under CI=true (marker ``required``).
The random model makes no useful tool call, and its answers run past the
task's output allowance, so Claude Code gives up: the verifier still judges
the sandbox (reward 0) and the session finishes with that reward.

Every model call the CLI made is a recorded turn: the gateway's count of the
session's requests equals its recorded turns, and the token usage Claude
Code itself reports equals the sum over those turns.
"""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import CommandRan, SessionAborted, SessionDropped, SessionFinished, SessionOpened, TurnRecorded
from agentlog.gateway import agents
from agentlog.events import read_log
from agentlog.loop.check import check_run
from agentlog.loop.config import LoopConfig
from agentlog.loop.publish import hf_checkpoint_dir
from agentlog.loop.learner_records import read_learner_records

from custom_task_helpers import train_cli

pytestmark = [pytest.mark.agent_cli, pytest.mark.required]

#: A text task as a user writes it: write a word into answer.txt; the verifier greps for it.
TASK_MODULE = '''
import random
from pathlib import Path

from agentlog.engine.tasks import TextEpisode, TextTask, register_task, verdict_of_command


@register_task("{name}")
class WriteWordTask(TextTask):
    name = "{name}"
    max_turns = 8
    max_new_tokens = 16
    session_budget_s = 90.0
    command_budget_s = 10.0

    def new_episode(self, rng: random.Random) -> TextEpisode:
        word = rng.choice(("apple", "river", "stone"))
        return TextEpisode(messages=[{{"role": "user", "content": f"Write {{word}} into answer.txt"}}], label=word,
                           state={{"word": word}})

    async def setup(self, episode, sandbox) -> None:
        Path(sandbox.workdir, "README").write_text("put the word in answer.txt\\n")

    async def verify(self, episode, sandbox):
        return verdict_of_command(await sandbox.run_command(f"grep -qx {{episode.state['word']}} answer.txt", self.command_budget_s))
'''

CONFIG = '''
hf_model = "tiny-llama"
steps = 1
groups_per_step = 1
group_size = 2
warmup_steps = 0
stop_reward = 0
max_lag = 0
fsync = "never"

[task]
name = "{name}"
module = "{module}"

[agent]
harness = "claude-code"
cli = "{cli}"
cli_tools = ["Bash"]
system_prompt = "You are a coding agent in a sandbox. Use the Bash tool, then stop."
budget_s = 90

[metrics]
tensorboard = false

[faults]
exception_rate = 0.0
timeout_rate = 0.0
drop_rate = 0.0
straggler_rate = 0.0
empty_marker_rate = 0.0
'''


@pytest.fixture(scope="module")
def claude() -> str:
    """The Claude Code that ``.ci/run`` installed, or skip with the reason (a failure under CI=true)."""
    cli = agents.DEFAULT_CLI_DIR / "node_modules" / ".bin" / "claude"
    if not cli.exists():
        pytest.skip(f"Claude Code not installed in {agents.DEFAULT_CLI_DIR}: run tools/gateway_clis.sh (.ci/run does)")
    if shutil.which("node") is None:
        pytest.skip("node not present: the installed Claude Code needs it")
    return str(cli)


def _cli_result(output_tail: str) -> dict:
    """Claude Code's ``--output-format json`` result: the last JSON line of its output."""
    lines = [ln for ln in output_tail.splitlines() if ln.startswith('{"type":"result"')]
    assert lines, f"no JSON result in the CLI's output: {output_tail[-1000:]}"
    return json.loads(lines[-1])


def test_claude_code_plays_every_session_of_a_training_step_and_each_model_call_is_a_recorded_turn(tmp_path, claude):
    user = tmp_path / "user"
    user.mkdir()
    tag = uuid.uuid4().hex[:8]
    module, name = f"cc_word_{tag}", f"cc-word-{tag}"
    (user / f"{module}.py").write_text(TASK_MODULE.format(name=name))
    (user / "run.toml").write_text(CONFIG.format(name=name, module=module, cli=claude))
    proc = train_cli(user, "--config", "run.toml")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    run_dir = user / "run"
    cfg = LoopConfig.load(run_dir / "config.json")
    assert cfg.agent.harness == "claude-code" and cfg.agent.cli_tools == ["Bash"]

    envs = list(read_log(run_dir / "rollout", 0))
    opened = [e.session_id for e in envs if isinstance(e.body, SessionOpened)]
    ends = {e.session_id: e.body for e in envs if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped))}
    assert len(opened) == 2 and set(ends) == set(opened), (opened, ends)
    turns = [e for e in full_turns(envs) if isinstance(e.body, TurnRecorded)]
    for sid in opened:
        end = ends[sid]
        assert isinstance(end, SessionFinished), end  # not aborted: the CLI giving up on the model is the policy's doing
        commands = [e.body for e in envs if e.session_id == sid and isinstance(e.body, CommandRan)]
        (cli_run, verifier) = commands
        assert "--bare" in cli_run.command and "--tools Bash" in cli_run.command and "--system-prompt" in cli_run.command
        assert verifier.command.startswith("grep -qx")
        # The session finishes with the verifier's reward.
        assert end.reward == (1.0 if verifier.exit_code == 0 else 0.0) and end.metadata["exit_code"] == verifier.exit_code
        assert end.metadata["agent"]["exit_code"] == cli_run.exit_code
        mine = [t.body for t in turns if t.session_id == sid]
        # Every model call the CLI made is a recorded turn: by the gateway's count of the session's requests...
        assert len(mine) >= 1 and end.metadata["gateway"] == {"requests": len(mine), "turns": len(mine)}, end.metadata
        # ... and by the CLI's own account of the tokens it was served.
        usage = _cli_result(cli_run.output_tail)["usage"]
        assert usage["input_tokens"] == sum(len(t.prompt_tokens) for t in mine)
        assert usage["output_tokens"] == sum(len(t.output_tokens) for t in mine)
        assert all(len(t.output_tokens) <= 16 for t in mine)  # the task's allowance, whatever the CLI asked for
        assert all(t.sampling["api"] == "messages" and t.sampling["client"]["max_tokens"] == 16 for t in mine)

    check = check_run(run_dir)
    assert check.ok and check.digests_equal == check.steps == 1, (check.mismatches, check.missing)
    records = read_learner_records(run_dir / "learner")
    assert [r.policy_version for r in records] == [0, 1]
    assert (user / hf_checkpoint_dir(records[-1].checkpoint)).is_dir()  # the trained version, published as an HF directory
    assert records[-1].metrics["rollout/groups"] == 1.0 and records[-1].metrics["rollout/groups_skipped"] == 0.0
