"""Bad input: a clear one-line error and exit 2, never a traceback."""

from __future__ import annotations

import pytest

from cli_helpers import agentlog


def _one_line_exit_2(res, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("agentlog: error: ")
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize(
    "cmd",
    [
        ["replay"],
        ["show", "{LOG}", "fin-0"],
        ["reconstruct", "-o", "{TMP}/x.jsonl"],
        ["stats"],
        ["tail"],
        ["report", "-o", "{TMP}/r.html"],
        ["verify"],
    ],
    ids=lambda c: c[0],
)
def test_a_missing_log_a_plain_file_and_a_non_log_directory_exit_2_naming_the_path(cmd, tmp_path):
    missing = tmp_path / "no-such-log"
    other = tmp_path / "not-a-log"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    plain = tmp_path / "plain-file"
    plain.write_text("hello")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    # tail accepts an empty directory: a log about to be written.
    for target in (missing, other, plain) if cmd[0] == "tail" else (missing, other, plain, empty):
        args = [a.replace("{TMP}", str(tmp_path)) for a in cmd]
        if "{LOG}" in args:
            args = [str(target) if a == "{LOG}" else a for a in args]
        else:
            args = [args[0], str(target), *args[1:]]
        _one_line_exit_2(agentlog(*args), str(target))


def test_an_unknown_session_id_exits_2(run_log):
    path, _ = run_log
    _one_line_exit_2(agentlog("show", str(path), "no-such-session"), "no-such-session", str(path))
    _one_line_exit_2(agentlog("replay", str(path), "--session", "no-such-session"), "no-such-session")
    _one_line_exit_2(agentlog("replay", str(path), "--group", "no-such-group"), "no-such-group")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["replay", "{LOG}", "--until", "-3"], "--until"),
        (["replay", "{LOG}", "--status", "exploded"], "--status"),
        (["replay", "{LOG}", "--from", "9", "--until", "2"], "--from"),
        (["stats", "{LOG}", "--bogus"], "--bogus"),
        (["reconstruct", "{LOG}", "--format", "msgpack"], "-o OUT"),
        (["reconstruct", "{LOG}", "-o", "/tmp/x", "--format", "xml"], "--format"),
        (["reconstruct", "{LOG}", "-o", "/nonexistent-dir/x.jsonl"], "/nonexistent-dir/x.jsonl"),
        (["no-such-command"], "no-such-command"),
    ],
    ids=["until-negative", "status", "from-after-until", "unknown-flag", "format-without-output", "format", "unwritable", "command"],
)
def test_an_invalid_option_exits_2_with_one_line(run_log, args, needle):
    path, _ = run_log
    _one_line_exit_2(agentlog(*[str(path) if a == "{LOG}" else a for a in args]), needle)


def test_a_crc_valid_frame_that_is_not_an_event_exits_1_naming_its_lsn_and_session(run_log_copy, tmp_path):
    """Every reading command stops at a foreign payload with one line, exit 1, never a traceback."""
    from agentlog.events.log.format import encode_frame, list_segments, pack_durable, read_durable, segment_name

    next_lsn, epoch = read_durable(run_log_copy)
    with open(run_log_copy / segment_name(list_segments(run_log_copy)[-1]), "ab") as f:
        f.write(encode_frame(next_lsn, 3, 1, 0, b"live-0", b"\x93not-an-event"))
    (run_log_copy / "DURABLE").write_bytes(pack_durable(next_lsn + 1, epoch))
    log = str(run_log_copy)
    for args in (
        ["replay", log], ["replay", log, "--json"], ["replay", log, "--status", "finished"], ["stats", log],
        ["reconstruct", log, "-o", str(tmp_path / "s.jsonl")], ["report", log, "-o", str(tmp_path / "r.html")], ["show", log, "live-0"],
    ):
        res = agentlog(*args)
        assert res.returncode == 1, (args, res.returncode, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in res.stderr, (args, res.stderr)
        assert f"lsn {next_lsn}" in lines[0] and "live-0" in lines[0] and "schema-v1 event" in lines[0], (args, lines[0])


def test_serve_on_a_log_damaged_mid_log_exits_2_with_one_line_and_keeps_the_log(run_log_copy):
    """The writer's open checks the tail; the engine's restart fold meets the damage mid-log."""
    from agentlog.events.log.format import list_segments, segment_name

    seg = run_log_copy / segment_name(list_segments(run_log_copy)[0])
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    res = agentlog("serve", "--log", str(run_log_copy), "--port", "0", "--admin-token", "t", timeout=120)
    _one_line_exit_2(res, f"--log {run_log_copy}", "CRC mismatch", "agentlog verify")
    assert seg.read_bytes() == bytes(data)  # nothing stored was touched


def test_an_agentlog_error_a_command_leaves_unhandled_exits_2_with_one_line(run_log, monkeypatch, capsys):
    """The CLI maps the library's error root to one line and exit 2; a CliError keeps its own code."""
    from agentlog.reducers.trajectory import TrajectoryError
    from agentlog.tools import cli, cmd_stats

    path, _ = run_log

    def refuse(log, *, quiet=False):
        raise TrajectoryError(f"session 'fin-0', lsn 7: refused while reading {log}")

    monkeypatch.setattr(cmd_stats, "compute_stats", refuse)
    assert cli.main(["stats", str(path), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"agentlog: error: session 'fin-0', lsn 7: refused while reading {path}"], lines

    def data_problem(log, *, quiet=False):
        raise cli.CliError(f"{log}: a problem found in the data", cli.EXIT_DATA)

    monkeypatch.setattr(cmd_stats, "compute_stats", data_problem)
    assert cli.main(["stats", str(path), "--quiet"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"agentlog: error: {path}: a problem found in the data"]
