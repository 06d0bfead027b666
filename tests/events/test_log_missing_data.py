"""Readers never report an empty log when acknowledged records are missing:
with the only segment emptied, cut to its header or deleted, every lock-free
reader (read_log, follow_log, verify_log and the CLI on top of them) checks
the DURABLE watermark as recovery does and names the missing LSN range. A
middle segment lost or cut while later segments exist is corruption to the
readers as it is to verify, with or without the watermark, never the end of
a shorter log."""

from __future__ import annotations

import asyncio
import os

import pytest

from agentlog.events import FileLog, LogCorruption, follow_log, read_log, verify_log
from agentlog.events.log.format import DURABLE_NAME, INDEX_NAME, SEG_HDR_SIZE, list_segments, segment_name
from agentlog.events.schema.types import CommandRan, SessionOpened, SessionStarted
from log_helpers import frame_offsets, seg_path, write_small_log
from agentlog.tools.cli import main

DAMAGE = ["emptied", "cut_to_header", "deleted"]


def _damaged(tmp_path, how: str):
    d = tmp_path / "log"
    write_small_log(d, 12)
    seg = seg_path(d)
    if how == "emptied":
        os.truncate(seg, 0)
    elif how == "cut_to_header":
        os.truncate(seg, SEG_HDR_SIZE)
    else:
        seg.unlink()
    return d, seg


@pytest.mark.parametrize("how", DAMAGE)
def test_read_log_raises_naming_the_missing_range(tmp_path, how):
    d, seg = _damaged(tmp_path, how)
    with pytest.raises(LogCorruption, match=r"lsn 0\.\.11 were acknowledged; they are missing") as info:
        list(read_log(d))
    assert (seg.name if how != "deleted" else "no segment files exist") in str(info.value)
    # Records not claimed by the watermark are not demanded.
    assert list(read_log(d, durable_only=False)) == []
    assert list(read_log(d, 12)) == []


@pytest.mark.parametrize("how", DAMAGE)
def test_follow_log_raises_instead_of_waiting_forever(tmp_path, how):
    d, _seg = _damaged(tmp_path, how)

    async def first():
        async for env in follow_log(d, poll_s=0.01):
            return env

    with pytest.raises(LogCorruption, match=r"lsn 0\.\.11 were acknowledged; they are missing"):
        asyncio.run(asyncio.wait_for(first(), 5))


@pytest.mark.parametrize("how", DAMAGE)
def test_verify_reports_corrupt(tmp_path, how):
    d, seg = _damaged(tmp_path, how)
    rep = verify_log(d)
    assert rep.status == "corrupt" and not rep.ok
    if how == "emptied":  # its header is gone too, and the watermark says it held records
        assert seg.name in rep.problem and "header" in rep.problem
    else:
        assert "lsn 0..11" in rep.problem and "missing" in rep.problem


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("cmd", [["replay"], ["stats"], ["reconstruct", "-o", "{TMP}/out.jsonl"]], ids=lambda c: c[0])
def test_cli_readers_exit_1_with_one_line(tmp_path, capsys, how, cmd):
    d, _seg = _damaged(tmp_path, how)
    capsys.readouterr()
    args = [cmd[0], str(d), *(a.replace("{TMP}", str(tmp_path)) for a in cmd[1:])]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 1, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentlog: error: "), err
    assert "lsn 0..11 were acknowledged; they are missing" in lines[0]


def _four_segment_log(d) -> int:
    """11 records of one session in 4 segments (3 + 3 + 3 + 2 records); returns the record count."""
    lg = FileLog.open(d, segment_bytes=900, max_record_bytes=4096)
    seq = 0
    for n in (3, 1, 2, 3, 2):
        lg.append_batch([("s", s, SessionOpened(group_id="g", group_size=1) if s == 0 else SessionStarted() if s == 1
                          else CommandRan(command=f"c{s}", output_tail="F." * 60)) for s in range(seq, seq + n)])
        seq += n
    lg.close()
    return seq


@pytest.mark.usefixtures("codec")
@pytest.mark.parametrize("damage", ["deleted", "emptied", "cut_in_header", "cut_after_first_frame"])
def test_a_damaged_middle_segment_of_a_log_without_watermark_or_index_is_corruption(tmp_path, damage):
    """A log copied without DURABLE and INDEX (read_log's "copied log"): a middle segment lost
    or cut while later segments exist is corruption, as verify says; once the reader ended the
    log there and left the later segments' records out without a word."""
    d = tmp_path / "log"
    n = _four_segment_log(d)
    segs = list_segments(d)
    assert len(segs) >= 3
    (d / DURABLE_NAME).unlink()
    (d / INDEX_NAME).unlink()
    mid = d / segment_name(segs[1])
    data = mid.read_bytes()
    if damage == "deleted":
        mid.unlink()
    elif damage == "emptied":
        mid.write_bytes(b"")
    elif damage == "cut_in_header":
        mid.write_bytes(data[:20])
    else:
        mid.write_bytes(data[: frame_offsets(d, 1)[0][1]])
    assert verify_log(d).status == "corrupt"
    for durable_only in (True, False):
        with pytest.raises(LogCorruption) as exc:
            got = list(read_log(d, durable_only=durable_only))
            pytest.fail(f"read {len(got)} of {n} records without an error; later segments hold lsn {segs[2]}..{n - 1}")
        # Named: the lost segment's successor, or the cut one; and the last record read before it.
        assert exc.value.segment in (mid.name, segment_name(segs[2])) and exc.value.last_good_lsn < segs[2], str(exc.value)


@pytest.mark.usefixtures("codec")
def test_a_torn_header_of_a_middle_segment_is_named_by_the_readers_error(tmp_path):
    """With the watermark the read raised, but blamed the previous, intact segment ("ends at
    offset N ... lsn 4..10 are missing") although lsn 7..10 are on disk: it names the segment
    whose header is torn, as verify does."""
    d = tmp_path / "log"
    _four_segment_log(d)
    segs = list_segments(d)
    mid = d / segment_name(segs[1])
    mid.write_bytes(mid.read_bytes()[:20])
    rep = verify_log(d)
    assert rep.status == "corrupt" and rep.segment == mid.name
    with pytest.raises(LogCorruption) as exc:
        list(read_log(d))
    assert exc.value.segment == mid.name and exc.value.last_good_lsn == segs[1] - 1, str(exc.value)
