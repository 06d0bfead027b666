"""One lifecycle check, four commands: a ``session_seq`` gap, a repeat and an
event after the terminal one are found by ``reconstruct``, ``replay``,
``stats`` and ``verify``, each naming the LSN, the session and the kind, each
reacting in its documented way (reconstruct and verify exit 1, replay shows
the violation and exits 0, stats counts it and exits 1 after printing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentlog.events.log.format import DURABLE_NAME, FLAG_TERMINAL, encode_frame, pack_durable, pack_segment_header, segment_name
from agentlog.events.schema.types import (
    TERMINAL_EVENT_TYPES,
    RewardAssigned,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    encode_body,
)
from cli_helpers import agentlog

EPOCH = 1
TS0 = 1_800_000_000_000_000_000


def write_raw_log(target: Path, records: list[tuple[str, int, Any]]) -> Path:
    """Write ``(session_id, session_seq, body)`` records as given, LSN 0.., as
    one segment plus its DURABLE watermark: a writer that checks nothing
    (FileLog refuses a wrong ``session_seq``, so bad logs are built here)."""
    target.mkdir(parents=True)
    frames = [pack_segment_header(EPOCH, 0)]
    for lsn, (sid, seq, body) in enumerate(records):
        flags = FLAG_TERMINAL if isinstance(body, TERMINAL_EVENT_TYPES) else 0
        frames.append(encode_frame(lsn, seq, TS0 + lsn * 1_000_000, flags, sid.encode(), encode_body(body)))
    (target / segment_name(0)).write_bytes(b"".join(frames))
    (target / DURABLE_NAME).write_bytes(pack_durable(len(records), EPOCH))
    return target


def _opened() -> SessionOpened:
    return SessionOpened(group_id="g", group_size=2)


#: name -> (records, (lsn, session, kind) of the one violation they hold).
BAD_LOGS: dict[str, tuple[list[tuple[str, int, Any]], tuple[int, str, str]]] = {
    "gap": (
        [
            ("a", 0, _opened()),
            ("a", 1, SessionStarted()),
            ("b", 0, SessionOpened(group_id="g", group_size=2, sample_index=1)),
            ("a", 3, RewardAssigned(reward=1.0)),  # seq 2 is missing
            ("a", 4, SessionFinished(reward=None)),
            ("b", 1, SessionStarted()),
            ("b", 2, SessionFinished(reward=0.0)),
        ],
        (3, "a", "seq_gap"),
    ),
    "repeat": (
        [
            ("a", 0, _opened()),
            ("a", 1, SessionStarted()),
            ("b", 0, SessionOpened(group_id="g", group_size=2, sample_index=1)),
            ("a", 1, RewardAssigned(reward=1.0)),  # seq 1 again
            ("a", 2, SessionFinished(reward=1.0)),
            ("b", 1, SessionStarted()),
            ("b", 2, SessionFinished(reward=0.0)),
        ],
        (3, "a", "seq_repeat"),
    ),
    "after_terminal": (
        [
            ("a", 0, _opened()),
            ("a", 1, SessionStarted()),
            ("a", 2, SessionFinished(reward=1.0)),
            ("b", 0, SessionOpened(group_id="g", group_size=2, sample_index=1)),
            ("a", 3, RewardAssigned(reward=0.0)),  # after a's terminal event
            ("b", 1, SessionStarted()),
            ("b", 2, SessionFinished(reward=0.0)),
        ],
        (4, "a", "after_terminal"),
    ),
}


@pytest.fixture(params=sorted(BAD_LOGS))
def bad_log(request, tmp_path) -> tuple[Path, tuple[int, str, str]]:
    records, violation = BAD_LOGS[request.param]
    return write_raw_log(tmp_path / f"{request.param}.log", records), violation


def _names(text: str, violation: tuple[int, str, str]) -> bool:
    lsn, sid, kind = violation
    return f"lsn {lsn}" in text and f"session {sid!r}" in text and kind in text


def test_reconstruct_exits_1_naming_lsn_session_and_kind(bad_log, tmp_path):
    path, violation = bad_log
    res = agentlog("reconstruct", str(path), "-o", str(tmp_path / "out.jsonl"))
    assert res.returncode == 1, (res.stdout, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("agentlog: error: ") and _names(line, violation), line


def test_replay_shows_the_violation_in_place_and_exits_0(bad_log):
    path, violation = bad_log
    res = agentlog("replay", str(path))
    assert res.returncode == 0, (res.stdout, res.stderr)
    shown = [line for line in res.stdout.splitlines() if "!! VIOLATION" in line]
    assert len(shown) == 1 and _names(shown[0], violation), res.stdout
    assert _names(res.stderr, violation) and "1 lifecycle violation(s) shown" in res.stderr
    steps = [json.loads(line) for line in agentlog("replay", str(path), "--json").stdout.splitlines()]
    flagged = [(s["lsn"], s["session_id"], s["violations"]) for s in steps if "violations" in s]
    lsn, sid, kind = violation
    assert [(f[0], f[1]) for f in flagged] == [(lsn, sid)] and flagged[0][2][0].startswith(f"{kind}: ")


def test_stats_counts_the_violation_shows_the_count_and_exits_1(bad_log):
    path, violation = bad_log
    lsn, sid, kind = violation
    res = agentlog("stats", str(path))
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert f"VIOLATIONS 1: {kind} (1)" in res.stdout, res.stdout
    assert f"  lsn {lsn} session {sid!r}: {kind}: " in res.stdout
    assert _names(res.stderr, violation) and "1 lifecycle violation(s) counted" in res.stderr
    v = json.loads(agentlog("stats", str(path), "--json").stdout)["violations"]
    assert v["count"] == 1 and v["by_kind"] == {kind: 1}
    assert [(f["lsn"], f["session_id"], f["kind"]) for f in v["first"]] == [violation]


def test_verify_exits_1_naming_lsn_session_and_kind(bad_log):
    path, violation = bad_log
    lsn, sid, kind = violation
    res = agentlog("verify", str(path))
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = res.stdout.splitlines()
    assert ": ok, 7 records" in lines[0]  # the frames are sound: the lifecycle check finds it
    assert lines[1:] == [lines[1]] and lines[1].startswith(f"  lsn {lsn} session {sid!r}: {kind}: "), lines
    assert _names(res.stderr, violation) and "1 lifecycle violation(s)" in res.stderr


def test_the_same_log_without_the_fault_passes_all_four(tmp_path):
    records = [r for r in BAD_LOGS["after_terminal"][0] if not (r[0] == "a" and r[1] == 3)]
    path = write_raw_log(tmp_path / "good.log", records)
    assert agentlog("verify", str(path)).returncode == 0
    assert agentlog("stats", str(path)).returncode == 0
    res = agentlog("replay", str(path))
    assert res.returncode == 0 and "VIOLATION" not in res.stdout and res.stderr == ""
    assert agentlog("reconstruct", str(path), "-o", str(tmp_path / "out.jsonl")).returncode == 0
