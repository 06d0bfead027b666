"""`agentlog verify-tokens`: recorded turns re-fed to an engine (in process, and servers that
follow SGLang's and vLLM's public routes, backed by the same real model): a clean run passes,
the negative control is caught at its exact position, retokenization drift is named by token
and message, and greedy turns are reproduced."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import agentlog
from engine_servers import EngineServer

from agentlog.events import FileLog, read_log
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.loop.model_scorer import load_policy
from agentlog.loop.run_folder import Run
from agentlog.loop.token_check import collect_turns
from agentlog.tools.cli import main as cli_main


def _demo(short_demo_run) -> Path:
    cwd, _ = short_demo_run
    return cwd / "runs" / "demo"


def _cli(*args: str) -> tuple[int, str, str]:
    """``agentlog verify-tokens ARGS`` in this process (a subprocess per call would spend most
    of the test importing torch): exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["verify-tokens", *args])
    return rc, out.getvalue(), err.getvalue()


def _verify(*args: str) -> tuple[int, dict]:
    rc, out, err = _cli(*args, "--json", "-q")
    assert rc in (0, 1), err
    return rc, json.loads(out)


def test_in_process_the_runs_own_checkpoints_reproduce_every_recorded_log_prob(short_demo_run) -> None:
    rc, report = _verify(str(_demo(short_demo_run)))
    assert rc == 0 and report["ok"]
    assert report["turns_checked"] == len(report["turns"]) > 20 and report["turns_skipped"] == 0
    assert len({t["policy_version"] for t in report["turns"]}) >= 2  # each turn at its own version
    assert report["tokens"] == sum(t["tokens"] for t in report["turns"])
    assert report["lp_max_abs_diff"] <= report["tolerance"]
    assert report["first_mismatch"] is None


@pytest.mark.parametrize("position", [0, 37, "last"])
def test_in_process_negative_control_is_caught_at_its_exact_position(short_demo_run, position) -> None:
    run = str(_demo(short_demo_run))
    total = _verify(run)[1]["tokens"]
    k = total - 1 if position == "last" else position
    rc, report = _verify(run, "--corrupt", str(k))
    assert rc == 0 and report["corrupt"]["caught"], report["first_mismatch"]
    assert report["first_mismatch"]["global_position"] == k and report["first_mismatch"]["check"] == "log_prob"
    if position == 37:  # the command as a user runs it, in a fresh interpreter, once
        res = agentlog("verify-tokens", run, "--corrupt", str(k), "-q", timeout=180)
        text = res.stdout
        assert res.returncode == 0 and f"negative control: output token {k} " in text and "caught there" in text
        assert text.rstrip().endswith("OK")
    rc, _, err = _cli(run, "--corrupt", str(total), "-q")
    assert rc == 2 and f"--corrupt {total}: the checked turns hold {total} output tokens" in err


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_servers_on_their_public_routes_pass_clean_and_catch_the_negative_control(short_demo_run, engine) -> None:
    run_dir = _demo(short_demo_run)
    newest = max(t.version for t in collect_turns(read_log(run_dir / "rollout")))
    with Run.open(run_dir) as run:
        model = load_policy(run.dir, run.config, newest)
    assert model is not None
    with EngineServer(model) as server:
        args = (str(run_dir), "--server", server.url, "--engine", engine)
        rc, report = _verify(*args)
        assert rc == 0 and report["ok"], report["first_mismatch"]
        # A server holds one version: only the newest version's turns are checked.
        assert report["turns_checked"] > 0 and {t["policy_version"] for t in report["turns"]} == {newest}
        assert report["lp_max_abs_diff"] <= 1e-4
        rc, report = _verify(*args, "--corrupt", "3")
        assert rc == 0 and report["corrupt"]["caught"] and report["first_mismatch"]["global_position"] == 3
        routes = {route for route, _ in server.requests}
        assert routes == ({"/generate"} if engine == "sglang" else {"/v1/completions"})
    # Other weights than the recorded version's: log-probs past the tolerance, exit 1.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    with EngineServer(model) as server:
        rc, report = _verify(str(run_dir), "--server", server.url, "--engine", engine)
        assert rc == 1 and report["first_mismatch"]["check"] == "log_prob"


def test_an_unreachable_server_and_a_bare_log_without_an_engine_are_usage_errors(short_demo_run, tmp_path) -> None:
    import shutil

    run_dir = _demo(short_demo_run)
    rc, _, err = _cli(str(run_dir), "--server", "http://127.0.0.1:9", "-q")
    assert rc == 2 and "verify-tokens: backend sglang" in err
    bare = shutil.copytree(run_dir / "rollout", tmp_path / "bare")
    rc, _, err = _cli(str(bare), "-q")
    assert rc == 2 and "is not a run folder, so it has no checkpoints" in err


# ---------------------------------------------------------------- constructed logs on the tiny HF model


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from agentlog.gateway.chat import HFChatTemplate
    from agentlog.learner.hf_model import HFCausalLM
    from agentlog.learner.hf_tiny import build_tiny_hf

    path = build_tiny_hf(tmp_path_factory.mktemp("tiny") / "model")
    return path, HFCausalLM(path).eval(), HFChatTemplate.from_pretrained(str(path))


def _turn(index, messages, prompt, output, log_probs, temperature=1.0):
    return TurnRecorded(turn_index=index, messages=messages, prompt_ids=prompt, output_ids=output, output_log_probs=log_probs,
                        finish_reason="length", sampling={"temperature": temperature, "top_p": 1.0, "top_k": -1})


def _scored(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float() / temperature, dim=-1)
    return [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(output)]


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def _write(path: Path, sessions: dict[str, list[TurnRecorded]]) -> Path:
    with FileLog.open(path) as log:
        for sid, turns in sessions.items():
            bodies = [SessionOpened(group_id="g", group_size=1, sample_index=0), SessionStarted(), *turns, SessionFinished(reward=1.0)]
            log.append_batch([(sid, i, b) for i, b in enumerate(bodies)])
    return path


def test_retokenization_drift_names_the_first_differing_token_and_its_message(tiny_hf, tmp_path) -> None:
    """Session 'clean' recorded the template's own ids; session 'rewritten' is an agent that
    rewrote its history: the recorded prompt is the template of what it was first sent
    (the user message said 'list files'), its messages now say otherwise."""
    path, model, template = tiny_hf
    sent = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "list files"}]
    rewritten = [sent[0], {"role": "user", "content": "delete files"}]
    prompt = template.encode_prompt(sent, [])
    output = template.tok.encode("ls -la", add_special_tokens=False)
    lps = _scored(model, prompt, output)
    log = _write(tmp_path / "log", {"clean": [_turn(0, sent, prompt, output, lps)],
                                    "rewritten": [_turn(0, rewritten, prompt, output, lps)]})
    want_at = next(i for i, (a, b) in enumerate(zip(template.encode_prompt(rewritten, []), prompt)) if a != b)
    for engine_args in (("--model", str(path)), "vllm"):
        if engine_args == "vllm":
            with EngineServer(model, template) as server:
                rc, report = _verify(str(log), "--server", server.url, "--engine", "vllm")
        else:
            rc, report = _verify(str(log), *engine_args)
        assert rc == 1
        by_session = {t["session_id"]: t for t in report["turns"]}
        assert by_session["clean"]["retokenization"] == "ok"
        assert by_session["rewritten"]["retokenization"] == "mismatch"
        assert by_session["rewritten"]["retok_first_diff"] == want_at and by_session["rewritten"]["retok_message"] == 1
        assert report["first_mismatch"] == {"session": "rewritten", "turn": 0, "lsn": by_session["rewritten"]["lsn"],
                                            "check": "retokenization", "position": want_at, "message": 1, "global_position": -1}
        assert report["lp_max_abs_diff"] < 1e-4 and report["retok_checked"] == 2 and report["retok_mismatched"] == 1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_greedy_turns_are_reproduced_and_a_changed_one_is_named(tiny_hf, tmp_path, engine) -> None:
    path, model, template = tiny_hf
    prompt = template.encode_prompt([{"role": "user", "content": "run the tests"}], [])
    output = _greedy(model, prompt, 6)
    changed = output[:4] + [(output[4] + 1) % 100] + output[5:]
    log = _write(tmp_path / "log", {
        "greedy": [_turn(0, [], prompt, output, _scored(model, prompt, output), temperature=0.0)],
        "edited": [_turn(0, [], prompt, changed, _scored(model, prompt, changed), temperature=0.0)],
    })
    with EngineServer(model, template) as server:
        rc, report = _verify(str(log), "--server", server.url, "--engine", engine)
    by_session = {t["session_id"]: t for t in report["turns"]}
    assert by_session["greedy"]["reproduction"] == "ok"
    assert by_session["edited"]["reproduction"] == "mismatch" and by_session["edited"]["repro_first_diff"] == 4
    assert rc == 1 and report["greedy_checked"] == 2 and report["greedy_mismatched"] == 1
    assert report["first_mismatch"]["check"] == "reproduction" and report["first_mismatch"]["session"] == "edited"
    # In process, the teacher-forced arg-max says the same.
    rc, report = _verify(str(log), "--model", str(path))
    assert {t["session_id"]: t["reproduction"] for t in report["turns"]} == {"greedy": "ok", "edited": "mismatch"}
