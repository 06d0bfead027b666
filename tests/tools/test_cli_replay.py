"""`agentlog replay` as a subprocess on an engine-written log."""

from __future__ import annotations

import json

from cli_helpers import EXPECTED, agentlog
from agentlog.events import FileLog, read_log
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded

# The lifecycle, written out by hand: the state each event leaves its session in.
_AFTER = {
    "session_opened": "open",
    "session_started": "running",
    "turn_recorded": "running",
    "turn_delta": "running",
    "turn_undelivered": "running",
    "command_ran": "running",
    "reward_assigned": "running",
    "session_finished": "finished",
    "session_aborted": "aborted",
    "session_dropped": "dropped",
}


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _all_events(path) -> list:
    return list(read_log(path))


def test_replay_json_states_match_the_lifecycle(run_log):
    path, facts = run_log
    res = agentlog("replay", str(path), "--json")
    assert res.returncode == 0, res.stderr
    objs = _json_lines(res.stdout)
    assert [o["lsn"] for o in objs] == list(range(facts["last_lsn"] + 1))
    state: dict[str, str | None] = {}
    for o in objs:
        sid = o["session_id"]
        assert o["state_before"] == state.get(sid), o
        assert o["state_after"] == _AFTER[o["type"]], o
        state[sid] = o["state_after"]
        for key in ("lsn", "session_id", "session_seq", "ts_ns", "type", "state_before", "state_after"):
            assert key in o
    final = {sid: st for sid, st in state.items()}
    assert final == {sid: s["status"] for sid, s in EXPECTED["sessions"].items()}
    # The straggler turn the engine refused after strag-3 finished never reached the log.
    strag = [o for o in objs if o["session_id"] == EXPECTED["straggler_refused"]]
    assert strag[-1]["type"] == "session_finished"
    assert sum(o["type"] == "turn_delta" for o in strag) == EXPECTED["sessions"]["strag-3"]["turns"]


def test_replay_json_carries_event_fields_with_token_lists(run_log):
    path, _ = run_log
    res = agentlog("replay", str(path), "--json", "--session", "fin-0")
    assert res.returncode == 0, res.stderr
    # Replay shows the events as stored: each turn as a delta against the one before.
    turns = [o for o in _json_lines(res.stdout) if o["type"] == "turn_delta"]
    assert turns[0]["shared_tokens"] == 0 and turns[0]["new_prompt_ids"] == [1, 2, 3, 4]
    assert turns[0]["output_ids"] == [10, 11, 12]
    assert turns[0]["output_log_probs"] == [-0.5, -0.5, -0.5]
    # Turn 1's prompt [1, 2, 3, 4, 10, 11, 12, 7, 8] repeats turn 0's prompt + output.
    assert turns[1]["shared_tokens"] == 7 and turns[1]["new_prompt_ids"] == [7, 8]
    assert turns[0]["finish_reason"] == "stop" and turns[0]["turn_index"] == 0
    cmd = next(o for o in _json_lines(res.stdout) if o["type"] == "command_ran")
    assert cmd["command"] == "pytest -x" and cmd["exit_code"] == 1


def test_replay_filters_select_exactly_the_right_events(run_log):
    path, facts = run_log
    events = _all_events(path)
    sessions = EXPECTED["sessions"]

    def lsns(*args: str) -> list[int]:
        res = agentlog("replay", str(path), "--json", *args)
        assert res.returncode == 0, res.stderr
        return [o["lsn"] for o in _json_lines(res.stdout)]

    def expected(pred) -> list[int]:
        return [e.lsn for e in events if pred(e)]

    assert lsns("--session", "fork-2") == expected(lambda e: e.session_id == "fork-2")
    assert lsns("--group", "g-bad") == expected(lambda e: sessions[e.session_id]["group"] == "g-bad")
    assert lsns("--status", "aborted") == expected(lambda e: sessions[e.session_id]["status"] == "aborted")
    assert lsns("--status", "running") == expected(lambda e: e.session_id == "live-0")
    assert lsns("--reason", "cancelled") == expected(lambda e: e.session_id == "drop-2")
    assert lsns("--from", "10", "--until", "20") == list(range(10, 21))
    assert lsns("--group", "g-ok", "--status", "finished", "--until", "12") == expected(
        lambda e: e.lsn <= 12 and sessions[e.session_id]["group"] == "g-ok" and e.session_id in ("fin-0", "fin-1")
    )
    # --status judges the outcome within the range: fork-2 has not finished by lsn 12.
    assert facts["last_lsn"] > 20


def test_replay_text_shows_state_change_and_summary(run_log):
    path, _ = run_log
    res = agentlog("replay", str(path), "--session", "abort-0")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 4
    assert "session_opened" in lines[0] and "- -> open" in lines[0]
    assert "turn 0: in 4 (4 new) out 3 tokens, 2 new messages, finish stop" in lines[2]
    assert "running -> aborted" in lines[3] and "wall_clock_timeout" in lines[3]


def test_replay_marks_illegal_sequences_in_place_notes_them_and_exits_0(tmp_path):
    path = tmp_path / "bad.log"
    log = FileLog.open(path)
    log.append_batch(
        [
            ("a", 0, SessionOpened(group_id="g", group_size=1)),
            ("a", 1, SessionStarted()),
            ("a", 2, SessionFinished(reward=1.0)),
        ]
    )
    # The log checks sequence numbers, not the lifecycle: these go in.
    log.append_batch([("a", 0, SessionOpened(group_id="g", group_size=1))])  # id reused
    log.append_batch([("b", 0, TurnRecorded(turn_index=0))])  # never opened
    log.close()
    res = agentlog("replay", str(path))
    assert res.returncode == 0, res.stderr  # showing violations is replay's job, not an error
    lines = res.stdout.splitlines()
    assert lines[3].split()[0] == "3" and "session_opened" in lines[3]
    assert lines[4].startswith("       3  !! VIOLATION") and "reused" in lines[4]
    assert "!! VIOLATION" in lines[6] and "never opened" in lines[6]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("agentlog: note: ") and "2 lifecycle violation(s) shown" in err[0]
    assert "lsn 3" in err[0] and str(path) in err[0] and "reused_id" in err[0]
    js = _json_lines(agentlog("replay", str(path), "--json").stdout)
    assert "reused" in js[3]["violations"][0] and "violations" not in js[2]


def _one_line_exit_2(res) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == "", res.stdout  # nothing printed before the complaint
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("agentlog: error: ") and "Traceback" not in res.stderr
    return line


def test_every_filter_value_that_matches_nothing_exits_2_naming_the_filter_and_the_values_that_exist(run_log):
    """One rule for all filters (replay --help states it): an unknown value is an error listing what the log holds."""
    path, _ = run_log
    line = _one_line_exit_2(agentlog("replay", str(path), "--reason", "nope"))
    assert "--reason 'nope'" in line and str(path) in line, line
    for reason, n in (("wall_clock_timeout", 1), ("exception:ValueError", 1), ("cancelled", 1)):
        assert f"{reason} ({n})" in line, line
    line = _one_line_exit_2(agentlog("replay", str(path), "--session", "nope"))
    assert "--session 'nope'" in line and "it holds 8 sessions: fin-0, fin-1, fork-2, abort-0, exc-1, drop-2, strag-3, live-0" in line, line
    line = _one_line_exit_2(agentlog("replay", str(path), "--group", "nope"))
    assert "--group 'nope'" in line and "g-ok, g-bad, g-live" in line, line
    line = _one_line_exit_2(agentlog("replay", str(path), "--status", "open"))
    assert "--status open" in line and "finished (4), aborted (2), dropped (1), running (1)" in line, line
    # Within --until: at lsn 2 only fin-0 exists, and it is still running.
    line = _one_line_exit_2(agentlog("replay", str(path), "--status", "finished", "--until", "2"))
    assert "at lsn 2" in line and "running (1)" in line, line
    line = _one_line_exit_2(agentlog("replay", str(path), "--session", "live-0", "--until", "3"))
    assert "up to lsn 3" in line and "fin-0" in line, line
    # --json and text follow the same rule.
    _one_line_exit_2(agentlog("replay", str(path), "--json", "--reason", "nope"))
    help_text = agentlog("replay", "--help").stdout
    assert "a value that matches no session is an error" in " ".join(help_text.split()), help_text


def test_filters_that_each_match_but_do_not_meet_print_nothing_and_exit_0(run_log):
    path, _ = run_log
    for args in (["--session", "fin-0", "--group", "g-bad"], ["--session", "fin-0", "--status", "aborted"],
                 ["--group", "g-ok", "--reason", "cancelled"]):
        res = agentlog("replay", str(path), *args)
        assert (res.returncode, res.stdout, res.stderr) == (0, "", ""), (args, res)
