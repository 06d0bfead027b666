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


def _tables_of(cls, prefix: str = "") -> dict[str, list[str]]:
    """Every TOML table of the loop's config and its keys, walked from the config types themselves."""
    import dataclasses
    import typing

    from agentlog.learner.config import LearnerConfig
    from agentlog.loop.config import TASK_TABLE_KEYS

    tables: dict[str, list[str]] = {"[task]": list(TASK_TABLE_KEYS), "[learner]": [f.name for f in dataclasses.fields(LearnerConfig)]}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            tables[f"[{f.name}]"] = [g.name for g in dataclasses.fields(kind)]
            for g in dataclasses.fields(kind):  # a list of tables inside a table: [[distill.teachers]]
                inner = typing.get_args(typing.get_type_hints(kind)[g.name])
                if inner and dataclasses.is_dataclass(inner[0]):
                    tables[f"[[{f.name}.{g.name}]]"] = [h.name for h in dataclasses.fields(inner[0])]
    return tables


def test_help_lists_every_config_table_and_key(capsys):
    import dataclasses

    import pytest

    from agentlog.loop.config import LoopConfig
    from agentlog.tools.cli import build_parser

    tables = _tables_of(LoopConfig)
    assert {"[agent]", "[inference]", "[rollout]", "[log]", "[faults]", "[metrics]", "[distill]", "[[distill.teachers]]"} <= set(tables)
    for command in ("train", "demo"):
        with pytest.raises(SystemExit):
            build_parser([command]).parse_args([command, "--help"])
        text = capsys.readouterr().out
        for header, keys in tables.items():
            assert f"\n{header}  (" in text, (command, header)
            section = text.split(f"\n{header}  (", 1)[1].split("\n[", 1)[0]
            for key in keys:
                assert f"\n  {key}" in section, (command, header, key)
        top = [f.name for f in dataclasses.fields(LoopConfig) if f"[{f.name}]" not in tables and f.name not in ("learner", "task", "task_modules", "task_path")]
        flat = " ".join(text.split())
        for key in top:
            assert f" {key}," in flat or f" {key}." in flat, (command, key)


def test_the_demo_s_latest_run_is_runs_demo(tmp_path: Path):
    from agentlog.tools.cli_loop import _link_latest

    runs = tmp_path / "runs"
    first, second = runs / "20261204-000000-s0", runs / "20261204-000100-s0"
    first.mkdir(parents=True)
    second.mkdir()
    assert _link_latest(first, runs / "demo") == runs / "demo"
    assert (runs / "demo").resolve() == first.resolve()
    assert _link_latest(second, runs / "demo") == runs / "demo"
    assert (runs / "demo").resolve() == second.resolve() and first.is_dir()
    # A real runs/demo (say `agentlog demo --out runs/demo` earlier) is never replaced.
    (runs / "demo").unlink()
    (runs / "demo").mkdir()
    assert _link_latest(second, runs / "demo") == second and not (runs / "demo").is_symlink()


def test_the_run_summary_ends_with_next_commands_naming_a_session_that_scored_0(short_demo_run):
    import re

    cwd, printed = short_demo_run
    run = cwd / "runs" / "demo"
    tail = printed[printed.index("\nnext     "):]
    show = re.search(rf"next     agentlog show {re.escape(str(run))} (\S+) +# why this session scored 0", tail)
    assert show, tail
    assert f"agentlog replay {run} --status aborted" in tail and f"agentlog stats {run}" in tail, tail
    res = agentlog("show", str(run), show.group(1), "--quiet")
    assert res.returncode == 0 and "outcome  finished" in res.stdout and "reward   0 from" in res.stdout, res.stdout[:800]


def test_field_help_names_a_class_without_a_class_statement_in_its_source():
    import dataclasses

    import pytest

    from agentlog.loop.config import FaultConfig, field_help

    assert field_help(FaultConfig) and all(isinstance(text, str) and text for text in field_help(FaultConfig).values())
    made = dataclasses.make_dataclass("Made", ["x"])  # no source: help would silently lose its docs
    with pytest.raises(LookupError, match="no class statement of Made in the source of types"):
        field_help(made)
