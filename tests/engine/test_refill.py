"""Per-sample refill and abort classes, end to end: the engine decides (session_aborted.refill),
the log records, the reducers follow, and the learner's advantages see valid members only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.errors import ConfigError
from agentlog.events.log.api import MemoryLog
from agentlog.events.log.writer import FileLog
from agentlog.events.schema.types import SessionAborted, SessionOpened
from agentlog.learner.advantages import compute_advantages
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.groups import GroupError, row_removed
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.runstats import RunStats

#: infrastructure aborts are refilled, policy aborts count as failures, task aborts are excluded.
RULES = dict(abort_outcomes={"infrastructure": "refill", "policy": "fail", "task": "exclude"}, fail_reward=-0.5)
REASONS = {"infrastructure": "setup_failed:OSError", "policy": "wall_clock_timeout", "task": "verifier_failed:KeyError"}


async def _play(eng: SessionEngine, gid: str, size: int, attempts: list[list[object]]) -> None:
    """Play each member's attempts in turn: a reward finishes it, a class name aborts it with
    that class's reason. While the engine owes a replacement for the member just played, the
    next attempt is played as that replacement (a finish once the attempts run out)."""
    for i in range(size):
        plays, sid, replaces = list(attempts[i]), f"{gid}-s{i}", ""
        index = i
        while True:
            h = await eng.open_session(sid, group_id=gid, group_size=size, sample_index=index, replaces=replaces)
            await h.start()
            what = plays.pop(0) if plays else 1.0
            if isinstance(what, str):
                await h.abort(REASONS[what])
            else:
                await h.finish(reward=what)
            if sid not in eng.owed_replacements(gid):
                break
            index = eng.replacement_index(gid)
            sid, replaces = f"{gid}-s{index}", sid


attempt = st.one_of(st.sampled_from(["infrastructure", "policy", "task"]), st.sampled_from([0.0, 1.0]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(1, 6), cap=st.integers(0, 3), data=st.data())
def test_refilled_groups_are_full_point_at_what_they_replace_and_count_valid_members_only(size, cap, data) -> None:
    attempts = [data.draw(st.lists(attempt, max_size=4), label=f"member {i}") for i in range(size)]
    config = ReduceConfig(min_valid=1, max_refills=cap, **RULES)

    async def go() -> MemoryLog:
        log = MemoryLog()
        eng = await SessionEngine.open(log, groups=config)
        await _play(eng, "g", size, attempts)
        await eng.close()
        return log

    log = asyncio.run(go())
    result = reduce_log(log, config)
    assert result.pending_groups == {}
    (group,) = result.groups
    opened = {e.session_id: e.body for e in log.read(0) if isinstance(e.body, SessionOpened)}
    aborts = {e.session_id: e.body for e in log.read(0) if isinstance(e.body, SessionAborted)}
    refilled = [sid for sid, body in aborts.items() if body.refill]
    # The engine refilled infrastructure aborts only, and never past the cap.
    assert all(aborts[sid].reason == REASONS["infrastructure"] for sid in refilled)
    assert len(refilled) == min(cap, sum(1 for a in aborts.values() if a.reason == REASONS["infrastructure"]))
    # Every replacement points at a refilled member of its group, each refilled member has one.
    assert sorted(replaced for _, replaced in group.replaced) == sorted(refilled)
    for replacement, replaced in group.replaced:
        assert opened[replacement].replaces == replaced and opened[replacement].group_id == "g"
    assert {m.replaces for m in group.members if m.replaces} == set(refilled)
    # Full size: each original slot ends in exactly one member that is not a refilled abort.
    assert len(group.members) - len(refilled) == size
    # Valid: finished members, and policy aborts as failures with the failure reward.
    for m in group.members:
        reason = aborts[m.session_id].reason if m.session_id in aborts else None
        assert m.valid == (reason is None or reason == REASONS["policy"])
        if reason == REASONS["policy"]:
            assert m.reward == -0.5
    # A group whose every refill was granted has its full size of valid members, or lost them to task aborts.
    if len(refilled) < cap or not any(a.reason == REASONS["infrastructure"] and not a.refill for a in aborts.values()):
        task_aborts = sum(1 for a in aborts.values() if a.reason == REASONS["task"])
        assert group.n_valid == size - task_aborts
    # Advantages use valid members only: the excluded ones change none of them and get 0.
    members = group.members
    rewards = torch.tensor([m.reward if m.valid else 0.0 for m in members], dtype=torch.float32)
    valid = torch.tensor([m.valid for m in members])
    adv = compute_advantages(rewards, torch.zeros(len(members), dtype=torch.long), valid)
    alone = compute_advantages(rewards[valid], torch.zeros(int(valid.sum()), dtype=torch.long), valid[valid])
    assert torch.equal(adv[valid], alone) and torch.equal(adv[~valid], torch.zeros(int((~valid).sum())))
    # Excluded aborted members (refilled or not) contribute exactly zero: every row removed.
    for m in members:
        if not m.valid:
            assert m.samples and all(row_removed(m.valid, s) for s in m.samples)
    # The statistics fold agrees with the reducer on the group.
    stats = RunStats.of(config)
    for env in log.read(0):
        stats.feed(env)
    snap = stats.snapshot()["groups"]
    assert (snap["released"], snap["pending"], snap["skipped"]) == (1, 0, int(group.skipped))


def test_a_replacement_nobody_owes_is_refused_by_the_engine_and_the_reducers() -> None:
    config = ReduceConfig(max_refills=1, **RULES)

    async def go() -> None:
        eng = await SessionEngine.open(MemoryLog(), groups=config)
        h = await eng.open_session("g-s0", group_id="g", group_size=2, sample_index=0)
        await h.start()
        await h.abort(REASONS["task"])  # excluded: owes nothing
        with pytest.raises(GroupError, match=r"group 'g': session 'g-s2' replaces 'g-s0', but a group that owes replacements for: none"):
            await eng.open_session("g-s2", group_id="g", group_size=2, sample_index=2, replaces="g-s0")
        h = await eng.open_session("g-s1", group_id="g", group_size=2, sample_index=1)
        await h.start()
        await h.abort(REASONS["infrastructure"])  # refilled, once
        assert eng.owed_replacements("g") == ["g-s1"]
        r = await eng.open_session("g-s2", group_id="g", group_size=2, replaces="g-s1")
        assert r.sample_index == 2  # a replacement's default index is past the original slots
        with pytest.raises(GroupError, match=r"replaces 'g-s1', but a group that owes replacements for: none"):
            await eng.open_session("g-s3", group_id="g", group_size=2, sample_index=3, replaces="g-s1")
        await r.start()
        await r.abort(REASONS["infrastructure"])  # the cap (1) is spent: excluded, no replacement owed
        assert eng.owed_replacements("g") == []
        await eng.close()

    asyncio.run(go())


def test_an_owed_replacement_survives_an_engine_restart(tmp_path: Path) -> None:
    config = ReduceConfig(**RULES)

    async def first() -> None:
        log = FileLog.open(tmp_path / "log")
        eng = await SessionEngine.open(log, groups=config, checkpoint_every=0)
        for i in range(2):
            h = await eng.open_session(f"g-s{i}", group_id="g", group_size=2, sample_index=i)
            await h.start()
            if i:
                await h.abort(REASONS["infrastructure"])
            else:
                await h.finish(reward=1.0)
        log.close()  # killed before the replacement opened

    async def second() -> list[str]:
        log = FileLog.open(tmp_path / "log")
        eng = await SessionEngine.open(log, groups=config, checkpoint_every=0)
        owed = eng.owed_replacements("g")
        r = await eng.open_session("g-s2", group_id="g", group_size=2, replaces="g-s1")
        await r.start()
        await r.finish(reward=0.0)
        await eng.close()
        log.close()
        return owed

    asyncio.run(first())
    assert asyncio.run(second()) == ["g-s1"]
    with FileLog.open(tmp_path / "log") as log:
        (group,) = reduce_log(log, config).groups
    assert group.replaced == (("g-s2", "g-s1"),) and group.n_valid == 2


def test_abort_class_tables_are_checked_by_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown abort class 'network'; expected one of infrastructure, policy, task, other"):
        ReduceConfig(abort_outcomes={"network": "refill"})
    with pytest.raises(ConfigError, match=r"class 'policy' gets 'retry'; expected one of exclude, fail, refill"):
        ReduceConfig(abort_outcomes={"policy": "retry"})
    with pytest.raises(ConfigError, match=r"reason 'oom' is put in class 'memory'"):
        ReduceConfig(abort_reasons={"oom": "memory"})
    assert ReduceConfig(abort_reasons={"oom": "policy"}, abort_outcomes={"policy": "fail"}).outcome_of("oom:cuda") == "fail"
    # The reducers' default excludes every abort (old logs rebuild byte for byte).
    assert {ReduceConfig().outcome_of(r) for r in ("wall_clock_timeout", "engine_restart", "verifier_failed:X", "mine")} == {
        "exclude"}


def test_the_aborts_of_a_restart_owe_no_replacement_even_where_their_class_is_refilled(tmp_path: Path) -> None:
    """A restart aborts the sessions a killed engine left running (``engine_restart``, an
    infrastructure reason) and owes their groups nothing, though infrastructure aborts are
    refilled: nobody plays a replacement of a batch that was interrupted (the loop opens and
    aborts what it still owed), so one owed would hold its group unreleased. The decision is
    recorded: the abort's ``refill`` is unset, and the group reduces with the orphan excluded."""
    config = ReduceConfig(**RULES)

    async def first() -> None:
        log = FileLog.open(tmp_path / "log")
        eng = await SessionEngine.open(log, groups=config, checkpoint_every=0)
        done = await eng.open_session("g-s0", group_id="g", group_size=2, sample_index=0)
        await done.start()
        await done.finish(reward=1.0)
        orphan = await eng.open_session("g-s1", group_id="g", group_size=2, sample_index=1)
        await orphan.start()
        log.close()  # killed with g-s1 running

    async def second() -> tuple[int, list[str]]:
        log = FileLog.open(tmp_path / "log")
        eng = await SessionEngine.open(log, groups=config, checkpoint_every=0)
        try:
            return eng.stats["restart_aborted"], eng.owed_replacements("g")
        finally:
            await eng.close()
            log.close()

    asyncio.run(first())
    aborted, owed = asyncio.run(second())
    assert (aborted, owed) == (1, [])
    with FileLog.open(tmp_path / "log") as log:
        (abort,) = [e.body for e in log.read() if isinstance(e.body, SessionAborted)]
        (group,) = reduce_log(log, config).groups
    assert abort.reason == "engine_restart" and not abort.refill  # unset: no replacement owed
    assert config.outcome_of(abort.reason) == "refill"  # the class is refilled; the restart's abort is not
    assert group.replaced == () and group.n_valid == 1
