"""The ``agentlog`` command starts without importing torch: the reading
commands never need it, and importing it costs about two seconds of every
command's start (``agentlog.learner``'s names are imported on first use)."""

from __future__ import annotations

import subprocess
import sys

from agentlog.events import FileLog
from agentlog.events.schema.types import SessionOpened


def _modules_after(argv: list[str]) -> set[str]:
    code = (
        "import sys\n"
        "from agentlog.tools.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODULES', ' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line = next((x for x in out.stdout.splitlines() if x.startswith("MODULES ")), None)
    assert line is not None, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    return set(line.split()[1:])


def test_help_and_a_reading_command_start_without_torch(tmp_path):
    log = tmp_path / "log"
    with FileLog.open(log) as lg:
        lg.append_batch([("s0", 0, SessionOpened(group_id="g", group_size=1))])
    for argv in (["--help"], ["stats", str(log)]):
        loaded = _modules_after(argv)
        assert "agentlog.tools.cli" in loaded
        assert "torch" not in loaded, f"agentlog {' '.join(argv)} imported torch"


def test_the_learner_names_are_still_reachable_on_first_use():
    import agentlog.learner as learner

    assert learner.LearnerConfig.__module__ == "agentlog.learner.config"
    assert learner.compute_advantages.__module__ == "agentlog.learner.advantages"
    assert learner.loss.__name__ == "agentlog.learner.loss"  # a submodule, as an attribute
    assert set(learner.__all__) >= {"Learner", "GPT", "total_loss"}
    assert all(getattr(learner, name) is not None for name in learner.__all__)  # each lazy name resolves


def test_train_and_demo_build_their_config_reference_only_for_help(monkeypatch, capsys):
    """The reference of every config key (generated from the config types'
    source, ~0.3 s) is made when help is printed, not when a run starts."""
    import pytest

    import agentlog.tools.cmd_demo as cmd_demo
    import agentlog.tools.cmd_train as cmd_train
    from agentlog.tools.cli import build_parser

    made: list[str] = []

    def reference(defaults) -> str:
        made.append(type(defaults).__name__)
        return "THE CONFIG REFERENCE"

    monkeypatch.setattr(cmd_train, "config_reference", reference)
    monkeypatch.setattr(cmd_demo, "config_reference", reference)
    args = build_parser(["train"]).parse_args(["train", "--config", "run.toml", "--steps", "2"])
    assert args.steps == 2 and build_parser(["demo"]).parse_args(["demo"]).command == "demo"
    assert made == [], "a run's start built the config reference"
    for command in ("train", "demo"):
        with pytest.raises(SystemExit):
            build_parser([command]).parse_args([command, "--help"])
        assert "THE CONFIG REFERENCE" in capsys.readouterr().out, command
    assert made == ["LoopConfig", "LoopConfig"]


def test_the_train_command_itself_runs_without_torch(tmp_path):
    """`agentlog train` with the built-in GPT: only its learner and rollout worker processes
    need torch; the process that starts and watches them, and checks the run at its end, does
    not pay torch's import (about two seconds of every run's start, and of every test's)."""
    from agentlog.loop.learner_records import read_learner_records

    config = tmp_path / "one.toml"
    config.write_text("steps = 1\ngroups_per_step = 2\ngroup_size = 2\nwarmup_steps = 0\nseed = 0\n")
    run = tmp_path / "run"
    loaded = _modules_after(["train", "--config", str(config), "--out", str(run), "--quiet", "--no-report"])
    assert "agentlog.loop.run" in loaded
    assert [r.policy_version for r in read_learner_records(run / "learner")][-1] == 1  # it trained
    assert "torch" not in loaded, "the train command's own process imported torch"
