"""`agentlog show` and `agentlog verify` (plus reading commands on damaged logs) as subprocesses."""

from __future__ import annotations

import os

from cli_helpers import agentlog
from events.log_format import SEG_HDR_SIZE, list_segments, segment_name


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
