"""Recovery and verify scan the log with the same walk (events.log.scan.LogWalk):
for the same damage they agree on what is a torn tail and what is corruption,
and name the same problem (message, segment, offset, last good LSN)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, LogCorruption, verify_log
from agentlog.events.log.format import DURABLE_NAME, INDEX_NAME, SEG_HDR_SIZE, list_segments, segment_name
from agentlog.events.schema.types import SessionOpened
from log_helpers import flip_bit, write_small_log

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")

#: Small segments, so that a small log spans several.
SEGMENT_BYTES = 512
RECORDS = 40
#: Records written past the durable watermark (as after a crash before the sync).
UNACKED = 3


def _source(d: Path) -> Path:
    """A multi-segment log whose last UNACKED records lie past the watermark,
    without its INDEX: recovery then scans every segment, as verify does (with
    a checkpoint it trusts, recovery starts where the checkpoint says)."""
    write_small_log(d, RECORDS, segment_bytes=SEGMENT_BYTES)
    durable = (d / DURABLE_NAME).read_bytes()
    lg = FileLog.open(d, segment_bytes=SEGMENT_BYTES)
    for i in range(UNACKED):
        lg.append_batch([(f"late{i}", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    (d / DURABLE_NAME).write_bytes(durable)
    (d / INDEX_NAME).unlink()
    assert len(list_segments(d)) >= 4
    return d


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return _source(tmp_path_factory.mktemp("agree") / "src")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _assert_agree(d: Path) -> str:
    """Verify the log, then open it as its writer: both must reach the same verdict."""
    rep = verify_log(d)
    if rep.status == "corrupt":
        with pytest.raises(LogCorruption) as info:
            FileLog.open(d).close()
        err = info.value
        assert (str(err), err.segment, err.offset, err.last_good_lsn) == (
            rep.problem,
            rep.segment,
            rep.offset,
            rep.last_good_lsn,
        ), rep.summary()
    else:
        assert rep.status in ("ok", "torn"), rep.summary()
        lg = FileLog.open(d, segment_bytes=SEGMENT_BYTES)
        try:
            assert lg.next_lsn == rep.next_lsn, rep.summary()
        finally:
            lg.close()
        assert verify_log(d).status == "ok"
    return rep.status


def test_a_missing_middle_segment_is_the_same_corruption(source, tmp_path):
    d = _copy(source, tmp_path / "log")
    gone = list_segments(d)[1]
    (d / segment_name(gone)).unlink()
    assert _assert_agree(d) == "corrupt"


def test_missing_segment_files_are_the_same_corruption(source, tmp_path):
    d = _copy(source, tmp_path / "log")
    for first in list_segments(d):
        (d / segment_name(first)).unlink()
    assert _assert_agree(d) == "corrupt"


def test_a_damaged_middle_segment_is_the_same_corruption(source, tmp_path):
    d = _copy(source, tmp_path / "log")
    flip_bit(d / segment_name(list_segments(d)[1]), (SEG_HDR_SIZE + 20) * 8)
    assert _assert_agree(d) == "corrupt"


def test_a_torn_tail_is_cut_where_verify_says(source, tmp_path):
    d = _copy(source, tmp_path / "log")
    last = d / segment_name(list_segments(d)[-1])
    last.write_bytes(last.read_bytes()[:-5])
    assert _assert_agree(d) == "torn"


def test_a_zeroed_last_header_past_the_watermark_is_torn(source, tmp_path):
    d = _copy(source, tmp_path / "log")
    last = d / segment_name(list_segments(d)[-1])
    data = last.read_bytes()
    last.write_bytes(bytes(SEG_HDR_SIZE) + data[SEG_HDR_SIZE:])
    assert _assert_agree(d) in ("torn", "corrupt")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(segment=st.integers(0, 100), bit=st.integers(0, 1 << 20))
def test_any_flipped_bit_gets_the_same_verdict(source, tmp_path_factory, segment, bit):
    d = _copy(source, tmp_path_factory.mktemp("flip") / "log")
    segs = list_segments(d)
    path = d / segment_name(segs[segment % len(segs)])
    flip_bit(path, bit % (path.stat().st_size * 8))
    _assert_agree(d)
