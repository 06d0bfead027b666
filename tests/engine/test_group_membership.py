"""Group membership at open: the engine refuses what the reducers would refuse.

The engine and the reducers share one rule (``reducers.groups.GroupTracker.check_open``):
a membership the engine accepts always folds, so one careless open can no longer
make ``reconstruct`` refuse the whole log.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionOpened
from agentlog.reducers.groups import GroupError
from agentlog.reducers.pipeline import reduce_log


def opened(log, sid):
    (env,) = [e for e in log.read(0) if e.session_id == sid and isinstance(e.body, SessionOpened)]
    return env.body


def test_omitted_sample_index_takes_the_next_free_one_and_the_log_reduces(arun):
    """The README's example: several sessions of one group, no sample_index."""

    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        hs = [await eng.open_session(f"s{i}", group_id="g", group_size=3) for i in range(3)]
        assert [opened(log, f"s{i}").sample_index for i in range(3)] == [0, 1, 2]
        for h in hs:
            await h.start()
            await h.finish(reward=1.0)
        res = reduce_log(log)
        assert [len(g.members) for g in res.groups] == [3]

    arun(go())


def test_a_freed_index_is_not_reused_and_explicit_indices_are_skipped(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        await eng.open_session("a", group_id="g", group_size=3, sample_index=1)
        await eng.open_session("b", group_id="g", group_size=3)
        await eng.open_session("c", group_id="g", group_size=3)
        assert [opened(log, s).sample_index for s in "abc"] == [1, 0, 2]

    arun(go())


@pytest.mark.parametrize(
    "second, match",
    [
        (dict(group_size=3), r"group 'g': session 'b' declares group_size 3, but sessions 'a' \(lsn 0\) declared group_size 2"),
        (dict(group_size=2, sample_index=0), r"group 'g': session 'b' repeats sample_index 0 of session 'a'"),
    ],
)
def test_conflicting_membership_is_refused_naming_it_and_appends_nothing(arun, second, match):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        await eng.open_session("a", group_id="g", group_size=2, sample_index=0)
        with pytest.raises(GroupError, match=match):
            await eng.open_session("b", group_id="g", **second)
        assert log.next_lsn == 1 and eng.get("b") is None
        # The refused id stays usable: nothing of it was kept.
        await eng.open_session("b", group_id="g", group_size=2)
        assert opened(log, "b").sample_index == 1

    arun(go())


def test_more_members_than_group_size_is_refused(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        await eng.open_session("a", group_id="g", group_size=2)
        await eng.open_session("b", group_id="g", group_size=2)
        with pytest.raises(GroupError, match=r"session 'c' would be member 3 of a group of group_size 2 \(members: 'a', 'b'\)"):
            await eng.open_session("c", group_id="g", group_size=2, sample_index=2)
        assert log.next_lsn == 2

    arun(go())


def test_a_released_group_takes_no_new_member(arun):
    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        h = await eng.open_session("a", group_id="g", group_size=1)
        await h.drop("x")
        with pytest.raises(GroupError, match=r"joins a group already released at lsn 1"):
            await eng.open_session("b", group_id="g", group_size=1)
        assert len(eng._groups) == 0  # released groups hold no membership

    arun(go())


def test_membership_of_open_groups_survives_a_restart(arun):
    """A new engine rebuilds the groups still in flight from the log, orphans included."""

    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        a = await eng.open_session("a", group_id="g", group_size=3)
        await a.start()
        await a.finish(reward=1.0)
        await eng.open_session("b", group_id="g", group_size=3)  # left open: an orphan at restart
        eng2 = await SessionEngine.open(log)
        with pytest.raises(GroupError, match=r"declares group_size 4, but sessions 'a' \(lsn 0\), 'b' \(lsn 3\) declared group_size 3"):
            await eng2.open_session("c", group_id="g", group_size=4)
        with pytest.raises(GroupError, match=r"repeats sample_index 1 of session 'b'"):
            await eng2.open_session("c", group_id="g", group_size=3, sample_index=1)
        c = await eng2.open_session("c", group_id="g", group_size=3)
        assert opened(log, "c").sample_index == 2
        await c.drop("x")  # completes the group: a (finished), b (aborted at restart), c (dropped)
        assert len(eng2._groups) == 0
        res = reduce_log(log)
        assert [sorted(m.session_id for m in g.members) for g in res.groups] == [["a", "b"]]

    arun(go())


_OPEN = st.tuples(st.sampled_from(["g1", "g2"]), st.integers(1, 3), st.one_of(st.none(), st.integers(0, 3)), st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_OPEN, max_size=14), restart_at=st.integers(0, 14))
def test_whatever_the_engine_accepts_the_reducers_fold(arun, ops, restart_at):
    """Random opens (some ending at once), with a restart in the middle: every
    open the engine accepts reduces without error, and every one it refuses
    is refused with a GroupError that appends nothing."""

    async def go():
        log = MemoryLog()
        eng = await SessionEngine.open(log)
        for i, (gid, size, index, end) in enumerate(ops):
            if i == restart_at:
                eng = await SessionEngine.open(log)
            before = log.next_lsn
            try:
                h = await eng.open_session(f"s{i}", group_id=gid, group_size=size, sample_index=index)
            except GroupError:
                assert log.next_lsn == before
                continue
            if end:
                await h.drop("x")
        reduce_log(log)  # raises ReduceError on any membership the reducers refuse

    arun(go())
