"""The group reward mean has one definition (``reducers.groups.reward_mean``):
added left to right from 0.0, then divided by the count; NaN for none."""

from __future__ import annotations

import math
from functools import reduce
from operator import add

from hypothesis import given
from hypothesis import strategies as st

from agentlog.reducers.groups import Group, GroupMember, group_means, reward_mean

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=40))
def test_the_mean_adds_left_to_right(rewards):
    assert reward_mean(rewards) == reduce(add, rewards, 0.0) / len(rewards)


def test_the_mean_is_not_compensated_summation():
    # Left to right, the 1.0 is lost against 1e16 (as torch's index_add_ loses it); fsum would keep it.
    assert reward_mean([1e16, 1.0, -1e16]) == 0.0 != math.fsum([1e16, 1.0, -1e16]) / 3


def test_no_rewards_have_no_mean():
    assert math.isnan(reward_mean([]))


@given(st.lists(st.tuples(st.integers(min_value=0, max_value=4), finite), max_size=40))
def test_group_means_are_each_groups_mean_in_order(pairs):
    groups = [g for g, _ in pairs]
    means = group_means([r for _, r in pairs], groups)
    assert len(means) == (max(groups) + 1 if groups else 0)
    for g, m in enumerate(means):
        mine = [r for h, r in pairs if h == g]
        assert (math.isnan(m) and not mine) or m == reward_mean(mine)


def test_a_groups_baseline_is_the_mean_of_its_valid_members():
    members = (
        GroupMember("a", 0, "finished", True, 1.0),
        GroupMember("b", 1, "aborted", False, None, "timeout"),
        GroupMember("c", 2, "finished", True, 0.0),
        GroupMember("d", 3, "finished", False, None, "no usable reward"),
    )
    group = Group("g", 4, members, (), False, "", 0, 9)
    assert group.baseline == 0.5 == reward_mean(group.valid_rewards)
