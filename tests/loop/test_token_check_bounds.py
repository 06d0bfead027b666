"""The negative control against an engine that holds one version counts only the
output tokens that engine compares (a partial rollout's other version's part is not)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from agentlog.learner.model import GPT, GPTConfig
from agentlog.loop.model_scorer import ModelScorer
from agentlog.loop.token_check import Turn, verify_turns


def _gpt(seed: int) -> ModelScorer:
    torch.manual_seed(seed)
    return ModelScorer(GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, max_seq_len=64)))


V0, V1 = _gpt(0), _gpt(1)
PROMPT = np.array([1, 2, 3, 4], np.int32)
OUTPUT = np.array([5, 6, 7, 8, 9, 10], np.int32)


def _scores(scorer: ModelScorer) -> np.ndarray:
    return np.asarray(scorer.score_batch([(PROMPT, OUTPUT, 1.0)])[0], np.float32)


def test_against_one_version_the_negative_control_lands_on_a_compared_token() -> None:
    # v0 made output tokens 0-2, v1 tokens 3-5; a server holding v1 compares only 3-5.
    recorded = np.concatenate([_scores(V0)[:3], _scores(V1)[3:]])
    turn = Turn(session_id="s", turn_index=0, lsn=10, version=0, prompt=PROMPT, output=OUTPUT, log_probs=recorded,
                temperature=1.0, greedy=False, stop_ids=(), spans=((0, 0), (3, 1)))
    report = asyncio.run(verify_turns([turn], lambda _v: V1, engine="v1 only", only_version=1, corrupt=0))
    assert report.tokens == 3
    assert report.corrupt["offset"] == 3, report.corrupt  # the first token v1 generated: the first compared one
    assert report.ok and report.corrupt["caught"], (report.corrupt, report.first_mismatch)


def test_a_nan_or_negative_tolerance_is_refused_not_a_silent_pass() -> None:
    import pytest

    wrong = _scores(V0) - 1.0  # every token off by 1
    for bad in (float("nan"), -0.5):
        turn = Turn(session_id="s", turn_index=0, lsn=10, version=0, prompt=PROMPT, output=OUTPUT, log_probs=wrong,
                    temperature=1.0, greedy=False, stop_ids=(), spans=((0, 0),))
        with pytest.raises(ValueError, match="tolerance"):
            asyncio.run(verify_turns([turn], lambda _v: V0, engine="v0", tolerance=bad))
