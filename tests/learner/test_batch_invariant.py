"""The built-in GPT's one numeric path: what `GPT.sample` records, the learner's forward
reproduces bit for bit (``torch.equal``), whatever the batch, the packing, the lengths
or the thread count; and that path computes the same function as torch's own kernels."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from agentlog.learner import batch_invariant
from agentlog.learner.batching import make_batches
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import GPT, GPTConfig, token_stats
from agentlog.reducers.samples import COMPLETED, Sample


class Case:
    """A seeded model and prompts; the repr names the seed, so a failure can be reproduced."""

    def __init__(self, seed: int, *, n: int, longest: int, new: int, d_model: int = 64, max_seq_len: int = 128) -> None:
        self.seed, self.new = seed, new
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig(vocab_size=40, n_layer=2, n_head=4, d_model=d_model, max_seq_len=max_seq_len))
        # Large embeddings, as the demo's, so that log-probs spread over several binades.
        torch.nn.init.normal_(self.model.tok_emb.weight, std=0.5)
        torch.nn.init.normal_(self.model.pos_emb.weight, std=0.5)
        rng = random.Random(seed)
        self.prompts = [[rng.randrange(1, 40) for _ in range(rng.randrange(1, longest + 1))] for _ in range(n)]

    def __repr__(self) -> str:
        return f"Case(seed={self.seed}, prompts={len(self.prompts)}, new={self.new})"


def sample_rows(model: GPT, prompts: list[list[int]], new: int, temperature: float, seed: int = 0) -> list[Sample]:
    """One training row per prompt, holding what `GPT.sample` generated and recorded."""
    out = model.sample(prompts, new, temperature=temperature, stop_ids=[0], generator=torch.Generator().manual_seed(seed))
    return [
        Sample(group_id=f"g{i // 4}", session_id=f"s{i}", sample_index=i % 4,
               tokens=np.asarray(p + out.tokens[i].tolist(), dtype="<i4").tobytes(), response_length=len(out.tokens[i]),
               loss_mask=bytes([1]) * len(out.tokens[i]), rollout_log_probs=out.log_probs[i].astype("<f4").tobytes(),
               reward=float(i % 2), status=COMPLETED, temperature=temperature)
        for i, p in enumerate(prompts)
    ]


def assert_reproduced(model: GPT, samples: list[Sample], **batching) -> int:
    """The training forward's log-probs equal the recorded ones on every response token; returns how many."""
    n = 0
    for b in make_batches(samples, **batching):
        lp = token_stats(model, b, with_entropy=True).log_probs.detach()
        on = b.loss_mask > 0
        assert torch.equal(lp[on], b.rollout_log_probs[on]), float((lp - b.rollout_log_probs)[on].abs().max())
        n += int(on.sum())
    return n


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("batching", [dict(packing=True), dict(packing=False), dict(packing=True, max_tokens_per_batch=300)],
                         ids=["packed", "padded", "small-micro-batches"])
def test_sampled_log_probs_are_reproduced_bit_for_bit_by_the_training_forward(temperature, batching):
    """48 prompts of 1..30 tokens sampled as one batch, scored by the learner's forward in
    other batches (packed several to a row, padded, split into micro-batches of 300 tokens)."""
    case = Case(0, n=48, longest=30, new=20)
    samples = sample_rows(case.model, case.prompts, case.new, temperature)
    assert assert_reproduced(case.model, samples, **batching) > 400, case


@pytest.mark.parametrize("threads", [(1, 2), (2, 1)], ids=["sample-1-learn-2", "sample-2-learn-1"])
def test_the_thread_count_changes_nothing(threads):
    case = Case(1, n=40, longest=40, new=24, d_model=96)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads[0])
        samples = sample_rows(case.model, case.prompts, case.new, 1.0)
        torch.set_num_threads(threads[1])
        assert_reproduced(case.model, samples)
    finally:
        torch.set_num_threads(before)


def test_long_rows_over_many_key_blocks_and_query_tiles_are_reproduced():
    """Prompts up to 120 tokens and 60 new ones: several query tiles and key blocks per row."""
    case = Case(2, n=12, longest=120, new=60, max_seq_len=192)
    samples = sample_rows(case.model, case.prompts, case.new, 1.3)
    assert max(len(s.token_ids) for s in samples) > 4 * batch_invariant.QUERY_TILE, case
    assert_reproduced(case.model, samples, packing=True)
    assert_reproduced(case.model, samples, packing=False)


def test_a_second_turn_is_reproduced_over_the_whole_row():
    """Turn 2's prompt holds turn 1, its output and a tool result (mask 0): the learner scores
    the whole row in one forward, and both turns' recorded log-probs are reproduced."""
    case = Case(3, n=16, longest=12, new=6)
    gen = torch.Generator().manual_seed(5)
    first = case.model.sample(case.prompts, 6, stop_ids=[0], generator=gen)
    tool = [[7, 8, 9][: 1 + i % 3] for i in range(len(case.prompts))]
    second_prompts = [p + t.tolist() + x for p, t, x in zip(case.prompts, first.tokens, tool)]
    second = case.model.sample(second_prompts, 6, stop_ids=[0], generator=gen)
    samples = []
    for i, p in enumerate(case.prompts):
        t1, t2 = first.tokens[i].tolist(), second.tokens[i].tolist()
        response = t1 + tool[i] + t2
        mask = [1] * len(t1) + [0] * len(tool[i]) + [1] * len(t2)
        lps = np.concatenate([first.log_probs[i], np.zeros(len(tool[i]), np.float32), second.log_probs[i]])
        samples.append(Sample(group_id="g", session_id=f"s{i}", sample_index=i, tokens=np.asarray(p + response, "<i4").tobytes(),
                              response_length=len(response), loss_mask=bytes(mask), rollout_log_probs=lps.astype("<f4").tobytes(),
                              reward=0.0, status=COMPLETED, turns=2))
    assert assert_reproduced(case.model, samples) == sum(len(first.tokens[i]) + len(second.tokens[i]) for i in range(16))


def test_a_learner_step_measures_no_mismatch_at_the_rollout_version():
    """`Learner.step` on freshly sampled rows: ``stats/train_rollout_logprob_abs_diff_max`` is
    exactly 0.0 over every trained token, with one mini-batch (old log-probs from the training
    forward) and with three (old log-probs from a separate no-grad forward)."""
    case = Case(4, n=32, longest=20, new=12)
    samples = sample_rows(case.model, case.prompts, case.new, 0.8)
    trained = sum(int(s.mask.sum()) for s in samples)
    for steps in (1, 3):
        learner = Learner(GPT.from_state_dict(case.model.state_dict(), {"n_head": 4}),
                          LearnerConfig(num_steps_per_rollout=steps, tis_cap=2.0, max_tokens_per_batch=256))
        m = learner.step(samples)
        assert m["stats/train_rollout_tokens"] == trained
        assert m["stats/train_rollout_logprob_abs_diff_max"] == 0.0 and m["stats/train_rollout_logprob_abs_diff"] == 0.0
        assert m["stats/train_rollout_kl"] == 0.0 and m["stats/rollout_logprob_abs_diff"] == 0.0


def test_a_sequence_scores_the_same_alone_and_inside_any_batch():
    torch.manual_seed(6)
    model = GPT(vocab_size=30, max_seq_len=96, n_layer=2, d_model=48, n_head=4)
    seq = torch.randint(0, 30, (1, 37))
    alone = model(seq)
    batch = torch.randint(0, 30, (5, 70))
    batch[3, :37] = seq[0]
    assert torch.equal(model(batch)[3, :37], alone[0])  # padded: the row is longer, other rows around it
    packed = torch.randint(0, 30, (2, 90))
    packed[1, 20:57] = seq[0]
    pos = torch.cat([torch.arange(20), torch.arange(37), torch.arange(33)]).expand(2, 90).clone()
    pos[0] = torch.arange(90)
    assert torch.equal(model(packed, position_ids=pos)[1, 20:57], alone[0])  # packed behind another sample


@pytest.mark.parametrize("packing", [False, True])
def test_the_invariant_path_computes_what_torch_kernels_compute(packing):
    """Same logits (to float tolerance) and same gradients as torch's attention and linear layers."""
    torch.manual_seed(7)
    model = GPT(vocab_size=30, max_seq_len=128, n_layer=2, d_model=48, n_head=4)
    rng = np.random.default_rng(7)
    samples = [Sample(group_id="g", session_id=f"s{i}", sample_index=i, tokens=rng.integers(0, 30, n).astype("<i4").tobytes(),
                      response_length=n // 2, loss_mask=bytes([1]) * (n // 2), rollout_log_probs=bytes(4 * (n // 2)),
                      reward=0.0, status=COMPLETED) for i, n in enumerate([5, 17, 40, 90, 33])]
    (b,) = make_batches(samples, packing=packing)
    grads = []
    for invariant in (True, False):
        model.batch_invariant = invariant
        model.zero_grad()
        lp = token_stats(model, b).log_probs
        (lp * b.loss_mask).sum().backward()
        grads.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    assert_close(grads[0][0], grads[1][0], atol=2e-5, rtol=1e-5)
    for g_inv, g_fast in zip(grads[0][1], grads[1][1]):
        assert_close(g_inv, g_fast, atol=2e-5, rtol=1e-4)


def test_sampling_on_either_path_draws_from_the_same_distribution():
    """With the same seed both paths draw the same tokens, at log-probs equal to float tolerance."""
    case = Case(8, n=20, longest=25, new=4)
    drawn = []
    for invariant in (True, False):
        case.model.batch_invariant = invariant
        out = case.model.sample(case.prompts, case.new, generator=torch.Generator().manual_seed(0))
        drawn.append((np.concatenate(out.tokens), torch.tensor(np.concatenate(out.log_probs))))
    assert np.array_equal(drawn[0][0], drawn[1][0]), case
    assert_close(drawn[0][1], drawn[1][1], atol=1e-5, rtol=1e-5)


def test_attend_refuses_a_query_count_it_cannot_tile():
    q = torch.zeros(2, batch_invariant.QUERY_TILE + 1, 8)
    k = torch.zeros(2, batch_invariant.KEY_BLOCK * 2, 8)
    with pytest.raises(ValueError, match="neither at most"):
        batch_invariant.attend(q, k, k, torch.zeros(1, q.shape[1], dtype=torch.long))
