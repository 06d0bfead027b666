"""LoopConfig validation, TOML loading, and the demo/train command lines (no run)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agentlog.tools.cli import build_parser, main as cli_main
from agentlog.loop.run_folder import Run
from agentlog.loop.config import ConfigError, FaultConfig, LoopConfig, MetricsConfig


def test_demo_help_documents_every_knob(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = capsys.readouterr().out
    defaults = LoopConfig()
    for f in dataclasses.fields(LoopConfig):
        value = getattr(defaults, f.name)
        if f.name not in ("faults", "learner") and not dataclasses.is_dataclass(value) and not isinstance(value, dict):
            assert "--" + f.name.replace("_", "-") in text, f.name
    for f in dataclasses.fields(FaultConfig) + dataclasses.fields(MetricsConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
    assert "--learner KEY=VALUE" in text and "eps_clip_high" in text


def test_metrics_flags_and_table_reach_the_config(tmp_path: Path) -> None:
    """`--tensorboard false --wandb-project p` and a [metrics] table both set LoopConfig.metrics."""
    from agentlog.tools.cli_loop import config_from_args

    args = build_parser().parse_args(["demo", "--tensorboard", "false", "--wandb-project", "p", "--hf-model", "tiny-qwen2"])
    cfg = config_from_args(args, LoopConfig())
    assert cfg.metrics == MetricsConfig(tensorboard=False, wandb_project="p") and cfg.hf_model == "tiny-qwen2"
    path = tmp_path / "m.toml"
    path.write_text('hf_model = "tiny-llama"\ngradient_checkpointing = true\n[metrics]\ntensorboard = false\n')
    cfg = LoopConfig.load(path)
    assert cfg.metrics.tensorboard is False and cfg.gradient_checkpointing and cfg.hf_model == "tiny-llama"


def test_unknown_config_key_names_it_and_the_known_ones(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('steps = 5\ngroup_sise = 4\n')
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key\(s\) \['group_sise'\]; known keys are .*group_size"):
        LoopConfig.load(bad)


def test_toml_config_with_learner_and_faults_tables(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'steps = 7\nseed = 3\nstaleness_mode = "drop"\n[learner]\nlr = 5e-4\nestimator = "dr_grpo"\n[faults]\ndrop_rate = 0.0\n'
    )
    cfg = LoopConfig.load(path)
    assert (cfg.steps, cfg.seed, cfg.staleness_mode) == (7, 3, "drop")
    assert cfg.faults.drop_rate == 0.0 and cfg.faults.exception_rate == FaultConfig().exception_rate
    lc = cfg.learner_config()
    assert lc.lr == 5e-4 and lc.estimator == "dr_grpo" and lc.tis_cap is None


@pytest.mark.parametrize(
    "values, message",
    [
        ({"staleness_mode": "ignore"}, "staleness_mode: expected one of"),
        ({"steps": 0}, "steps: expected an int >= 1"),
        ({"min_valid": 9}, "min_valid: expected 1..group_size"),
        ({"faults": {"drop_rate": 1.5}}, "drop_rate: expected a fraction"),
        ({"temperature": 0.0}, "temperature: expected a number > 0"),
        # 0 deleted each checkpoint as it was saved, before the record naming it was appended.
        ({"keep_checkpoints": 0}, "keep_checkpoints: expected an int >= 1"),
        # Accepted, then the worker crashed opening its first session (the engine's budget is finite).
        ({"faults": {"timeout_budget_s": float("inf")}}, "timeout_budget_s: expected a finite number of seconds > 0"),
        # Accepted (the bound was > -1), then the worker's snapshot store refused it at start.
        ({"resume": {"keep_aborted_s": -0.5}}, r"keep_aborted_s: expected a number of seconds >= 0"),
    ],
)
def test_out_of_range_values_are_refused_by_name(values, message) -> None:
    with pytest.raises(ConfigError, match=message):
        LoopConfig.from_dict(values)


def test_an_infinite_fault_budget_in_toml_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text("[faults]\ntimeout_budget_s = inf\n")
    with pytest.raises(ConfigError, match=r"train\.toml.*timeout_budget_s"):
        LoopConfig.load(path)


def test_train_with_a_bad_config_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = [\n")
    assert cli_main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and str(bad) in err and "Traceback" not in err
    unknown_task = tmp_path / "task.toml"
    unknown_task.write_text('task = "nope"\n')
    assert cli_main(["train", "--config", str(unknown_task)]) == 2
    assert "no task is registered under the name 'nope'" in capsys.readouterr().err


def test_demo_refuses_a_bad_learner_override_before_starting(tmp_path: Path, capsys) -> None:
    rc = cli_main(["demo", "--out", str(tmp_path / "r"), "--learner", "estimator=ppo"])
    assert rc == 2
    assert "estimator" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _one_line_exit_2(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentlog: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize(
    "override, needle",
    [("lr=abc", "LearnerConfig.lr: expected float, found 'abc'"), ("updates_per_step=true", "updates_per_step"),
     ("betas=3", "betas"), ("grad_clip=\"x\"", "grad_clip")],
)
def test_demo_refuses_a_learner_value_of_the_wrong_type_with_one_line(tmp_path: Path, capsys, override, needle) -> None:
    rc = cli_main(["demo", "--out", str(tmp_path / "r"), "--learner", override])
    _one_line_exit_2(rc, capsys.readouterr().err, needle)
    assert not (tmp_path / "r").exists()


def test_a_config_value_of_the_wrong_type_is_refused_by_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('stop_reward = "high"\n[learner]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"LoopConfig.stop_reward: expected float, found 'high'"):
        LoopConfig.load(bad)
    with pytest.raises(ConfigError, match=r"LearnerConfig.lr: expected float, found 'fast'"):
        LoopConfig(learner={"lr": "fast"}).learner_config()
    # None where the field allows it, ints for floats: accepted.
    assert LoopConfig(learner={"grad_clip": None, "lr": 1}).learner_config().grad_clip is None


def test_demo_out_naming_an_existing_file_exits_2(tmp_path: Path, capsys) -> None:
    plain = tmp_path / "plain"
    plain.write_text("mine")
    _one_line_exit_2(cli_main(["demo", "--out", str(plain)]), capsys.readouterr().err, str(plain), "is a file")
    assert plain.read_text() == "mine"


def test_demo_out_inside_another_run_folder_exits_2_and_makes_nothing(tmp_path: Path, capsys) -> None:
    """--out runA/rollout used to start a run inside another: runA/rollout then read as a run folder."""
    run_a = tmp_path / "runA"
    run_a.mkdir()
    Run.save_config(run_a, LoopConfig())
    inside = run_a / "rollout" / "new"
    _one_line_exit_2(cli_main(["demo", "--out", str(inside)]), capsys.readouterr().err, str(inside),
                     f"is inside the run folder {run_a}")
    assert sorted(p.name for p in run_a.iterdir()) == ["config.json"]


def test_demo_with_an_unknown_task_exits_2_and_leaves_no_run_folder(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r"
    _one_line_exit_2(cli_main(["demo", "--task", "nope", "--out", str(out)]), capsys.readouterr().err, "'nope'", "lookup")
    assert not out.exists()
    # So the same --out is free for the next try (which fails later, on its own bad value, still before any run).
    _one_line_exit_2(cli_main(["demo", "--task", "nope", "--out", str(out)]), capsys.readouterr().err, "'nope'")
    assert not out.exists()


def test_a_relative_weights_cache_is_resolved_against_the_config_files_folder(tmp_path: Path, monkeypatch) -> None:
    """[log] weights_cache was used as given: relative to each worker process's own working
    directory (the learner's and a worker's can differ), and "~" never expanded."""
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "train.toml"
    path.write_text('[log]\nweights_cache = "cache/weights"\n')
    monkeypatch.chdir(tmp_path)
    assert LoopConfig.load(path).log.weights_cache == str(tmp_path / "conf" / "cache" / "weights")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path.write_text('[log]\nweights_cache = "~/weights"\n')
    assert LoopConfig.load(path).log.weights_cache == str(tmp_path / "home" / "weights")
