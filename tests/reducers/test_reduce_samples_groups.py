"""Samples per terminal state, rewards, groups, errors and configuration."""

from __future__ import annotations

import math

import pytest
from reduce_streams import Script, expect_row, log_of, msg, reduce_scripts

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import Envelope, PolicyUpdated, SessionAborted, SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.reducers.config import ConfigError, ReduceConfig
from agentlog.reducers.pipeline import Reducer, ReduceError, reduce_log
from agentlog.reducers.samples import ABORTED, COMPLETED, aborted_placeholder, check_sample, resolve_reward

S, U, A1 = msg("system", "s"), msg("user", "u"), msg("assistant", "a1")


def member(sid: str, gid: str = "g", size: int = 3, index: int = 0) -> Script:
    s = Script(sid, group_id=gid, group_size=size, sample_index=index, policy_version=4)
    s.turn([S, U], [1, 2, 3], [10 + index, 11], response=A1, policy_version=5)
    return s


# ------------------------------------------------------------------ samples


def test_aborted_session_yields_exactly_the_placeholder():
    s = member("s").abort("sandbox_boot")
    result = reduce_scripts(s)
    assert result.samples == [
        aborted_placeholder("g", "s", 0, "sandbox_boot", policy_version=4, turns=1, lsn_first=0, lsn_last=3)
    ]
    (p,) = result.samples
    assert (p.token_ids.tolist(), p.response_length, p.mask.tolist(), p.log_probs.tolist()) == ([0, 0], 1, [0], [0.0])
    assert (p.reward, p.remove_sample, p.status, p.metadata) == (0.0, True, ABORTED, {"abort_reason": "sandbox_boot"})


def test_dropped_session_yields_nothing():
    result = reduce_scripts(member("s", size=1).drop("duplicate"))
    assert result.samples == []
    (group,) = result.groups
    assert group.members == () and group.dropped == ("s",)


def test_finished_sample_carries_provenance():
    result = reduce_scripts(Script("x", group_id="h").turn([U], [7], [8]).finish(), member("s", size=1).finish(1))
    sample = result.samples[1]
    assert (sample.group_id, sample.session_id, sample.sample_index) == ("g", "s", 0)
    assert (sample.lsn_first, sample.lsn_last, sample.turns, sample.policy_version) == (4, 7, 1, 5)
    assert sample.reward == 1.0 and sample.status == COMPLETED


def test_reward_falls_back_to_last_reward_assigned():
    s = member("s", size=1).reward(0.25).reward(0.75).finish(None)
    (sample,) = reduce_scripts(s).samples
    assert sample.reward == 0.75


def test_session_finished_reward_wins_over_reward_assigned():
    (sample,) = reduce_scripts(member("s", size=1).reward(0.25).finish(0.5)).samples
    assert sample.reward == 0.5


def test_dict_reward_uses_configured_key_or_single_value():
    single = reduce_scripts(member("s", size=1).finish({"pass": 1.0})).samples[0]
    assert single.reward == 1.0
    keyed = reduce_scripts(member("s", size=1).finish({"pass": 1.0, "style": 0.2}), config=ReduceConfig(reward_key="style"))
    assert keyed.samples[0].reward == 0.2 and not keyed.samples[0].remove_sample


def test_unusable_reward_marks_rows_removed_and_member_invalid():
    result = reduce_scripts(member("s", size=1).finish({"pass": 1.0, "style": 0.2}), config=ReduceConfig(min_valid=1))
    (sample,) = result.samples
    assert sample.remove_sample and sample.reward == 0.0
    assert "reward_key" in sample.metadata["reward_error"]
    (group,) = result.groups
    assert group.members[0].valid is False and group.skipped
    missing = reduce_scripts(member("s", size=1).finish(None), config=ReduceConfig(min_valid=1))
    assert missing.samples[0].remove_sample and "no reward" in missing.samples[0].metadata["reward_error"]


@pytest.mark.parametrize(
    "value, expected",
    [(1, 1.0), (True, 1.0), (False, 0.0), (0.5, 0.5), ({"a": 2}, 2.0), (None, None), (math.nan, None),
     (math.inf, None), ("1", None), ({"a": 1, "b": 2}, None), ({"a": math.nan}, None), ({"a": {"b": 1}}, None)],
)
def test_resolve_reward_never_raises(value, expected):
    reward, problem = resolve_reward(value)
    assert reward == expected
    assert bool(problem) == (expected is None)


# ------------------------------------------------------------------ groups


def test_group_released_once_when_all_members_terminal_with_aborted_invalid():
    a, b, c = member("a", index=0), member("b", index=1), member("c", index=2)
    log = log_of(a, b, c, interleave=True)  # all three open before any ends
    log.append_batch([("b", 3, SessionAborted(reason="oom")), ("a", 3, SessionFinished(reward=1.0))])
    reducer = Reducer()
    outputs = [reducer.feed(env) for env in log.read(0)]
    assert sum(len(o.groups) for o in outputs) == 0  # c still running
    log.append_batch([("c", 3, SessionFinished(reward=0.0))])
    last = reducer.feed(list(log.read(log.next_lsn - 1))[0])
    (group,) = last.groups
    assert [m.session_id for m in group.members] == ["a", "b", "c"]
    assert [m.valid for m in group.members] == [True, False, True]
    assert group.valid == [True, False, True]
    assert group.valid_rewards == [1.0, 0.0]
    assert group.samples[1].remove_sample and not group.skipped
    assert reducer.pending_groups() == {}


def test_groups_released_in_completion_order():
    g1 = [member(f"x{i}", gid="g1", size=2, index=i) for i in range(2)]
    g2 = [member(f"y{i}", gid="g2", size=2, index=i) for i in range(2)]
    log = MemoryLog(clock=lambda: 0)
    for s in g1 + g2:
        log.append_batch(s.records())  # every session open and running
    for sid in ("x0", "y0", "y1", "x1"):
        log.append_batch([(sid, 3, SessionFinished(reward=1.0))])
    result = reduce_log(log)
    assert [(g.group_id, g.release_index) for g in result.groups] == [("g2", 0), ("g1", 1)]
    assert result.groups[0].lsn_released < result.groups[1].lsn_released


def test_group_with_too_few_valid_members_is_skipped_with_reason():
    a, b, c = member("a", index=0).finish(1.0), member("b", index=1).abort("timeout"), member("c", index=2).drop("cancelled")
    (group,) = reduce_scripts(a, b, c).groups
    assert group.skipped
    assert group.skip_reason == "1 valid member(s) < min_valid 2 (1 aborted, 1 dropped, 0 finished without a usable reward)"
    assert [m.session_id for m in group.members] == ["a", "b"] and group.dropped == ("c",)


def test_members_disagreeing_on_group_size_is_an_error_naming_them():
    with pytest.raises(ReduceError) as err:
        reduce_scripts(member("first", size=3), member("second", size=2, index=1))
    text = str(err.value)
    assert "'first'" in text and "'second'" in text and "group_size 2" in text and "group_size 3" in text


def test_too_many_members_and_repeated_sample_index_are_errors():
    with pytest.raises(ReduceError, match="member 3 of a group of group_size 2"):
        reduce_scripts(member("a", size=2, index=0), member("b", size=2, index=1), member("c", size=2, index=2))
    with pytest.raises(ReduceError, match="repeats sample_index 0 of session 'a'"):
        reduce_scripts(member("a", size=2, index=0), member("b", size=2, index=0))


# ------------------------------------------------------------------ bad logs


def _env(lsn, sid, seq, body):
    return Envelope(lsn=lsn, session_id=sid, session_seq=seq, ts_ns=0, body=body)


def test_turn_after_terminal_event_is_reported_with_lsn_and_session():
    reducer = Reducer()
    reducer.feed_many(log_of(member("s", size=1).finish(1.0)).read(0))
    straggler = TurnRecorded(turn_index=1, prompt_ids=[1], output_ids=[2])
    with pytest.raises(ReduceError, match=r"lsn 9, session 's': after_terminal: turn_recorded after the session's terminal event") as exc:
        reducer.feed(_env(9, "s", 4, straggler))
    assert exc.value.kind == "after_terminal"
    with pytest.raises(ReduceError, match=r"it ended finished at lsn 3"):
        reducer.feed(_env(9, "s", 4, straggler))


def test_a_reused_session_id_is_an_error_not_a_second_session():
    """Ids are never reused: re-opening an ended id must not yield a second set of samples."""
    reducer = Reducer()
    reducer.feed_many(log_of(member("s", gid="g1", size=1).finish(1.0)).read(0))
    with pytest.raises(ReduceError, match=r"lsn 9, session 's': reused_id: session_opened .*it ended finished at lsn 3"):
        reducer.feed(_env(9, "s", 0, SessionOpened(group_id="g2", group_size=1)))
    assert reducer.open_sessions() == {} and reducer.pending_groups() == {}


def test_a_reused_session_id_never_counts_twice_in_its_group():
    """Even once the reducer's window of ended ids has forgotten it, a pending group refuses the id again."""
    from agentlog.reducers.groups import GroupError, GroupTracker

    groups = GroupTracker()
    groups.open("g", "a", 3, 0, lsn=0)
    with pytest.raises(GroupError, match=r"session 'a' at lsn 5 joins again \(first joined at lsn 0\)"):
        groups.open("g", "a", 3, 1, lsn=5)
    assert groups.pending() == {"g": (3, 1, 0)}


def test_session_seq_gap_and_lsn_regression_are_errors():
    reducer = Reducer()
    reducer.feed(_env(0, "s", 0, SessionOpened(group_id="g", group_size=1)))
    with pytest.raises(ReduceError, match=r"lsn 1, session 's': seq_gap: session_seq 2 on session_started, expected 1 \(a gap"):
        reducer.feed(_env(1, "s", 2, SessionStarted()))
    reducer = Reducer()
    reducer.feed(_env(5, "s", 0, SessionOpened(group_id="g", group_size=1)))
    with pytest.raises(ReduceError, match=r"lsn_order: lsn 5 does not increase"):
        reducer.feed(_env(5, "s", 1, SessionStarted()))


def test_illegal_transition_is_reported_not_accepted():
    reducer = Reducer()
    reducer.feed(_env(0, "s", 0, SessionOpened(group_id="g", group_size=1)))
    with pytest.raises(ReduceError, match=r"lsn 1, session 's': .*illegal 'finish' in state 'open'"):
        reducer.feed(_env(1, "s", 1, SessionFinished(reward=1.0)))


def test_duplicate_turn_index_and_unknown_undelivered_turn_are_errors():
    s = member("s", size=1)
    s.bodies.append(s.bodies[-1])  # the same turn_index again
    with pytest.raises(ReduceError, match="turn_index 0 recorded twice"):
        reduce_scripts(s)
    with pytest.raises(ReduceError, match="turn_undelivered for turn_index 5"):
        reduce_scripts(member("s", size=1).undelivered(5))


def test_policy_updated_events_are_skipped():
    log = log_of(member("s", size=1))
    log.append_batch([("learner", 0, PolicyUpdated(step=1, policy_version=1))])
    log.append_batch([("s", 3, SessionFinished(reward=1.0))])
    (sample,) = reduce_log(log).samples
    expect_row(sample, [1, 2, 3, 10, 11], [1, 1])


def test_every_sample_satisfies_the_length_invariant():
    result = reduce_scripts(member("a", index=0).finish(1), member("b", index=1).abort(), member("c", index=2).drop())
    for sample in result.samples:
        check_sample(sample)


# ------------------------------------------------------------------ config


def test_config_is_recorded_in_the_stream_header():
    config = ReduceConfig(fork_threshold=7, max_context_tokens=100, min_valid=1)
    result = reduce_scripts(member("s", size=1).finish(1.0), config=config)
    header = result.header()
    assert header["reduce_config"] == config.to_dict()
    assert ReduceConfig.from_dict(header["reduce_config"]) == config
    assert header["reduce_config_digest"] == config.digest() != ReduceConfig().digest()
    assert header["sample_digest"] == result.digest


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ConfigError, match="fork_threshold"):
        ReduceConfig(fork_threshold=-1)
    with pytest.raises(ConfigError, match="min_valid"):
        ReduceConfig(min_valid=0)
    with pytest.raises(ConfigError, match="forkthreshold"):
        ReduceConfig.from_dict({"forkthreshold": 3})


def test_other_config_changes_the_samples_not_the_log():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, msg("tool", "t")], [1, 2, 3, 10, 99, 20], [12], response=msg("assistant", "a2")).finish()
    log = log_of(s)
    realign = reduce_log(log, ReduceConfig())
    fork = reduce_log(log, ReduceConfig(fork_threshold=0))
    assert (len(realign.samples), len(fork.samples)) == (1, 2)
    assert realign.digest != fork.digest
    assert reduce_log(log, ReduceConfig()).digest == realign.digest


def test_member_joining_an_already_released_group_is_an_error():
    with pytest.raises(ReduceError, match=r"joins a group already released at lsn 3 \(group ids are never reused\)"):
        reduce_scripts(member("a", size=1).finish(1.0), member("late", size=1))


def test_in_flight_session_can_be_inspected_and_is_evicted_at_its_end():
    reducer = Reducer()
    log = log_of(member("s", size=1))
    reducer.feed_many(log.read(0))
    assert reducer.open_sessions() == {"s": "running"}
    (row,) = reducer.trajectory("s").rows
    assert row.turn_indices == (0,)
    log.append_batch([("s", 3, SessionFinished(reward=1.0))])
    out = reducer.feed(list(log.read(3))[0])
    assert len(out.samples) == 1 and len(out.groups) == 1
    assert reducer.open_sessions() == {} and reducer.pending_groups() == {}
    with pytest.raises(KeyError, match="not in flight"):
        reducer.trajectory("s")


def test_a_refused_envelope_leaves_the_reducer_unchanged():
    reducer = Reducer()
    reducer.feed_many(log_of(member("s", size=1)).read(0))
    before = (reducer.last_lsn, reducer.events, reducer.open_sessions(), reducer.trajectory("s"))
    bad = [
        _env(7, "s", 9, SessionFinished(reward=1.0)),  # seq gap
        _env(7, "s", 3, TurnRecorded(turn_index=0, prompt_ids=[1], output_ids=[2])),  # turn index repeated
        _env(7, "s", 3, TurnRecorded(turn_index=1, messages=[{"role": "user"}, 5], prompt_ids=[1])),
        _env(7, "x", 0, SessionOpened(group_id="g", group_size=2)),  # g (size 1) is still pending
    ]
    for env in bad:
        with pytest.raises(ReduceError):
            reducer.feed(env)
        assert (reducer.last_lsn, reducer.events, reducer.open_sessions(), reducer.trajectory("s")) == before
    (sample,) = reducer.feed(_env(7, "s", 3, SessionFinished(reward=1.0))).samples
    expect_row(sample, [1, 2, 3, 10, 11], [1, 1])
