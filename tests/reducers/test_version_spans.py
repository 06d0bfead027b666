"""Partial rollouts in the log: a turn made by more than one policy version
records ``version_spans``; a turn made by one is stored byte for byte as
before the field existed; the reducers rebuild every token's version and
carry it, with the recorded tokens, mask and log-probs, into the samples."""

from __future__ import annotations

import asyncio
import re

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.turn import canonical_version_spans, turn_version_spans
from agentlog.events.schema.types import EventValidationError, TurnRecorded, decode_body, encode_body
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.samples import decode_sample, encode_sample


def test_a_turn_of_one_version_is_stored_without_the_field_and_decodes_unset() -> None:
    """The stored map of a one-version turn has exactly the keys it had before
    version spans existed; a multi-version turn adds ``version_spans`` and
    decodes back equal."""
    one = TurnRecorded(turn_index=0, prompt_ids=[1, 2], output_ids=[3, 4, 5], policy_version=2)
    keys = set(msgspec.msgpack.decode(encode_body(one)))
    assert "version_spans" not in keys and "policy_version" in keys
    assert decode_body(encode_body(one)).version_spans is msgspec.UNSET
    assert turn_version_spans(one) == ((0, 2),)
    two = TurnRecorded(turn_index=0, prompt_ids=[1, 2], output_ids=[3, 4, 5], policy_version=2, version_spans=((0, 2), (1, 3)))
    back = decode_body(encode_body(two))
    assert back == two and back.version_spans == ((0, 2), (1, 3))
    assert set(msgspec.msgpack.decode(encode_body(two))) == keys | {"version_spans"}


@pytest.mark.parametrize("spans, version, field", [
    (((0, 2),), 2, "version_spans"),  # one span: the field stays unset
    (((1, 2), (2, 3)), 2, "version_spans[0]"),  # not from token 0
    (((0, 2), (3, 3)), 2, "version_spans[1]"),  # an empty span past the output
    (((0, 3), (1, 2)), 3, "version_spans[1]"),  # versions going back
    (((0, 2), (2, 3), (1, 4)), 2, "version_spans[2]"),  # first tokens going back
    (((0, 2), (1, -1)), 2, "version_spans[1][1]"),
    (((0, 2), (True, 3)), 2, "version_spans[1][0]"),
    (((0, 2), (1, 3)), 3, "policy_version"),  # not the oldest span's
])
def test_spans_not_in_canonical_form_are_refused_naming_the_field(spans, version, field) -> None:
    with pytest.raises(EventValidationError, match=re.escape(f"turn_recorded.{field}: expected")):
        TurnRecorded(turn_index=0, output_ids=[3, 4, 5], policy_version=version, version_spans=spans)


def test_canonical_spans_drop_empty_spans_and_keep_the_later_version() -> None:
    assert canonical_version_spans([(0, 3), (2, 4)], 5) == (3, ((0, 3), (2, 4)))
    assert canonical_version_spans([(0, 3), (0, 4)], 5) == (4, msgspec.UNSET)  # interrupted at token 0
    assert canonical_version_spans([(0, 3), (5, 4)], 5) == (3, msgspec.UNSET)  # after the last token
    assert canonical_version_spans([(0, 3), (2, 4), (2, 5)], 5) == (3, ((0, 3), (2, 5)))
    assert canonical_version_spans([(0, 3), (0, 4)], 0) == (4, msgspec.UNSET)
    with pytest.raises(ValueError, match="versions only increase"):
        canonical_version_spans([(0, 4), (2, 3)], 5)


def _play(turns: list[tuple[int, list[tuple[int, int]]]], reward: float = 1.0) -> tuple[MemoryLog, list[dict]]:
    """One finished session; each turn: (output length, interrupts as (token, new version)), starting at version 3."""

    async def run():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        context, recorded, version = [1, 2, 3], [], 3
        for t, (n, interrupts) in enumerate(turns):
            out = [100 * (t + 1) + i for i in range(n)]
            lps = [-0.25 * (i + 1) - t for i in range(n)]
            starts = [(0, version)] + [(tok, v) for tok, v in interrupts]
            policy_version, spans = canonical_version_spans(starts, n)
            version = starts[-1][1]
            await h.record_turn(prompt_ids=context, output_ids=out, output_log_probs=lps,
                                policy_version=policy_version, version_spans=spans)
            per_token = [next(v for first, v in reversed(turn_version_spans(
                TurnRecorded(turn_index=0, output_ids=out, policy_version=policy_version, version_spans=spans))) if first <= i)
                for i in range(n)]
            recorded.append({"out": out, "lps": lps, "versions": per_token, "spans": spans})
            context = context + out + [7, 8]
        await h.finish(reward=reward)
        await eng.close()
        return log, recorded

    return asyncio.run(run())


@st.composite
def _turns(draw):
    """1-3 turns of 1-9 output tokens (the last of two or more may have none), each
    with 0-3 weight updates at any token boundary, including 0 and the last."""
    turns, version = [], 3
    count = draw(st.integers(1, 3))
    for t in range(count):
        n = draw(st.integers(0 if 0 < t == count - 1 else 1, 9))
        points = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        interrupts = []
        for p in points:
            version += 1
            interrupts.append((p, version))
        turns.append((n, interrupts))
    return turns


@settings(max_examples=60, deadline=None)
@given(_turns())
def test_rebuilt_samples_carry_exactly_the_recorded_tokens_masks_log_probs_and_versions(turns) -> None:
    """Over interrupt points (token 0 and the last included) and numbers of
    updates per turn: the sample's response holds the recorded output tokens
    with mask 1, their recorded log-probs and, per token, the version that
    generated it; ``policy_version`` is the oldest trained token's; the
    sample decodes back equal."""
    log, recorded = _play(turns)
    (sample,) = reduce_log(log).samples
    mask, lps = sample.mask, sample.log_probs
    response = sample.token_ids[sample.prompt_length:]
    trained = mask.astype(bool)
    want_tokens = [t for r in recorded for t in r["out"]]
    assert response[trained].tolist() == want_tokens
    assert np.array_equal(lps[trained], np.array([x for r in recorded for x in r["lps"]], dtype="<f4"))
    want_versions = [v for r in recorded for v in r["versions"]]
    assert sample.policy_version == min(want_versions)
    partial = any(r["spans"] is not msgspec.UNSET for r in recorded)
    if partial:
        assert sample.versions[trained].tolist() == want_versions
        assert not sample.versions[~trained].any()
    else:
        assert sample.token_versions == b""
    assert decode_sample(encode_sample(sample)) == sample


def test_a_row_without_partial_turns_keeps_its_sample_bytes() -> None:
    """No interrupted turn: ``token_versions`` is empty and left out of the
    canonical bytes, which equal the bytes of the same sample without the
    field (the digests of earlier runs stay valid)."""
    log, _ = _play([(3, []), (2, [])])
    (sample,) = reduce_log(log).samples
    assert sample.token_versions == b""
    assert "token_versions" not in msgspec.msgpack.decode(encode_sample(sample))
    interrupted, _ = _play([(3, [(1, 4)]), (2, [])])
    (other,) = reduce_log(interrupted).samples
    assert other.versions.tolist() == [3, 4, 4, 0, 0, 4, 4]  # the tool result between the turns is not trained
    assert "token_versions" in msgspec.msgpack.decode(encode_sample(other))


def test_a_cut_row_keeps_the_versions_of_the_tokens_it_keeps() -> None:
    """``max_context_tokens`` cuts inside the second span of an interrupted
    turn: the kept tokens keep their versions."""
    log, recorded = _play([(6, [(2, 4)])])
    (sample,) = reduce_log(log, ReduceConfig(max_context_tokens=3 + 4)).samples
    assert sample.response_length == 4
    assert sample.versions.tolist() == [3, 3, 4, 4]
    assert sample.token_ids[3:].tolist() == recorded[0]["out"][:4]
