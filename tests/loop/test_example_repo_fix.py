"""End to end, the copyable example runs: the real
``agentlog train`` command, run on ``examples/repo_fix/config.toml`` from a
copy of that directory (the task module imported from the user's own
directory, no PYTHONPATH, no model hub), trains 2 RL steps of the repo-fix
task with the tiny HF Llama, the Python agent and the gateway. Each test
checks one acceptance point on that one run; the last one runs the README's
"Train your own agent" commands on it.

The random model earns reward 0 (it never writes a well-formed tool call, so
every session is one answered turn): the entropy bonus of the example's
``[learner]`` table is what moves the weights.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionOpened, TurnRecorded
from agentlog.events import read_log
from agentlog.loop.check import check_run
from agentlog.loop.config import LoopConfig
from agentlog.loop.publish import hf_checkpoint_dir
from agentlog.loop.learner_records import read_learner_records
from agentlog.reducers.pipeline import reduce_log

from custom_task_helpers import REPO, agentlog_exe, clean_env

pytestmark = pytest.mark.required

EXAMPLE = REPO / "examples" / "repo_fix"
#: What the README's "Train your own agent" section tells users to run from the example's directory.
TRAIN = "agentlog train --config config.toml --steps 2 --out runs/first"
TERMINAL = (SessionFinished, SessionAborted, SessionDropped)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(the user's directory, the finished command): ``TRAIN`` run from a copy of examples/repo_fix."""
    pytest.importorskip("transformers", reason="the example needs the hf extra: pip install -e '.[dev]'")
    user = tmp_path_factory.mktemp("user") / "repo_fix"
    shutil.copytree(EXAMPLE, user, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    env = {**clean_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = shlex.split(TRAIN)[1:] + ["--quiet", "--timeout", "240"]
    proc = subprocess.run([agentlog_exe(), *args], cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return user, proc


def _run_dir(example_run) -> Path:
    return example_run[0] / "runs" / "first"


def _envelopes(run_dir: Path) -> list:
    return list(full_turns(read_log(run_dir / "rollout", 0)))


def test_the_example_trained_two_steps_of_its_task_imported_from_the_users_directory(example_run):
    user, proc = example_run
    run_dir = _run_dir(example_run)
    cfg = LoopConfig.load(run_dir / "config.json")
    assert (cfg.task, cfg.task_modules, cfg.hf_model, cfg.agent.harness) == ("repo-fix", ["repo_fix_task"], "tiny-llama", "python-agent")
    assert str(user) in cfg.task_path  # found beside the config, not through PYTHONPATH or the repository
    assert [r.policy_version for r in read_learner_records(run_dir / "learner")] == [0, 1, 2]
    assert "stopped at version 2 by the step limit" in proc.stdout, proc.stdout
    # [agent] max_tokens (96) is below the task's max_new_tokens (256): the agent asks for it, the gateway allows it.
    turns = [e.body for e in _envelopes(run_dir) if isinstance(e.body, TurnRecorded)]
    assert turns and {(t.sampling["client"]["max_tokens"], t.sampling["max_new_tokens"]) for t in turns} == {(96, 96)}
    assert all(t.output_tokens.size <= 96 for t in turns)


def test_every_session_ends_in_exactly_one_terminal_state(example_run):
    envs = _envelopes(_run_dir(example_run))
    opened = [e.session_id for e in envs if isinstance(e.body, SessionOpened)]
    ended = [e.session_id for e in envs if isinstance(e.body, TERMINAL)]
    assert opened and len(set(opened)) == len(opened)
    assert sorted(ended) == sorted(opened), "every session opened ends exactly once"
    # Each session is a real gateway rollout: its sandbox set up, the agent's turns, the verifier's test command.
    finished = [e.body for e in envs if isinstance(e.body, SessionFinished)]
    assert finished and all(f.reward in (0.0, 1.0) and "agent" in f.metadata for f in finished)
    turned = {e.session_id for e in envs if isinstance(e.body, TurnRecorded)}
    assert {e.session_id for e in envs if isinstance(e.body, SessionFinished)} <= turned


def test_the_offline_reconstruction_equals_the_online_digests(example_run):
    user, proc = example_run
    run_dir = _run_dir(example_run)
    check = check_run(run_dir)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.digests_equal == check.steps == 2
    assert "vs the learner's online digests: EQUAL (2/2 steps equal" in proc.stdout, proc.stdout


def test_samples_carry_the_hf_tokenizers_ids_and_the_chat_templates_loss_mask(example_run):
    """Rebuilt from the log by the reducers, a sample is the tokenizer's own rendering of the
    session's messages (its chat template, the agent's bash tool, the generation prompt), then
    the generated ids; the loss mask is 1 on exactly the generated ids and 0 on the template's."""
    from transformers import AutoTokenizer

    from agentlog.gateway.python_agent import BASH_TOOL

    run_dir = _run_dir(example_run)
    tok = AutoTokenizer.from_pretrained(run_dir / "hf-model" / "tiny-llama", local_files_only=True)
    envs = _envelopes(run_dir)
    turns: dict[str, list[TurnRecorded]] = {}
    for e in envs:
        if isinstance(e.body, TurnRecorded):
            turns.setdefault(e.session_id, []).append(e.body)
    samples = reduce_log(envs, LoopConfig.load(run_dir / "config.json").reduce_config()).samples
    single = [s for s in samples if len(turns.get(s.session_id, ())) == 1]
    assert single, "no one-turn session to compare"
    for s in single:
        (turn,) = turns[s.session_id]
        prompt = tok.apply_chat_template(turn.messages, tools=[BASH_TOOL], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if not isinstance(prompt, list) else prompt)
        assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
        out = turn.output_tokens.tolist()
        assert s.token_ids.tolist() == prompt + out, s.session_id
        assert s.prompt_length == len(prompt) and s.response_length == len(out)
        full_mask = [0] * s.prompt_length + s.mask.tolist()
        assert full_mask == [0] * len(prompt) + [1] * len(out)
        assert max(out) < len(tok)
        if turn.finish_reason == "stop":
            # The stop token is generated and trained, as the template's {% generation %} block marks it.
            assert out[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    # A multi-turn session (a well-formed tool call, unlikely from a random model): tool results are
    # rendered by the template between turns and masked 0, so the trained tokens are the outputs.
    for s in samples:
        if s.session_id in turns and len(turns[s.session_id]) > 1:
            assert int(s.mask.sum()) <= sum(t.output_tokens.size for t in turns[s.session_id])


def test_new_hf_checkpoints_load_with_transformers_and_their_weights_moved(example_run):
    from transformers import AutoModelForCausalLM

    run_dir = _run_dir(example_run)
    records = read_learner_records(run_dir / "learner")
    newest = hf_checkpoint_dir(records[-1].checkpoint)
    if not newest.is_absolute():
        newest = example_run[0] / newest
    assert (newest / "config.json").is_file() and (newest / "model.safetensors").is_file()
    last = AutoModelForCausalLM.from_pretrained(newest, local_files_only=True).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "hf-model" / "tiny-llama", local_files_only=True).state_dict()
    assert last.keys() == initial.keys()
    moved = [k for k in initial if not torch.equal(initial[k], last[k])]
    assert moved, "the trained version's weights equal the initial model's"


def test_turns_after_the_reload_record_policy_version_1(example_run):
    """The worker reloaded version 1 from its HF directory; every turn recorded after that reload
    records version >= 1, every turn before it version 0, and a session's turns all record the
    version the session opened with."""
    run_dir = _run_dir(example_run)
    worker_log = [json.loads(line) for line in (run_dir / "logs" / "worker-w0.jsonl").read_text().splitlines()]
    (reload_1,) = [e for e in worker_log if e["event"] == "gateway.weights_reloaded" and e["policy_version"] == 1]
    assert Path(reload_1["path"]).name == "policy-v00001"  # the published HF directory
    reloaded_ns = int(datetime.fromisoformat(reload_1["timestamp"].replace("Z", "+00:00")).timestamp() * 1e9)
    envs = _envelopes(run_dir)
    opened = {e.session_id: e.body.policy_version for e in envs if isinstance(e.body, SessionOpened)}
    turns = [e for e in envs if isinstance(e.body, TurnRecorded)]
    assert all(e.body.policy_version == opened[e.session_id] for e in turns)
    # max_lag = 0: batch b is played by version b, loaded before it started.
    assert {(e.session_id[:6], e.body.policy_version) for e in turns} == {("b00000", 0), ("b00001", 1)}
    before = {e.body.policy_version for e in turns if e.ts_ns < reloaded_ns}
    after = {e.body.policy_version for e in turns if e.ts_ns > reloaded_ns}
    assert before == {0} and after and min(after) >= 1 and 1 in after, (before, after)


def test_the_readmes_train_your_own_agent_commands_run_as_written(example_run):
    """README "Train your own agent": the training command is the one this module ran, and the
    inspection commands that follow it run on that run folder as written."""
    user, _ = example_run
    section = (REPO / "README.md").read_text().split("### Train your own agent", 1)[1].split("\n### ", 1)[0]
    lines = [line[2:] for block in re.findall(r"```console\n(.*?)```", section, re.S) for line in block.splitlines() if line.startswith("$ ")]
    assert lines[:2] == ["cd examples/repo_fix", TRAIN], lines
    assert (user / "runs" / "first" / "report.html").is_file()
    inspect = lines[2:]
    assert {shlex.split(c)[1] for c in inspect} >= {"show", "reconstruct"}, inspect
    for command in inspect:
        args = shlex.split(command)
        assert args[0] == "agentlog", command
        proc = subprocess.run([agentlog_exe(), *args[1:]], cwd=user, env=clean_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"$ {command}\n{proc.stderr[-3000:]}{proc.stdout[-2000:]}"
    # The [inference] table it shows is a valid one.
    (table,) = re.findall(r"```toml\n(.*?)```", section, re.S)
    cfg = LoopConfig.from_dict(tomllib.loads(table))
    assert cfg.inference.backend in ("sglang", "vllm") and cfg.inference.url.startswith("http://")


def test_a_tool_calling_session_in_the_runs_chat_template_masks_the_tool_result_0(example_run):
    """The random model never writes a well-formed tool call, so the run's sessions are one turn.
    This is the session a model that does would make, in the run's own chat template (the gateway's
    HFChatTemplate and the python agent's bash tool): turn 0 generates a Hermes tool call, turn 1's
    prompt adds the tool's result. The rebuilt sample is turn 1's prompt then its output, and the
    loss mask is 1 on exactly the two outputs, 0 on the template's tool-response tokens between them."""
    from transformers import AutoTokenizer

    from agentlog.events.log.api import MemoryLog
    from agentlog.events.schema.types import SessionStarted
    from agentlog.gateway import HFChatTemplate, HermesToolParser, ToolSpec
    from agentlog.gateway.chat import assistant_message
    from agentlog.gateway.python_agent import BASH_TOOL
    from agentlog.reducers.config import ReduceConfig

    tok = AutoTokenizer.from_pretrained(_run_dir(example_run) / "hf-model" / "tiny-llama", local_files_only=True)
    tpl = HFChatTemplate(tok)
    tools = [ToolSpec(BASH_TOOL["function"]["name"], BASH_TOOL["function"]["description"], BASH_TOOL["function"]["parameters"])]
    m1 = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "total([1, 2, 3]) returns 3"}]
    call = assistant_message("", [{"id": "c1", "name": "bash", "arguments": {"command": "python3 test_stats.py"}}])
    m2 = m1 + [call, {"role": "tool", "content": "exit code 1\nAssertionError", "tool_call_id": "c1"}]
    p1, p2 = tpl.encode_prompt(m1, tools), tpl.encode_prompt(m2, tools)
    assert p2[: len(p1)] == p1
    # What turn 0 generated: the assistant's call up to its stop token, as turn 1's prompt renders it.
    out0 = p2[len(p1): p2.index(tok.eos_token_id, len(p1)) + 1]
    assert not HermesToolParser().parse(tpl.decode(out0), tools).ill_formed
    out1 = tok.encode("done") + [tok.eos_token_id]

    def turn(i, messages, prompt, out, response):
        return TurnRecorded(turn_index=i, messages=messages, prompt_ids=np.asarray(prompt, "<i4").tobytes(), response_message=response,
                            output_ids=np.asarray(out, "<i4").tobytes(), output_log_probs=np.full(len(out), -1.0, "<f4").tobytes(),
                            sampling={"temperature": 1.0})

    log = MemoryLog(clock=lambda: 0)
    log.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1)), ("s", 1, SessionStarted()),
                      ("s", 2, turn(0, m1, p1, out0, call)), ("s", 3, turn(1, m2, p2, out1, assistant_message("done", []))),
                      ("s", 4, SessionFinished(reward=1.0))])
    (sample,) = reduce_log(log, ReduceConfig(min_valid=1)).samples
    assert sample.token_ids.tolist() == p2 + out1 and sample.prompt_length == len(p1)
    tool_part = p2[len(p1) + len(out0):]
    assert sample.mask.tolist() == [1] * len(out0) + [0] * len(tool_part) + [1] * len(out1)
    assert "<tool_response>\nexit code 1\nAssertionError\n</tool_response>" in tok.decode(tool_part)
