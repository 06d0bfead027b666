"""Record-health flags (reducers/health.py): one constructed session per flag, the flags of a
session in flight, untrainable flags by configuration (a zero-masked placeholder out of the
baseline), and the property that flags folded event by event equal a batch reference."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reduce_streams import RandomStream, Script, log_of, msg

from agentlog.events.errors import ConfigError
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import (
    RewardAssigned, SessionAborted, SessionDropped, SessionFinished, SessionOpened, TeacherScored, TurnDelta, TurnRecorded,
    TurnUndelivered, encode_body,
)
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.groups import row_removed, row_trains
from agentlog.reducers.health import ALL_FLAGS, PROBLEM_FLAGS, SessionHealth
from agentlog.reducers.pipeline import Reducer, reduce_log, session_trajectory
from agentlog.reducers.runstats import RunStats, decode_projection
from agentlog.reducers.samples import resolve_reward
from test_turn_delta import delta_log

S = msg("system", "sys")
U = msg("user", "task")
A1 = msg("assistant", "a1")
A2 = msg("assistant", "a2")
T1 = msg("tool", "r1")


def flags_of(*scripts: Script, config: ReduceConfig | None = None) -> dict[str, tuple[str, ...]]:
    """Every session's flags, from the sample pipeline's outputs."""
    return Reducer(config or ReduceConfig()).feed_many(log_of(*scripts).read(0)).flags


def clean(sid: str = "s", **kw) -> Script:
    """Two turns, the second's prompt extending the first's prompt + output."""
    s = Script(sid, **kw)
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20], [12], response=A2)
    return s


def scored(turn: int, n_out: int, *, error: str = "") -> TeacherScored:
    if error:
        return TeacherScored(turn_index=turn, teacher="t", teacher_version="1", temperature=1.0, error=error)
    return TeacherScored(turn_index=turn, teacher="t", teacher_version="1", temperature=1.0, log_probs=[-0.5] * n_out)


# ---------------------------------------------------------------- one session per flag


def test_a_clean_finished_session_with_a_reward_is_complete_and_nothing_else():
    assert flags_of(clean().finish(1.0)) == {"s": ("complete",)}


def test_a_turn_acknowledged_but_maybe_not_received_flags_undelivered():
    assert flags_of(clean().undelivered(1).finish(1.0)) == {"s": ("undelivered",)}


def test_an_agent_that_retokenizes_its_history_gets_the_drift_flag():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    # The same messages, but the agent re-tokenised the response it was sent: 11 became 99 (REALIGN).
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 99, 20], [12], response=A2).finish(1.0)
    assert flags_of(s) == {"s": ("drift",)}
    # A token-only agent (no messages) that rewrites the start of its context: a FORK, drift too.
    t = Script("t")
    t.turn([], [1, 2, 3], [10, 11]).turn([], [7, 2, 3, 10, 11, 5], [12]).finish(1.0)
    assert [d.drift for d in session_trajectory(log_of(t).read(0), "t").decisions] == ["clean", "fork"]
    assert flags_of(t) == {"t": ("drift",)}


def test_a_side_query_on_another_branch_and_a_verbatim_retry_are_not_drift():
    """Turns that do not extend the turn before in log order, but do extend the turn they follow in the tree."""
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1)
    s.turn([msg("system", "title?"), U], [8, 8], [9], response=msg("assistant", "a title"))  # a side query: its own branch
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20], [12], response=A2)  # the main thread goes on
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 11, 20], [13], response=A2)  # a retry of that prompt, verbatim
    s.finish(1.0)
    assert set(d.drift for d in session_trajectory(log_of(s).read(0), "s").decisions) == {"clean"}
    assert flags_of(s) == {"s": ("complete",)}


def test_a_turn_that_stopped_at_its_token_limit_flags_truncated():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, finish="length").finish(1.0)
    assert flags_of(s) == {"s": ("truncated",)}


def _turn(s: Script, prompt: list[int], out: list[int], version: int, spans=None) -> None:
    kw = {} if spans is None else {"version_spans": spans}
    s.bodies.append(TurnRecorded(turn_index=s._turn, prompt_ids=prompt, output_ids=out, output_log_probs=[-0.1] * len(out),
                                 policy_version=version, **kw))
    s._turn += 1


@pytest.mark.parametrize("bound, flagged", [(2, True), (3, False)])
def test_versions_spanning_more_than_the_bound_flag_version_span(bound, flagged):
    s = Script("s")
    _turn(s, [1, 2], [3, 4], version=1)
    # A partial rollout: the second turn's last token came from version 4 (newest 4 - oldest 1 = 3).
    _turn(s, [1, 2, 3, 4, 5], [6, 7, 8], version=2, spans=((0, 2), (2, 4)))
    s.finish(1.0)
    got = flags_of(s, config=ReduceConfig(max_version_span=bound))["s"]
    assert got == (("version_span",) if flagged else ("complete",))


def test_a_session_scored_by_a_teacher_on_some_turns_only_flags_teacher_missing():
    s = clean()
    s.bodies.append(scored(0, 2))
    assert flags_of(s.finish(1.0)) == {"s": ("teacher_missing",)}
    both = clean()
    both.bodies += [scored(0, 2), scored(1, 1)]
    assert flags_of(both.finish(1.0)) == {"s": ("complete",)}
    failed = clean()
    failed.bodies += [scored(0, 2), scored(1, 1, error="teacher timed out")]  # a failed score is no score
    assert flags_of(failed.finish(1.0)) == {"s": ("teacher_missing",)}


def test_a_distilling_run_expects_scores_on_every_finished_session_but_not_on_aborts():
    config = ReduceConfig(expect_teacher_scores=True)
    assert flags_of(clean("f").finish(1.0), config=config) == {"f": ("teacher_missing",)}
    assert flags_of(clean("a").abort("timeout"), config=config) == {"a": ()}
    assert flags_of(clean("f").finish(1.0)) == {"f": ("complete",)}  # without it, no score is expected


@pytest.mark.parametrize("how", ["never rewarded", "dict without the key"])
def test_a_finished_session_without_a_usable_reward_flags_no_reward(how):
    s = clean()
    s.finish(None) if how == "never rewarded" else s.reward({"a": 1.0, "b": 0.0}).finish(None)
    assert flags_of(s) == {"s": ("no_reward",)}
    # The same dict with the run's reward_key names a usable reward.
    assert flags_of(s, config=ReduceConfig(reward_key="a"))["s"] == ("no_reward",) if how == "never rewarded" else ("complete",)


def test_aborted_and_dropped_sessions_are_never_complete_and_carry_their_turn_flags():
    a = Script("a").turn([S, U], [1, 2], [3], response=A1, finish="length").abort("timeout")
    d = Script("d", group_id="h").drop()
    assert flags_of(a, d) == {"a": ("truncated",), "d": ()}


def test_a_session_in_flight_carries_the_flags_its_turns_decide_so_far():
    s = Script("s")
    s.turn([S, U], [1, 2, 3], [10, 11], response=A1, finish="length")
    s.turn([S, U, A1, T1], [1, 2, 3, 10, 99, 20], [12], response=A2)
    reducer = Reducer()
    reducer.feed_many(log_of(s).read(0))
    # No reward and no completeness yet: those wait for the terminal event.
    assert reducer.session_flags("s") == ("drift", "truncated")
    with pytest.raises(KeyError, match="'ghost' is not in flight"):
        reducer.session_flags("ghost")


def test_flag_names_are_sorted_and_complete_is_no_problem():
    assert list(ALL_FLAGS) == sorted(ALL_FLAGS) and PROBLEM_FLAGS == set(ALL_FLAGS) - {"complete"}


@pytest.mark.parametrize("value, message", [
    (["complete"], "ReduceConfig.untrainable_flags: 'complete' names no problem"),
    (["drfit"], "ReduceConfig.untrainable_flags: 'drfit' is not a flag; expected some of ['drift', 'no_reward',"),
    ("drift", "ReduceConfig.untrainable_flags: expected a list of flag names, found 'drift'"),
])
def test_an_unknown_untrainable_flag_is_a_config_error_naming_it_and_the_known_ones(value, message):
    with pytest.raises(ConfigError) as err:
        ReduceConfig(untrainable_flags=value)
    assert str(err.value).startswith(message)
    with pytest.raises(ConfigError, match="max_version_span: expected an int >= 0, found -1"):
        ReduceConfig(max_version_span=-1)


def test_untrainable_flags_have_one_canonical_form():
    a, b = ReduceConfig(untrainable_flags=["truncated", "drift", "drift"]), ReduceConfig(untrainable_flags=("drift", "truncated"))
    assert a.untrainable_flags == ("drift", "truncated") and a.digest() == b.digest()
    assert ReduceConfig.from_dict(a.to_dict()) == a


# ---------------------------------------------------------------- untrainable by configuration


def _group() -> list[Script]:
    """A group of three: two clean finishes and one truncated finish (reward 1.0)."""
    ok0 = clean("ok0", group_size=3, sample_index=0).finish(0.0)
    ok1 = clean("ok1", group_size=3, sample_index=1).finish(0.5)
    cut = Script("cut", group_size=3, sample_index=2)
    cut.turn([S, U], [1, 2, 3], [10, 11], response=A1, finish="length").finish(1.0)
    return [ok0, ok1, cut]


def test_a_flag_made_untrainable_turns_the_session_into_a_placeholder_out_of_the_baseline():
    default = reduce_log(log_of(*_group()), ReduceConfig())
    flagged = reduce_log(log_of(*_group()), ReduceConfig(untrainable_flags=["truncated"]))
    (g0,), (g1,) = default.groups, flagged.groups
    assert g0.baseline == 0.5 and g0.members[2].valid  # by default the truncated member trains
    cut = g1.members[2]
    assert (cut.session_id, cut.status, cut.valid, cut.reward) == ("cut", "finished", False, None)
    assert cut.reason == "untrainable: truncated"
    (placeholder,) = cut.samples
    # Zero gradient: the one zero-masked placeholder an excluded abort yields, removed whatever its member.
    assert placeholder.token_ids.tolist() == [0, 0] and placeholder.mask.tolist() == [0] and placeholder.log_probs.tolist() == [0.0]
    assert placeholder.remove_sample and placeholder.reward == 0.0 and placeholder.status == "aborted"
    assert placeholder.metadata == {"untrainable_flags": ["truncated"]}
    assert row_removed(cut.valid, placeholder) and not row_trains(cut.valid, placeholder)
    # The baseline is the other members' mean: the flagged reward (1.0) is left out.
    assert g1.valid_rewards == [0.0, 0.5] and g1.baseline == 0.25 and not g1.skipped
    # The members without the flag are untouched, sample for sample.
    assert [m.samples for m in g1.members[:2]] == [m.samples for m in g0.members[:2]]
    assert flagged.metrics["sessions/by_status"] == {"finished": 3}


def test_an_untrainable_abort_counted_as_a_failure_is_excluded_and_a_skip_says_why():
    config = ReduceConfig(abort_outcomes={"policy": "fail"}, untrainable_flags=["truncated"], min_valid=3)
    fail = Script("fail", group_size=3, sample_index=0)
    fail.turn([S, U], [1, 2, 3], [10, 11], response=A1, finish="length").abort("wall_clock_timeout")
    members = [fail, clean("ok", group_size=3, sample_index=1).finish(1.0)]
    cut = Script("cut", group_size=3, sample_index=2)
    cut.turn([S, U], [1, 2], [3], response=A1, finish="length").finish(1.0)
    (group,) = reduce_log(log_of(*members, cut), config).groups
    failed = group.members[0]
    assert (failed.status, failed.valid, failed.reason) == ("aborted", False, "wall_clock_timeout")
    assert failed.samples[0].metadata == {"abort_reason": "wall_clock_timeout", "untrainable_flags": ["truncated"]}
    assert group.skip_reason == ("1 valid member(s) < min_valid 3 (1 aborted, 0 dropped, 0 finished without a usable reward,"
                                 " 1 untrainable by health flags)")
    # The statistics fold counts the groups as the learner sees them.
    stats = RunStats(config)
    for env in log_of(*members, cut).read(0):
        stats.feed(env)
    snap = stats.snapshot()
    assert snap["groups"]["skipped"] == 1 and snap["groups"]["untrainable_by_flags"] == 2
    assert snap["flags"] == {**dict.fromkeys(ALL_FLAGS, 0), "complete": 1, "truncated": 2}


def test_the_default_configuration_makes_no_flag_untrainable_and_changes_no_sample():
    scripts = [*_group(), clean("u", group_id="h", group_size=1).undelivered(0).finish(None)]
    base = reduce_log(log_of(*scripts), ReduceConfig())
    assert ReduceConfig().untrainable_flags == ()
    assert base.digest == reduce_log(log_of(*scripts), ReduceConfig(untrainable_flags=[])).digest
    assert base.digest != reduce_log(log_of(*scripts), ReduceConfig(untrainable_flags=list(PROBLEM_FLAGS))).digest


# ---------------------------------------------------------------- incremental equals batch


def _varied(log: MemoryLog, seed: int) -> MemoryLog:
    """``log`` with teacher_scored events after some turns (scored, failed or none) and some finishes
    given an unusable reward (a dict of two entries), sequences renumbered."""
    rng = random.Random(seed)
    out, seqs = MemoryLog(clock=lambda: 0), {}
    for env in log.read(0):
        body = env.body
        bodies = [body]
        if isinstance(body, TurnRecorded) and body.output_ids and rng.random() < 0.5:
            n_out = len(body.output_ids) // 4
            bodies.append(scored(body.turn_index, n_out, error="boom" if rng.random() < 0.2 else ""))
        if isinstance(body, SessionFinished) and rng.random() < 0.15:
            bodies = [SessionFinished(reward={"a": 1.0, "b": 0.0})]
        for b in bodies:
            seq = seqs.get(env.session_id, 0)
            out.append_batch([(env.session_id, seq, b)])
            seqs[env.session_id] = seq + 1
    return out


def _some_deltas(log: MemoryLog, seed: int) -> MemoryLog:
    """``log`` with about half its turns re-encoded as deltas on the turn before, the rest kept whole."""
    from agentlog.events.schema.turn_delta import TurnContext

    rng = random.Random(seed)
    out, contexts = MemoryLog(clock=lambda: 0), {}
    for env in log.read(0):
        body = env.body
        if type(body) is TurnRecorded:
            context = contexts.get(env.session_id, TurnContext())
            contexts[env.session_id] = TurnContext.after(body)
            if rng.random() < 0.5:
                body = context.delta_of(body)
        out.append_batch([(env.session_id, env.session_seq, body)])
    return out


def reference_flags(envs: list, config: ReduceConfig) -> dict[str, tuple[str, ...]]:
    """The flags of every ended session, from its whole event list at once (a plain batch reading
    of the rules, not SessionHealth): the trajectory's decisions for drift."""
    by_session: dict[str, list] = {}
    for env in envs:
        by_session.setdefault(env.session_id, []).append(env)
    out = {}
    for sid, evs in by_session.items():
        bodies = [e.body for e in evs]
        end = bodies[-1]
        if not isinstance(end, (SessionFinished, SessionAborted, SessionDropped)):
            continue
        turns = [b for b in bodies if isinstance(b, (TurnRecorded, TurnDelta))]
        flags = set()
        decisions = session_trajectory(evs, sid, config).decisions
        if any(d.drift in ("realign", "fork") for d in decisions):
            flags.add("drift")
        if any(isinstance(b, TurnUndelivered) for b in bodies):
            flags.add("undelivered")
        if any(t.finish_reason == "length" for t in turns):
            flags.add("truncated")
        versions = [v for t in turns for _, v in ((0, t.policy_version),) if t.version_spans is msgspec.UNSET]
        versions += [v for t in turns if t.version_spans is not msgspec.UNSET for _, v in t.version_spans]
        if versions and max(versions) - min(versions) > config.max_version_span:
            flags.add("version_span")
        teacher = [b for b in bodies if isinstance(b, TeacherScored)]
        finished = isinstance(end, SessionFinished)
        if teacher or (finished and config.expect_teacher_scores):
            good = {b.turn_index for b in teacher if not b.error}
            if any(t.output_ids and t.turn_index not in good for t in turns):
                flags.add("teacher_missing")
        if finished:
            assigned = [b.reward for b in bodies if isinstance(b, RewardAssigned)]
            raw = end.reward if end.reward is not None else (assigned[-1] if assigned else None)
            if resolve_reward(raw, config.reward_key)[0] is None:
                flags.add("no_reward")
            if not flags:
                flags.add("complete")
        out[sid] = tuple(sorted(flags))
    return out


CONFIGS = st.sampled_from([
    ReduceConfig(), ReduceConfig(fork_threshold=0), ReduceConfig(max_version_span=1, expect_teacher_scores=True),
    ReduceConfig(fork_threshold=3, max_version_span=0, untrainable_flags=["drift", "truncated"]),
])


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cuts=st.lists(st.integers(1, 30), max_size=12), config=CONFIGS,
       deltas=st.sampled_from(["none", "all", "some"]))
def test_flags_folded_event_by_event_equal_the_batch_reference_in_every_fold(seed, cuts, config, deltas):
    log = _varied(RandomStream(seed).log(), seed)
    if deltas == "all":
        log, _ = delta_log(log)  # what the engine writes: turns as deltas on the turn before
    elif deltas == "some":
        log = _some_deltas(log, seed)  # full and delta turns mixed in a session
    envs = list(log.read(0))
    want = reference_flags(envs, config)
    # The sample pipeline, one envelope at a time.
    one = Reducer(config)
    by_one: dict[str, tuple[str, ...]] = {}
    for env in envs:
        by_one.update(one.feed(env).flags)
    assert by_one == want
    # ... and in arbitrary chunks: the same flags.
    chunked, start, by_chunk = Reducer(config), 0, {}
    for size in cuts + [len(envs)]:
        by_chunk.update(chunked.feed_many(envs[start:start + size]).flags)
        start += size
    assert by_chunk == want
    # The statistics fold over projections and stored bytes counts the same flags.
    stats = RunStats(config)
    for env in envs:
        payload = encode_body(env.body)
        stats.feed_record(env.lsn, env.session_id, env.session_seq, env.ts_ns, decode_projection(payload), payload)
    counts = dict.fromkeys(ALL_FLAGS, 0)
    for flags in want.values():
        for f in flags:
            counts[f] += 1
    assert stats.snapshot()["flags"] == counts
    # ... and over full bodies (each turn encoded for keeping): the same counts.
    bodies = RunStats(config)
    for env in envs:
        bodies.feed(env)
    assert bodies.snapshot()["flags"] == counts
    # Deterministic: a second fold gives the same flags, in the same (sorted) order.
    assert reduce_flags(envs, config) == want


def reduce_flags(envs: list, config: ReduceConfig) -> dict[str, tuple[str, ...]]:
    return Reducer(config).feed_many(envs).flags


def test_a_turn_projection_without_its_payload_is_refused_at_the_call_naming_session_and_lsn():
    """The statistics keep turns for the drift flag: a projected turn must come with its stored bytes."""
    t = Script("t")
    t.turn([], [1, 2, 3], [10, 11]).turn([], [1, 2, 3, 10, 11, 5], [12])  # turns that extend each other: no drift either way
    health = SessionHealth("t", ReduceConfig(), keep_turns=True)
    health.observe("session_opened", SessionOpened(group_id="g", group_size=1))
    with pytest.raises(TypeError, match=r"session 't': turn 0 was given as a projection without its stored bytes"):
        health.observe("turn_recorded", decode_projection(encode_body(t.bodies[2])))
    stats = RunStats()
    envs = list(log_of(t).read(0))
    for env in envs[:2]:
        stats.feed(env)
    with pytest.raises(TypeError, match=rf"RunStats.feed_record: lsn {envs[2].lsn}, session 't': a turn_recorded projection needs its payload"):
        stats.feed_record(envs[2].lsn, "t", envs[2].session_seq, envs[2].ts_ns, decode_projection(encode_body(envs[2].body)))
    assert stats.events == 2  # nothing folded


def _full_prompt_session(turns: int, tokens_per_turn: int) -> Script:
    """One session whose every turn_recorded holds its whole prompt (an old, full-prompt log):
    a prompt and a conversation that grow by a tool answer each turn."""
    s = Script("long")
    prompt, messages = list(range(1, 50)), [S, U]
    for i in range(turns):
        out = [300 + i] * tokens_per_turn
        s.turn(list(messages), list(prompt), out, response=msg("assistant", f"reply {i} " + "x" * 200))
        messages = messages + [msg("assistant", f"reply {i} " + "x" * 200), msg("tool", f"result {i} " + "y" * 200)]
        prompt = prompt + out + [7] * tokens_per_turn
    return s.finish(1.0)


def test_the_statistics_keep_a_full_prompt_session_in_memory_linear_in_its_turns():
    """Kept turns hold what each adds to the one before (a stored delta), not each whole prompt:
    the bytes kept grow linearly with the turns while the stored turns grow quadratically."""
    kept, stored = {}, {}
    for n in (20, 40):
        health = SessionHealth("long", ReduceConfig(), keep_turns=True)
        stored[n] = 0
        for env in log_of(_full_prompt_session(n, 30)).read(0):
            payload = encode_body(env.body)
            if env.body.__struct_config__.tag != "session_finished":  # kept until the end; then freed
                health.observe(env.body.__struct_config__.tag, decode_projection(payload), payload)
            stored[n] += len(payload) if isinstance(env.body, TurnRecorded) else 0
        kept[n] = health.kept_bytes
    assert stored[40] > 3.5 * stored[20]  # quadratic
    assert kept[40] < 2.2 * kept[20] and kept[40] < stored[40] / 8  # linear


def test_a_drifting_full_prompt_session_is_linearised_from_its_kept_deltas_as_from_the_log():
    """A session the statistics must linearise: the kept deltas give the trajectory's own decisions."""
    s = _full_prompt_session(6, 3)
    drifted = s.bodies[4]  # the third turn: one of its prompt tokens re-tokenised
    s.bodies[4] = msgspec.structs.replace(drifted, prompt_ids=b"\x63\x00\x00\x00" + drifted.prompt_ids[4:])
    envs = list(log_of(s).read(0))
    want = reduce_flags(envs, ReduceConfig())["long"]
    assert "drift" in want
    stats = RunStats()
    for env in envs:
        payload = encode_body(env.body)
        stats.feed_record(env.lsn, env.session_id, env.session_seq, env.ts_ns, decode_projection(payload), payload)
    assert [f for f, n in stats.snapshot()["flags"].items() if n] == list(want)
