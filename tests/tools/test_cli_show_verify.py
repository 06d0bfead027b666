"""`agentlog show` and `agentlog verify` (plus reading commands on damaged logs) as subprocesses."""

from __future__ import annotations

import os

from cli_helpers import agentlog
from agentlog.events.log.format import SEG_HDR_SIZE, list_segments, segment_name


def test_show_prints_rows_with_trained_and_context_tokens(run_log):
    path, _ = run_log
    res = agentlog("show", str(path), "fin-0")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "session fin-0  group g-ok [0/3]" in out
    assert "outcome  finished  reward 1.0  turns 2" in out
    # Turn 1's prompt extends the held tokens: CLEAN, one row, the tool tokens as context.
    assert "response  train[10 11 12] ctx[7 8] train[13 14]" in out
    assert "    prompt    1 2 3 4\n" in out
    turn_lines = [line for line in out.splitlines() if line.strip().startswith("turn ") and "drift" in line]
    assert len(turn_lines) == 2 and all("drift CLEAN" in t and t.rstrip().endswith("trained") for t in turn_lines)
    assert "running -> finished" in out


def test_show_reports_a_fork_as_a_second_row(run_log):
    path, _ = run_log
    out = agentlog("show", str(path), "fork-2").stdout
    assert "drift FORK" in out
    assert "  row 0: completed" in out and "  row 1: completed" in out
    assert "    prompt    9 9 30 31 32 5\n    response  train[33 34]" in out


def test_show_aborted_session_has_one_zero_masked_placeholder(run_log):
    path, _ = run_log
    out = agentlog("show", str(path), "abort-0").stdout
    assert "outcome  aborted (wall_clock_timeout)" in out
    assert "row 0: aborted remove_sample, reward 0, 2 tokens = 1 prompt + 1 response, 0 trained" in out
    assert "response  ctx[0]" in out
    out = agentlog("show", str(path), "drop-2").stdout
    assert "outcome  dropped (cancelled)" in out and "(no samples: dropped sessions yield none)" in out


def _last_segment(path):
    return path / segment_name(list_segments(path)[-1])


def test_verify_reports_a_torn_tail_with_its_position_and_repair_fixes_it(run_log_copy):
    path = run_log_copy
    seg = _last_segment(path)
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\x07" * 23)  # a half-written frame
    res = agentlog("verify", str(path))
    assert res.returncode == 1
    assert f"segment {seg.name} offset {size}" in res.stdout and "torn tail" in res.stdout
    fixed = agentlog("verify", str(path), "--repair")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "repaired" in fixed.stdout
    assert seg.stat().st_size == size
    again = agentlog("verify", str(path))
    assert again.returncode == 0 and ": ok," in again.stdout


def test_a_corrupt_middle_frame_is_reported_never_skipped(run_log_copy):
    path = run_log_copy
    seg = _last_segment(path)
    fd = os.open(seg, os.O_RDWR)
    try:
        off = SEG_HDR_SIZE + 60  # inside the first frame; valid frames follow
        byte = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), off)
    finally:
        os.close(fd)
    res = agentlog("verify", str(path))
    assert res.returncode == 1 and "CORRUPT" in res.stdout and seg.name in res.stdout
    for cmd in (["stats"], ["replay"], ["reconstruct", "-o", str(path.parent / "x.jsonl")]):
        r = agentlog(*cmd, str(path)) if cmd[0] != "reconstruct" else agentlog(cmd[0], str(path), *cmd[1:])
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and seg.name in err[0] and "Traceback" not in r.stderr, (cmd, r.stderr)
    assert not (path.parent / "x.jsonl").exists()  # no partial sample file left behind


def test_show_answers_why_a_session_scored_so_reward_source_and_transcript(run_log):
    """The reward and where it came from, the messages new at each turn, the response text, the command output."""
    path, _ = run_log
    out = agentlog("show", str(path), "fin-0").stdout
    assert "label    (none)" in out
    assert "assigned reward 1 from tests at lsn 5" in out
    assert "reward   1 from the last reward_assigned, lsn 5, source tests" in out
    transcript = out[out.index("\ntranscript"):out.index("\ntree")]
    assert (
        "  turn 0  lsn 2  finish stop\n    [system] You are a coding agent.\n    [user] Fix bug 0.\n    -> [assistant] reply 10\n"
        "  $ pytest -x  -> exit 1 in 0.25s  lsn 3\n    output 1 failed\n"
        "  turn 1  lsn 4  finish stop\n    [tool] 1 failed\n    -> [assistant] reply 13\n"
    ) in transcript, transcript
    out = agentlog("show", str(path), "fin-1").stdout
    assert "reward   0 from session_finished at lsn 10" in out, out


def test_show_prints_the_abort_error_and_traceback(run_log):
    path, _ = run_log
    out = agentlog("show", str(path), "exc-1").stdout
    assert "error    the agent crashed" in out
    tb = out[out.index("traceback\n"):out.index("\ntimeline")]
    assert "  Traceback (most recent call last):" in tb and 'raise ValueError("the agent crashed")' in tb and tb.rstrip().endswith("ValueError: the agent crashed"), tb


def test_show_prints_label_verifier_detail_and_cuts_long_texts_unless_full(tmp_path):
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionAborted, SessionFinished, SessionOpened, SessionStarted, TurnRecorded

    long_text = "word " * 200  # 1000 characters
    path = tmp_path / "why.log"
    log = FileLog.open(path)
    log.append_batch([
        ("s", 0, SessionOpened(group_id="g", group_size=2, label={"answer": "v12"}, metadata={"task": "lookup"})),
        ("s", 1, SessionStarted()),
        ("s", 2, TurnRecorded(turn_index=0, messages=[{"role": "user", "content": long_text}],
                              response_message={"role": "assistant", "content": "",
                                                "tool_calls": [{"id": "c1", "name": "lookup", "arguments": {"key": "k3"}}]})),
        ("s", 3, SessionFinished(reward=0.0, metadata={"success": False, "answer": "v7", "expected": "v12"})),
        ("t", 0, SessionOpened(group_id="g", group_size=2, sample_index=1)),
        ("t", 1, SessionStarted()),
        ("t", 2, SessionAborted(reason="exception:KeyError", error="'k9'",
                                traceback="Traceback (most recent call last):\n" + "".join(f"  frame {i}\n" for i in range(30)) + "KeyError: 'k9'\n")),
    ])
    log.close()
    out = agentlog("show", str(path), "s").stdout
    assert 'label    {"answer": "v12"}' in out
    assert 'verifier answer="v7"  expected="v12"  success=false' in out
    assert "reward   0 from session_finished at lsn 3" in out
    assert '    -> [assistant] tool call lookup({"key": "k3"})' in out
    user = next(line for line in out.splitlines() if line.startswith("    [user] "))
    assert user.endswith("... (+599 chars; --full shows all)") and len(user) < 500, user
    full = agentlog("show", str(path), "s", "--full").stdout
    user = next(line for line in full.splitlines() if line.startswith("    [user] "))
    assert user == "    [user] " + " ".join(long_text.split()), user
    out = agentlog("show", str(path), "t").stdout
    assert "traceback (last 12 of 32 lines; --full shows all)" in out and "  KeyError: 'k9'" in out and "frame 0\n" not in out
    full = agentlog("show", str(path), "t", "--full").stdout
    assert "  Traceback (most recent call last):" in full and "    frame 0\n" in full
