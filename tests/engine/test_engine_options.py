"""Bad engine options are refused at construction, naming the option. They were accepted: a
negative drain_s cancelled every ending's in-flight work at once; a checkpoint_poll_s of 0 or
below made the checkpoint loop spin the event loop for the engine's life; a negative
status_cache was clamped, then failed at open naming another thing."""

from __future__ import annotations

import math

import pytest

from agentlog.engine import SessionEngine
from agentlog.events import MemoryLog


@pytest.mark.parametrize("option, value", [
    ("drain_s", -1.0), ("drain_s", math.nan), ("status_cache", -1), ("status_cache", 1.5),
    ("checkpoint_poll_s", -1.0), ("checkpoint_poll_s", math.nan), ("checkpoint_poll_s", 0),
    ("checkpoint_every", -1),
])
def test_a_bad_engine_option_is_refused_naming_it(option, value):
    with pytest.raises(ValueError, match=rf"^{option}: expected .*found {value!r}$"):
        SessionEngine(MemoryLog(), **{option: value})


def test_zero_drain_and_zero_status_cache_are_taken():
    SessionEngine(MemoryLog(), drain_s=0, status_cache=0, checkpoint_every=0)
