"""`agentlog trace`: the per-session timeline as Chrome Trace Event JSON."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from cli_helpers import EXPECTED, agentlog, write_many_sessions

REQUIRED = ("ph", "ts", "pid", "tid", "name")


def _trace(log, tmp_path) -> dict:
    out = tmp_path / "trace.json"
    res = agentlog("trace", str(log), "-o", str(out), "-q", timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(out.read_text())


def _check_format(trace: dict) -> dict[int, list[dict]]:
    """Every event follows the Trace Event format; returns the events by track (tid)."""
    assert isinstance(trace["traceEvents"], list)
    by_tid: dict[int, list[dict]] = defaultdict(list)
    for ev in trace["traceEvents"]:
        for key in REQUIRED:
            assert key in ev, (key, ev)
        assert ev["ph"] in ("X", "i", "M"), ev
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0, ev
        if ev["ph"] == "i":
            assert ev["s"] in ("t", "p", "g"), ev
        by_tid[ev["tid"]].append(ev)
    return by_tid


def _names(trace: dict) -> dict[int, str]:
    return {ev["tid"]: ev["args"]["name"] for ev in trace["traceEvents"] if ev["ph"] == "M" and ev["name"] == "thread_name"}


def test_trace_of_the_engine_run_has_one_track_per_session_with_its_turns_commands_and_end(run_log, tmp_path):
    path, _ = run_log
    trace = _trace(path, tmp_path)
    by_tid = _check_format(trace)
    names = _names(trace)
    sessions = EXPECTED["sessions"]
    # One track per session, named after it.
    by_session = {n.split(" ")[0]: tid for tid, n in names.items()}
    assert sorted(by_session) == sorted(sessions)
    assert len(set(by_session.values())) == len(sessions)
    for sid, facts in sessions.items():
        evs = by_tid[by_session[sid]]
        turns = [e for e in evs if e["ph"] == "X" and e.get("cat") == "turn"]
        assert len(turns) == facts["turns"], (sid, turns)
        spans = [e for e in evs if e["ph"] == "X" and e.get("cat") == "session"]
        assert len(spans) == 1, (sid, spans)
        s = spans[0]
        for t in turns:  # a turn lies within its session
            assert s["ts"] <= t["ts"] and t["ts"] + t["dur"] <= s["ts"] + s["dur"] + 1e-3, (sid, s, t)
        ends = [e for e in evs if e["ph"] == "i"]
        if facts["status"] == "running":
            assert ends == [] and s["name"] == "session (in flight)"
            continue
        assert len(ends) == 1, (sid, ends)
        want = "finished" if facts["status"] == "finished" else f"{facts['status']}: {facts['reason']}"
        assert ends[0]["name"] == want
        if facts["status"] == "finished":
            assert ends[0]["args"]["reward"] == facts["reward"]
    commands = [e for e in trace["traceEvents"] if e.get("cat") == "command"]
    assert len(commands) == 1 and commands[0]["tid"] == by_session["fin-0"] and commands[0]["args"]["exit_code"] == 1
    assert trace["otherData"]["sessions"] == len(sessions) and trace["otherData"]["in_flight"] == 1


def test_trace_counts_match_a_generated_log(tmp_path):
    log = tmp_path / "many.log"
    facts = write_many_sessions(log, 3000, seed=5)
    trace = _trace(log, tmp_path)
    by_tid = _check_format(trace)
    assert len(_names(trace)) == 3000
    kinds = Counter(e.get("cat") for e in trace["traceEvents"])
    assert kinds["turn"] == facts["turns"] and kinds["command"] == facts["commands"]
    assert kinds["session"] == 3000 and kinds["terminal"] == 3000
    ends = Counter(e["name"] for e in trace["traceEvents"] if e["ph"] == "i")
    assert ends["finished"] == facts["finished"]
    for reason, n in facts["abort_reasons"].items():
        assert ends[f"aborted: {reason}"] == n
    assert ends["dropped: cancelled"] == facts["dropped"]
    # Each session's events stay on its own track: one session span per tid.
    assert all(sum(1 for e in evs if e.get("cat") == "session") == 1 for tid, evs in by_tid.items() if tid)


def test_a_nan_generate_s_or_an_infinite_duration_still_writes_strict_json(tmp_path):
    """The schema does not bound generate_s or duration_s, and the trace wrote a NaN one as the bare
    token NaN: no JSON parser but Python's reads it (Perfetto and chrome://tracing refuse the file)."""
    from agentlog.events import FileLog
    from agentlog.events.schema.types import CommandRan, SessionFinished, SessionOpened, SessionStarted, TurnRecorded

    log = tmp_path / "log"
    with FileLog.open(log) as w:
        w.append_batch([("s", i, b) for i, b in enumerate([
            SessionOpened(group_id="g", group_size=1), SessionStarted(),
            TurnRecorded(turn_index=0, prompt_ids=[1, 2], output_ids=[3], generate_s=float("nan")),
            CommandRan(command="ls", exit_code=0, duration_s=float("inf")), SessionFinished(reward=1.0)])])
    out = tmp_path / "trace.json"
    res = agentlog("trace", str(log), "-o", str(out), "-q")
    assert res.returncode == 0, res.stderr

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    trace = json.loads(out.read_text(), parse_constant=refuse)
    turn = next(e for e in trace["traceEvents"] if e.get("cat") == "turn")
    assert turn["args"]["generate_s"] == "nan" and turn["dur"] == 0
    _check_format(trace)
