"""The reading commands on a log written by a newer agentlog
(``tests/fixtures/future_log``: two unknown event types, a new finish reason,
an extra field): verify, replay and stats show what they do not understand;
reconstruct refuses in one line that names the tag and says to upgrade."""

from __future__ import annotations

import json
from pathlib import Path

from cli_helpers import agentlog

FUTURE_LOG = str(Path(__file__).resolve().parents[1] / "fixtures" / "future_log")


def test_verify_says_ok_with_a_note():
    res = agentlog("verify", FUTURE_LOG)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith(": ok, 6 records (lsn 0..5) in 1 segments, 781 bytes, 1 open sessions; "
                                       "note: 2 records of unknown types (newer writer): tags checkpoint_pruned, turn_scored")


def test_replay_shows_unknown_events_with_their_tag():
    res = agentlog("replay", FUTURE_LOG)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 6
    assert "turn_recorded" in lines[2] and "finish tool_calls" in lines[2]
    assert "turn_scored" in lines[3] and "running -> running" in lines[3]
    assert "UNKNOWN event type (written by a newer agentlog), fields: turn_index, score, scorer" in lines[3]
    assert "checkpoint_pruned" in lines[5] and "running -> finished" in lines[4]
    res = agentlog("replay", FUTURE_LOG, "--json")
    assert res.returncode == 0, res.stderr
    scored = json.loads(res.stdout.splitlines()[3])
    assert scored["type"] == "turn_scored" and scored["unknown"] is True and scored["score"] == 0.5


def test_stats_count_unknown_events_per_tag():
    res = agentlog("stats", FUTURE_LOG)
    assert res.returncode == 0, res.stderr
    assert "unknown events checkpoint_pruned (1), turn_scored (1)" in res.stdout
    assert "finish tool_calls (1)" in res.stdout
    stats = json.loads(agentlog("stats", FUTURE_LOG, "--json").stdout)
    assert stats["unknown_events"] == {"checkpoint_pruned": 1, "turn_scored": 1}
    assert stats["sessions"]["finished"] == 1


def test_reconstruct_exits_1_naming_the_tag_and_saying_upgrade(tmp_path):
    res = agentlog("reconstruct", FUTURE_LOG, "--out", str(tmp_path / "samples.jsonl"))
    assert res.returncode == 1
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in res.stderr
    assert err[0].endswith(
        "lsn 3, session 's-0': event type 'turn_scored' is unknown to this version of agentlog "
        "(the log was written by a newer one); upgrade agentlog to reduce this log"
    )


def test_an_unknown_events_fields_never_overwrite_the_records_header():
    """replay --json merged a newer writer's fields after the header: a field named session_id or
    lsn misreported where the record lies. The header wins; the stored fields are all still shown."""
    from agentlog.events.schema.types import Envelope, UnknownEvent
    from agentlog.tools.cmd_replay import step_json

    env = Envelope(7, "s", 3, 1, UnknownEvent("session_forked", {"session_id": "child", "lsn": 99, "depth": 2}))
    obj = step_json(env, None, None)
    assert (obj["lsn"], obj["session_id"], obj["type"], obj["unknown"]) == (7, "s", "session_forked", True)
    assert obj["depth"] == 2 and obj["shadowed_fields"] == {"session_id": "child", "lsn": 99}  # every stored field still shown
