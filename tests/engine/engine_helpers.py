"""Helpers shared by the engine tests (a yielding log, an independent log checker)."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from typing import Any

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import TERMINAL_EVENT_TYPES, SessionOpened, SessionResumed


class YieldingLog(MemoryLog):
    """A MemoryLog whose appends give the event loop away a random number of
    times, like a real group-committing writer, so concurrent operations
    really interleave. The seed is in the repr for reproduction."""

    def __init__(self, seed: int = 0, max_yields: int = 3) -> None:
        super().__init__()
        self.seed = seed
        self._rng = random.Random(seed)
        self._max_yields = max_yields

    def __repr__(self) -> str:
        return f"YieldingLog(seed={self.seed})"

    async def append(self, session_id: str, session_seq: int, body: Any):
        for _ in range(self._rng.randint(0, self._max_yields)):
            await asyncio.sleep(0)
        env = self.append_batch([(session_id, session_seq, body)])[0]
        for _ in range(self._rng.randint(0, self._max_yields)):
            await asyncio.sleep(0)
        return env


def check_log_invariants(log) -> dict[str, list]:
    """Independent of the code under test: per session, the first event is
    session_opened, session_seq is 0,1,2,..., there is at most one terminal
    event and nothing follows it. Returns the events per session."""
    per: dict[str, list] = defaultdict(list)
    last_lsn = -1
    for env in log.read(0):
        assert env.lsn == last_lsn + 1, f"lsn gap at {env.lsn}"
        last_lsn = env.lsn
        per[env.session_id].append(env)
    for sid, envs in per.items():
        assert isinstance(envs[0].body, SessionOpened), f"{sid}: first event {type(envs[0].body).__name__}"
        assert [e.session_seq for e in envs] == list(range(len(envs))), f"{sid}: session_seq not gapless"
        terminals = [i for i, e in enumerate(envs) if isinstance(e.body, TERMINAL_EVENT_TYPES)]
        assert len(terminals) <= 1, f"{sid}: {len(terminals)} terminal events"
        if terminals:
            assert terminals[0] == len(envs) - 1, f"{sid}: events after the terminal one"
    return per


async def fire(h: Any, trigger: str) -> Any:
    """Fire ``trigger`` (a lifecycle trigger, or turn/reward/command) on handle ``h``."""
    if trigger == "start":
        return await h.start()
    if trigger == "finish":
        return await h.finish(reward=1.0)
    if trigger == "abort":
        return await h.abort("random")
    if trigger == "drop":
        return await h.drop("random")
    if trigger == "resume":
        # A live session resumed in place: what SessionEngine.resume appends for an adopted one.
        body = SessionResumed(incarnation=1, durable_turns=h.turns, snapshot="0" * 64, snapshot_turn=max(h.turns - 1, 0))
        return await h._engine._transition(h, "resume", body)
    if trigger == "reward":
        return await h.assign_reward(0.5, source="test")
    if trigger == "command":
        return await h.record_command("true", 0, False, 0.01, "")
    return await h.record_turn(prompt_ids=[1, 2], output_ids=[3], output_log_probs=[-0.5])
