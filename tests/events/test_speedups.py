"""The schema's compiled speedups (agentlog.events.schema.speedups): the identity
comparison of the turn encoding agrees with its Python path, and the module is
chosen, switched off and refused when stale as the file log's codec is (the
packing's differential tests are in test_packing.py)."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.schema import speedups
from agentlog.events.schema.turn_delta import _repeated_objects

from log_helpers import with_pure_switch
from test_packing import PATHS, path

_POOL = [{"role": "user", "content": str(i)} for i in range(6)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(range(6)), max_size=12), st.lists(st.sampled_from(range(6)), max_size=12),
       st.integers(0, 12), st.booleans())
def test_repeated_objects_agree_on_both_paths(held_ids, new_ids, shared, equal_copies):
    """Leading identical objects, never equal ones: a copy of a held message (equal, another
    object) ends the run on either path."""
    held = tuple(_POOL[i] for i in held_ids)
    new = list(held[:shared]) + [dict(_POOL[i]) if equal_copies else _POOL[i] for i in new_ids]
    found = []
    for name in PATHS:
        with path(name):
            found.append(_repeated_objects(new, held))
    expected = next((i for i, (a, b) in enumerate(zip(new, held)) if a is not b), min(len(new), len(held)))
    assert found == [expected, expected]


def test_repeated_objects_of_a_non_list_take_the_python_path():
    held = tuple(_POOL[:3])
    for name in PATHS:
        with path(name):
            assert _repeated_objects(iter_list(held[:2]), held) == 2


class iter_list(list):  # noqa: N801 - a list subclass: the compiled comparison takes exact lists only
    pass


def test_the_environment_variable_switches_the_speedups_off_as_it_does_the_codec():
    if not speedups.available():
        pytest.skip(speedups.unavailable_reason())
    code = "from agentlog.events.schema import speedups; print(speedups.native is not None)"
    on = with_pure_switch(code, None)
    assert on.returncode == 0 and on.stdout.strip() == "True", on.stderr
    off = with_pure_switch(code, "1")
    assert off.returncode == 0 and off.stdout.strip() == "False", off.stderr
    bad = with_pure_switch(code, "maybe")
    assert bad.returncode != 0 and "AGENTLOG_PURE_PYTHON='maybe'" in bad.stderr and "expected 1/true/yes" in bad.stderr


def test_a_stale_speedups_module_is_named_and_not_used():
    if not speedups.available():
        pytest.skip(speedups.unavailable_reason())
    assert speedups.stale_reason(speedups._compiled) == ""  # the one built here is current
    reason = speedups.stale_reason(types.SimpleNamespace(API=speedups.API + 1))
    assert f"its API {speedups.API + 1}, this version needs {speedups.API}" in reason and "pip install -e ." in reason
    assert "schema speedups" in reason and "pure-Python path is used meanwhile" in reason


def test_use_native_refuses_what_was_not_built(monkeypatch):
    monkeypatch.setattr(speedups, "native", speedups.native)  # restored after
    monkeypatch.setattr(speedups._ACCELERATOR, "module", None)
    monkeypatch.setattr(speedups._ACCELERATOR, "missing", "the compiled schema speedups module is not built (no compiler)")
    with pytest.raises(RuntimeError, match="not built"):
        speedups.use_native(True)
    speedups.use_native(False)
    assert speedups.native is None
