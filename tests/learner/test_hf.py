"""HFCausalLM in the learner: packing, zero contribution, temperature, checkpointing, training from a log."""

from __future__ import annotations

import copy

import msgspec
import numpy as np
import pytest
import torch
from hf_helpers import tiny_hf_dir, tiny_qwen2_dir  # noqa: F401  (fixtures)
from learner_helpers import make_sample, random_samples
from torch.testing import assert_close

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.learner.batching import make_batches
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import HFCausalLM, token_log_probs
from agentlog.reducers.pipeline import reduce_log

pytestmark = pytest.mark.required


@pytest.fixture(scope="module")
def hf(tiny_hf_dir):  # noqa: F811
    torch.manual_seed(0)
    return HFCausalLM(tiny_hf_dir)


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    lp, _ = token_log_probs(model, batch)
    (lp * batch.loss_mask).sum().backward()
    return lp.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_packed_and_padded_batches_agree(which, tiny_hf_dir, tiny_qwen2_dir):  # noqa: F811
    """Same per-token log-probs and the same gradients, packed into 2 rows or padded into 6."""
    model = HFCausalLM(tiny_hf_dir if which == "llama" else tiny_qwen2_dir)
    samples = random_samples(np.random.default_rng(3), 6, model.vocab_size, max_prompt=20, max_response=15)
    (pad,) = make_batches(samples, packing=False)
    (pack,) = make_batches(samples, packing=True, max_tokens_per_row=64)
    assert pack.input_ids.shape[0] < pad.input_ids.shape[0]  # really packed
    lp_pad, g_pad = _grads(model, pad)
    lp_pack, g_pack = _grads(model, pack)
    for i in range(len(samples)):
        n = samples[i].response_length
        assert_close(lp_pad[pad.sample_indices.index(i), :n], lp_pack[pack.sample_indices.index(i), :n],
                     rtol=1e-5, atol=1e-5)
    assert g_pad.keys() == g_pack.keys() and g_pad
    for name in g_pad:
        assert_close(g_pad[name], g_pack[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_attention_never_crosses_samples(hf):
    """Rewriting one packed sample leaves the log-probs of its row-mates bit-identical."""
    a = make_sample("g", "a", [5, 6, 7, 8], [9, 10, 11])
    b = make_sample("g", "b", [12, 13], [14, 15, 16, 17])
    a2 = make_sample("g", "a", [40, 41, 42, 43], [44, 45, 46])
    (p1,) = make_batches([a, b], packing=True, max_tokens_per_row=16)
    (p2,) = make_batches([a2, b], packing=True, max_tokens_per_row=16)
    assert p1.input_ids.shape[0] == 1  # one row holds both
    with torch.no_grad():
        lp1, lp2 = token_log_probs(hf, p1)[0], token_log_probs(hf, p2)[0]
    rb = p1.sample_indices.index(1)
    assert torch.equal(lp1[rb], lp2[rb])
    ra = p1.sample_indices.index(0)
    assert not torch.equal(lp1[ra], lp2[ra])


def test_aborted_rows_contribute_exactly_zero(hf, placeholder):
    """Learner.step with aborted placeholders == without them: every parameter, bit for bit."""
    rng = np.random.default_rng(7)
    groups = [random_samples(rng, 3, hf.vocab_size, group=f"g{i}", max_prompt=10, max_response=8) for i in range(2)]
    with_aborts = [list(groups[0]) + [placeholder("g0", "a0")], [placeholder("g1", "a1")] + list(groups[1])]
    cfg = LearnerConfig(kl_coef=0.05, tis_cap=2.0, entropy_coef=0.01, num_steps_per_rollout=2, weight_decay=0.01)
    a, b = Learner(copy.deepcopy(hf), cfg), Learner(copy.deepcopy(hf), cfg)
    ma = a.step([s for g in groups for s in g])
    mb = b.step([s for g in with_aborts for s in g])
    assert mb["rollout/removed"] == 2 and ma["rollout/removed"] == 0
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert a.policy_version == b.policy_version == 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_are_taken_at_the_turns_sampling_temperature(hf, temperature):
    """What HFCausalLM.sample recorded at temperature T is what the learner recomputes for a sample carrying T."""
    prompts = [[5, 6, 7, 8, 9, 10], [11], [12, 13, 14]]
    gen = hf.sample(prompts, 8, temperature=temperature, generator=torch.Generator().manual_seed(0))
    samples = [
        msgspec.structs.replace(
            make_sample("g", f"s{i}", p, t.tolist(), log_probs=lp.tolist()), temperature=temperature)
        for i, (p, t, lp) in enumerate(zip(prompts, gen.tokens, gen.log_probs))
    ]
    for packing in (False, True):
        (b,) = make_batches(samples, packing=packing)
        with torch.no_grad():
            lp, _ = token_log_probs(hf, b)
        for row, i in enumerate(b.sample_indices):
            n = len(gen.tokens[i])
            assert_close(lp[row, :n], torch.from_numpy(gen.log_probs[i]), rtol=1e-4, atol=1e-4)
    if temperature != 1.0:  # and the temperature matters: at 1.0 they differ
        (b,) = make_batches(samples, packing=False)
        with torch.no_grad():
            assert not torch.allclose(token_log_probs(hf, b, temperature=1.0)[0] * b.loss_mask, b.rollout_log_probs,
                                      atol=1e-3)


def test_sampling_stops_at_stop_ids_and_reports_why(hf):
    stops = list(range(0, hf.vocab_size, 2))
    gen = hf.sample([[1, 2, 3]] * 8, max_new_tokens=6, stop_ids=stops, generator=torch.Generator().manual_seed(2))
    for toks, lps, why in zip(gen.tokens, gen.log_probs, gen.finish_reasons):
        assert len(toks) == len(lps) >= 1 and np.all(lps <= 0)
        evens = [t for t in toks.tolist() if t % 2 == 0]
        if why == "stop":
            assert evens == [toks[-1]]
        else:
            assert why == "length" and len(toks) == 6 and not evens
    assert "stop" in gen.finish_reasons


def test_gradient_checkpointing_gives_the_same_gradients(tiny_hf_dir):  # noqa: F811
    samples = random_samples(np.random.default_rng(5), 4, 64, max_prompt=12, max_response=10)
    (batch,) = make_batches(samples, packing=True)
    plain, ckpt = HFCausalLM(tiny_hf_dir), HFCausalLM(tiny_hf_dir, gradient_checkpointing=True)
    assert ckpt.checkpointing and not plain.checkpointing
    plain.train(), ckpt.train()
    lp0, g0 = _grads(plain, batch)
    lp1, g1 = _grads(ckpt, batch)
    assert_close(lp0, lp1, rtol=0, atol=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory.*nothing is downloaded"):
        HFCausalLM(str(tmp_path / "nope"))


def _session_records(sid, index, tok, model, reward):
    """A two-turn session whose ids come from the HF tokenizer's chat template and the HF model."""
    from agentlog.gateway import HFChatTemplate

    tpl = HFChatTemplate(tok)
    m1 = [{"role": "user", "content": f"Fix the bug {index}"}]
    p1 = tpl.encode_prompt(m1, [])
    g1 = model.sample([p1], 6, temperature=0.8, stop_ids=tpl.stop_ids, generator=torch.Generator().manual_seed(index))
    r1 = {"role": "assistant", "content": tpl.decode(g1.tokens[0].tolist())}
    m2 = m1 + [r1, {"role": "user", "content": "run the tests"}]
    p2 = tpl.encode_prompt(m2, [])
    g2 = model.sample([p2], 6, temperature=0.8, stop_ids=tpl.stop_ids, generator=torch.Generator().manual_seed(99 + index))
    turn = dict(finish_reason="length", sampling={"temperature": 0.8})
    return [
        (sid, 0, SessionOpened(group_id="g", group_size=3, sample_index=index)),
        (sid, 1, SessionStarted()),
        (sid, 2, TurnRecorded(turn_index=0, messages=m1, prompt_ids=np.asarray(p1, "<i4").tobytes(),
                              output_ids=g1.tokens[0].astype("<i4").tobytes(),
                              output_log_probs=g1.log_probs[0].astype("<f4").tobytes(), response_message=r1, **turn)),
        (sid, 3, TurnRecorded(turn_index=1, messages=m2, prompt_ids=np.asarray(p2, "<i4").tobytes(),
                              output_ids=g2.tokens[0].astype("<i4").tobytes(),
                              output_log_probs=g2.log_probs[0].astype("<f4").tobytes(),
                              response_message={"role": "assistant", "content": tpl.decode(g2.tokens[0].tolist())},
                              **turn)),
        (sid, 4, SessionFinished(reward=reward)),
    ]


def test_learner_trains_the_hf_model_from_a_log_of_hf_tokenized_sessions(hf, tmp_path):
    """Sessions recorded with the HF tokenizer's ids -> reducers -> Learner.step; the published
    HF directory loads with from_pretrained and holds the new weights."""
    from transformers import AutoModelForCausalLM

    model = copy.deepcopy(hf)
    log = MemoryLog(clock=lambda: 0)
    for i, reward in enumerate([1.0, 0.0, 0.5]):
        log.append_batch(_session_records(f"s{i}", i, hf.tokenizer, model, reward))
    result = reduce_log(log)
    (group,) = result.groups
    rows = [s for s in group.samples if not s.remove_sample]
    assert rows and all(s.temperature == pytest.approx(0.8) for s in rows)
    assert all(int(t) < len(hf.tokenizer) for s in rows for t in s.token_ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    learner = Learner(model, LearnerConfig(lr=1e-2, warmup_steps=0))
    metrics = learner.step(result.groups)
    assert learner.policy_version == 1 and metrics["learner/skipped"] == 0.0
    # The learner recomputed the rollout's log-probs at the recorded temperature 0.8.
    assert metrics["stats/rollout_logprob_abs_diff"] < 1e-4
    out = model.save_pretrained(tmp_path / "policy-v00001")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    changed = [k for k, v in loaded.state_dict().items() if not torch.equal(v, before["model." + k])]
    assert changed
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()["model." + k]), k


def test_loading_and_saving_print_no_transformers_progress_bars(tiny_hf_dir, tmp_path, capfd):  # noqa: F811
    """The learner and each worker load and save at every version: no "Loading weights" /
    "Writing model shards" bars in their logs, even when something turned the bars on."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    capfd.readouterr()
    m = HFCausalLM(str(tiny_hf_dir))
    hf_logging.enable_progress_bar()
    m.save_pretrained(tmp_path / "saved")
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err, err[-500:]
    assert not hf_logging.is_progress_bar_enabled()
    assert (tmp_path / "saved" / "model.safetensors").is_file()
