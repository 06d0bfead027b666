"""A recorded rollout log whose groups straddle each other: sessions of many
groups in flight at once, advanced in a seeded random order, through the real
engine (for the bounded-restart tests)."""

from __future__ import annotations

import asyncio
import random

from agentlog.engine import SessionEngine
from agentlog.engine.tasks.lookup import ANSWER, EOS, LOOKUP, LookupTask, key_token, value_token


def record_interleaved(log, *, seed: int, groups: int, group_size: int = 4, in_flight: int = 12,
                       abort_rate: float = 0.1, drop_rate: float = 0.05) -> None:
    """Append ``groups`` groups of ``group_size`` lookup-task sessions to ``log``;
    up to ``in_flight`` sessions are open at once and each step advances one
    of them, chosen at random (open, start, two turns, then finish, abort or
    drop), so groups open and release out of order."""
    task = LookupTask()
    rng = random.Random(seed)

    async def session(engine, gid: str, i: int, ep, version: int):
        key, value = ep.state["key"], ep.state["table"][ep.state["key"]]
        h = await engine.open_session(f"{gid}-s{i}", group_id=gid, group_size=group_size, sample_index=i,
                                      prompt=ep.messages, prompt_ids=list(ep.prompt_ids), policy_version=version)
        yield
        await h.start(harness="test")
        yield
        fate = rng.random()
        if fate < abort_rate:
            await h.abort("exception:Boom")
            return
        if fate < abort_rate + drop_rate:
            await h.drop("cancelled")
            return
        out0 = [LOOKUP, key_token(key), EOS]
        await h.record_turn(messages=ep.messages, prompt_ids=list(ep.prompt_ids), output_ids=out0,
                            output_log_probs=[-0.5] * 3, response_message={"role": "assistant", "content": task.decode(out0)},
                            policy_version=version)
        yield
        tool = task.tool_step(ep, 0, out0)
        ctx = list(ep.prompt_ids) + out0 + list(tool.ids)
        right = rng.random() < 0.5
        out1 = [ANSWER, value_token(value if right else (value + 1) % 16), EOS]
        msgs = ep.messages + [{"role": "assistant", "content": task.decode(out0)}, {"role": "tool", "content": tool.text}]
        await h.record_turn(messages=msgs, prompt_ids=ctx, output_ids=out1, output_log_probs=[-0.5] * 3,
                            response_message={"role": "assistant", "content": task.decode(out1)}, policy_version=version)
        yield
        await h.finish(reward=1.0 if right else 0.0)

    async def play() -> None:
        engine = await SessionEngine.open(log)
        live: list = []
        to_open = [(f"g{g:04d}", i) for g in range(groups) for i in range(group_size)]
        episodes: dict[str, object] = {}
        while to_open or live:
            if to_open and (len(live) < in_flight and rng.random() < 0.5 or not live):
                gid, i = to_open.pop(0)
                ep = episodes.setdefault(gid, task.new_episode(rng))
                gen = session(engine, gid, i, ep, 0)
                await gen.__anext__()
                live.append(gen)
                continue
            gen = live[rng.randrange(len(live))]
            try:
                await gen.__anext__()
            except StopAsyncIteration:
                live.remove(gen)
        await engine.close()

    asyncio.run(play())
