"""The id filter's bit probes in the compiled codec (``bloom_probe``) set and
find exactly the bits of the pure-Python loop: a filter built by either, or
a checkpoint's filter restored by the other, gives the same answers."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.log import framecodec
from agentlog.reducers.lifecycle import IdFilter

if not framecodec.available():
    if os.environ.get("CI") == "true":
        raise AssertionError(f"CI=true: the compiled codec must be built here ({framecodec.unavailable_reason()})")
    pytest.skip(framecodec.unavailable_reason(), allow_module_level=True)


def _build(native: bool, capacity: int, ids: list[str], probes: list[str]):
    saved = framecodec.native
    framecodec.use_native(native)
    try:
        f = IdFilter(capacity)
        added = [f.add(s) for s in ids]
        found = [s in f for s in probes]
        return added, found, f.to_snapshot()
    finally:
        framecodec.native = saved


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=200),
       others=st.lists(st.text(min_size=1, max_size=12), max_size=50), capacity=st.integers(1, 64))
def test_the_compiled_probes_set_and_find_the_bits_the_python_loop_does(ids, others, capacity):
    """Layers grow past ``capacity``, so the probes of older layers run too."""
    compiled = _build(True, capacity, ids, ids + others)
    pure = _build(False, capacity, ids, ids + others)
    assert compiled == pure
    assert all(compiled[1][: len(ids)])  # no false negatives


def test_a_filter_restored_from_a_snapshot_answers_alike_under_either_codec():
    ids = [f"s{i}" for i in range(3000)]
    _added, _found, snap = _build(False, 1000, ids, [])
    saved = framecodec.native
    try:
        for native in (True, False):
            framecodec.use_native(native)
            f = IdFilter.from_snapshot(snap)
            assert all(s in f for s in ids)
            assert [f.add(s) for s in ids[:50]] == [True] * 50
    finally:
        framecodec.native = saved


def test_bloom_probe_refuses_a_bit_count_its_array_cannot_hold():
    native = framecodec._compiled
    with pytest.raises(ValueError, match="bloom_probe: 65 bits over a 8-byte array"):
        native.bloom_probe(bytearray(8), 65, 1, 1, 16, True)
    with pytest.raises(OverflowError):
        native.bloom_probe(bytearray(8), 64, -1, 1, 16, False)
    with pytest.raises(BufferError):
        native.bloom_probe(b"\x00" * 8, 64, 1, 1, 16, True)  # setting needs a writable array
