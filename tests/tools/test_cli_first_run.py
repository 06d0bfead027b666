"""What a new user meets first: one error prefix, "did you mean" for a typo'd
command, a missing task named as a task with what was expected, a bad
[learner] table named with its file, and nothing but a command's own output on
stdout (the library's log events go to stderr)."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import agentlog


def _one_error_line(res) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def test_a_typo_d_command_gets_did_you_mean_and_one_prefix():
    line = _one_error_line(agentlog("trian"))
    assert line.startswith("agentlog: error: unknown command 'trian'; did you mean 'train'"), line
    assert line.count("agentlog") == 1 + line.count("agentlog --help"), line
    line = _one_error_line(agentlog("show"))
    assert line == "agentlog: error: show: the following arguments are required: LOG, SESSION", line


def test_a_missing_task_is_named_as_a_task_with_the_registered_ones_and_stdout_stays_empty(tmp_path: Path):
    (tmp_path / "my_tasks.py").write_text("")  # imports, registers nothing
    conf = tmp_path / "run.toml"
    conf.write_text('[task]\nname = "lokup"\nmodule = "my_tasks"\n')
    res = agentlog("train", "--config", str(conf), "--out", str(tmp_path / "run"))
    line = _one_error_line(res)
    assert "unknown harness" not in line, line
    assert "no task is registered under the name 'lokup'" in line and "did you mean 'lookup'?" in line, line
    assert "expected one of the registered tasks: lookup" in line and "register_task" in line, line
    # The task modules were loaded (tasks.loaded) before the refusal: no log event reaches stdout.
    assert res.stdout == "", res.stdout
    assert not (tmp_path / "run").exists()


def test_a_bad_learner_table_names_the_config_file(tmp_path: Path):
    conf = tmp_path / "run.toml"
    conf.write_text("steps = 2\n\n[learner]\nlr = -1\n")
    line = _one_error_line(agentlog("train", "--config", str(conf), "--out", str(tmp_path / "run")))
    assert line.startswith(f"agentlog: error: {conf}: [learner] "), line
    assert "lr" in line and "-1" in line, line
