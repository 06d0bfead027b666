"""Token ids and log-probs given as a list pack through ``struct`` (the fast
path) to exactly what numpy's path gives the same values as a tuple, and a
list that path would refuse is refused alike."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.schema.packing import pack_log_probs, pack_tokens
from agentlog.events.schema.validation import EventValidationError

_items = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(),  # past int32 now and then
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(-1e30, 1e30),
    st.text(max_size=3),
    st.builds(np.int64, st.integers(-(2**31), 2**31 - 1)),
    st.builds(np.float32, st.floats(-1e6, 1e6)),
)


def _outcome(pack, values):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's cast of a double past float32 warns
        try:
            return "ok", pack(values)
        except (EventValidationError, OverflowError, TypeError, ValueError) as exc:
            return "refused", type(exc).__name__


@settings(max_examples=400, deadline=None)
@given(st.lists(_items, max_size=8) | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200)
       | st.lists(st.floats(width=32, allow_nan=False), max_size=200))
def test_a_list_packs_as_the_same_values_as_a_tuple_do(values):
    for pack in (pack_tokens, pack_log_probs):
        fast, slow = _outcome(pack, values), _outcome(pack, tuple(values))
        if slow[0] == "ok" and fast[0] == "ok" and pack is pack_log_probs:
            # NaN payloads aside (both keep a NaN a NaN), the same float32 bytes.
            a, b = (np.frombuffer(x[1], dtype="<f4") for x in (fast, slow))
            assert np.array_equal(a, b, equal_nan=True)
        else:
            assert fast == slow, (pack.__name__, values)


def test_all_bool_token_ids_are_refused_as_before():
    import pytest

    with pytest.raises(EventValidationError, match="dtype bool"):
        pack_tokens([True, False])
    assert pack_tokens([1, True]) == np.array([1, 1], dtype="<i4").tobytes()  # numpy's int dtype takes a bool among ints


@settings(max_examples=400, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=600), st.booleans())
def test_all_finite_answers_as_numpy_for_any_float32s_short_or_long(values, as_bits):
    """The sum test (short runs) and numpy's (long runs) agree with numpy's answer on every input,
    NaNs of any payload, infinities of either sign, subnormals and float32's largest values included."""
    from agentlog.events.schema.packing import all_finite

    raw = np.asarray(values, dtype="<f4").tobytes()
    if as_bits and raw:  # a NaN with an arbitrary payload, which no float literal gives
        raw = raw[:-4] + (0x7F800001 + len(values)).to_bytes(4, "little")
    assert all_finite(raw) == bool(np.isfinite(np.frombuffer(raw, "<f4")).all())


def test_all_finite_finds_a_nan_or_infinity_among_huge_finite_values():
    from agentlog.events.schema.packing import all_finite

    big = np.full(200, np.finfo(np.float32).max, dtype="<f4")
    assert all_finite(big.tobytes()) and all_finite((-big).tobytes())
    for bad in (np.inf, -np.inf, np.nan):
        mixed = big.copy()
        mixed[7] = bad
        assert not all_finite(mixed.tobytes())
    both = np.array([np.inf, -np.inf], dtype="<f4")  # their sum is NaN: still not finite
    assert not all_finite(both.tobytes())
