"""The writer's inlined framing produces exactly the reference frame layout,
for small payloads (one piece with their header) and large ones (their own iovec)."""

from __future__ import annotations

import pytest

from agentlog.events import FileLog
from agentlog.events.log.format import FLAG_TERMINAL, SEG_HDR_SIZE, encode_frame, pack_segment_header
from agentlog.events.schema.types import SessionDropped, TurnRecorded, encode_body
from event_samples import small_event
from log_helpers import seg_path

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")


def test_written_frames_equal_the_reference_encoding(tmp_path):
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
