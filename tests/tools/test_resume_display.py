"""What the readers make of a crashed-and-resumed session (tests/resume_log.py): `show` marks the resume
point and the dead incarnation's records, `replay --json` carries the new events' fields, the ui's session
view holds the marker, and every other reader runs on the log with a resumed session counted once.

The log, ``write_session(path, 4, [2])``: the worker dies after turn 1's command, with turn 2's request
generating; a new incarnation resumes from the snapshot before turn 1, runs turn 1's command again and
finishes turns 2 and 3. Its LSNs (checked below, so a change to the builder shows here first):
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import urllib.request

import pytest

from resume_log import digest, write_session
from ui_helpers import start_ui

#: lsn -> what it holds.
LAYOUT = {0: "session_opened", 1: "session_started", 2: "sandbox_snapshotted", 3: "turn_delta", 4: "command_ran",
          5: "sandbox_snapshotted", 6: "turn_delta", 7: "command_ran", 8: "sandbox_snapshotted", 9: "session_resumed",
          10: "command_ran", 11: "sandbox_snapshotted", 12: "turn_delta", 13: "command_ran", 14: "sandbox_snapshotted",
          15: "turn_delta", 16: "command_ran", 17: "session_finished"}
#: The dead incarnation's records the resume made void: turn 1's command and turn 2's snapshot.
UNDONE = (7, 8)
#: lsn of each snapshot -> (turn, incarnation that took it).
SNAPSHOTS = {2: (0, 0), 5: (1, 0), 8: (2, 0), 11: (2, 1), 14: (3, 1)}


@pytest.fixture(scope="module")
def resumed_log(tmp_path_factory):
    path = tmp_path_factory.mktemp("resumed") / "run"
    asyncio.run(write_session(path, 4, [2]))
    return path


def _cli(*args: str) -> str:
    """The real `agentlog` command, run in this process (stdout)."""
    from agentlog.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([str(a) for a in args])
    assert rc == 0, (args, out.getvalue()[-500:])
    return out.getvalue()


def _read(path) -> list:
    from agentlog.events import FileLog

    log = FileLog.open(path)
    try:
        return list(log.read(0))
    finally:
        log.close()


def _dataset_rows(envs) -> dict:
    """The session's export-dataset row (tools.dataset_rows.DatasetFold), advantages all 0."""
    from agentlog.reducers.config import DEFAULT_CONFIG
    from agentlog.tools.dataset_rows import DatasetFold

    fold = DatasetFold(DEFAULT_CONFIG, lambda rewards, groups, valid: [0.0] * len(rewards))
    rows = [row for env in envs for row in fold.feed(None, env)] + fold.finish()
    (row,) = rows
    return row


def _snapshot_line(lsn: int) -> str:
    turn, incarnation = SNAPSHOTS[lsn]
    return (f"snapshot before turn {turn}: {digest(turn, incarnation)[:8]}... {3 + turn} files, {300 + turn} bytes"
            f" ({10 * turn} new) in 0.25s")


def test_replay_json_carries_the_new_events_fields(resumed_log):
    events = [json.loads(line) for line in _cli("replay", "--json", resumed_log).splitlines()]
    assert {e["lsn"]: e["type"] for e in events} == LAYOUT
    snaps = [e for e in events if e["type"] == "sandbox_snapshotted"]
    assert [(e["lsn"], e["turn_index"], e["digest"], e["files"], e["bytes"], e["seconds"]) for e in snaps] == [
        (lsn, t, digest(t, i), 3 + t, 300 + t, 0.25) for lsn, (t, i) in SNAPSHOTS.items()]
    assert all(e["state_before"] == e["state_after"] == "running" for e in snaps)
    (resumed,) = [e for e in events if e["type"] == "session_resumed"]
    assert {k: resumed[k] for k in ("incarnation", "durable_turns", "snapshot", "snapshot_turn", "worker",
                                    "state_before", "state_after")} == {
        "incarnation": 1, "durable_turns": 2, "snapshot": digest(1, 0), "snapshot_turn": 1, "worker": "w1",
        "state_before": "running", "state_after": "running"}
    text = _cli("replay", resumed_log).splitlines()
    assert "incarnation 1 on w1: keeps 2 durable turn(s), sandbox restored from " + digest(1, 0)[:8] in text[9]
    assert _snapshot_line(2) in text[2]


def test_show_marks_the_resume_after_the_last_durable_turn_and_before_the_rerun(resumed_log):
    out = _cli("show", resumed_log, "s").splitlines()
    assert out[1].startswith("outcome  finished") and out[1].endswith("resumed 1x")
    transcript = out[out.index(next(line for line in out if line.startswith("transcript"))) + 1:out.index("tree (turns as routed; leaves depth-first)")]
    (marker,) = [i for i, line in enumerate(transcript) if line.startswith("  -- resumed:")]
    line = transcript[marker]
    for said in ("incarnation 1 on w1 took over from incarnation 0 after 2 durable turn(s)",
                 f"sandbox restored from snapshot {digest(1, 0)[:8]}... taken before turn 1",
                 "the 1 command(s) and 1 snapshot(s) above marked 'undone' were incarnation 0's",
                 "turn 1's commands run again below --", "lsn 9"):
        assert said in line, said
    # Above it: turn 1, then its command and turn 2's snapshot as the dead incarnation made them, marked undone.
    before, after = transcript[:marker], transcript[marker + 1:]
    assert before[-6].startswith("  turn 1  lsn 6")
    assert before[-3] == "  $ echo 1  -> exit 0 in 0.01s  lsn 7  [undone: incarnation 0's, before the resume at lsn 9]"
    assert before[-1] == f"  {_snapshot_line(8)}  lsn 8  [undone: incarnation 0's, before the resume at lsn 9]"
    # Below it: the re-run of turn 1's command, then turn 2's snapshot and turn 2; nothing else undone.
    assert after[0] == "  $ echo 1  -> exit 0 in 0.01s  lsn 10" and after[2] == f"  {_snapshot_line(11)}  lsn 11"
    assert after[3].startswith("  turn 2  lsn 12")
    assert sum("[undone" in t for t in transcript) == 2
    for lsn in SNAPSHOTS:
        assert sum(f"{_snapshot_line(lsn)}  lsn {lsn}" in t for t in transcript) == 1, lsn
    # The timeline: the marker right before the session_resumed line, the same two records marked undone.
    start = out.index("timeline")
    timeline = out[start + 1:out.index("", start)]
    assert len(timeline) == len(LAYOUT) + 1
    (at,) = [i for i, t in enumerate(timeline) if t.startswith("  -- resumed:")]
    assert timeline[at] == line.rsplit("  lsn 9", 1)[0] and timeline[at + 1].split()[0] == "9"
    assert [t.split()[0] for t in timeline if "[undone" in t] == [str(lsn) for lsn in UNDONE]


def test_the_ui_session_view_holds_the_resume_marker_and_the_snapshots(resumed_log, tmp_path):
    url, stop = start_ui(resumed_log, index_path=tmp_path / "ui.sqlite")
    try:
        def get(path: str) -> dict:
            with urllib.request.urlopen(url + path, timeout=20) as resp:
                return json.loads(resp.read())

        (row,) = get("/api/sessions?sort=-resumes")["rows"]
        assert (row["session_id"], row["turns"], row["resumes"]) == ("s", 4, 1)
        assert get("/api/run")["sessions_resumed"] == 1
        s = get("/api/session/s")
    finally:
        stop()
    (r,) = s["resumes"]
    assert (r["lsn"], r["turn"], r["incarnation"], r["durable_turns"], r["snapshot"], r["worker"]) == ("9", 1, 1, 2, digest(1, 0), "w1")
    assert r["line"].startswith("-- resumed: incarnation 1 on w1 took over from incarnation 0")
    # The transcript places it among turn 1's commands by LSN: after the dead incarnation's run, before the re-run.
    assert [(c["lsn"], c["turn"], c["undone"]) for c in s["commands"] if c["turn"] == 1] == [
        ("7", 1, {"resume_lsn": "9", "incarnation": 0}), ("10", 1, None)]
    assert [(p["lsn"], p["turn_index"], p["digest"], p["undone"] is not None) for p in s["snapshots"]] == [
        (str(lsn), t, digest(t, i), lsn in UNDONE) for lsn, (t, i) in SNAPSHOTS.items()]
    assert [t["turn"] for t in s["turns"]] == [0, 1, 2, 3] and len(s["rows"]) == 1


def test_every_other_reader_counts_a_resumed_session_once(resumed_log, tmp_path):
    stats = json.loads(_cli("stats", "--json", resumed_log))
    assert (stats["sessions"]["total"], stats["sessions"]["finished"], stats["sessions"]["resumed"], stats["sessions"]["resumes"]) == (1, 1, 1, 1)
    assert (stats["turns"]["total"], stats["commands"]["total"], stats["snapshots"]["count"]) == (4, 5, 5)
    assert "resumed    1 session(s), 1 resume(s)" in _cli("stats", resumed_log)
    assert "ok, 18 records" in _cli("verify", resumed_log)
    assert "1 samples" in _cli("reconstruct", resumed_log, "--out", tmp_path / "samples.jsonl")
    # export-dataset's rows (its fold; no advantage estimator, which would import torch): the resumed session's row
    # is the uninterrupted one's, its conversation every durable turn once.
    got, want = _dataset_rows(_read(resumed_log)), _dataset_rows(asyncio.run(write_session(None, 4)).read(0))
    assert [m["content"] for m in got["messages"] if m["role"] == "assistant"] == ["a0", "a1", "a2", "a3"]
    assert got == want
    _cli("trace", resumed_log, "-o", tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [e["name"] for e in trace["traceEvents"] if e.get("cat") == "resume"] == ["resumed (incarnation 1)"]
    assert (trace["otherData"]["sessions"], trace["otherData"]["snapshots"], trace["otherData"]["resumes"]) == (1, 5, 1)
    _cli("report", resumed_log, "--out", tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "sessions resumed 1 (1 resumes)" in page and 'data-resumes="1">resumed 1x' in page
