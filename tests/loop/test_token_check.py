"""verify-tokens' checks on turns built by hand, scored by two built-in GPTs standing for two
policy versions: a partial rollout's parts are each scored by their own version, turns without
recorded log-probs still get their other checks, and the negative control counts only tokens
that can be compared."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from agentlog.learner.model import GPT, GPTConfig
from agentlog.loop.model_scorer import ModelScorer
from agentlog.loop.token_check import Turn, corruptible_tokens, verify_turns


def _gpt(seed: int) -> ModelScorer:
    torch.manual_seed(seed)
    return ModelScorer(GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, max_seq_len=64)))


V0, V1 = _gpt(0), _gpt(1)
PROMPT = np.array([1, 2, 3, 4], np.int32)
OUTPUT = np.array([5, 6, 7, 8, 9, 10], np.int32)


def _turn(log_probs: np.ndarray, *, spans=((0, 0),), greedy=False, output=OUTPUT, index=0) -> Turn:
    return Turn(session_id="s", turn_index=index, lsn=10 + index, version=spans[0][1], prompt=PROMPT, output=output,
                log_probs=log_probs, temperature=1.0, greedy=greedy, stop_ids=(), spans=spans)


def _scores(scorer: ModelScorer, output=OUTPUT) -> np.ndarray:
    return np.asarray(scorer.score_batch([(PROMPT, output, 1.0)])[0], np.float32)


def _verify(turns, **kw):
    return asyncio.run(verify_turns(turns, {0: V0, 1: V1}.get, engine="two versions", **kw))


def test_a_partial_rollouts_parts_are_each_scored_by_their_own_version() -> None:
    recorded = np.concatenate([_scores(V0)[:3], _scores(V1)[3:]])  # v0 made tokens 0-2, v1 the rest
    report = _verify([_turn(recorded, spans=((0, 0), (3, 1)))])
    assert report.ok and report.tokens == 6 and report.lp_max_abs_diff == 0.0
    # Against one version only (a server), the other part is not compared, and says so.
    report = _verify([_turn(recorded, spans=((0, 0), (3, 1)))], only_version=1)
    assert report.ok and report.tokens == 3 and report.unchecked_tokens == 3
    # Scored wholly by its first version (the mistake this guards against), the second part differs.
    whole = _verify([_turn(recorded, spans=((0, 0),))])
    assert not whole.ok and whole.first_mismatch["position"] == 3


def _greedy(scorer: ModelScorer, n: int) -> list[int]:
    ids = PROMPT.tolist()
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(scorer.model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(PROMPT):]


def test_a_turn_without_recorded_log_probs_still_fails_its_greedy_reproduction() -> None:
    greedy = _greedy(V0, 6)
    changed = np.array(greedy, np.int32)
    changed[2] = (changed[2] + 1) % 32
    report = _verify([_turn(np.zeros(0, np.float32), greedy=True, output=changed)])
    assert not report.ok and report.turns_checked == 1 and report.unchecked_tokens == 6
    assert report.first_mismatch["check"] == "reproduction" and report.first_mismatch["position"] == 2
    same = _verify([_turn(np.zeros(0, np.float32), greedy=True, output=np.array(greedy, np.int32))])
    assert same.ok and same.greedy_checked == 1


def test_the_negative_control_counts_only_tokens_with_recorded_log_probs() -> None:
    turns = [_turn(np.zeros(0, np.float32), index=0), _turn(_scores(V0), index=1)]
    assert corruptible_tokens(turns) == 6
    report = _verify(turns, corrupt=2)
    assert report.corrupt["turn"] == 1 and report.corrupt["offset"] == 2
    assert report.ok and report.corrupt["caught"] and report.first_mismatch["global_position"] == 2
    with pytest.raises(ValueError, match="hold 6 output tokens"):
        _verify([_turn(np.zeros(0, np.float32), index=0), _turn(_scores(V0), index=1)], corrupt=6)


def test_a_version_without_a_policy_is_skipped_and_counted() -> None:
    report = _verify([_turn(_scores(V0), spans=((0, 7),))])
    assert report.ok and report.turns_skipped == 1 and report.turns_checked == 0
    assert report.turns[0].skipped == "no policy for version 7"


def test_against_one_version_the_negative_control_lands_on_a_compared_token() -> None:
    """--corrupt K counted every output token, also those of a version the engine does not hold:
    the control could land on a token never compared, and report "NOT caught" against a right engine."""
    # v0 made output tokens 0-2, v1 tokens 3-5; a server holding v1 compares only 3-5.
    recorded = np.concatenate([_scores(V0)[:3], _scores(V1)[3:]])
    turn = Turn(session_id="s", turn_index=0, lsn=10, version=0, prompt=PROMPT, output=OUTPUT, log_probs=recorded,
                temperature=1.0, greedy=False, stop_ids=(), spans=((0, 0), (3, 1)))
    report = asyncio.run(verify_turns([turn], lambda _v: V1, engine="v1 only", only_version=1, corrupt=0))
    assert report.tokens == 3
    assert report.corrupt["offset"] == 3, report.corrupt  # the first token v1 generated: the first compared one
    assert report.ok and report.corrupt["caught"], (report.corrupt, report.first_mismatch)


def test_a_nan_or_negative_tolerance_is_refused_not_a_silent_pass() -> None:
    wrong = _scores(V0) - 1.0  # every token off by 1
    for bad in (float("nan"), -0.5):
        turn = Turn(session_id="s", turn_index=0, lsn=10, version=0, prompt=PROMPT, output=OUTPUT, log_probs=wrong,
                    temperature=1.0, greedy=False, stop_ids=(), spans=((0, 0),))
        with pytest.raises(ValueError, match="tolerance"):
            asyncio.run(verify_turns([turn], lambda _v: V0, engine="v0", tolerance=bad))
