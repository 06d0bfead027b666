"""Group-relative advantages: hand-computed values, grouping by id, no NaN."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from agentlog.learner.advantages import compute_advantages

T = torch.tensor


def test_aborted_member_is_out_of_the_baseline_before_std_scaling():
    """rewards [1, 1, 0, 0], member 1 aborted -> [0.667, 0, -0.333, -0.333] (dr_grpo: no std)."""
    adv = compute_advantages(T([1.0, 1.0, 0.0, 0.0]), T([0, 0, 0, 0]), T([True, False, True, True]), "dr_grpo")
    assert_close(adv, T([2 / 3, 0.0, -1 / 3, -1 / 3]))
    assert adv[1].item() == 0.0


def test_grpo_scales_by_the_unbiased_std_of_valid_members():
    adv = compute_advantages(T([1.0, 1.0, 0.0, 0.0]), T([0, 0, 0, 0]), T([True, False, True, True]), "grpo")
    std = (1 / 3) ** 0.5  # unbiased std of [1, 0, 0]
    assert_close(adv, T([(2 / 3) / (std + 1e-6), 0.0, (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)]))
    assert_close(adv, compute_advantages(T([1.0, 1.0, 0.0, 0.0]), T([0, 0, 0, 0]),
                                         T([True, False, True, True]), "gspo"))


def test_interleaved_groups_are_grouped_by_id_not_by_position():
    rewards = T([1.0, 5.0, 0.0, 3.0, 2.0, 4.0])
    gids = T([7, 2, 7, 2, 7, 2])
    adv = compute_advantages(rewards, gids, torch.ones(6, dtype=torch.bool), "grpo", eps=0.0)
    # group 7: [1, 0, 2], mean 1, std 1; group 2: [5, 3, 4], mean 4, std 1
    assert_close(adv, T([0.0, 1.0, -1.0, -1.0, 1.0, 0.0]))


def test_zero_variance_and_single_member_groups_give_zero_not_nan():
    rewards = T([0.1, 0.1, 0.1, 0.7, 0.3, 0.9, 0.2])
    gids = T([0, 0, 0, 1, 2, 2, 3])
    valid = T([True, True, True, True, True, False, False])
    for est in ("grpo", "dr_grpo", "gspo"):
        adv = compute_advantages(rewards, gids, valid, est)
        assert torch.isfinite(adv).all()
        # 0.1 * 3 / 3 != 0.1 in float: the residue must not be divided by eps
        assert torch.equal(adv, torch.zeros(7)), est


def test_no_valid_member_at_all_gives_zeros():
    adv = compute_advantages(T([1.0, 0.0]), T([0, 0]), T([False, False]))
    assert torch.equal(adv, torch.zeros(2))


def test_bad_inputs_raise_naming_the_problem():
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages(T([1.0]), T([0]), T([True]), "ppo")
    with pytest.raises(ValueError, match="equal length"):
        compute_advantages(T([1.0, 2.0]), T([0]), T([True]))
    with pytest.raises(ValueError, match="integers"):
        compute_advantages(T([1.0]), T([0.5]), T([True]))
    with pytest.raises(ValueError, match=r"non-finite reward .*\[1\]"):
        compute_advantages(T([1.0, float("nan")]), T([0, 0]), T([True, True]))


def test_non_finite_reward_of_an_invalid_member_is_ignored():
    adv = compute_advantages(T([1.0, float("nan"), 0.0]), T([0, 0, 0]), T([True, False, True]), "dr_grpo")
    assert_close(adv, T([0.5, 0.0, -0.5]))


members = st.lists(
    st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 0.1]), st.booleans()),
    min_size=1, max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(members, st.sampled_from(["grpo", "dr_grpo", "gspo"]), st.randoms(use_true_random=False))
def test_invalid_members_anywhere_leave_valid_advantages_bit_identical(rows, estimator, rnd):
    """Adding aborted members (any reward, any position) changes no valid member's advantage."""
    valid_rows = [r for r in rows if r[2]]
    if not valid_rows:
        return
    base = compute_advantages(
        T([r[1] for r in valid_rows], dtype=torch.float32), T([r[0] for r in valid_rows]),
        torch.ones(len(valid_rows), dtype=torch.bool), estimator)
    mixed = list(rows)
    rnd.shuffle(mixed)
    # keep valid members in their original relative order
    it = iter(valid_rows)
    mixed = [next(it) if r[2] else r for r in mixed]
    full = compute_advantages(
        T([r[1] for r in mixed], dtype=torch.float32), T([r[0] for r in mixed]),
        T([r[2] for r in mixed]), estimator)
    valid = T([r[2] for r in mixed])
    assert torch.equal(full[valid], base)
    assert torch.equal(full[~valid], torch.zeros(int((~valid).sum())))


@settings(max_examples=40, deadline=None)
@given(members, st.sampled_from(["grpo", "dr_grpo"]))
def test_vectorised_advantages_match_a_plain_loop(rows, estimator):
    """Element by element against a loop over groups with torch.mean / torch.std."""
    rewards = T([r[1] for r in rows], dtype=torch.float64)
    gids = T([r[0] for r in rows])
    valid = T([r[2] for r in rows])
    got = compute_advantages(rewards, gids, valid, estimator)
    want = torch.zeros(len(rows), dtype=torch.float64)
    for g in set(gids.tolist()):
        idx = [i for i in range(len(rows)) if rows[i][0] == g and rows[i][2]]
        r = rewards[idx]
        if len(idx) < 2 or r.max() == r.min():
            continue
        a = r - r.mean()
        if estimator == "grpo":
            a = a / (r.std() + 1e-6)
        want[idx] = a
    assert_close(got, want)


@settings(max_examples=60, deadline=None)
@given(members)
def test_the_baseline_is_the_groups_reward_mean_to_the_bit(rows):
    """dr_grpo's advantage is ``r - baseline``, the baseline being the one
    definition of the group reward mean (reducers.groups), bit for bit."""
    from agentlog.reducers.groups import reward_mean

    rewards = T([r[1] for r in rows], dtype=torch.float64)
    got = compute_advantages(rewards, T([r[0] for r in rows]), T([r[2] for r in rows]), "dr_grpo")
    for g in {r[0] for r in rows}:
        idx = [i for i, r in enumerate(rows) if r[0] == g and r[2]]
        valid = [rows[i][1] for i in idx]
        if len(idx) < 2 or max(valid) == min(valid):
            continue
        baseline = reward_mean(valid)
        assert [float(got[i]) for i in idx] == [r - baseline for r in valid]
