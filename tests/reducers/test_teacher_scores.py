"""Teacher scores (``teacher_scored``): refused at the engine when they cannot
be right, aligned by the reducers to each sample's response tokens exactly
like the rollout log-probs, and carried byte for byte through the sample
encoding and digest."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import EventValidationError, TeacherScored
from agentlog.reducers.pipeline import ReduceError, reduce_log
from agentlog.reducers.samples import decode_sample, digest_samples, distill_problem, encode_sample


def _play(turns, scores, *, temperature=0.7, failures=()):
    """One finished session of ``turns`` (output lengths; a tool result of 2
    tokens between turns), scored by ``scores``: (turn, teacher, start, log-probs, top) tuples."""

    async def run():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        context = [1, 2, 3]
        outputs = []
        for t, n in enumerate(turns):
            out = [10 + 10 * t + i for i in range(n)]
            await h.record_turn(prompt_ids=context, output_ids=out, output_log_probs=[-1.0 - t] * n,
                                sampling={"temperature": temperature})
            outputs.append(out)
            context = context + out + [7, 8]
        for turn, teacher, start, lps, top in scores:
            kw = {} if top is None else {"top_ids": top[0], "top_log_probs": top[1]}
            await h.record_teacher_scores(turn, teacher=teacher, teacher_version="v1", temperature=temperature,
                                          log_probs=lps, start=start, **kw)
        for turn, teacher, error in failures:
            await h.record_teacher_failure(turn, teacher=teacher, teacher_version="v1", error=error)
        await h.finish(reward=1.0)
        await eng.close()
        return log

    return asyncio.run(run())


def test_the_engine_refuses_scores_at_another_temperature_or_past_the_turn() -> None:
    """A teacher's log-probs at a temperature other than the turn's are of
    another distribution: refused naming the session, turn and both
    temperatures. So are an unknown turn and tokens past its output."""

    async def run():
        eng = await SessionEngine.open(MemoryLog())
        h = await eng.open_session("s9", group_id="g", group_size=1)
        await h.start()
        await h.record_turn(prompt_ids=[1], output_ids=[2, 3], output_log_probs=[-1, -1], sampling={"temperature": 0.7})
        with pytest.raises(ValueError, match=r"'s9'.*turn 0.*temperature 1.0.*sampled at temperature 0.7"):
            await h.record_teacher_scores(0, teacher="t", teacher_version="v", temperature=1.0, log_probs=[-1, -1])
        with pytest.raises(ValueError, match=r"turn_index: expected a recorded turn in \[0, 1\), found 1"):
            await h.record_teacher_scores(1, teacher="t", teacher_version="v", temperature=0.7, log_probs=[-1])
        with pytest.raises(ValueError, match="run past the turn's 2 output tokens"):
            await h.record_teacher_scores(0, teacher="t", teacher_version="v", temperature=0.7, log_probs=[-1, -1], start=1)
        with pytest.raises(ValueError, match=r"shaped \(2, K\)"):
            await h.record_teacher_scores(0, teacher="t", teacher_version="v", temperature=0.7, log_probs=[-1, -1],
                                          top_ids=[[1, 2]], top_log_probs=[[-1, -2]])
        await h.record_teacher_scores(0, teacher="t", teacher_version="v", temperature=0.7, log_probs=[-1, -1])
        await h.finish(reward=0.0)
        await eng.close()

    asyncio.run(run())


def test_the_event_refuses_bad_values() -> None:
    """Positive or non-finite log-probs, a top-K of the wrong size, and an
    error beside scores are refused when the event is built."""
    base = dict(turn_index=0, teacher="t", teacher_version="v", temperature=1.0)
    for kw, field in [
        (dict(log_probs=[-1.0, 0.5]), "log_probs[1]"),
        (dict(log_probs=[-1.0, float("nan")]), "log_probs[1]"),
        (dict(log_probs=[-1.0], top_k=2, top_ids=[1], top_log_probs=[-1.0]), "top_ids/top_log_probs"),
        (dict(log_probs=[-1.0], error="boom"), "error"),
        (dict(log_probs=[]), "log_probs"),
        (dict(log_probs=[-1.0], temperature=0.0), "temperature"),
    ]:
        with pytest.raises(EventValidationError, match=field.replace("[", r"\[").replace("]", r"\]")):
            TeacherScored(**{**base, **kw})


def test_scores_line_up_with_the_response_tokens_like_the_rollout_log_probs() -> None:
    """Two turns with a tool result between them: the sample's teacher
    log-probs sit on exactly the trained tokens of each turn (0 and unscored
    on the tool tokens), several teachers are averaged per token, top-K is
    kept with one teacher, and the sample encodes and decodes unchanged."""
    log = _play([3, 2], [
        (0, "a", 0, [-0.5, -0.25, -2.0], ([[1, 2], [3, 4], [5, 6]], [[-0.5, -1.0], [-0.25, -3.0], [-2.0, -2.5]])),
        (1, "a", 0, [-1.0, -3.0], ([[7, 8], [9, 10]], [[-1.0, -1.5], [-3.0, -4.0]])),
    ])
    s = reduce_log(log).samples[0]
    assert s.mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert s.teacher_lp.tolist() == [-0.5, -0.25, -2.0, 0.0, 0.0, -1.0, -3.0]
    assert s.teacher_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    ids, lps = s.teacher_top()
    assert ids.tolist() == [[1, 2], [3, 4], [5, 6], [0, 0], [0, 0], [7, 8], [9, 10]]
    assert lps[5].tolist() == [-1.0, -1.5]
    assert s.metadata["teachers"] == ["a@v1"] and distill_problem(s) == ""
    assert decode_sample(encode_sample(s)) == s
    two = reduce_log(_play([2], [(0, "a", 0, [-1.0, -2.0], None), (0, "b", 0, [-3.0, -4.0], None)])).samples[0]
    assert two.teacher_lp.tolist() == [-2.0, -3.0] and two.teacher_top() is None
    assert two.metadata["teachers"] == ["a@v1", "b@v1"]


def test_unscored_tokens_and_teacher_failures_are_named() -> None:
    """A trained token without a score, or a teacher that failed on a trained
    turn, makes the sample undistillable with the reason."""
    partial = reduce_log(_play([3], [(0, "a", 1, [-1.0, -1.0], None)])).samples[0]
    assert partial.teacher_mask.tolist() == [0, 1, 1]
    assert "1 of 3 trained tokens have no teacher score (first at response position 0)" in distill_problem(partial)
    failed = reduce_log(_play([2], [], failures=[(0, "a", "timeout after 5 s")])).samples[0]
    assert failed.metadata["teacher_error"] == "a@v1: timeout after 5 s"
    assert "timeout after 5 s" in distill_problem(failed)
    unscored = reduce_log(_play([2], [])).samples[0]
    assert "no teacher scored" in distill_problem(unscored) and not unscored.teacher_scored


def test_a_sample_without_teacher_scores_encodes_as_before() -> None:
    """No teacher: the canonical bytes leave the teacher fields out, so the
    digests of every log written before them stay the same."""
    s = reduce_log(_play([2], [])).samples[0]
    assert b"teacher" not in encode_sample(s)
    scored = reduce_log(_play([2], [(0, "a", 0, [-1.0, -2.0], None)])).samples[0]
    assert b"teacher_log_probs" in encode_sample(scored)
    assert digest_samples([s]) != digest_samples([scored])


def test_the_reducer_refuses_scores_that_cannot_belong_to_the_session() -> None:
    """A stored teacher_scored for a turn never recorded, or the same tokens
    scored twice by one teacher, stops the fold naming the LSN and session."""
    log = _play([2], [])
    envs = list(log.read(0))
    finished = envs[-1]
    bad = TeacherScored(turn_index=5, teacher="a", teacher_version="v1", temperature=0.7, log_probs=[-1.0])
    forged = envs[:-1] + [finished.__class__(finished.lsn, "s", finished.session_seq, finished.ts_ns, bad)]
    with pytest.raises(ReduceError, match=r"teacher_scored of turn 5 by a@v1: the session recorded no such turn"):
        reduce_log(forged)
    twice = _play([2], [(0, "a", 0, [-1.0, -2.0], None), (0, "a", 1, [-2.0], None)])
    with pytest.raises(ReduceError, match="already scored by this teacher"):
        reduce_log(twice)


@settings(max_examples=40, deadline=None)
@given(turns=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data())
def test_any_scoring_of_any_turns_lines_up_token_for_token(turns, data) -> None:
    """Hypothesis: for random turn lengths and random scored spans, every
    scored output token's log-prob appears at its response position and
    nowhere else; replaying the same log gives the same bytes."""
    scores = []
    expected = {}
    for t, n in enumerate(turns):
        if not data.draw(st.booleans(), label=f"score turn {t}"):
            continue
        start = data.draw(st.integers(0, n - 1), label="start")
        k = data.draw(st.integers(1, n - start), label="tokens")
        lps = data.draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=k, max_size=k), label="log-probs")
        scores.append((t, "a", start, lps, None))
        for i, v in enumerate(lps):
            expected[(t, start + i)] = v
    log = _play(turns, scores)
    s = reduce_log(log).samples[0]
    # The response: turn 0's output, then for each later turn the 2 tool tokens and its output.
    pos = 0
    for t, n in enumerate(turns):
        if t:
            pos += 2
        for i in range(n):
            if (t, i) in expected:
                assert s.teacher_mask[pos] == 1 and s.teacher_lp[pos] == np.float32(expected[(t, i)])
            elif s.teacher_scored:
                assert s.teacher_mask[pos] == 0 and s.teacher_lp[pos] == 0.0
            pos += 1
    assert pos == s.response_length
    assert encode_sample(reduce_log(log).samples[0]) == encode_sample(s)


@pytest.mark.parametrize("scores, why", [
    # Turn 0 with top-2, turn 1 without: its tokens had ids 0 and log-prob 0, marked real in the batch, and the
    # top-K loss pulled them toward token 0.
    ([(0, "t", 0, [-0.5, -0.5], ([[10, 12], [11, 13]], [[-0.5, -1.5], [-0.5, -1.5]])), (1, "t", 0, [-0.5, -0.5], None)],
     "t@v1 sent top-K for 2 of the 4 tokens it scored in this row"),
    # One span of a turn with top-K, the other without.
    ([(0, "t", 0, [-0.5], ([[10, 12]], [[-0.5, -1.5]])), (0, "t", 1, [-0.5], None), (1, "t", 0, [-0.5, -0.5], None)],
     "t@v1 sent top-K for 1 of the 4 tokens it scored in this row"),
    # Top-1 on turn 0, top-2 on turn 1: the fold died in numpy, naming no session.
    ([(0, "t", 0, [-0.5, -0.5], ([[10], [11]], [[-0.5], [-0.5]])),
      (1, "t", 0, [-0.5, -0.5], ([[30, 21], [31, 21]], [[-0.5, -1.0], [-0.5, -1.0]]))],
     "t@v1 sent top_k 1 and 2 on different turns"),
])
def test_a_row_whose_top_k_does_not_cover_every_scored_token_with_one_k_carries_none_and_says_why(scores, why):
    log = _play([2, 2], scores)
    (s,) = reduce_log(log).samples
    assert s.mask.tolist() == [1, 1, 0, 0, 1, 1]  # turn 0, the tool's tokens, turn 1
    assert s.teacher_top_k == 0 and s.metadata["teacher_top_k_dropped"] == why
    assert s.teacher_mask.tolist() == [1, 1, 0, 0, 1, 1]  # the log-probs still distil every scored token
