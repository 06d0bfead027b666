"""Token ids and log-probs given as a list pack through ``array`` (the fast
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
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's cast of a double past float32 warns; array's does not
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
