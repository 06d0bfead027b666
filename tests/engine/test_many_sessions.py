"""10,000 concurrent sessions with random outcomes: afterwards the engine holds
no session, its memory is back to the baseline, and the log holds exactly one
terminal event per session."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import tracemalloc
from collections import Counter
from typing import Any, Iterator

import pytest
import structlog

import agentlog.engine as engine
import agentlog.reducers.lifecycle as lifecycle_mod
from agentlog.engine import SessionEngine, StragglerRefused
from agentlog.events.log.api import EventLog, PendingRecord
from agentlog.events.schema.types import TERMINAL_EVENT_TYPES, Envelope, SessionOpened

ENGINE_DIR = os.path.dirname(engine.__file__)  # not "*/engine/*": that also matches tests/engine
OUTCOMES = ("finish", "abort", "drop", "exception", "cancel", "unfinished", "straggler", "budget")


class TallyLog(EventLog):
    """A complete EventLog (sequence checks included) that keeps a tally per
    session instead of the records, so the only memory left to measure is the
    engine's. It checks the grammar as it goes: opened first, nothing after
    the terminal event."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self._rng = random.Random(seed)
        self._lsn = 0
        self.terminal: dict[str, str] = {}
        self.events: dict[str, int] = {}
        self.errors: list[str] = []
        self._reasons: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"TallyLog(seed={self.seed})"

    @property
    def next_lsn(self) -> int:
        return self._lsn

    def append_batch(self, records):
        out = []
        for rec in self._check_batch(records):
            sid = rec.session_id
            if sid in self.terminal:
                self.errors.append(f"{sid}: {type(rec.body).__name__} after terminal")
            if (sid not in self.events) != isinstance(rec.body, SessionOpened):
                self.errors.append(f"{sid}: first event {type(rec.body).__name__}")
            self.events[sid] = self.events.get(sid, 0) + 1
            if isinstance(rec.body, TERMINAL_EVENT_TYPES):
                reason = getattr(rec.body, "reason", "finished")
                # Keep one copy per distinct reason: the engine allocated these strings.
                self.terminal[sid] = self._reasons.setdefault(reason, reason)
            self._advance(rec)
            out.append(Envelope(self._lsn, sid, rec.session_seq, 0, rec.body))
            self._lsn += 1
        return out

    async def append(self, session_id: str, session_seq: int, body: Any) -> Envelope:
        if self._rng.random() < 0.5:
            await asyncio.sleep(0)
        return self.append_batch([PendingRecord(session_id, session_seq, body)])[0]

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[Envelope]:
        return iter(())

    async def follow(self, from_lsn: int = 0, *, poll_s: float = 0.05):
        raise NotImplementedError("TallyLog keeps no records")
        yield  # pragma: no cover

    def close(self) -> None:
        pass


async def run_sessions(eng: SessionEngine, prefix: str, n: int, rng: random.Random) -> Counter:
    """n sessions, all live at once, each with a random outcome."""
    outcomes = [rng.choice(OUTCOMES) for _ in range(n)]
    all_open = asyncio.Event()
    opened = 0
    peak = 0
    raised: Counter = Counter()

    async def one(i: int, outcome: str):
        nonlocal opened, peak
        budget = 0.05 if outcome == "budget" else None
        async with eng.session(f"{prefix}{i}", group_id=f"{prefix}g{i // 8}", group_size=8, budget_s=budget) as h:
            opened += 1
            peak = max(peak, eng.live_count)
            if opened == n:
                all_open.set()
            await all_open.wait()
            await h.start()
            await h.record_turn(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_log_probs=[-0.1, -0.2])
            if outcome == "finish":
                await h.finish(reward=rng.random())
            elif outcome == "abort":
                await h.abort("verifier_failed", error="boom")
            elif outcome == "drop":
                await h.drop("duplicate")
            elif outcome == "exception":
                raise ValueError(f"session {i} failed")
            elif outcome in ("cancel", "budget"):
                await asyncio.sleep(30)
            elif outcome == "straggler":
                await h.finish(reward=1.0)
                try:
                    await h.record_turn(output_ids=[9])
                except StragglerRefused:
                    raised["straggler_refused"] += 1

    tasks = [asyncio.create_task(one(i, o)) for i, o in enumerate(outcomes)]
    await all_open.wait()
    await asyncio.sleep(0)
    for t, o in zip(tasks, outcomes):
        if o == "cancel":
            t.cancel()
    for r in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(r, BaseException):
            raised[type(r).__name__] += 1
    raised["peak_live"] = peak
    raised.update(Counter(outcomes))
    return raised


def engine_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes allocated by engine code (and the lifecycle reducer it uses) and still alive."""
    snap = snapshot.filter_traces([tracemalloc.Filter(True, os.path.join(ENGINE_DIR, "*")), tracemalloc.Filter(True, lifecycle_mod.__file__)])
    return sum(s.size for s in snap.statistics("filename"))


@pytest.mark.parametrize("n", [10_000, pytest.param(50_000, marks=pytest.mark.slow)])
def test_concurrent_sessions_with_random_outcomes_leave_nothing_behind(arun, n):
    structlog.configure(processors=[], logger_factory=structlog.ReturnLoggerFactory())  # cheap, keeps nothing
    rng = random.Random(20261130)
    log = TallyLog(seed=7)
    try:
        async def go():
            eng = await SessionEngine.open(log, status_cache=256, drain_s=0.05)
            await run_sessions(eng, "warm", 500, rng)  # fills the status cache and warms free lists
            await asyncio.sleep(0)  # a fresh loop step: the finished gather's result list is gone
            gc.collect()
            before = engine_bytes(tracemalloc.take_snapshot())
            counts = await run_sessions(eng, "s", n, rng)
            assert eng.live_count == 0
            await asyncio.sleep(0)
            gc.collect()
            after = engine_bytes(tracemalloc.take_snapshot())
            return eng, counts, before, after

        tracemalloc.start()
        try:
            eng, counts, before, after = arun(go())
        finally:
            tracemalloc.stop()
    finally:
        structlog.reset_defaults()
    assert counts["peak_live"] == n  # all n were live at once
    assert after - before < 16 * 1024, f"engine memory grew by {after - before} bytes over {n} sessions"
    assert eng._live == {} and eng._bg == set() and len(eng._ids.recent) == 256
    # Released groups hold no membership; only the warm-up's last group, 4 of
    # its 8 members never opened, is still in flight.
    assert eng._groups.pending() == {"warmg62": (8, 4, 4)}
    assert log.errors == []
    mine = [sid for sid in log.events if sid.startswith("s")]
    assert len(mine) == n
    assert all(sid in log.terminal for sid in mine), "a session without a terminal event"
    reasons = Counter(log.terminal[sid] for sid in mine)
    assert reasons["exception:ValueError"] == counts["exception"] == counts["ValueError"]
    assert reasons["cancelled"] == counts["cancel"] == counts["CancelledError"]
    assert reasons["wall_clock_timeout"] == counts["budget"] == counts["SessionTimeout"]
    assert reasons["unfinished"] == counts["unfinished"]
    assert reasons["finished"] == counts["finish"] + counts["straggler"]
    assert counts["straggler_refused"] == counts["straggler"]
