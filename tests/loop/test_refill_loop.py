"""Per-sample refill and abort classes in the training loop: the worker opens a replacement for
every member the engine owes one, groups complete at full size, and the run rebuilds EQUAL."""

from __future__ import annotations

import json
from pathlib import Path

from loop_helpers import small_config

from agentlog.events.schema.types import SessionAborted, SessionOpened
from agentlog.loop.check import check_run
from agentlog.loop.config import FaultConfig, LoopConfig
from agentlog.loop.run import run_loop
from agentlog.loop.run_folder import Run
from agentlog.reducers.partitioned import reduce_partitions


def _run_and_check(cfg: LoopConfig, tmp_path: Path) -> tuple[Path, list]:
    """Run ``cfg``'s loop; check that it rebuilds EQUAL offline; its folder and every rollout envelope."""
    run_dir = tmp_path / "run"
    run_loop(cfg, run_dir)
    check = check_run(run_dir, cfg)
    assert check.ok and check.digests_equal == check.steps >= cfg.steps, (check.mismatches, check.missing)
    with Run.open(run_dir) as run:
        return run_dir, [e for src in run.existing_rollout_logs().values() for e in src.read()]


def test_a_run_that_refills_infrastructure_aborts_completes_its_groups_and_rebuilds_equal(tmp_path: Path) -> None:
    # Injected exceptions (reason exception:InjectedFault) are infrastructure aborts: refilled here.
    cfg = small_config(steps=3, faults=FaultConfig(exception_rate=0.15, timeout_rate=0.0, drop_rate=0.0, straggler_rate=0.0,
                                                     empty_marker_rate=0.0),
                       groups={"infrastructure": "refill", "max_refills": 4}, max_untrainable_batches=0)
    run_dir, envs = _run_and_check(cfg, tmp_path)
    with Run.open(run_dir) as run:
        released = reduce_partitions({pid: src.read() for pid, src in run.existing_rollout_logs().items()}, cfg.reduce_config())
    opened = {e.session_id: e.body for e in envs if isinstance(e.body, SessionOpened)}
    refilled = {e.session_id for e in envs if isinstance(e.body, SessionAborted) and e.body.refill}
    replacements = {sid: body.replaces for sid, body in opened.items() if body.replaces}
    assert refilled, "15% injected exceptions over 96 sessions refilled some"
    # Each refilled member got exactly one replacement, in its own group, past the original slots.
    assert sorted(replacements.values()) == sorted(refilled)
    for sid, replaced in replacements.items():
        assert opened[sid].group_id == opened[replaced].group_id and opened[sid].sample_index >= cfg.group_size
    groups = {gid: r.group for part in released.values() for gid, r in part.items()}
    for g in groups.values():
        originals = [m for m in g.members if not m.replaces]
        # Full size: every original slot ends in one member that is not a refilled abort (or was dropped).
        assert len(g.members) + len(g.dropped) - len([m for m in g.members if m.session_id in refilled]) == cfg.group_size
        assert len(originals) + sum(1 for s in g.dropped if not opened[s].replaces) == cfg.group_size


def test_a_run_folder_saved_before_abort_classes_rebuilds_with_every_abort_excluded(tmp_path: Path) -> None:
    saved = LoopConfig().to_dict()
    del saved["groups"]
    saved["dynamic_sampling"] = True  # where dynamic sampling sat before the [groups] table
    (tmp_path / "config.json").write_text(json.dumps(saved))
    cfg = Run.load_config(tmp_path)
    assert cfg.groups.outcomes() == {"infrastructure": "exclude", "policy": "exclude", "task": "exclude", "other": "exclude"}
    assert cfg.groups.dynamic_sampling is True
    assert cfg.reduce_config().outcome_of("wall_clock_timeout") == "exclude"
    # A new run's defaults: a policy abort is a failure.
    assert LoopConfig().reduce_config().outcome_of("wall_clock_timeout") == "fail"


def test_an_oversampled_run_trains_the_first_groups_and_records_the_cancelled_leftovers(tmp_path: Path) -> None:
    from agentlog.events.schema.types import SessionDropped
    from agentlog.loop.learner_records import read_learner_records

    # Injected hangs (3 s) keep some groups running after four completed: those get cancelled.
    hangs = FaultConfig(exception_rate=0.0, timeout_rate=0.08, drop_rate=0.0, straggler_rate=0.0, empty_marker_rate=0.0,
                        timeout_budget_s=3.0)
    cfg = small_config(steps=4, groups_per_step=4, faults=hangs, groups={"oversample": 0.5}, max_untrainable_batches=0)
    run_dir, envs = _run_and_check(cfg, tmp_path)
    opened = {e.session_id: e.body for e in envs if isinstance(e.body, SessionOpened)}
    cancelled = {e.session_id for e in envs if isinstance(e.body, SessionDropped) and e.body.reason == "oversampled"}
    # Each batch started 6 groups (4 x 1.5), and cancelled the sessions still live once 4 had completed
    # (a group that completed before that is trained in a later step, as slime keeps finished extras).
    assert {o.group_id for o in opened.values()} >= {f"b00000-g{g:02d}" for g in range(6)}
    assert cancelled, "the leftovers' live sessions were dropped, reason oversampled"
    records = [r for r in read_learner_records(run_dir / "learner") if r.step > 0]
    leftovers = {gid for r in records for gid, why in r.skipped.items() if why.startswith("oversampled: ")}
    assert leftovers and leftovers == {opened[s].group_id for s in cancelled} & {g for r in records for g in r.skipped}
    for r in records:
        # A step counts the groups that completed, never a leftover, and trains at most groups_per_step.
        assert len(r.groups) <= cfg.groups_per_step
        assert not leftovers & set(r.groups)
        assert r.metrics["rollout/groups_oversampled"] == sum(1 for g in r.skipped if g in leftovers)
        assert "rollout/len_trained" in r.metrics and "rollout/len_released" in r.metrics


def test_the_counterfactual_of_excluding_policy_aborts_changes_exactly_the_groups_that_hold_one(tmp_path: Path) -> None:
    from agentlog.loop.counterfactual import diff_outcomes, policy_config, replay_run

    timeouts = FaultConfig(exception_rate=0.0, timeout_rate=0.2, drop_rate=0.0, straggler_rate=0.0, empty_marker_rate=0.0)
    cfg = small_config(steps=2, faults=timeouts, max_untrainable_batches=0)  # a new run: policy aborts are failures
    run_dir, envs = _run_and_check(cfg, tmp_path)
    timed_out = {e.session_id for e in envs if isinstance(e.body, SessionAborted) and e.body.reason == "wall_clock_timeout"}
    opened = {e.session_id: e.body.group_id for e in envs if isinstance(e.body, SessionOpened)}
    own = replay_run(run_dir, cfg)
    assert own.steps_equal == own.steps
    # By hand: a group changes iff a member timed out (its failure, no rows, becomes one zero-masked placeholder).
    predicted = {f"p0000/{opened[s]}" for s in timed_out} & set(own.outcomes)
    assert predicted, "20% injected timeouts hit some consumed group"
    diff = diff_outcomes(own, replay_run(run_dir, policy_config(cfg, {"groups": {"policy": "exclude"}})))
    assert {c.group for c in diff.changes} == predicted
    assert all("samples" in c.changed for c in diff.changes)


def test_dynamic_sampling_at_the_top_level_of_a_config_says_where_it_moved() -> None:
    import pytest

    from agentlog.events.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dynamic_sampling: moved to the \[groups\] table"):
        LoopConfig.from_dict({"dynamic_sampling": True})
