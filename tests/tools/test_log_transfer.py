"""The copy behind ``agentlog export`` and ``import`` (``tools/log_transfer.py``), between two file
logs: where it stops, and what its error names, when the source is damaged or its LSNs skip. (The
copies between JetStream and directories are tested end to end in test_cli_nats.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agentlog.events import FileLog, read_log
from agentlog.events.log.format import list_segments, segment_name
from agentlog.events.schema.types import CommandRan, SessionOpened
from agentlog.tools.log_transfer import FLUSH_RECORDS, CopyError, ReplayClock, copy_records

N = 300


def _source(d: Path) -> None:
    """``N`` records of one session, each appended alone with a timestamp of its own (as a stream's are)."""
    ticks = itertools.count(1_000)
    lg = FileLog.open(d, clock=lambda: next(ticks))
    lg.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1))])
    for seq in range(1, N):
        lg.append_batch([("s", seq, CommandRan(command=f"step {seq}", exit_code=0, output_tail=f"MARK-{seq:04d}-" * 8))])
    lg.close()


def _copy(records, d: Path) -> tuple[str, int]:
    """Copy into a new log at ``d``: the error's text and the records the copy holds afterwards."""
    clock = ReplayClock()
    dest = FileLog.open(d, fsync="never", clock=clock, fence=False)
    try:
        with pytest.raises(CopyError) as caught:
            copy_records(records, dest, clock, where="SRC -> DST", per_record_ts=False)
    finally:
        dest.close()
    return str(caught.value), len(list(read_log(d)))


def test_a_damaged_source_is_named_at_the_lsn_of_the_record_it_could_not_give(tmp_path):
    assert N < FLUSH_RECORDS  # the whole source is one append: the error must not name the append's first LSN
    src = tmp_path / "src"
    _source(src)
    seg = src / segment_name(list_segments(src)[0])
    data = bytearray(seg.read_bytes())
    at = data.index(b"MARK-0200-")
    data[at] ^= 0xFF  # a flipped byte in record 200's payload: its frame's CRC no longer holds
    seg.write_bytes(bytes(data))
    message, copied = _copy(read_log(src, raw=True), tmp_path / "copy")
    assert message.startswith("SRC -> DST: at lsn 200: "), message
    assert "CRC" in message, message
    assert copied == 0  # the records held for the append are not written; the export removes what it staged


def test_a_gap_in_the_sources_lsns_is_named_before_anything_after_it_is_written(tmp_path):
    _source(tmp_path / "src")
    records = list(read_log(tmp_path / "src", raw=True))
    skipping = records[:200] + [r._replace(lsn=r.lsn + 1) for r in records[200:]]
    message, copied = _copy(iter(skipping), tmp_path / "copy")
    assert message == ("SRC -> DST: record at lsn 201, but the copy is at lsn 200 "
                       "(the source's LSNs must run from 0 without a gap)"), message
    assert copied == 0
