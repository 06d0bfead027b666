"""Dynamic sampling (``dynamic_sampling``: DAPO's filter): a group whose valid rewards have no
spread teaches nothing (every advantage is 0), so the learner records it as skipped, reason
``zero spread``, instead of training it. The decision is the learner's one rule
(``trainer.decide_group``), so the online step and the counterfactual replay agree."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.errors import ConfigError
from agentlog.loop import LoopConfig
from agentlog.loop.config import GroupsConfig
from agentlog.loop.dynamic_sampling import ends_chain, run_chain, wants_redraw
from agentlog.loop.naming import redraw_id, redraw_of
from agentlog.reducers.groups import Group, GroupMember
from agentlog.loop.check import check_run
from agentlog.loop.counterfactual import diff_outcomes, policy_config, replay_run
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.run import run_loop
from agentlog.loop.run_folder import Run
from agentlog.reducers.partitioned import reduce_partitions


def _groups(run_dir: Path, cfg: LoopConfig) -> dict:
    with Run.open(run_dir) as run:
        released = reduce_partitions({pid: src.read() for pid, src in run.existing_rollout_logs().items()},
                                     cfg.reduce_config())
    return {gid: r.group for groups in released.values() for gid, r in groups.items()}


def _spreads(group) -> bool:
    rewards = group.valid_rewards
    return bool(rewards) and max(rewards) - min(rewards) > 0


def test_the_counterfactual_with_dynamic_sampling_filters_exactly_the_groups_without_spread(short_demo_run) -> None:
    cwd, _ = short_demo_run
    run_dir = cwd / "runs" / "demo"
    with Run.open(run_dir) as run:
        cfg = run.config
    own = replay_run(run_dir, cfg)
    groups = _groups(run_dir, cfg)
    # By hand: a trained group whose valid rewards are all equal.
    predicted = {name for name, o in own.outcomes.items() if o.trained and not _spreads(groups[name.split("/", 1)[1]])}
    assert predicted, "the short demo trained groups whose rewards are all equal"
    diff = diff_outcomes(own, replay_run(run_dir, policy_config(cfg, {"groups": {"dynamic_sampling": True}})))
    assert {c.group for c in diff.changes} == predicted
    assert all(c.after.reason.startswith("zero spread: ") and not c.after.trained for c in diff.changes)


def test_a_run_with_dynamic_sampling_trains_no_group_without_spread_and_reconstructs_equal(tmp_path: Path) -> None:
    # A warmed-up policy solves some prompts, so some groups spread (from a cold one none does, and
    # dynamic sampling then trains nothing: the run stops after max_untrainable_batches). 150 warm-up
    # steps of 64 demonstrations teach the protocol as the demo's 300 of 256 do (a quarter to a third of the
    # groups spread either way, on seeds 0-7), at a tenth of the cost; one warm-up thread, as the test
    # shares 2 cores with the other xdist workers (two threads there spin against them, 4-8x slower).
    cfg = LoopConfig(seed=0, steps=3, warmup_steps=150, warmup_batch=64, warmup_threads=1, groups_per_step=4, group_size=4,
                     stop_reward=0, time_budget_s=0, groups={"dynamic_sampling": True}, max_untrainable_batches=10)
    run_dir = tmp_path / "run"
    run_loop(cfg, run_dir)
    check = check_run(run_dir, cfg)
    assert check.ok and check.digests_equal == check.steps >= cfg.steps, (check.mismatches, check.missing)
    groups = _groups(run_dir, cfg)
    records = [r for r in read_learner_records(run_dir / "learner") if r.step > 0]
    trained = [gid for r in records for gid in r.groups]
    filtered = {gid: why for r in records for gid, why in r.skipped.items() if why.startswith("zero spread")}
    assert trained and filtered
    assert all(_spreads(groups[gid]) for gid in trained)
    # Every group it filtered had no spread, and every released group without spread was filtered or skipped.
    assert all(not _spreads(groups[gid]) and groups[gid].n_valid >= cfg.min_valid for gid in filtered)
    assert sum(r.metrics["rollout/groups_filtered"] for r in records) == len(filtered)
    # The worker drew a new prompt after each filtered group with a redraw left, and each step
    # ended exactly groups_per_step chains: its trained groups, plus its shortfall.
    released = {gid for r in records for gid in [*r.groups, *r.skipped]}
    assert any(redraw_of(gid) > 0 for gid in released), "some group was redrawn"
    for r in records:
        ends = [gid for gid in [*r.groups, *r.skipped] if ends_chain(groups[gid], cfg.groups)]
        assert len(ends) == cfg.groups_per_step, (r.step, ends)
        assert r.metrics["rollout/groups_short"] == cfg.groups_per_step - len(r.groups)
        assert r.metrics["rollout/redraws"] == sum(1 for gid in [*r.groups, *r.skipped] if redraw_of(gid) > 0)
        for gid in r.skipped:
            if wants_redraw(groups[gid], cfg.groups):
                assert redraw_id(gid.split("-r")[0], redraw_of(gid) + 1) in released, gid


@settings(max_examples=200, deadline=None)
@given(max_redraws=st.integers(0, 4), spreads=st.lists(st.booleans(), max_size=8), dynamic=st.booleans())
def test_a_chain_ends_at_its_first_group_with_spread_or_its_last_redraw(max_redraws, spreads, dynamic) -> None:
    cfg = GroupsConfig(dynamic_sampling=dynamic, max_redraws=max_redraws)

    async def play(k: int) -> Group:
        spread = spreads[k] if k < len(spreads) else False  # past the list: never spreads
        rewards = (0.0, 1.0) if spread else (1.0, 1.0)
        members = tuple(GroupMember(f"s{i}", i, "finished", True, r) for i, r in enumerate(rewards))
        return Group(redraw_id("b00000-g00", k), 2, members, (), False, "", k, k)

    played = asyncio.run(run_chain(play, cfg))
    # Terminates under its cap, at the first group with spread (or the first of all without dynamic sampling).
    assert 1 <= len(played) <= max_redraws + 1
    first_spread = next((k for k, sp in enumerate(spreads) if sp), None)
    expected = 1 if not dynamic else min(max_redraws, first_spread if first_spread is not None else max_redraws) + 1
    assert len(played) == expected
    # The learner counts exactly one end per chain, whatever came before it.
    assert [ends_chain(g, cfg) for g in played] == [False] * (len(played) - 1) + [True]


def test_a_bad_spread_tolerance_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"\[groups\] spread_tolerance: expected a finite number >= 0, found -1"):
        LoopConfig(groups={"dynamic_sampling": True, "spread_tolerance": -1})
