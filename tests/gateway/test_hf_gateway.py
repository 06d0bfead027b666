"""The gateway serving a Hugging Face model: its chat template, `serve --model`, weight reloads."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from gateway_helpers import oa_client, open_running, rig, run, turns_of
from hf_helpers import tiny_hf_dir  # noqa: F401  (fixture)

from agentlog.events import FileLog
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import TurnRecorded
from agentlog.gateway import BackendError, HermesToolParser, HFChatTemplate, ToolSpec, TorchBackend
from agentlog.gateway.chat import assistant_message

pytestmark = pytest.mark.required

TOOLS = [ToolSpec("bash", "run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})]


@pytest.fixture(scope="module")
def template(tiny_hf_dir):  # noqa: F811
    return HFChatTemplate.from_pretrained(str(tiny_hf_dir))


def test_tool_calls_and_tool_results_render_through_the_tokenizers_template(template):
    """A canonical conversation with a call and its result renders with the model's own template, and
    the assistant's call renders exactly as the Hermes parser reads it back."""
    call = assistant_message("I will look.", [{"id": "c1", "name": "bash", "arguments": {"command": "ls -la"}}])
    msgs = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix the bug"}, call,
            {"role": "tool", "content": "calc.py", "tool_call_id": "c1"}]
    ids = template.encode_prompt(msgs, TOOLS)
    text = template.tok.decode(ids)
    hermes = HermesToolParser()
    rendered_call = hermes.render("bash", {"command": "ls -la"})
    assert "I will look.\n" + rendered_call + "<|im_end|>" in text
    assert "<tool_response>\ncalc.py\n</tool_response>" in text
    assert '"name": "bash"' in text.split("</tools>")[0]  # the declared tool is in the system block
    assert text.endswith("<|im_start|>assistant\n")  # generation prompt
    # What the model would generate for that turn decodes and parses back to the same call.
    generated = template.tok.encode("I will look.\n" + rendered_call) + list(template.stop_ids)
    parsed = hermes.parse(template.decode(generated), TOOLS)
    assert not parsed.ill_formed and parsed.content == "I will look."
    assert parsed.tool_calls == [{"name": "bash", "arguments": {"command": "ls -la"}}]


def test_chat_template_marks_the_assistants_tokens_for_the_loss_mask(template):
    """``{% generation %}``: return_assistant_tokens_mask covers exactly the assistant's turns."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "done"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    out = template.tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    assert template.tok.decode([i for i, m in zip(ids, mask) if m]) == "done<|im_end|>ok<|im_end|>"


def _serve(logdir, *extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentlog.tools.cli", "serve", "--log", str(logdir), "--port", "0",
         "--admin-token", "tok", "--max-tokens", "8", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on " in line:
            return proc, line.split("listening on ")[1].split()[0], lines
    proc.wait(10)
    raise AssertionError("".join(lines))


def test_serve_model_dir_answers_the_openai_client_and_records_the_hf_ids(tiny_hf_dir, template, tmp_path):  # noqa: F811
    """`agentlog serve --model DIR`: the official openai client talks to the tiny HF model; the log holds the
    prompt as the model's chat template tokenised it and output ids of its vocabulary."""
    import openai

    proc, url, lines = _serve(tmp_path / "log", "--model", str(tiny_hf_dir))
    try:
        admin = openai.OpenAI(base_url=url, api_key="x", default_headers={"X-Admin-Token": "tok"})
        opened = admin.post("/admin/sessions", cast_to=object, body={"session_id": "s1", "group_id": "g", "group_size": 1})
        client = openai.OpenAI(base_url=url + "/v1", api_key=opened["api_key"], max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Fix the bug"}]
        tools = [{"type": "function", "function": t.to_dict()} for t in TOOLS]
        out = client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=8, temperature=0.9)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert 1 <= out.usage.completion_tokens <= 8
        admin.post("/admin/sessions/s1/finish", cast_to=object, body={"reward": 0.0})
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0, "".join(lines) + proc.stdout.read()
    with FileLog.open(tmp_path / "log") as log:
        (turn,) = [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]
    assert turn.prompt_tokens.tolist() == template.encode_prompt(messages, TOOLS)
    assert turn.output_tokens.size == out.usage.completion_tokens
    assert int(turn.output_tokens.max()) < len(template.tok)
    assert turn.sampling["temperature"] == pytest.approx(0.9)


def test_torch_backend_reloads_a_published_hf_directory(tiny_hf_dir, tmp_path):  # noqa: F811
    """reload_weights(DIR): the served weights become the directory's, and later turns record its version;
    a directory that does not fit is refused and changes nothing."""
    from agentlog.learner.learner import save_weights
    from agentlog.learner.model import HFCausalLM

    model = HFCausalLM(tiny_hf_dir)
    newer = HFCausalLM(tiny_hf_dir)
    with torch.no_grad():
        for p in newer.parameters():
            p.mul_(0.5)
    published = newer.save_pretrained(tmp_path / "policy-v00002")
    bad = tmp_path / "bad"
    shutil.copytree(published, bad)
    (bad / "model.safetensors").unlink()

    async def body():
        backend = TorchBackend(model)
        async with rig(backend, config=None) as (gw, engine, log):
            from agentlog.gateway import HFChatTemplate as T

            gw.template = T(model.tokenizer)
            await open_running(engine, "s")
            c = oa_client(gw, "s")
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            await backend.reload_weights(published, 2)
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
                await backend.reload_weights(bad, 3)
            with pytest.raises(BackendError, match="cannot read it as a weights file"):
                await backend.reload_weights(tmp_path / "missing.pt", 3)
            assert backend.policy_version == 2
            t0, t1 = turns_of(log, "s")
            assert (t0.policy_version, t1.policy_version) == (0, 2)
            # A learner weights file (torch.save, "model" entry) reloads too.
            await backend.reload_weights(save_weights(newer, tmp_path / "w.pt"), 4)
            assert backend.policy_version == 4

    run(body())
    for (name, a), b in zip(model.named_parameters(), newer.parameters()):
        assert torch.equal(a, b), name


def test_serve_checkpoint_accepts_the_learners_checkpoint_format(tmp_path):
    """The known gap: `serve --checkpoint` took only a bare state_dict. A learner checkpoint
    (policy-vNNNNN.pt) now serves, with its recorded GPT shape (head count included)."""
    from agentlog.gateway import ByteChatTemplate
    from agentlog.learner.config import LearnerConfig
    from agentlog.learner.learner import Learner
    from agentlog.learner.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=ByteChatTemplate.VOCAB_SIZE, max_seq_len=512, d_model=32, n_layer=1, n_head=8))
    ckpt = Learner(gpt, LearnerConfig()).save_checkpoint(tmp_path / "checkpoints" / "policy-v00000.pt")
    proc, url, lines = _serve(tmp_path / "log", "--checkpoint", str(ckpt))
    try:
        import urllib.request

        req = urllib.request.Request(url + "/admin/sessions", data=json.dumps({"session_id": "a"}).encode(),
                                     headers={"X-Admin-Token": "tok", "Content-Type": "application/json"})
        key = json.loads(urllib.request.urlopen(req, timeout=30).read())["api_key"]
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0, "".join(lines)
    with FileLog.open(tmp_path / "log") as log:
        (turn,) = [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]
    # The served model is the checkpoint's: its log-probs are what the checkpointed GPT gives.
    prompt, output = turn.prompt_tokens.tolist(), turn.output_tokens.tolist()
    with torch.no_grad():
        logits = gpt(torch.tensor([prompt + output]))[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)
    np.testing.assert_allclose(turn.log_probs, want.numpy(), atol=1e-4)
