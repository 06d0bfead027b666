"""The ``[task]`` table of a loop config and the task-module flags:
``name``, ``module`` and ``path`` onto LoopConfig's ``task``, ``task_modules``
and ``task_path``, recorded in the run folder's config.json for the worker and
learner processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentlog.loop.config import ConfigError, LoopConfig
from agentlog.tools.cli import build_parser
from agentlog.tools.cli_loop import config_from_args


def test_the_task_table_sets_name_modules_and_absolute_paths(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    path = conf / "run.toml"
    path.write_text('steps = 3\n[task]\nname = "repo-fix"\nmodule = ["a_tasks", "b.tasks"]\npath = ["../src", "/opt/x"]\n')
    cfg = LoopConfig.load(path)
    assert cfg.task == "repo-fix" and cfg.task_modules == ["a_tasks", "b.tasks"]
    # Relative to the config file, not the current directory; the config's own directory follows.
    assert cfg.task_path == [str(tmp_path / "src"), "/opt/x", str(conf)]
    saved = tmp_path / "config.json"
    cfg.save(saved)
    assert LoopConfig.load(saved) == cfg


def test_a_single_module_string_and_no_path(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[task]\nmodule = "mytask"\n')
    cfg = LoopConfig.load(path)
    assert cfg.task == "lookup" and cfg.task_modules == ["mytask"] and cfg.task_path == [str(tmp_path)]


def test_a_task_table_without_modules_adds_no_path(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[task]\nname = "lookup"\n')
    cfg = LoopConfig.load(path)
    assert (cfg.task, cfg.task_modules, cfg.task_path) == ("lookup", [], [])


@pytest.mark.parametrize(
    "table, message",
    [
        ('modules = "x"', r"\[task\] unknown key\(s\) \['modules'\]; known keys are \['module', 'name', 'path'\]"),
        ("module = 3", r"\[task\] module: expected a non-empty string or a list of them, found 3"),
        ('module = ["ok", ""]', r"\[task\] module: expected a non-empty string"),
        ("path = []", r"\[task\] path: expected a non-empty string or a list of them"),
        ("name = 1", r"\[task\] name: expected a task name \(str\), found 1"),
    ],
)
def test_a_bad_task_table_is_refused_by_name(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"[task]\n{table}\n")
    with pytest.raises(ConfigError, match=message):
        LoopConfig.load(path)


def test_task_modules_both_flat_and_in_the_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('task_modules = ["a"]\n[task]\nmodule = "b"\n')
    with pytest.raises(ConfigError, match="task_modules: given both at the top level and in the \\[task\\] table"):
        LoopConfig.load(path)


@pytest.mark.parametrize("bad", [[""], [3], 5])
def test_loop_config_checks_the_task_lists(bad) -> None:
    with pytest.raises(ConfigError, match="LoopConfig.task_modules: expected a list of non-empty strings"):
        LoopConfig(task_modules=bad)


def test_import_flags_add_the_modules_the_config_dir_and_the_cwd(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "run.toml").write_text('[task]\nmodule = "from_config"\npath = ["lib"]\n')
    args = build_parser().parse_args(["train", "--config", str(conf / "run.toml"), "--import", "from_flag",
                                      "--task-path", "rel", "--task-modules", "another"])
    base = LoopConfig.load(args.config)
    cfg = config_from_args(args, base, task_modules=args.imports, import_dirs=[conf])
    assert cfg.task_modules == ["from_config", "another", "from_flag"]
    assert cfg.task_path == [str(conf / "lib"), str(conf), str(tmp_path / "rel"), str(tmp_path)]
    assert all(os.path.isabs(p) for p in cfg.task_path)


def test_without_task_modules_no_directory_is_recorded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text("steps = 2\n")
    args = build_parser().parse_args(["train", "--config", "run.toml"])
    cfg = config_from_args(args, LoopConfig.load(args.config), task_modules=args.imports, import_dirs=[tmp_path])
    assert (cfg.task_modules, cfg.task_path) == ([], [])
