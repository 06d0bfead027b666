"""The copy behind ``agentlog export`` and ``import`` (``tools/log_transfer.py``), between two file
logs: where it stops, and what its error names, when the source is damaged or its LSNs skip. (The
copies between JetStream and directories are tested end to end in test_cli_nats.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events import Envelope, FileLog, read_log
from agentlog.events.log.format import list_segments, segment_name
from agentlog.events.log.read import RawRecord
from agentlog.events.schema.types import CommandRan, SessionOpened
from agentlog.tools import log_transfer
from agentlog.tools.log_transfer import FLUSH_RECORDS, CopyError, ReplayClock, _appends, copy_records

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


@settings(max_examples=100, deadline=None)
@given(
    stamps=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    sizes=st.lists(st.integers(0, 400), min_size=1, max_size=120),
    per_record_ts=st.booleans(),
    batch=st.integers(1, 9),
    flush_records=st.integers(1, 40),
    flush_bytes=st.integers(1, 5_000),
)
def test_the_copys_appends_hold_every_record_once_in_order_in_runs_a_writer_can_stamp(
        stamps, sizes, per_record_ts, batch, flush_records, flush_bytes):
    """How ``_appends`` cuts a source (small limits, so every cut is reached): every record once,
    in order; a batch of at most BATCH records, of one timestamp where the writer stamps a batch;
    one batch an append where it stamps each record; else runs gathered until an append holds
    FLUSH_RECORDS records or FLUSH_BYTES of payload (a run more at most), never fewer but the last."""
    ts = list(itertools.accumulate(stamps))  # runs of one timestamp where a step is 0
    records = [RawRecord.of_envelope(Envelope(lsn, "s", lsn, t, CommandRan(command="x", exit_code=0, output_tail="y" * sizes[lsn % len(sizes)])))
               for lsn, t in enumerate(ts)]
    with pytest.MonkeyPatch.context() as limits:
        limits.setattr(log_transfer, "BATCH", batch)
        limits.setattr(log_transfer, "FLUSH_RECORDS", flush_records)
        limits.setattr(log_transfer, "FLUSH_BYTES", flush_bytes)
        appends = list(_appends(iter(records), 0, where="w", per_record_ts=per_record_ts))
    assert [rec for runs in appends for run in runs for rec, _env in run] == records
    assert all(env == rec.decode() for runs in appends for run in runs for rec, env in run)
    for k, runs in enumerate(appends):
        assert all(0 < len(run) <= batch for run in runs)
        if per_record_ts:
            assert len(runs) == 1
            continue
        assert all(len({rec.ts_ns for rec, _ in run}) == 1 for run in runs)
        held, staged = sum(map(len, runs)), sum(len(rec.payload) for run in runs for rec, _ in run)
        before_last = sum(map(len, runs[:-1])), sum(len(rec.payload) for run in runs[:-1] for rec, _ in run)
        assert before_last[0] < flush_records and before_last[1] < flush_bytes  # it took runs only while short of both
        if k < len(appends) - 1:
            assert held >= flush_records or staged >= flush_bytes
