"""The CLI refuses, in one line with exit 2 and before anything is written: an output path
inside the log it reads, an option its mode would drop without a word, and an out-of-range
number; `ui` rebuilds its own damaged index and refuses a named one it cannot open."""

from __future__ import annotations

import pytest

from agentlog.events.log.format import list_segments, segment_name
from agentlog.tools.cli import main
from cli_helpers import agentlog, on_a_terminal


def _refused(capsys, args: list[str], *needles: str) -> str:
    """Run ``agentlog ARGS`` in process: exit 2, one line on stderr naming each of ``needles``."""
    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("agentlog: error: "), (code, out[-500:], err[-2000:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize("cmd", ["reconstruct", "report", "trace", "export-dataset"])
@pytest.mark.parametrize("target", ["segment", "DURABLE", "inside"])
def test_a_reading_command_never_writes_its_output_over_the_log_it_reads(run_log_copy, capsys, cmd, target):
    """-o naming a file of the log being read (a typo, a tab completion) is refused before anything is
    opened. reconstruct once opened it with "wb" before reading (and removed it when the read then
    failed); report and trace replaced it once read: either way the log was gone."""
    files = {p.name: p.read_bytes() for p in run_log_copy.iterdir() if p.is_file()}
    victim = {"segment": run_log_copy / segment_name(list_segments(run_log_copy)[0]), "DURABLE": run_log_copy / "DURABLE",
              "inside": run_log_copy / "samples"}[target]
    _refused(capsys, [cmd, str(run_log_copy), "-o", str(victim), "--quiet"], str(victim), "which this command reads")
    assert {p.name: p.read_bytes() for p in run_log_copy.iterdir() if p.is_file()} == files
    assert not (run_log_copy / "samples").exists()


def test_an_output_through_a_link_into_the_log_is_refused_and_one_beside_it_is_written(run_log_copy, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(run_log_copy / "DURABLE")
    _refused(capsys, ["report", str(run_log_copy), "-o", str(link), "--quiet"], "which this command reads")
    beside = run_log_copy.parent / "report.html"
    assert main(["report", str(run_log_copy), "-o", str(beside), "--quiet"]) == 0 and beside.stat().st_size > 0


def test_reconstruct_policy_refuses_the_options_it_would_ignore(tmp_path, capsys):
    """--policy re-reduces under the policy file's settings and writes no samples: -o, --format and the
    fold settings were dropped without a word (exit 0, no file). Refused before the log is opened."""
    line = _refused(capsys, ["reconstruct", str(tmp_path), "--policy", str(tmp_path / "policy.toml"), "--diff",
                             "-o", str(tmp_path / "cf.jsonl"), "--format", "msgpack", "--fork-threshold", "5",
                             "--max-context-tokens", "7", "--allow-repeated-targets", "--config", str(tmp_path / "c.json")],
                    "--policy")
    for flag in ("-o", "--format", "--fork-threshold", "--max-context-tokens", "--allow-repeated-targets", "--config"):
        assert f"{flag}," in line or f"{flag} do" in line, (flag, line)
    assert not (tmp_path / "cf.jsonl").exists()


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_ui_port_out_of_range_is_a_usage_error(run_log, capsys, port):
    """--port took any int >= 0, and 70000 died in bind() with a traceback (serve checked the range)."""
    _refused(capsys, ["ui", str(run_log[0]), "--port", port, "--no-browser", "-q"], "--port", port)


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_demo_timeout_must_be_a_positive_number(tmp_path, capsys, value):
    """-1 and 0 once started the loop, gave up after it and left an INCOMPLETE run folder; nan never timed out."""
    out = tmp_path / "run"
    _refused(capsys, ["demo", "--steps", "1", "--quiet", "--no-report", "--timeout", value, "--out", str(out)], "--timeout")
    assert not out.exists()


@pytest.mark.parametrize("what", ["text-file", "directory", "inside-the-log"])
def test_ui_index_it_cannot_open_is_one_line_exit_2_and_left_as_it_was(run_log, run_log_copy, tmp_path, what):
    """--index naming a file SQLite cannot open (once a sqlite3 traceback), or a file inside the log (once
    written there, beside the segments), is refused; a file the user named is never removed."""
    index = {"text-file": tmp_path / "notes.txt", "directory": tmp_path / "somedir",
             "inside-the-log": run_log_copy / "index.sqlite"}[what]
    if what == "directory":
        index.mkdir()
    elif what == "text-file":
        index.write_text("my notes\n")
    log = run_log_copy if what == "inside-the-log" else run_log[0]
    # A process of its own, with a time limit: a ui that takes the index serves until stopped.
    res = agentlog("ui", str(log), "--port", "0", "--index", str(index), "--no-browser", "-q", timeout=30)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and str(index) in lines[0], (res.returncode, res.stderr[-2000:])
    if what == "text-file":
        assert index.read_text() == "my notes\n"
    if what == "inside-the-log":
        assert not index.exists() and not index.with_name("index.sqlite.lock").exists()


def test_ui_rebuilds_its_own_default_index_when_the_file_is_damaged(run_log_copy):
    """The default index is ui's own cache, rebuilt whenever stale; a damaged file there (a crash, a full
    disk) made every later `agentlog ui` die with a sqlite3 traceback."""
    index = run_log_copy.parent / ".agentlog-ui" / f"{run_log_copy.name}.sqlite"
    index.parent.mkdir()
    index.write_bytes(b"\x00garbage, not SQLite\x00" * 8)
    code, text = on_a_terminal("ui", str(run_log_copy), "--port", "0", "--no-browser", stdout=True,
                               until=lambda t: "agentlog ui: index" in t or "Traceback" in t, timeout=60)
    assert "Traceback" not in text and "rebuilt: the index file could not be read" in text, text[-1500:]
    # Rebuilt: a second start reuses it.
    code, text = on_a_terminal("ui", str(run_log_copy), "--port", "0", "--no-browser", stdout=True,
                               until=lambda t: "agentlog ui: index" in t or "Traceback" in t, timeout=60)
    assert "Traceback" not in text and "resumed" in text, text[-1500:]


def test_the_cli_subprocess_refuses_an_output_inside_the_log_too(run_log_copy):
    """The same refusal through the installed command (one process start for the whole file)."""
    victim = run_log_copy / "DURABLE"
    before = victim.read_bytes()
    res = agentlog("reconstruct", str(run_log_copy), "-o", str(victim), "--quiet")
    assert res.returncode == 2 and victim.read_bytes() == before, res.stderr[-1000:]
