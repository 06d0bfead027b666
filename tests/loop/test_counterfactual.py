"""Counterfactual re-reduction of a recorded run (``agentlog reconstruct RUN --policy FILE --diff``):
the short demo's run (faults on: aborted members, groups of 4) replayed under its own settings
and under others, without re-running anything."""

from __future__ import annotations

import json
import subprocess
import sys

from agentlog.loop.counterfactual import diff_outcomes, policy_config, replay_run
from agentlog.loop.run_folder import Run


def _run(short_demo_run):
    cwd, _ = short_demo_run
    run_dir = cwd / "runs" / "demo"
    with Run.open(run_dir) as run:
        return run_dir, run.config


def test_the_runs_own_settings_give_an_empty_diff_and_the_online_digests(short_demo_run) -> None:
    run_dir, cfg = _run(short_demo_run)
    own = replay_run(run_dir, cfg)
    assert own.steps == 2 and own.steps_equal == own.steps and not own.missing
    assert any(o.trained for o in own.outcomes.values())
    diff = diff_outcomes(own, replay_run(run_dir, cfg))
    assert diff.changes == () and diff.trained_before == diff.trained_after


def test_a_higher_min_valid_drops_exactly_the_groups_a_hand_count_predicts(short_demo_run) -> None:
    run_dir, cfg = _run(short_demo_run)
    own = replay_run(run_dir, cfg)
    new_min = cfg.group_size  # every member must be valid
    # By hand: a group trained under the run's settings is dropped iff it has fewer valid members.
    predicted = {name for name, o in own.outcomes.items() if o.trained and o.valid_members < new_min}
    assert predicted, "the short demo (faults on) has a trained group with an invalid member"
    other = replay_run(run_dir, policy_config(cfg, {"min_valid": new_min}))
    diff = diff_outcomes(own, other)
    assert {c.group for c in diff.changes} == predicted
    for c in diff.changes:
        assert c.before.trained and not c.after.trained and c.after.trained_tokens == 0
        assert c.after.reason.startswith(f"{c.before.valid_members} valid member(s) < min_valid {new_min}")
    assert diff.trained_after == diff.trained_before - len(predicted)
    assert diff.steps_equal_after < diff.steps_equal_before  # the trained batches are no longer the online ones


def test_the_cli_prints_the_diff_as_json_and_refuses_a_bad_policy_by_name(short_demo_run, tmp_path) -> None:
    run_dir, cfg = _run(short_demo_run)
    policy = tmp_path / "other.toml"
    policy.write_text(f"min_valid = {cfg.group_size}\n")
    cli = [sys.executable, "-m", "agentlog.tools.cli", "reconstruct", str(run_dir), "--policy", str(policy), "--diff"]
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    diff = json.loads(out.stdout)
    assert diff["changes"] and all(c["before"]["trained"] and not c["after"]["trained"] for c in diff["changes"])
    text = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and f"{len(diff['changes'])} group(s) changed:" in text.stdout
    policy.write_text("min_valid = 0\n")
    bad = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "LoopConfig.min_valid: expected 1..group_size (4), found 0" in bad.stderr


def test_train_once_is_a_policy_setting_and_linear_sessions_train_the_same_either_way(short_demo_run) -> None:
    run_dir, cfg = _run(short_demo_run)
    assert cfg.allow_repeated_targets is False and cfg.reduce_config().allow_repeated_targets is False
    repeated = policy_config(cfg, {"allow_repeated_targets": True})
    assert repeated.reduce_config().allow_repeated_targets is True
    # The built-in agent never branches (one row per session), so no turn is held by two rows:
    # re-reduced with repeated targets, every step still trains exactly the recorded samples.
    other = replay_run(run_dir, repeated)
    assert other.steps == other.steps_equal == 2
    assert diff_outcomes(replay_run(run_dir, cfg), other).changes == ()


def test_a_policy_that_makes_a_health_flag_untrainable_changes_exactly_the_groups_holding_a_flagged_member(short_demo_run) -> None:
    from agentlog.events.schema.types import SessionAborted, SessionFinished, SessionOpened, TurnDelta, TurnRecorded

    run_dir, cfg = _run(short_demo_run)
    own = replay_run(run_dir, cfg)
    with Run.open(run_dir) as run:
        envs = [(pid, e) for pid, src in run.existing_rollout_logs().items() for e in src.read()]
    # By hand: a member that trains (finished, or aborted as a failure) with a turn stopped at its length limit.
    group_of = {(pid, e.session_id): f"p{pid:04d}/{e.body.group_id}" for pid, e in envs if isinstance(e.body, SessionOpened)}
    cut = {(pid, e.session_id) for pid, e in envs if isinstance(e.body, (TurnRecorded, TurnDelta)) and e.body.finish_reason == "length"}
    trains = {(pid, e.session_id) for pid, e in envs
              if isinstance(e.body, SessionFinished)
              or isinstance(e.body, SessionAborted) and not e.body.refill and cfg.reduce_config().outcome_of(e.body.reason) == "fail"}
    predicted = {group_of[s] for s in cut & trains} & set(own.outcomes)
    assert predicted, "the demo's turns stop at their token limit"
    diff = diff_outcomes(own, replay_run(run_dir, policy_config(cfg, {"untrainable_flags": ["truncated"]})))
    assert {c.group for c in diff.changes} == predicted
    assert all("samples" in c.changed for c in diff.changes)
    # A flag no member carries changes nothing.
    assert diff_outcomes(own, replay_run(run_dir, policy_config(cfg, {"untrainable_flags": ["undelivered"]}))).changes == ()
