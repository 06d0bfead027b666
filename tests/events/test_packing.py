"""Token ids and log-probs given as a list pack through the compiled speedups or
``struct`` (the fast paths) to exactly what numpy's path gives the same values as
a tuple, and a list that path would refuse is refused alike. Every test runs
under both the compiled speedups (:mod:`agentlog.events.schema.speedups`) and the
pure-Python path, and the two give the same bytes, verdicts and refusals."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.schema import speedups
from agentlog.events.schema.packing import all_finite, pack_log_probs, pack_tokens
from agentlog.events.schema.validation import EventValidationError

#: The paths each test runs under: the compiled speedups, and pure Python.
PATHS = ("compiled", "pure")


@contextmanager
def path(name: str):
    """Run the block under the compiled speedups or the pure-Python path."""
    if name == "compiled" and not speedups.available():
        pytest.skip(speedups.unavailable_reason())
    saved = speedups.native
    speedups.use_native(name == "compiled")
    try:
        yield
    finally:
        speedups.native = saved

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
@pytest.mark.parametrize("name", PATHS)
def test_a_list_packs_as_the_same_values_as_a_tuple_do(name, values):
    for pack in (pack_tokens, pack_log_probs):
        with path(name):
            fast, slow = _outcome(pack, values), _outcome(pack, tuple(values))
        if slow[0] == "ok" and fast[0] == "ok" and pack is pack_log_probs:
            # NaN payloads aside (both keep a NaN a NaN), the same float32 bytes.
            a, b = (np.frombuffer(x[1], dtype="<f4") for x in (fast, slow))
            assert np.array_equal(a, b, equal_nan=True)
        else:
            assert fast == slow, (pack.__name__, values)


@settings(max_examples=400, deadline=None)
@given(st.lists(_items, max_size=8) | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200)
       | st.lists(st.floats(width=64, allow_nan=True, allow_infinity=True), max_size=200))
def test_the_compiled_and_python_paths_pack_alike(values):
    """The same bytes (NaN payloads included) or the same refusal, from either path."""
    for pack in (pack_tokens, pack_log_probs):
        outcomes = []
        for name in PATHS:
            with path(name):
                outcomes.append(_outcome(pack, values))
        assert outcomes[0] == outcomes[1], (pack.__name__, values)


@pytest.mark.parametrize("name", PATHS)
def test_all_bool_token_ids_are_refused_as_before(name):
    with path(name):
        with pytest.raises(EventValidationError, match="dtype bool"):
            pack_tokens([True, False])
        assert pack_tokens([1, True]) == np.array([1, 1], dtype="<i4").tobytes()  # numpy's int dtype takes a bool among ints


def test_the_compiled_packers_take_only_the_common_case():
    """Anything but a list of exact ints in int32 range (exact floats within float32) is handed back
    (None) for the Python path to pack or refuse in its own words."""
    if not speedups.available():
        pytest.skip(speedups.unavailable_reason())
    fast = speedups._compiled

    class Ids(list):
        pass

    assert fast.pack_int32([1, -(2**31), 2**31 - 1]) == np.array([1, -(2**31), 2**31 - 1], dtype="<i4").tobytes()
    for other in ([1, True], [1, np.int64(2)], [2**31], [-(2**31) - 1], [2**70], [1.0], Ids([1]), (1, 2)):
        assert fast.pack_int32(other) is None, other
    assert fast.pack_float32([-0.5, 0.1, float("inf")]) == np.array([-0.5, 0.1, np.inf], dtype="<f4").tobytes()
    for other in ([-1], [0.5, np.float64(0.5)], [1e39], [-1e39], [True], (0.5,)):
        assert fast.pack_float32(other) is None, other
    with pytest.raises(TypeError, match="expected two lists or tuples, found dict and list"):
        fast.leading_identical({}, [])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=600), st.booleans())
def test_all_finite_answers_as_numpy_for_any_float32s_short_or_long(values, as_bits):
    """The compiled test, the sum test (short runs) and numpy's (long runs) agree with numpy's answer on
    every input, NaNs of any payload, infinities of either sign, subnormals and float32's largest values included."""
    raw = np.asarray(values, dtype="<f4").tobytes()
    if as_bits and raw:  # a NaN with an arbitrary payload, which no float literal gives
        raw = raw[:-4] + (0x7F800001 + len(values)).to_bytes(4, "little")
    for name in PATHS:
        with path(name):
            assert all_finite(raw) == bool(np.isfinite(np.frombuffer(raw, "<f4")).all()), name


@pytest.mark.parametrize("name", PATHS)
def test_all_finite_finds_a_nan_or_infinity_among_huge_finite_values(name):
    big = np.full(200, np.finfo(np.float32).max, dtype="<f4")
    with path(name):
        assert all_finite(big.tobytes()) and all_finite((-big).tobytes())
        for bad in (np.inf, -np.inf, np.nan):
            mixed = big.copy()
            mixed[7] = bad
            assert not all_finite(mixed.tobytes())
        both = np.array([np.inf, -np.inf], dtype="<f4")  # their sum is NaN: still not finite
        assert not all_finite(both.tobytes())
