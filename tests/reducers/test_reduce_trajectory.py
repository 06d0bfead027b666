"""Trajectory tree and linearisation: hand-written tokens and masks per case."""

from __future__ import annotations

import pytest
from reduce_streams import Script, expect_row, msg, reduce_scripts

from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import session_trajectory
from agentlog.reducers.samples import COMPLETED, TRUNCATED, check_sample

S = msg("system", "sys")
S2 = msg("system", "other sys")
U = msg("user", "task")
U2 = msg("user", "other task")
A1 = msg("assistant", "a1")
A2 = msg("assistant", "a2")
A3 = msg("assistant", "a3")
T1 = msg("tool", "r1")
T1b = msg("tool", "r1 retried")


def two_turns(**kw) -> Script:
    """T0: [S,U] -> [10,11]; T1: [S,U,A1,T1] -> [12] (clean)."""
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2, **kw)
    return s


def test_clean_turns_append_prompt_tail_masked_zero_and_output_masked_one():
    (row,) = reduce_scripts(two_turns().finish()).samples
    expect_row(row, [1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 1])
    assert row.metadata["turn_indices"] == [0, 1]
    assert row.status == COMPLETED


def test_drift_inside_last_response_realigns_without_forking_the_tree():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    # The client re-tokenised the first response: 11 became 99.
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 99, 20, 21], [12], response=A2).finish()
    (row,) = reduce_scripts(s).samples
    # The drifted span is overwritten from the prompt as context.
    expect_row(row, [1, 2, 3, 10, 99, 20, 21, 12], [0, 0, 0, 0, 1])
    decisions = session_trajectory(_log(s), "s").decisions
    assert [d.drift for d in decisions] == ["clean", "realign"]


def _log(*scripts):
    from reduce_streams import log_of

    return log_of(*scripts).read(0)


@pytest.mark.parametrize(
    "output, expect_realign",
    [([12], True), ([12, 13], False)],
    ids=["shorter-than-threshold-realigns", "equal-to-threshold-forks"],
)
def test_realign_only_when_output_strictly_shorter_than_fork_threshold(output, expect_realign):
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 99, 20, 21], output, response=A2).finish()
    result = reduce_scripts(s, config=ReduceConfig(fork_threshold=2))
    if expect_realign:
        (row,) = result.samples
        expect_row(row, [1, 2, 3, 10, 99, 20, 21, 12], [0, 0, 0, 0, 1])
    else:
        first, second = result.samples
        expect_row(first, [1, 2, 3, 10, 11], [1, 1])
        expect_row(second, [1, 2, 3, 10, 99, 20, 21, 12, 13], [1, 1])
        assert (first.row_index, second.row_index) == (0, 1)


def test_fork_threshold_zero_disables_realign():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 99, 20, 21], [12], response=A2).finish()
    first, second = reduce_scripts(s, config=ReduceConfig(fork_threshold=0)).samples
    expect_row(first, [1, 2, 3, 10, 11], [1, 1])
    expect_row(second, [1, 2, 3, 10, 99, 20, 21, 12], [1])


def test_drift_before_last_response_forks_a_new_row():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    # The prompt itself re-rendered (3 -> 7): drift before the last response.
    s.turn([S, U, A1, T1], [1, 2, 7, 10, 11, 20, 21], [12], response=A2).finish()
    first, second = reduce_scripts(s).samples
    expect_row(first, [1, 2, 3, 10, 11], [1, 1])
    expect_row(second, [1, 2, 7, 10, 11, 20, 21, 12], [1])
    assert [d.drift for d in session_trajectory(_log(s), "s").decisions] == ["clean", "fork"]


def test_tool_result_fork_trains_shared_response_on_first_leaf_only():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2)
    s.turn([S, U, A1, T1b], [1, 2, 3, 10, 11, 30, 31], [13], response=A3).finish()
    first, second = reduce_scripts(s).samples
    expect_row(first, [1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 1])
    # A1 is shared: mask-0 context on the second leaf.
    expect_row(second, [1, 2, 3, 10, 11, 30, 31, 13], [0, 0, 0, 0, 1])
    assert (first.metadata["leaf"], second.metadata["leaf"]) == (0, 1)


def test_repeated_targets_train_the_shared_response_on_every_leaf():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2)
    s.turn([S, U, A1, T1b], [1, 2, 3, 10, 11, 30, 31], [13], response=A3).finish()
    first, second = reduce_scripts(s, config=ReduceConfig(allow_repeated_targets=True)).samples
    expect_row(first, [1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 1])
    # A1 is a target again on the second leaf, with its recorded log-probs.
    expect_row(second, [1, 2, 3, 10, 11, 30, 31, 13], [1, 1, 0, 0, 1])
    assert second.log_probs[:2].tolist() == first.log_probs[:2].tolist()
    assert second.trained_tokens_by_version() == {0: 3}


def test_system_fork_makes_independent_rows_in_insertion_order():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10], response=A1)
    s.turn([S2, U], [5, 2, 3], [11], response=A2)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 20], [12], response=A3).finish()
    first, second = reduce_scripts(s).samples
    # Depth-first in insertion order: the S subtree (leaf T2) before S2.
    expect_row(first, [1, 2, 3, 10, 20, 12], [1, 0, 1])
    expect_row(second, [5, 2, 3, 11], [1])


def test_user_fork_under_shared_system_message():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10], response=A1)
    s.turn([S, U2], [1, 2, 4], [11], response=A2).finish()
    first, second = reduce_scripts(s).samples
    expect_row(first, [1, 2, 3, 10], [1])
    expect_row(second, [1, 2, 4, 11], [1])


def test_foreign_assistant_message_is_routing_only():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    # The client replays an assistant message we never generated. With
    # rewrite-merging off it cannot replace A1, so it mounts as routing-only.
    foreign = msg("assistant", "something we never generated")
    s.turn([S, U, foreign, T1], [1, 2, 3, 50, 51, 20], [12], response=A2).finish()
    first, second = reduce_scripts(s, config=ReduceConfig(fork_threshold=0)).samples
    expect_row(first, [1, 2, 3, 10, 11], [1, 1])
    # 50, 51 (the foreign assistant) are prompt, never trained.
    expect_row(second, [1, 2, 3, 50, 51, 20, 12], [1])


def test_foreign_assistant_in_first_prompt_is_never_trained():
    s = Script("s")
    fewshot = msg("assistant", "example answer")
    s.turn([S, U, fewshot, U2], [1, 2, 50, 51, 4], [10], response=A1).finish()
    (row,) = reduce_scripts(s).samples
    expect_row(row, [1, 2, 50, 51, 4, 10], [1])
    (decision,) = session_trajectory(_log(s), "s").decisions
    assert (decision.routing, decision.mounted_nodes) == ("mounted", 4)


def test_rewrite_of_short_last_assistant_merges_and_old_turn_is_never_trained():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    rewritten = msg("assistant", "a1 ")  # re-rendered by the client
    s.turn([S, U, rewritten, T1], [1, 2, 3, 10, 12, 20], [13], response=A2).finish()
    (row,) = reduce_scripts(s).samples
    expect_row(row, [1, 2, 3, 10, 12, 20, 13], [1])
    decisions = session_trajectory(_log(s), "s").decisions
    assert (decisions[0].routing, decisions[0].trainable, decisions[0].reason) == ("rewritten", False, "rewritten")
    assert decisions[1].routing == "merged_rewrite"


def test_rewrite_of_long_assistant_forks_instead_of_merging():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    rewritten = msg("assistant", "a1 ")
    s.turn([S, U, rewritten, T1], [1, 2, 3, 10, 12, 20], [13], response=A2).finish()
    # fork_threshold 2: the 2-token A1 is not "short", so the rewrite forks.
    first, second = reduce_scripts(s, config=ReduceConfig(fork_threshold=2)).samples
    expect_row(first, [1, 2, 3, 10, 11], [1, 1])
    expect_row(second, [1, 2, 3, 10, 12, 20, 13], [1])


def test_stacked_tree_fork_plus_token_drift():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2)
    # A tool fork whose prompt also drifted before A1 (3 -> 7): on the second
    # leaf the shared A1 context row has nothing trainable and is dropped,
    # the drifted turn forks into its own row.
    s.turn([S, U, A1, T1b], [1, 2, 7, 10, 11, 30], [14], response=A3).finish()
    first, second = reduce_scripts(s).samples
    expect_row(first, [1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 1])
    expect_row(second, [1, 2, 7, 10, 11, 30, 14], [1])
    assert [d.drift for d in session_trajectory(_log(s), "s").decisions] == ["clean", "clean", "fork"]


def test_long_mixed_session():
    A = [msg("assistant", f"a{i}") for i in range(8)]
    T = [msg("tool", f"t{i}") for i in range(8)]
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A[0])  # 0 clean
    s.turn([S, U, A[0], T[0]], [1, 2, 3, 10, 11, 20, 21], [12, 13], response=A[1])  # 1 clean
    h2 = [S, U, A[0], T[0], A[1], T[1]]
    s.turn(h2, [1, 2, 3, 10, 11, 20, 21, 12, 99, 22], [14], response=A[2])  # 2 realign (13 -> 99)
    h3 = h2 + [A[2], T[2]]
    s.turn(h3, [1, 2, 3, 10, 11, 20, 21, 12, 99, 22, 14, 23], [15, 16], response=A[3], finish="abort")  # 3
    h4 = h3 + [A[3], T[3]]
    p4 = [1, 2, 3, 10, 11, 20, 21, 12, 99, 22, 14, 23, 15, 16, 24]
    s.turn(h4, p4, [17], response=A[4], log_probs=None)  # 4 no log-probs
    s.turn([S, U, A[0], T[0], A[1], T1b], [1, 2, 3, 10, 11, 20, 21, 12, 13, 25], [18], response=A[5])  # 5 tool fork
    s.turn([S2, U], [5, 2, 3], [19], response=A[6])  # 6 system fork
    s.turn([S2, U, A[6], T[6]], [5, 2, 8, 19, 26], [27], response=A[7])  # 7 token fork
    s.finish(0.5)
    rows = reduce_scripts(s).samples
    assert len(rows) == 4
    expect_row(rows[0], [1, 2, 3, 10, 11, 20, 21, 12, 99, 22, 14, 23, 15, 16, 24, 17], [1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0])
    expect_row(rows[1], [1, 2, 3, 10, 11, 20, 21, 12, 13, 25, 18], [0, 0, 0, 0, 0, 0, 0, 1])
    expect_row(rows[2], [5, 2, 3, 19], [1])
    expect_row(rows[3], [5, 2, 8, 19, 26, 27], [1])
    assert [r.metadata["turn_indices"] for r in rows] == [[0, 1, 2, 3, 4], [0, 1, 5], [6], [7]]
    assert all(r.reward == 0.5 and r.turns == 8 for r in rows)
    decisions = session_trajectory(_log(s), "s").decisions
    assert [d.drift for d in decisions] == ["clean", "clean", "realign", "clean", "clean", "clean", "clean", "fork"]
    assert [d.reason for d in decisions] == ["", "", "", "finish_abort", "missing_log_probs", "", "", ""]
    assert [d.row for d in decisions] == [0, 0, 0, 0, 0, 1, 2, 3]


def test_sessions_are_isolated_when_interleaved():
    a, b = two_turns().finish(1.0), Script("t", group_id="g2")
    b.turn([S, U], [1, 2, 3], [40], response=A1)
    b.turn([S, U, A1, T1], [1, 2, 3, 40, 20, 21], [41], response=A2).finish(0.0)
    together = reduce_scripts(a, b, interleave=True).samples
    alone = reduce_scripts(a).samples + reduce_scripts(b).samples
    assert {s.session_id for s in together} == {"s", "t"}
    by_session = sorted(together, key=lambda x: x.session_id)
    assert [x.tokens for x in by_session] == [x.tokens for x in alone]
    expect_row(by_session[1], [1, 2, 3, 40, 20, 21, 41], [1, 0, 0, 1])


def test_missing_log_probs_turn_is_context_not_trained():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, log_probs=None)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2).finish()
    (row,) = reduce_scripts(s).samples
    expect_row(row, [1, 2, 3, 10, 11, 20, 21, 12], [0, 0, 0, 0, 1])


def test_session_with_only_untrainable_turns_yields_no_row():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, log_probs=None)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20], [12], response=A2, finish="abort").finish()
    assert reduce_scripts(s).samples == []


def test_abort_finished_turn_is_not_trained():
    s = two_turns(finish="abort").finish()
    (row,) = reduce_scripts(s).samples
    expect_row(row, [1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 0])


def test_undelivered_turn_is_not_trained():
    s = two_turns().undelivered(0).finish()
    (row,) = reduce_scripts(s).samples
    expect_row(row, [1, 2, 3, 10, 11, 20, 21, 12], [0, 0, 0, 0, 1])
    assert session_trajectory(_log(s), "s").decisions[0].reason == "undelivered"


@pytest.mark.parametrize(
    "limit, expected",
    [
        (0, ([1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 1])),
        (7, ([1, 2, 3, 10, 11, 20, 21], [1, 1, 0, 0])),
        (4, ([1, 2, 3, 10], [1])),
        (3, None),  # the cut leaves no response at all
        (2, None),  # the cut falls inside the prompt: never a negative length
    ],
)
def test_max_context_truncation_never_yields_empty_mask_or_negative_length(limit, expected):
    result = reduce_scripts(two_turns().finish(), config=ReduceConfig(max_context_tokens=limit))
    if expected is None:
        assert result.samples == []
    else:
        (row,) = result.samples
        expect_row(row, *expected)
        assert row.metadata.get("cut_to_max_context", False) == (limit != 0)


def test_truncation_dropping_every_trained_token_emits_no_row():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, log_probs=None)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2).finish()
    # Only token 12 is trainable; a cut at 7 tokens leaves an all-zero mask.
    assert reduce_scripts(s, config=ReduceConfig(max_context_tokens=7)).samples == []
    for limit in range(1, 9):
        for sample in reduce_scripts(s, config=ReduceConfig(max_context_tokens=limit)).samples:
            check_sample(sample)
            assert 1 in sample.mask.tolist()


def test_final_length_turn_makes_sample_truncated():
    (row,) = reduce_scripts(two_turns(finish="length").finish()).samples
    assert row.status == TRUNCATED
    expect_row(row, [1, 2, 3, 10, 11, 20, 21, 12], [1, 1, 0, 0, 1])


def test_earlier_length_turn_with_final_stop_is_completed():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, finish="length")
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20, 21], [12], response=A2).finish()
    (row,) = reduce_scripts(s).samples
    assert row.status == COMPLETED


def test_turns_without_messages_chain_by_tokens():
    s = Script("s")
    s.turn([], [1, 2, 3], [10, 11])
    s.turn([], [1, 2, 3, 10, 11, 20], [12])
    s.turn([], [1, 9, 3, 10, 11, 20, 12, 21], [13]).finish()
    first, second = reduce_scripts(s).samples
    expect_row(first, [1, 2, 3, 10, 11, 20, 12], [1, 1, 0, 1])
    expect_row(second, [1, 9, 3, 10, 11, 20, 12, 21, 13], [1])


def test_linearise_is_non_destructive_and_repeatable():
    s = two_turns().finish()
    first = session_trajectory(_log(s), "s")
    again = session_trajectory(_log(s), "s")
    assert first == again
    assert len(first.rows) == 1


def test_decisions_say_which_turns_a_row_trains():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, policy_version=3)
    # Realign overwrites the first response: turn 0 ends up untrained.
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 99, 20, 21], [12], response=A2, policy_version=4).finish()
    traj = session_trajectory(_log(s), "s")
    assert [(d.drift, d.trainable, d.trained, d.row) for d in traj.decisions] == [
        ("clean", True, False, 0),
        ("realign", True, True, 0),
    ]
    (row,) = traj.rows
    assert row.trained_turns == (1,) and row.policy_version == 4
    cut = session_trajectory(_log(two_turns().finish()), "s", ReduceConfig(max_context_tokens=5))
    assert [d.trained for d in cut.decisions] == [True, False] and cut.rows[0].trained_turns == (0,)
