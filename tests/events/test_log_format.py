"""The writer's inlined framing produces exactly the reference frame layout,
on both checksum paths (in place via the C library, or via bytes)."""

from __future__ import annotations

import pytest

import events.log as log_mod
from events.log import FileLog
from events.log_format import FLAG_TERMINAL, SEG_HDR_SIZE, encode_frame, pack_segment_header
from events.types import SessionDropped, TurnRecorded, encode_body
from event_samples import small_event
from log_helpers import seg_path


@pytest.mark.parametrize("in_place_crc", [True, False])
def test_written_frames_equal_the_reference_encoding(tmp_path, monkeypatch, in_place_crc):
    if not in_place_crc:
        monkeypatch.setattr(log_mod, "_PTR_CRC", None)
    elif log_mod._PTR_CRC is None:
        pytest.skip("google-crc32c's C library is not loadable here")
    big = TurnRecorded(turn_index=0, output_ids=list(range(3000)), output_log_probs=[-0.5] * 3000)
    recs = [("s", 0, small_event(0)), ("s", 1, big), ("s", 2, small_event(2)), ("s", 3, big), ("s", 4, SessionDropped(reason="x"))]
    lg = FileLog.open(tmp_path / "log", clock=lambda: 1234)
    lg.append_batch(recs[:3])
    lg.append_batch(recs[3:])
    lg.close()
    expect = pack_segment_header(1, 0) + b"".join(
        encode_frame(lsn, seq, 1234, FLAG_TERMINAL if isinstance(body, SessionDropped) else 0, sid.encode(), encode_body(body))
        for lsn, (sid, seq, body) in enumerate(recs)
    )
    got = seg_path(tmp_path / "log").read_bytes()
    assert got[:SEG_HDR_SIZE] == expect[:SEG_HDR_SIZE]
    assert got == expect
