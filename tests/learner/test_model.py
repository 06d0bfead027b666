"""The built-in GPT: the (ids -> logits) interface, batched KV-cache sampling, tied embeddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_helpers import make_sample
from torch.testing import assert_close

from agentlog.learner.batching import make_batches
from agentlog.learner.model import GPT, GPTConfig, HFCausalLM, token_log_probs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return GPT(vocab_size=20, max_seq_len=48, n_layer=2, d_model=32, n_head=4)


def test_forward_maps_ids_to_logits(model):
    ids = torch.randint(0, 20, (3, 11))
    assert model(ids).shape == (3, 11, 20)


def test_embeddings_are_tied_by_default_and_can_be_untied():
    tied = GPT(vocab_size=10)
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = GPT(GPTConfig(vocab_size=10, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 10 * 64


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_a_full_forward(model, temperature):
    """KV-cache decoding with left-padded prompts of different lengths agrees with recomputation."""
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    gen = model.sample(prompts, max_new_tokens=8, temperature=temperature,
                       generator=torch.Generator().manual_seed(0))
    samples = [make_sample("g", f"s{i}", p, t.tolist()) for i, (p, t) in enumerate(zip(prompts, gen.tokens))]
    (b,) = make_batches(samples, packing=False)
    lp, _ = token_log_probs(model, b, temperature=temperature)
    for row, i in enumerate(b.sample_indices):
        n = len(gen.tokens[i])
        assert gen.log_probs[i].dtype == np.float32 and gen.tokens[i].dtype == np.int32
        assert_close(lp[row, :n], torch.from_numpy(gen.log_probs[i]), rtol=1e-4, atol=1e-4)


def test_batched_sampling_is_the_same_as_one_prompt_at_a_time(model):
    """Left padding is invisible: a prompt's greedy-ish continuation doesn't depend on its batch-mates."""
    prompts = [[3, 4, 5, 6], [9]]
    batched = model.sample(prompts, 6, temperature=0.01, generator=torch.Generator().manual_seed(0))
    for i, p in enumerate(prompts):
        alone = model.sample([p], 6, temperature=0.01, generator=torch.Generator().manual_seed(0))
        assert batched.tokens[i].tolist() == alone.tokens[0].tolist()


def test_sampling_stops_at_stop_ids_and_reports_why(model):
    gen = model.sample([[1]] * 16, max_new_tokens=12, stop_ids=list(range(0, 20, 2)),
                       generator=torch.Generator().manual_seed(2))
    for toks, lps, why in zip(gen.tokens, gen.log_probs, gen.finish_reasons):
        assert len(toks) == len(lps) >= 1
        evens = [t for t in toks.tolist() if t % 2 == 0]
        if why == "stop":
            assert evens == [toks[-1]]  # stop token included, nothing after it
        else:
            assert why == "length" and len(toks) == 12 and not evens
    assert "stop" in gen.finish_reasons


def test_sampling_is_reproducible_with_a_generator(model):
    a = model.sample([[1, 2]] * 4, 5, generator=torch.Generator().manual_seed(9))
    b = model.sample([[1, 2]] * 4, 5, generator=torch.Generator().manual_seed(9))
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]


def test_sampling_rejects_bad_requests(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        model.sample([[1] * 40], max_new_tokens=9)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        model.sample([[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside"):
        model.sample([[25]], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        model.sample([[1]], max_new_tokens=2, temperature=0.0)


def test_sampling_keeps_the_training_mode(model):
    model.train()
    model.sample([[1]], 2)
    assert model.training


def test_any_module_with_the_interface_can_be_trained_padded():
    """A plain nn.Module mapping (B, T) -> (B, T, V) works with padded batches (no extra kwargs)."""
    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(10, 10)

        def forward(self, ids):
            return self.table(ids)

    (b,) = make_batches([make_sample("g", "s", [1, 2], [3, 4])], packing=False)
    m = Bigram()
    lp, _ = token_log_probs(m, b)
    want = torch.log_softmax(m.table.weight, -1)[[2, 3], [3, 4]]
    assert_close(lp[0], want)


@pytest.mark.required  # transformers is in the dev extra: CI must run this
def test_hf_causal_lm_adapter_packs_like_it_pads():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    m = HFCausalLM(transformers.LlamaForCausalLM(cfg)).eval()
    samples = [make_sample("g", "a", [1, 2, 3], [4, 5]), make_sample("g", "b", [6], [7, 8, 9])]
    (pad,) = make_batches(samples, packing=False)
    (pack,) = make_batches(samples, packing=True)
    lp_pad, _ = token_log_probs(m, pad)
    lp_pack, _ = token_log_probs(m, pack)
    for i in range(2):
        r1, r2 = pad.sample_indices.index(i), pack.sample_indices.index(i)
        n = samples[i].response_length
        assert_close(lp_pad[r1, :n], lp_pack[r2, :n], rtol=1e-4, atol=1e-4)


def test_position_id_runs_attend_like_the_block_diagonal_mask(model):
    """Varlen attention from position_ids alone == the dense mask of the same segments, any layout."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5], [5, 6, 7, 0, 1, 2, 3, 4, 0, 0, 1]])
    ids = torch.randint(0, 20, pos.shape, generator=torch.Generator().manual_seed(0))
    starts = pos == 0
    starts[:, 0] = True
    seg = torch.cumsum(starts.long(), dim=1)
    dense = (seg[:, :, None] == seg[:, None, :]) & torch.ones(11, 11, dtype=torch.bool).tril()
    assert_close(model(ids, position_ids=pos), model(ids, position_ids=pos, attention_mask=dense),
                 rtol=1e-5, atol=1e-5)
    # one run per row is plain causal attention
    plain = torch.arange(11).expand(2, 11)
    assert_close(model(ids, position_ids=plain), model(ids), rtol=0, atol=0)


def test_the_shared_decode_loop_stops_rows_independently_and_feeds_each_step_back():
    """``decode`` (the loop of GPT.sample and HFCausalLM.sample) with a step
    function that makes the next token ``tok + 1`` certain: row 0 reaches the
    stop id 3, row 1 runs to the length limit; every step sees the tokens just drawn."""
    from agentlog.learner.model import decode

    V = 8

    def peaked(tok: torch.Tensor) -> torch.Tensor:
        return torch.full((len(tok), V), -1e4).scatter(1, ((tok + 1) % V)[:, None], 0.0)

    fed: list[tuple[list[int], int]] = []

    def step(tok: torch.Tensor, i: int) -> torch.Tensor:
        fed.append((tok.tolist(), i))
        return peaked(tok)

    gen = decode(peaked(torch.tensor([0, 4])), step, 4, 1.0, (3,), torch.Generator().manual_seed(0))
    assert [t.tolist() for t in gen.tokens] == [[1, 2, 3], [5, 6, 7, 0]]
    assert gen.finish_reasons == ["stop", "length"]
    assert all(abs(float(x)) < 1e-6 for lp in gen.log_probs for x in lp)
    assert fed == [([1, 5], 0), ([2, 6], 1), ([3, 7], 2)]  # no step after the last draw
