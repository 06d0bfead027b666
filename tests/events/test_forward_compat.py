"""Tolerant read: a log written by a newer agentlog reads here. Unknown
tags decode to UnknownEvent, new values of known fields read as they are, and
a known tag whose fields this version cannot decode is a SchemaError (upgrade),
never LogCorruption (disk damage)."""

from __future__ import annotations

import asyncio

import pytest

from agentlog.events import SchemaError, UnknownEvent
from agentlog.events import LogCorruption, follow_log, read_log, verify_log
from agentlog.events.schema.types import SessionFinished, TurnRecorded
from future_log_shim import FUTURE_LOG, future_records, write_frames


def test_a_future_writers_log_decodes_with_unknown_events_and_new_values():
    envs = list(read_log(FUTURE_LOG))
    assert [(e.lsn, e.session_id, e.session_seq) for e in envs] == [
        (0, "s-0", 0), (1, "s-0", 1), (2, "s-0", 2), (3, "s-0", 3), (4, "s-0", 4), (5, "learner", 0)
    ]
    turn = envs[2].body
    assert type(turn) is TurnRecorded and turn.finish_reason == "tool_calls"  # read as is
    assert turn.output_tokens.tolist() == [7, 8]  # the extra tool_calls field is skipped
    assert envs[3].body == UnknownEvent("turn_scored", {"turn_index": 0, "score": 0.5, "scorer": "prm-v2"})
    assert envs[4].body == SessionFinished(reward=1.0)
    assert envs[5].body == UnknownEvent("checkpoint_pruned", {"checkpoints": ["ckpt/1", "ckpt/2"]})
    # The zero-copy reader decodes the same records.
    assert [r.decode() for r in read_log(FUTURE_LOG, raw=True)] == envs


def test_a_follower_reads_a_future_writers_log():
    async def main():
        got = []
        async for env in follow_log(FUTURE_LOG, poll_s=0.01):
            got.append(env)
            if len(got) == len(future_records()):
                return got

    assert asyncio.run(asyncio.wait_for(main(), 10)) == list(read_log(FUTURE_LOG))


def test_verify_says_ok_with_a_note_on_unknown_types():
    rep = verify_log(FUTURE_LOG)
    assert rep.status == "ok" and rep.ok and rep.records == 6
    assert rep.unknown_types == {"turn_scored": 1, "checkpoint_pruned": 1}
    assert rep.summary().endswith("; note: 2 records of unknown types (newer writer): tags checkpoint_pruned, turn_scored")


@pytest.fixture
def mismatched_log(tmp_path):
    """A log whose lsn 2 is a session_finished with metadata as a list: a
    known tag whose field this version cannot decode, then one more record."""
    path = tmp_path / "log"
    write_frames(
        path,
        [
            ("s", {"type": "session_opened", "group_id": "g", "group_size": 1}, False),
            ("s", {"type": "session_started"}, False),
            ("s", {"type": "session_finished", "metadata": ["x"]}, True),
            ("t", {"type": "session_opened", "group_id": "g2", "group_size": 1}, False),
        ],
    )
    return path


def test_a_known_tag_that_does_not_decode_is_a_schema_error_not_corruption(mismatched_log):
    it = read_log(mismatched_log)
    assert [e.lsn for e in (next(it), next(it))] == [0, 1]
    with pytest.raises(SchemaError) as info:
        next(it)
    err = info.value
    assert not isinstance(err, LogCorruption)
    assert (err.lsn, err.session_id, err.tag, err.field) == (2, "s", "session_finished", "metadata")
    msg = str(err)
    assert "offset" in msg and "lsn 2, session 's': session_finished record whose field metadata" in msg
    assert "expected `object`, got `array`" in msg and "newer agentlog? upgrade agentlog" in msg
    raw = list(read_log(mismatched_log, raw=True))
    with pytest.raises(SchemaError, match=r"^lsn 2, session 's': session_finished record"):
        raw[2].decode()


def test_verify_reports_a_schema_mismatch_and_checks_the_rest(mismatched_log):
    rep = verify_log(mismatched_log)
    assert rep.status == "schema" and not rep.ok
    assert rep.records == 4 and rep.schema_errors == 1 and rep.open_sessions == 1
    summary = rep.summary()
    assert "SCHEMA MISMATCH: 1 records this version cannot decode (upgrade agentlog)" in summary
    assert "session_finished record whose field metadata" in summary and "CORRUPT" not in summary


def test_a_payload_that_is_no_event_is_still_corruption(tmp_path):
    """Only a tagged map is a schema question; anything else with a valid CRC was never an event."""
    path = tmp_path / "log"
    write_frames(path, [("s", {"no_type": 1}, False)])
    with pytest.raises(LogCorruption, match="does not decode as a schema-v1 event"):
        list(read_log(path))
    assert verify_log(path).status == "corrupt"
