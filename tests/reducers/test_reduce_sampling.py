"""Sampling settings on samples: carried from the turns, refused when they cannot be
reproduced, and left out of the canonical bytes at their defaults."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reduce_streams import RandomStream, Script, msg, reduce_scripts

from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.samples import (
    Sample,
    decode_sample,
    encode_sample,
    recorded_sampling,
    sampling_problem,
)

U, A1, T1 = msg("user", "q"), msg("assistant", "r"), msg("tool", "t")

#: What the gateway records with a turn at its default settings.
GATEWAY_DEFAULTS = {
    "max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None, "stop_ids": [2],
    "client": {}, "api": "chat", "model": "m",
}


def two_turns(sid: str, first: dict, second: dict, index: int = 0, size: int = 1) -> Script:
    """A session of two chained turns (one row) with the given sampling dicts."""
    s = Script(sid, "g", size, index)
    s.turn([U], [1, 2, 3], [4, 5], response=A1, sampling=first)
    s.turn([U, A1, T1], [1, 2, 3, 4, 5, 6], [7], sampling=second)
    return s.finish(1.0)


# ------------------------------------------------------------------ digests of existing logs


def test_digests_of_plainly_sampled_logs_are_the_ones_computed_before_the_sampling_fields():
    # Pinned with the code before Sample had sampling fields: logs sampled at the
    # defaults (recorded or not) must keep their digests, or every offline check
    # of an existing run would report a mismatch.
    a = Script("s-a", "g", 2, 0).turn([U], [1, 2, 3], [4, 5], sampling=GATEWAY_DEFAULTS)
    a.turn([U, A1, T1], [1, 2, 3, 4, 5, 6], [7], sampling=GATEWAY_DEFAULTS).finish(1.0)
    b = Script("s-b", "g", 2, 1).turn([U], [1, 2, 3], [8], sampling={"temperature": 1.0}).finish(0.0)
    assert reduce_scripts(a, b).digest == "sha256:8d37ddbc3cb249ec871ba2858aaa2cb28772c1d5db206503bf43dbc62dbda4ae"
    pinned = {
        1: "sha256:586b5b9862a0db0a0e442ab5ce0f6d071a3b06fc8f9f88a19b6094017e9a9be3",
        2: "sha256:4fec94c03419e90d556bebbf5417bab4c0ec2ebab7d29b986fed9a633526b361",
        3: "sha256:123643963b07ff9aaeea5b0501452156eca02d54f2f15df1a48d8dc17a4d7473",
    }
    for seed, digest in pinned.items():
        assert reduce_log(RandomStream(seed).log(), ReduceConfig()).digest == digest, seed


def test_a_sample_at_another_temperature_encodes_it_and_decodes_back_equal():
    (plain,) = reduce_scripts(two_turns("s", GATEWAY_DEFAULTS, GATEWAY_DEFAULTS)).samples
    hot = {**GATEWAY_DEFAULTS, "temperature": 0.7}
    (warm,) = reduce_scripts(two_turns("s", hot, hot)).samples
    assert warm.temperature == 0.7 and plain.temperature == 1.0
    assert b"temperature" in encode_sample(warm) and b"temperature" not in encode_sample(plain)
    assert encode_sample(warm) != encode_sample(plain)
    for s in (plain, warm):
        assert decode_sample(encode_sample(s)) == s


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(min_value=0.05, max_value=4.0),
    top_p=st.floats(min_value=0.01, max_value=1.0),
    top_k=st.integers(min_value=-1, max_value=50),
)
def test_any_sampling_round_trips_through_the_canonical_bytes(temperature, top_p, top_k):
    s = Sample("g", "s", 0, b"\x01\0\0\0\x02\0\0\0", 1, b"\x01", b"\0\0\0\0", 1.0, "completed",
               temperature=temperature, top_p=top_p, top_k=top_k)
    assert decode_sample(encode_sample(s)) == s


# ------------------------------------------------------------------ carried from the turns


def test_sample_carries_the_recorded_temperature_and_trains():
    hot = {**GATEWAY_DEFAULTS, "temperature": 0.7}
    (sample,) = reduce_scripts(two_turns("s", hot, hot)).samples
    assert (sample.temperature, sample.top_p, sample.top_k) == (0.7, 1.0, -1)
    assert not sample.remove_sample and "sampling_error" not in sample.metadata


def test_parameters_the_backend_ignored_count_as_off():
    # The built-in torch backend records top_p/top_k it did not apply under "ignored".
    ran = {**GATEWAY_DEFAULTS, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "ignored": ["top_p", "top_k"]}
    (sample,) = reduce_scripts(two_turns("s", ran, ran)).samples
    assert (sample.temperature, sample.top_p, sample.top_k) == (0.5, 1.0, -1)
    assert not sample.remove_sample


@pytest.mark.parametrize(
    "change, words",
    [({"top_p": 0.9}, "top_p=0.9"), ({"top_k": 40}, "top_k=40"), ({"top_p": 0.5, "top_k": 3}, "top_p=0.5 and top_k=3")],
)
def test_truncated_sampling_is_refused_with_its_reason_but_the_reward_stays_in_the_baseline(change, words):
    cut = {**GATEWAY_DEFAULTS, **change}
    result = reduce_scripts(two_turns("a", cut, cut, 0, 2), two_turns("b", GATEWAY_DEFAULTS, GATEWAY_DEFAULTS, 1, 2))
    refused, kept = result.samples
    assert refused.remove_sample and not kept.remove_sample
    assert words in refused.metadata["sampling_error"] and "kept-token sets" in refused.metadata["sampling_error"]
    (group,) = result.groups
    assert [m.valid for m in group.members] == [True, True] and not group.skipped


def test_top_k_zero_means_off():
    zero = {**GATEWAY_DEFAULTS, "top_k": 0}
    (sample,) = reduce_scripts(two_turns("s", zero, zero)).samples
    assert sample.top_k == -1 and not sample.remove_sample


def test_a_row_whose_trained_turns_differ_is_refused_naming_the_turns():
    (sample,) = reduce_scripts(two_turns("s", {"temperature": 0.7}, {"temperature": 1.0})).samples
    assert sample.remove_sample
    reason = sample.metadata["sampling_error"]
    assert "turns [0] at temperature=0.7" in reason and "turns [1] at temperature=1.0" in reason


def test_an_untrained_context_turn_may_differ():
    # Turn 0 is undelivered (mask 0, context only): only turn 1's setting matters.
    s = Script("s", "g", 1, 0)
    s.turn([U], [1, 2, 3], [4, 5], response=A1, sampling={"temperature": 1.0}).undelivered(0)
    s.turn([U, A1, T1], [1, 2, 3, 4, 5, 6], [7], sampling={"temperature": 0.6}).finish(1.0)
    (sample,) = reduce_scripts(s).samples
    assert sample.temperature == 0.6 and not sample.remove_sample


@pytest.mark.parametrize(
    "recorded, field",
    [({"temperature": 0}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 1.5}, "top_p"),
     ({"top_k": 2.5}, "top_k"), ({"temperature": True}, "temperature"), ({"ignored": "top_p"}, "ignored")],
)
def test_unusable_recorded_values_are_refused_naming_the_field(recorded, field):
    (sample,) = reduce_scripts(two_turns("s", recorded, recorded)).samples
    assert sample.remove_sample and f"turn 0: sampling.{field}" in sample.metadata["sampling_error"]


def test_recorded_sampling_defaults_and_sampling_problem():
    assert recorded_sampling({}) == (1.0, 1.0, -1)
    assert recorded_sampling({"temperature": 2, "top_k": 5}) == (2.0, 1.0, 5)
    assert sampling_problem(0.7, 1.0, -1) == ""
    assert "top_p=0.9" in sampling_problem(1.0, 0.9, -1)
    assert "temperature" in sampling_problem(0.0, 1.0, -1)


def test_old_samples_without_sampling_fields_decode_to_the_defaults():
    raw = msgspec.msgpack.encode({"group_id": "g", "session_id": "s", "sample_index": 0, "tokens": b"\0" * 8,
                                  "response_length": 1, "loss_mask": b"\x01", "rollout_log_probs": b"\0" * 4,
                                  "reward": 1.0, "status": "completed"})
    s = decode_sample(raw)
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, -1)
