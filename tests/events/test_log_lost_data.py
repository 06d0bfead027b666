"""Whole segments removed from a log never pass for a shorter, healthy log.

A log starts at lsn 0 (nothing removes its head), so a missing first segment
is damage; the INDEX checkpoint and FENCE are cross-checked against the
segments on disk, so a last segment deleted together with DURABLE, or every
segment deleted, is damage too. The writer refuses to open such a log (it
never reopens it at a lower LSN or at lsn 0), and every reader (read_log,
follow_log, read_partitions, verify_log and the CLI on top of them) raises
or reports it, naming the log directory, the file and the LSNs."""

from __future__ import annotations

import asyncio
import os

import pytest

from agentlog.events import FileLog, LogCorruption, follow_log, read_log, verify_log
from agentlog.events.log.format import DURABLE_NAME, FENCE_NAME, INDEX_NAME, list_segments, read_fence, segment_name
from agentlog.events.log.partitions import partition_dir, read_partitions
from agentlog.tools.cli import main
from log_helpers import write_small_log

#: Small segments: 40 records span several of them.
SEG = dict(segment_bytes=1024)


def _log(d, n=40):
    write_small_log(d, n, **SEG)
    segs = list_segments(d)
    assert len(segs) >= 3 and segs[0] == 0
    return segs


def _state(d):
    """Every file's name and bytes: what a refused open must leave alone (FENCE aside)."""
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d)) if n not in (FENCE_NAME, "LOCK")}


def _verify_cli(capsys, d) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["verify", str(d)])
    out, err = capsys.readouterr()
    return code, out + err


# ---------------------------------------------------------------- the first segment


def test_a_missing_first_segment_is_corruption_for_every_reader_and_the_writer(tmp_path, capsys):
    d = tmp_path / "log"
    segs = _log(d)
    (d / segment_name(0)).unlink()
    second = segs[1]
    want = f"segment {segment_name(0)} is missing: the first segment is {segment_name(second)}, which starts at lsn {second}"

    rep = verify_log(d)
    assert rep.status == "corrupt" and not rep.ok, rep.summary()
    assert want in rep.problem and f"lsn 0..{second - 1} are missing" in rep.problem and str(d) in rep.problem
    code, out = _verify_cli(capsys, d)
    assert code == 1 and "CORRUPT" in out and want in out

    with pytest.raises(LogCorruption, match=want):
        list(read_log(d))
    with pytest.raises(LogCorruption, match=want):
        list(read_log(d, second + 3))  # a reader positioned past the hole is told too

    async def first():
        async for env in follow_log(d, poll_s=0.01):
            return env

    with pytest.raises(LogCorruption, match=want):
        asyncio.run(asyncio.wait_for(first(), 5))

    before = _state(d)
    with pytest.raises(LogCorruption, match=want) as info:
        FileLog.open(d, **SEG)
    assert info.value.segment == segment_name(0) and str(d) in str(info.value)
    assert _state(d) == before  # nothing cut, moved or rewritten


def test_partitions_report_a_missing_first_segment_naming_the_partition(tmp_path):
    root = tmp_path / "parts"
    write_small_log(partition_dir(root, 0), 8)
    segs = _log(partition_dir(root, 1))
    (partition_dir(root, 1) / segment_name(0)).unlink()
    with pytest.raises(LogCorruption, match=rf"partition p0001 .*segment {segment_name(0)} is missing.*starts at lsn {segs[1]}"):
        list(read_partitions(root))


# ---------------------------------------------------------------- the last segment, with DURABLE


def test_a_last_segment_deleted_with_durable_is_corruption_and_the_writer_does_not_reopen_lower(tmp_path, capsys):
    d = tmp_path / "log"
    segs = _log(d)
    (d / segment_name(segs[-1])).unlink()
    (d / DURABLE_NAME).unlink()
    want = rf"INDEX checkpoint .* says lsn {segs[-1]}\.\.39 were written; they are missing \(INDEX names segment {segment_name(segs[-1])}, not on disk\)"

    rep = verify_log(d)
    assert rep.status == "corrupt", rep.summary()
    assert str(d) in rep.problem and segment_name(segs[-2]) in rep.problem
    code, out = _verify_cli(capsys, d)
    assert code == 1 and "CORRUPT" in out

    with pytest.raises(LogCorruption, match=want):
        list(read_log(d))

    async def drain():
        async for _env in follow_log(d, poll_s=0.01):
            pass

    with pytest.raises(LogCorruption, match=want):
        asyncio.run(asyncio.wait_for(drain(), 5))

    before = _state(d)
    with pytest.raises(LogCorruption, match=want):
        FileLog.open(d, **SEG)
    after = _state(d)
    after.pop(DURABLE_NAME, None)  # the refused open may leave an empty one (no watermark)
    assert after == before  # nothing cut, moved or rewritten


def test_every_segment_deleted_with_index_and_fence_left_is_refused_not_restarted_at_lsn_0(tmp_path, capsys):
    d = tmp_path / "log"
    segs = _log(d)
    for first in segs:
        (d / segment_name(first)).unlink()
    (d / DURABLE_NAME).unlink()
    with pytest.raises(LogCorruption, match=r"no segment files exist \(last good lsn -1\), but its INDEX checkpoint .* says lsn 0\.\.39 were written; they are missing") as info:
        FileLog.open(d, **SEG)
    assert str(d) in str(info.value)
    assert list_segments(d) == [] and (d / INDEX_NAME).exists()
    # Opened again and again, it is refused again and again: never a fresh log at lsn 0.
    with pytest.raises(LogCorruption):
        FileLog.open(d, **SEG)


def test_every_segment_deleted_with_only_fence_left_is_refused(tmp_path):
    d = tmp_path / "log"
    segs = _log(d)
    FileLog.open(d, **SEG).close()  # a second writer epoch
    for first in segs:
        (d / segment_name(first)).unlink()
    for name in (DURABLE_NAME, INDEX_NAME):
        (d / name).unlink()
    epoch = read_fence(d)
    with pytest.raises(LogCorruption, match=rf"its FENCE file says writer epoch {epoch} opened it, but DURABLE and every segment file .* are missing") as info:
        FileLog.open(d, **SEG)
    assert str(d) in str(info.value) and read_fence(d) == epoch  # refused before anything was written


def test_a_log_opened_and_never_written_still_reopens_empty(tmp_path):
    """The FENCE cross-check refuses removed records only: FENCE and DURABLE
    of a log whose writers never appended are a healthy empty log."""
    d = tmp_path / "log"
    for _ in range(3):
        FileLog.open(d).close()
    assert read_fence(d) == 3 and (d / DURABLE_NAME).exists()
    with FileLog.open(d) as lg:
        assert lg.next_lsn == 0
    assert verify_log(d).status == "ok"
