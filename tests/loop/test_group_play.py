"""A group's members and their refills (loop/group_play.py), cancelled midway as over-sampling cancels a leftover:
nothing opened after the cancel is played, and the group still releases, marked as a leftover."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionDropped, SessionFinished
from agentlog.loop import group_play
from agentlog.loop.dynamic_sampling import OVERSAMPLED, oversampled
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log

RULES = ReduceConfig(min_valid=1, abort_outcomes={"policy": "refill"})
G = "b00000-g05"


def test_a_replacement_owed_when_its_group_is_cancelled_is_opened_and_dropped_never_played() -> None:
    cancelled = False

    async def go() -> MemoryLog:
        nonlocal cancelled
        log = MemoryLog()
        eng = await SessionEngine.open(log, groups=RULES)

        async def play(i: int, slot: int, *, fault: str | None = None, replaces: str = "") -> None:
            async with eng.session(f"{G}-s{i}", group_id=G, group_size=2, sample_index=i, replaces=replaces,
                                   budget_s=0.05 if i == 0 else None) as h:
                await h.start()
                await asyncio.sleep(0.5)  # s0 hangs past its budget (a refill is owed); s1 still runs
                await h.finish(reward=1.0)

        async def unplayed(i: int, *, replaces: str = "") -> None:
            h = await eng.open_session(f"{G}-s{i}", group_id=G, group_size=2, sample_index=i, replaces=replaces)
            await h.drop(OVERSAMPLED)

        task = asyncio.ensure_future(group_play.play_group(eng, G, 2, play, {}, lambda *a: None, lambda: cancelled, unplayed))
        while not eng.owed_replacements(G):  # the cut comes right after s0's abort, before its replacement opens
            await asyncio.sleep(0)
        cancelled = True
        await asyncio.gather(*(h.cancel(OVERSAMPLED) for h in eng.live_members(G)))
        await task
        await eng.close()
        return log

    log = asyncio.run(go())
    finished = [e.session_id for e in log.read(0) if isinstance(e.body, SessionFinished)]
    dropped = {e.session_id: e.body.reason for e in log.read(0) if isinstance(e.body, SessionDropped)}
    assert finished == [] and dropped == {f"{G}-s1": OVERSAMPLED, f"{G}-s2": OVERSAMPLED}
    (group,) = reduce_log(log, RULES).groups
    assert group.replaced == ((f"{G}-s2", f"{G}-s0"),) and oversampled(group)


def test_every_members_failure_is_reported_not_only_the_first() -> None:
    async def main() -> None:
        engine = await SessionEngine.open(MemoryLog(), drain_s=0.1)
        try:
            async def play(i: int, slot: int, *, fault=None, replaces=""):
                await asyncio.sleep(0.01 * i)
                raise RuntimeError(f"member {i} broke: disk {i} gone")

            with capture_logs() as logs:
                with pytest.raises(RuntimeError, match="member 0 broke"):
                    await group_play.play_group(engine, "g0", 3, play, {}, lambda *a: None)
            text = repr(logs)
            assert "member 1 broke" in text and "member 2 broke" in text, logs
        finally:
            await engine.close()

    asyncio.run(main())
