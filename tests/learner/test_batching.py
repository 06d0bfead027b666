"""Padding and packing lay samples out differently but give the same per-token log-probs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_helpers import make_sample, random_samples
from torch.testing import assert_close

from agentlog.learner.batching import make_batches
from agentlog.learner.model import GPT, token_log_probs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(vocab_size=24, max_seq_len=64, n_layer=2, d_model=32, n_head=4).eval()


def _per_sample(batches, fn):
    """Map sample index -> (log_probs, entropy, mask) row, across micro-batches."""
    out = {}
    for b in batches:
        lp, ent = fn(b)
        for row, idx in enumerate(b.sample_indices):
            out[idx] = (lp[row], ent[row], b.loss_mask[row])
    return out


def test_packing_gives_the_same_log_probs_as_padding(model):
    rng = np.random.default_rng(0)
    samples = random_samples(rng, 20, 24, max_prompt=10, max_response=14)
    fn = lambda b: token_log_probs(model, b, with_entropy=True)  # noqa: E731
    padded = make_batches(samples, packing=False)
    packed = make_batches(samples, packing=True)
    assert sum(b.input_ids.shape[0] for b in packed) < len(samples)  # several samples share a row
    a, b = _per_sample(padded, fn), _per_sample(packed, fn)
    assert sorted(a) == sorted(b) == list(range(20))
    for i, s in enumerate(samples):
        n = s.response_length
        assert_close(a[i][0][:n], b[i][0][:n], rtol=1e-5, atol=1e-5)
        assert_close(a[i][1][:n], b[i][1][:n], rtol=1e-5, atol=1e-5)
        assert torch.equal(a[i][2][:n], b[i][2][:n])
        assert torch.equal(torch.from_numpy(s.mask.astype(np.float32)), b[i][2][:n])


def test_micro_batches_split_the_same_samples(model):
    rng = np.random.default_rng(1)
    samples = random_samples(rng, 12, 24, max_prompt=8, max_response=8)
    for packing in (True, False):
        whole = make_batches(samples, packing=packing, max_tokens_per_batch=10_000)
        split = make_batches(samples, packing=packing, max_tokens_per_batch=40)
        assert len(whole) == 1 and len(split) > 1
        assert all(b.num_padded <= 40 or b.input_ids.shape[0] == 1 for b in split)
        assert sorted(i for b in split for i in b.sample_indices) == list(range(12))
        fn = lambda b: token_log_probs(model, b, with_entropy=True)  # noqa: E731
        a, c = _per_sample(whole, fn), _per_sample(split, fn)
        for i, s in enumerate(samples):
            n = s.response_length
            assert_close(a[i][0][:n], c[i][0][:n], rtol=1e-5, atol=1e-5)


def test_packed_samples_cannot_see_each_other(model):
    """Changing one packed sample's tokens leaves its row-mates' log-probs bit-identical."""
    s1 = make_sample("g", "a", [1, 2, 3], [4, 5, 6])
    s2 = make_sample("g", "b", [7, 8], [9, 10, 11, 12])
    s1x = make_sample("g", "a", [13, 14, 15], [16, 17, 18])
    (b,) = make_batches([s1, s2], packing=True, max_tokens_per_row=64)
    (bx,) = make_batches([s1x, s2], packing=True, max_tokens_per_row=64)
    assert b.input_ids.shape[0] == 1  # both in one row
    lp, _ = token_log_probs(model, b)
    lpx, _ = token_log_probs(model, bx)
    row_b = b.sample_indices.index(1)
    assert torch.equal(lp[row_b], lpx[bx.sample_indices.index(1)])
    assert not torch.equal(lp[b.sample_indices.index(0)], lpx[bx.sample_indices.index(0)])


def test_packed_layout_restarts_positions_and_is_block_diagonal():
    s1 = make_sample("g", "a", [1, 2], [3, 4, 5], log_probs=[-0.1, -0.2, -0.3], mask=[1, 0, 1])
    s2 = make_sample("g", "b", [6], [7, 8], log_probs=[-0.4, -0.5])
    (b,) = make_batches([s1, s2], advantages=[0.5, -1.5], packing=True, max_tokens_per_row=16)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    m = b.attention_mask[0]
    assert m[6].tolist() == [False] * 5 + [True, True, False]  # token 7 sees 6 and itself only
    assert m[4].tolist() == [True] * 5 + [False] * 3
    # per-sample response tensors: logits at t predict token t + 1
    assert b.predict_index.tolist() == [1, 2, 3, 5, 6]
    assert b.targets.tolist() == [3, 4, 5, 7, 8]
    assert b.slots.tolist() == [0, 1, 2, 3, 4]  # (N, L) = (2, 3): sample 1 starts at slot 3
    assert b.loss_mask.tolist() == [[1, 0, 1], [1, 1, 0]]
    assert_close(b.rollout_log_probs, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, -0.5, 0.0]]))
    assert b.advantages.tolist() == [0.5, -1.5]
    assert b.num_tokens == 8


def test_padding_wastes_more_than_packing_on_long_tailed_lengths():
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(3.0, 0.8, 40).astype(int), 1, 300)
    samples = [make_sample("g", f"s{i}", [1], [2] * int(n)) for i, n in enumerate(lengths)]
    padded = sum(b.num_padded for b in make_batches(samples, packing=False, max_tokens_per_batch=10**9))
    packed = sum(b.num_padded for b in make_batches(samples, packing=True, max_tokens_per_batch=10**9))
    real = int(sum(lengths) + len(lengths))
    assert packed < padded
    assert 1 - real / packed < 0.25 < 1 - real / padded


def test_malformed_samples_are_rejected_naming_the_session():
    bad = make_sample("g", "sess-x", [1], [2, 3])
    import msgspec

    bad = msgspec.structs.replace(bad, loss_mask=b"\x01")
    with pytest.raises(ValueError, match=r"sess-x.*len\(loss_mask\)"):
        make_batches([bad])
    no_prompt = make_sample("g", "sess-y", [], [2, 3])
    with pytest.raises(ValueError, match="sess-y.*prompt token"):
        make_batches([no_prompt])
    with pytest.raises(ValueError, match="advantages"):
        make_batches([make_sample("g", "s", [1], [2])], advantages=[1.0, 2.0])


class _DenseMaskOnly(torch.nn.Module):
    """The built-in GPT seen as a generic model: packed batches arrive with a dense mask."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        assert position_ids is None or attention_mask is not None
        return self.gpt(input_ids, position_ids=position_ids, attention_mask=attention_mask)


def test_dense_mask_and_varlen_packing_agree(model):
    """Generic models get the block-diagonal mask; the GPT's varlen path computes the same thing."""
    rng = np.random.default_rng(4)
    samples = random_samples(rng, 15, 24, max_prompt=12, max_response=20)
    (b,) = make_batches(samples, packing=True)
    varlen, ent_v = token_log_probs(model, b, with_entropy=True)
    dense, ent_d = token_log_probs(_DenseMaskOnly(model), b, with_entropy=True)
    assert_close(varlen, dense, rtol=1e-5, atol=1e-5)
    assert_close(ent_v, ent_d, rtol=1e-5, atol=1e-5)
    assert b.attention_mask.shape == (b.input_ids.shape[0], b.input_ids.shape[1], b.input_ids.shape[1])


def test_row_capacity_bounds_packed_rows_and_long_samples_get_their_own():
    lengths = [3, 5, 9, 2, 4, 12]
    samples = [make_sample("g", f"s{i}", [1], [2] * (n - 1)) for i, n in enumerate(lengths)]
    (b,) = make_batches(samples, packing=True, max_tokens_per_row=10, max_tokens_per_batch=10**6)
    fills = sorted(int((row >= 0).sum()) for row in b.segment_ids)
    # first-fit decreasing into rows of 10: [9], [5, 4], [3, 2]; the 12-token sample alone
    assert fills == [5, 9, 9, 12]
    assert b.input_ids.shape == (4, 12)
