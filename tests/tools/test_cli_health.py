"""Health flags on the command line: ``show`` prints a session's, ``stats`` counts them (text and
``--json``), ``replay --flag`` selects by them, ``report`` tables them; a run folder whose
config makes a flag untrainable says so."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import agentlog
from agentlog.events import FileLog
from agentlog.events.schema.types import (
    SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted, TeacherScored, TurnRecorded, TurnUndelivered,
)
from agentlog.loop.config import LoopConfig

SYS, USER = {"role": "system", "content": "sys"}, {"role": "user", "content": "task"}
A1, TOOL = {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "ok"}


def _turn(i: int, messages: list, prompt: list[int], out: list[int], **kw) -> TurnRecorded:
    return TurnRecorded(turn_index=i, messages=messages, prompt_ids=prompt, output_ids=out, output_log_probs=[-0.5] * len(out),
                        response_message=A1 if i == 0 else {"role": "assistant", "content": "a2"}, **kw)


def _session(second_prompt: list[int] = (1, 2, 3, 10, 11, 20), *, finish: str = "stop", v: tuple[int, int] = (0, 0),
             extra: tuple = (), reward: float | None = 1.0) -> list:
    """Two turns (the second extending the first unless ``second_prompt`` says otherwise), ``extra`` events, a finish."""
    return [
        SessionOpened(group_id="g", group_size=1),  # the group id is made unique by _write
        SessionStarted(),
        _turn(0, [SYS, USER], [1, 2, 3], [10, 11], policy_version=v[0]),
        _turn(1, [SYS, USER, A1, TOOL], list(second_prompt), [12], finish_reason=finish, policy_version=v[1]),
        *extra,
        SessionFinished(reward=reward),
    ]


def _scored(turn: int, n: int) -> TeacherScored:
    return TeacherScored(turn_index=turn, teacher="t", teacher_version="1", temperature=1.0, log_probs=[-0.5] * n)


#: One session per flag, written by hand: session id -> (its events, its flags).
SESSIONS = {
    "ok": (_session(), ("complete",)),
    "undelivered": (_session(extra=(TurnUndelivered(turn_index=1, reason="client_gone"),)), ("undelivered",)),
    "retokenized": (_session((1, 2, 3, 10, 99, 20)), ("drift",)),  # the agent re-tokenised the response it was sent
    "cut": (_session(finish="length"), ("truncated",)),
    "stale": (_session(v=(0, 3)), ("version_span",)),  # versions 0..3 span 3 > the default bound 2
    "half-scored": (_session(extra=(_scored(0, 2),)), ("teacher_missing",)),
    "unrewarded": (_session(reward=None), ("no_reward",)),
}


def _write(path: Path, sessions: dict) -> None:
    log = FileLog.open(path)
    for n, (sid, (bodies, _)) in enumerate(sessions.items()):
        opened = SessionOpened(group_id=f"g{n}", group_size=1)
        log.append_batch([(sid, i, opened if i == 0 else b) for i, b in enumerate(bodies)])
    log.close()


@pytest.fixture(scope="module")
def flags_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("health") / "log"
    _write(path, SESSIONS)
    return path


def test_show_prints_each_sessions_flags(flags_log):
    for sid, (_, flags) in SESSIONS.items():
        res = agentlog("show", str(flags_log), sid)
        assert res.returncode == 0, res.stderr
        assert f"\nflags    {', '.join(flags)}\n" in res.stdout, (sid, res.stdout[:600])


def test_stats_counts_the_flags_of_ended_sessions_in_json_and_text(flags_log):
    res = agentlog("stats", str(flags_log), "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert stats["flags"] == {"complete": 1, "drift": 1, "no_reward": 1, "teacher_missing": 1, "truncated": 1,
                              "undelivered": 1, "version_span": 1}
    assert stats["groups"]["untrainable_by_flags"] == 0
    text = agentlog("stats", str(flags_log)).stdout
    assert ("flags      complete 1, drift 1, no_reward 1, teacher_missing 1, truncated 1, undelivered 1, version_span 1"
            " (ended sessions)\n") in text


def test_replay_flag_selects_exactly_the_sessions_carrying_it(flags_log):
    for sid, (bodies, flags) in SESSIONS.items():
        res = agentlog("replay", str(flags_log), "--flag", flags[0], "--json")
        assert res.returncode == 0, res.stderr
        events = [json.loads(line) for line in res.stdout.splitlines()]
        assert {e["session_id"] for e in events} == {sid} and len(events) == len(bodies)


def test_replay_flag_that_no_session_carries_names_the_flags_that_do(flags_log, tmp_path):
    only_ok = tmp_path / "ok"
    _write(only_ok, {"ok": SESSIONS["ok"], "cut": SESSIONS["cut"]})
    res = agentlog("replay", str(only_ok), "--flag", "drift")
    assert res.returncode == 2 and res.stdout == ""
    assert ("--flag drift: no session carries this flag at the end of the log; flags at the end of the log: "
            "complete (1), truncated (1)") in res.stderr
    bad = agentlog("replay", str(only_ok), "--flag", "drfit")
    assert bad.returncode == 2 and "argument --flag: invalid choice: 'drfit'" in bad.stderr


def test_report_tables_the_flag_counts_and_each_sessions_flags(flags_log, tmp_path):
    out = tmp_path / "report.html"
    res = agentlog("report", str(flags_log), "-o", str(out), "--quiet")
    assert res.returncode == 0, res.stderr
    page = out.read_text()
    table = page[page.index("id='flags'"):]
    table = table[: table.index("</table>")]
    assert re.findall(r"data-flag='(\w+)' data-count='(\d+)'", table) == [
        (f, "1") for f in ("complete", "drift", "no_reward", "teacher_missing", "truncated", "undelivered", "version_span")]
    for sid, (_, flags) in SESSIONS.items():
        row = page[page.index(f'data-session="{sid}"'):]
        row = row[: row.index("</summary>")]
        assert f'data-flags="{" ".join(flags)}"' in row, (sid, row)


def test_a_run_folder_that_makes_a_flag_untrainable_marks_it_and_counts_the_member(tmp_path):
    run = tmp_path / "run"
    (run / "rollout").mkdir(parents=True)
    LoopConfig(min_valid=1, untrainable_flags=["truncated"]).save(run / "config.json")
    _write(run / "rollout", {"ok": SESSIONS["ok"], "cut": SESSIONS["cut"]})
    show = agentlog("show", str(run), "cut")
    assert show.returncode == 0, show.stderr
    assert ("flags    truncated  (untrainable by untrainable_flags: truncated: one zero-masked placeholder, out of its "
            "group's baseline)") in show.stdout
    assert "row 0: aborted remove_sample, reward 0, 2 tokens = 1 prompt + 1 response, 0 trained  [untrainable: truncated]" in show.stdout
    stats = json.loads(agentlog("stats", str(run), "--json").stdout)
    assert stats["groups"]["untrainable_by_flags"] == 1 and stats["groups"]["skipped"] == 1  # the group of "cut" only


def _ended(how: Any) -> list:
    """Two turns, the second stopped at its token limit (``truncated``), then ``how`` ends it."""
    return [*_session(finish="length")[:-1], how]


def test_show_marks_untrainable_only_the_members_the_pipeline_makes_untrainable(tmp_path):
    """Flags make a member untrainable only when it would train: a finished session or an abort counted
    as a failure. An excluded abort and a dropped session carry the same flag and are not marked."""
    run = tmp_path / "run"
    (run / "rollout").mkdir(parents=True)
    LoopConfig(min_valid=1, untrainable_flags=["truncated"]).save(run / "config.json")  # a policy abort is a failure
    sessions = {
        "timeout": (_ended(SessionAborted(reason="wall_clock_timeout")), True),  # policy: a failure, so untrainable
        "crashed": (_ended(SessionAborted(reason="agent_crashed")), False),  # infrastructure: excluded anyway
        "gone": (_ended(SessionDropped(reason="cancelled")), False),
        "cut": (_session(finish="length"), True),
    }
    _write(run / "rollout", {sid: (bodies, ()) for sid, (bodies, _) in sessions.items()})
    for sid, (_, marked) in sessions.items():
        res = agentlog("show", str(run), sid)
        assert res.returncode == 0, res.stderr
        line = next(line for line in res.stdout.splitlines() if line.startswith("flags    "))
        assert line.startswith("flags    truncated"), (sid, line)
        assert ("untrainable by untrainable_flags: truncated" in line) is marked, (sid, line)
        assert ("[untrainable: truncated]" in res.stdout) is (sid == "cut"), (sid, res.stdout)  # an abort's row names its reason
    stats = json.loads(agentlog("stats", str(run), "--json").stdout)
    assert stats["groups"]["untrainable_by_flags"] == 2  # the same two members
