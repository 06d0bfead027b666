"""Partial rollouts in the in-process torch backend: a weight update lands at
a token boundary of the batch in flight, without draining it. ``continue``
goes on with the batch's KV cache; ``resubmit`` stops and samples the rest
from the prompt plus the partial output. Either way the caller gets one
generation whose version spans say where each version started, and the
engine and reducers carry those tokens, log-probs and versions unchanged
into the training sample."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.gateway import SamplingParams, TorchBackend
from agentlog.learner.model import GPT
from agentlog.reducers.pipeline import reduce_log

#: The token a "new version" emits at every step: its lm_head favours it overwhelmingly.
FORCED = 7


class SteppedGPT(GPT):
    """The learner's GPT, held at chosen token boundaries until the test has
    requested its weight update there (so the interrupt point is exact)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.hold_at: list[int] = []
        self.reached = threading.Event()
        self.proceed = threading.Event()
        self.offset = 0

    def sample(self, prompts, max_new_tokens, temperature=1.0, stop_ids=(), generator=None, between_steps=None):
        offset = self.offset  # tokens generated before this call (resubmit continues a row)

        def hook(n: int) -> bool:
            if offset + n in self.hold_at:
                self.reached.set()
                assert self.proceed.wait(10), "the test never let the batch go on"
                self.proceed.clear()
            stop = between_steps(n) if between_steps is not None else False
            if stop:
                self.offset = offset + n  # the next call resubmits from here
            return stop

        return super().sample(prompts, max_new_tokens, temperature, stop_ids, generator, between_steps=hook)


def _forcing(model: GPT) -> dict[str, torch.Tensor]:
    """Weights under which the model emits FORCED at every step."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    head = torch.zeros_like(state["lm_head.weight"])
    head[FORCED] = 50.0
    state["lm_head.weight"] = head
    state["ln_f.weight"] = torch.ones_like(state["ln_f.weight"])
    state["ln_f.bias"] = torch.ones_like(state["ln_f.bias"])  # every hidden unit > 0 after the norm: FORCED wins
    return state


async def _generate_with_updates(mode: str, n_tokens: int, points: list[int]):
    torch.manual_seed(0)
    model = SteppedGPT(vocab_size=32, max_seq_len=64, n_layer=1, d_model=16, n_head=2, tie_embeddings=False)
    model.hold_at = list(points)
    backend = TorchBackend(model, weight_update=mode, seed=3)
    try:
        call = asyncio.ensure_future(backend.generate([1, 2, 3], SamplingParams(max_new_tokens=n_tokens)))
        for k, _ in enumerate(points):
            await asyncio.to_thread(model.reached.wait, 10)
            model.reached.clear()
            update = asyncio.ensure_future(backend.load_weights(_forcing(model), 4 + k))
            while not backend._swaps and not update.done():
                await asyncio.sleep(0.001)
            model.proceed.set()
            await update
        return await call, backend
    finally:
        await backend.close()


@pytest.mark.parametrize("mode", ["continue", "resubmit"])
def test_an_update_mid_generation_lands_at_the_token_boundary_without_a_drain(mode) -> None:
    """Version 4 arrives after token 5 of 12: tokens 0-4 are the old
    weights' (not all FORCED), tokens 5-11 all FORCED with log-prob ~0, and
    the spans say so. The update waited one token boundary, not the batch."""
    gen, backend = asyncio.run(_generate_with_updates(mode, 12, [5]))
    assert gen.version_spans == ((0, 0), (5, 4)) and gen.policy_version == 0
    assert len(gen.output_ids) == 12 and gen.finish_reason == "length"
    assert gen.output_ids[5:] == [FORCED] * 7 and gen.output_ids[:5] != [FORCED] * 5
    assert max(abs(x) for x in gen.log_probs[5:]) < 1e-6
    assert backend.policy_version == 4 and len(backend.update_pauses_s) == 1


def test_drain_mode_applies_the_update_after_the_generation() -> None:
    """``drain`` (the default): the generation in flight finishes under the
    version it started with; the update waits for it."""

    async def run():
        torch.manual_seed(0)
        model = GPT(vocab_size=32, max_seq_len=64, n_layer=1, d_model=16, n_head=2, tie_embeddings=False)
        backend = TorchBackend(model, seed=3)
        try:
            call = asyncio.ensure_future(backend.generate([1, 2, 3], SamplingParams(max_new_tokens=40)))
            await asyncio.sleep(0.01)
            await backend.load_weights(_forcing(model), 4)
            first = await call
            after = await backend.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
            return first, after
        finally:
            await backend.close()

    first, after = asyncio.run(run())
    assert first.version_spans is msgspec.UNSET and first.policy_version == 0
    assert after.policy_version == 4 and after.output_ids == [FORCED] * 4


def test_an_unknown_weight_update_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="weight_update: expected one of"):
        TorchBackend(GPT(vocab_size=8, max_seq_len=8, n_layer=1, d_model=8, n_head=2), weight_update="later")


@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(["continue", "resubmit"]), n_tokens=st.integers(1, 10),
       points=st.lists(st.integers(1, 9), max_size=3, unique=True).map(sorted))
def test_recorded_partial_turns_rebuild_into_samples_with_their_tokens_log_probs_and_versions(mode, n_tokens, points) -> None:
    """Over interrupt points (the first boundary and the last token
    included), updates per turn and both modes: the generation's spans start
    where each update landed (updates after the last token change nothing),
    and the engine and reducers rebuild a sample with exactly the generated
    tokens, log-probs and per-token versions."""
    points = [p for p in points if p < n_tokens]  # the batch never reaches a boundary past its last token

    async def run():
        gen, _ = await _generate_with_updates(mode, n_tokens, points)
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        await h.record_turn(prompt_ids=[1, 2, 3], output_ids=gen.output_ids, output_log_probs=gen.log_probs,
                            finish_reason=gen.finish_reason, policy_version=gen.policy_version,
                            version_spans=gen.version_spans)
        await h.finish(reward=1.0)
        await eng.close()
        return gen, log

    gen, log = asyncio.run(run())
    want = [0] * n_tokens
    for k, p in enumerate(points):
        want[p:] = [4 + k] * (n_tokens - p)
    assert len(gen.output_ids) == n_tokens
    (sample,) = reduce_log(log).samples
    assert sample.token_ids[3:].tolist() == gen.output_ids
    assert np.array_equal(sample.log_probs, np.array(gen.log_probs, dtype="<f4"))
    assert sample.policy_version == want[0]
    if len(set(want)) > 1:
        assert sample.versions.tolist() == want
    else:
        assert sample.token_versions == b""
