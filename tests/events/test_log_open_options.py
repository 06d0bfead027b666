"""FileLog.open refuses a bad option before anything is made, naming the option and what was
expected, instead of accepting it and failing later (a writer fatal at its first append)."""

from __future__ import annotations

import re

import pytest

from agentlog.events import FileLog
from agentlog.events.log.writer import MAX_RECORD_BYTES_LIMIT


@pytest.mark.parametrize("bad", [None, "0.05", -1.0, float("nan"), float("inf"), True])
def test_a_bad_interval_is_refused_at_open_not_fatal_at_the_first_append(tmp_path, bad):
    # None or "0.05" used to be accepted, then the first flush raised TypeError in the writer thread.
    with pytest.raises(ValueError, match=rf"^interval_s: expected a finite number of seconds >= 0, found {re.escape(repr(bad))}$"):
        FileLog.open(tmp_path / "log", fsync="interval", interval_s=bad)
    assert not (tmp_path / "log").exists()


@pytest.mark.parametrize("bad", [63, MAX_RECORD_BYTES_LIMIT + 1, 1 << 40])
def test_a_max_record_bytes_no_frame_can_hold_is_refused(tmp_path, bad):
    # A frame's length is a u32: a cap above it promised records the format cannot store.
    with pytest.raises(ValueError, match=rf"^max_record_bytes: expected 64\.\.{MAX_RECORD_BYTES_LIMIT} .*found {bad}$"):
        FileLog.open(tmp_path / "log", max_record_bytes=bad)


def test_the_largest_max_record_bytes_and_a_zero_interval_are_taken(tmp_path):
    FileLog.open(tmp_path / "log", fsync="interval", interval_s=0, max_record_bytes=MAX_RECORD_BYTES_LIMIT).close()
