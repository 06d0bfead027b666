"""verify-tokens against a model directory that is broken (NaN weights) or whose
vocabulary does not match the recorded token ids."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from agentlog.events import FileLog
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.tools.cli import main as cli_main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from agentlog.gateway.chat import HFChatTemplate
    from agentlog.learner.hf_model import HFCausalLM
    from agentlog.learner.hf_tiny import build_tiny_hf

    root = tmp_path_factory.mktemp("tiny")
    path = build_tiny_hf(root / "model")
    return root, path, HFCausalLM(path).eval(), HFChatTemplate.from_pretrained(str(path))


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["verify-tokens", *args])
    return rc, out.getvalue(), err.getvalue()


def _scored(model, prompt, output):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + output]))[0].float(), dim=-1)
    return [float(logp[len(prompt) - 1 + k, t]) for k, t in enumerate(output)]


def _log(tmp_path: Path, model, template, output=None) -> Path:
    messages = [{"role": "user", "content": "list files"}]
    prompt = template.encode_prompt(messages, [])
    output = output or template.tok.encode("ls -la", add_special_tokens=False)
    turn = TurnRecorded(turn_index=0, messages=messages, prompt_ids=prompt, output_ids=output,
                        output_log_probs=_scored(model, prompt, output), finish_reason="length",
                        sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    path = tmp_path / "log"
    with FileLog.open(path) as log:
        bodies = [SessionOpened(group_id="g", group_size=1, sample_index=0), SessionStarted(), turn, SessionFinished(reward=1.0)]
        log.append_batch([("s", i, b) for i, b in enumerate(bodies)])
    return path


def test_an_engine_that_scores_nan_fails_the_log_prob_check(tiny, tmp_path) -> None:
    from agentlog.learner.hf_model import HFCausalLM

    root, path, model, template = tiny
    log = _log(tmp_path, model, template)
    broken = HFCausalLM(path)
    with torch.no_grad():
        broken.model.lm_head.weight[0, 0] = float("nan")  # NaN logits: every log-prob NaN
    nan_dir = broken.save_pretrained(tmp_path / "nan-model")
    rc, out, err = _cli(str(log), "--model", str(nan_dir), "--json", "-q")
    report = json.loads(out)
    assert rc == 1 and not report["ok"], report
    assert report["first_mismatch"]["check"] == "log_prob" and report["first_mismatch"]["position"] == 0


def test_a_model_whose_vocabulary_is_smaller_than_the_recorded_ids_is_a_clear_error(tiny, tmp_path) -> None:
    from agentlog.learner.hf_tiny import build_tiny_hf

    root, path, model, template = tiny
    big_id = model.vocab_size - 1
    log = _log(tmp_path, model, template, output=[5, big_id, 7])
    small = build_tiny_hf(tmp_path / "small", vocab_size=300)  # another tokenizer: ids up to ~300
    rc, out, err = _cli(str(log), "--model", str(small), "--json", "-q")
    assert rc == 2, (rc, out, err)
    assert "session 's' turn 0" in err and "vocabulary" in err and "Traceback" not in err


def test_a_model_directory_whose_tokenizer_has_no_chat_template_still_checks_log_probs(tiny, tmp_path) -> None:
    """A base model's directory (a tokenizer without a chat template): no traceback; the
    log-probs are checked and the report says why retokenization was not."""
    import shutil

    root, path, model, template = tiny
    log = _log(tmp_path, model, template)
    base = Path(shutil.copytree(path, tmp_path / "base"))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in base.glob("chat_template*"):
        f.unlink()
    rc, out, err = _cli(str(log), "--model", str(base), "--json", "-q")
    assert rc == 0, (rc, err)
    report = json.loads(out)
    assert report["ok"] and report["tokens"] == len(report["turns"][0:1]) * report["turns"][0]["tokens"] > 0
    assert "chat template" in report["turns"][0]["retokenization"]


def _truncated_copy(path: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(path, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # a copy cut short
    return dst


def test_a_model_directory_with_truncated_weights_is_a_clear_error(tiny, tmp_path) -> None:
    root, path, model, template = tiny
    log = _log(tmp_path, model, template)
    bad = _truncated_copy(path, tmp_path / "cut")
    rc, out, err = _cli(str(log), "--model", str(bad), "-q")
    assert rc == 2 and str(bad) in err and "Traceback" not in err


def test_a_runs_hf_checkpoint_with_truncated_weights_is_a_policy_load_error(tiny, tmp_path) -> None:
    from agentlog.loop.config import LoopConfig
    from agentlog.loop.model_scorer import PolicyLoadError, load_policy

    root, path, model, template = tiny
    _truncated_copy(path, tmp_path / "run" / "checkpoints" / "policy-v00003")
    with pytest.raises(PolicyLoadError, match="policy version 3"):
        load_policy(tmp_path / "run", LoopConfig(hf_model="tiny-llama"), 3)


def test_a_servers_reload_of_truncated_weights_is_an_os_error_naming_the_file(tiny, tmp_path) -> None:
    """The reload path (read_hf_weights, a server reading the next version) had the same gap:
    safetensors' own error, which is not an OSError, escaped every handler that names the version."""
    from agentlog.learner.hf_model import HFCausalLM

    root, path, model, template = tiny
    bad = _truncated_copy(path, tmp_path / "cut-reload")
    with pytest.raises(OSError, match=r"cut-reload/model\.safetensors: its weights do not load"):
        HFCausalLM(path).read_hf_weights(bad)
