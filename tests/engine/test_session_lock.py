"""The per-session FIFO lock: order, cancellation of waiters, hand-off while cancelled."""

from __future__ import annotations

import asyncio

import pytest

from agentlog.engine import SessionEngine
from agentlog.engine.session_lock import acquire_contended, release
from agentlog.events.log.api import MemoryLog


async def _handle():
    eng = await SessionEngine.open(MemoryLog())
    return await eng.open_session("s", group_id="g", group_size=1)


async def _hold(h, order, name, hold=0.0):
    if h._busy:
        await acquire_contended(h)
    else:
        h._busy = True
    try:
        order.append(name)
        await asyncio.sleep(hold)
    finally:
        release(h)


def test_waiters_get_the_lock_in_arrival_order(arun):
    async def go():
        h = await _handle()
        order = []
        tasks = [asyncio.create_task(_hold(h, order, i, 0.001)) for i in range(20)]
        await asyncio.gather(*tasks)
        assert order == list(range(20))
        assert not h._busy and h._waiters is None
    arun(go())


def test_a_cancelled_waiter_neither_runs_nor_blocks_the_others(arun):
    async def go():
        h = await _handle()
        order = []
        first = asyncio.create_task(_hold(h, order, "first", 0.05))
        await asyncio.sleep(0)
        victim = asyncio.create_task(_hold(h, order, "victim"))
        last = asyncio.create_task(_hold(h, order, "last"))
        await asyncio.sleep(0.01)
        victim.cancel()
        await asyncio.gather(first, last)
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert order == ["first", "last"]
        assert not h._busy
    arun(go())


def test_a_waiter_cancelled_just_after_the_hand_off_passes_the_lock_on(arun):
    async def go():
        h = await _handle()
        order = []
        h._busy = True  # held by "us"
        waiter = asyncio.create_task(_hold(h, order, "waiter"))
        last = asyncio.create_task(_hold(h, order, "last"))
        await asyncio.sleep(0)
        release(h)  # hands the lock to `waiter`...
        waiter.cancel()  # ...which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.wait_for(last, 1)
        assert order == ["last"] and not h._busy
    arun(go())
