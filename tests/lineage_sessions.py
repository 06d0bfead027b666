"""A session whose agent spawns one subagent, recorded through the real engine (not a test module)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable


async def spawning_session(engine: Any, sid: str, index: int, end: Callable[[Any], Awaitable[Any]], group_size: int) -> None:
    """A parent turn that spawns one subagent by a Task call, the subagent's turn, the parent again; then ``end(h)``."""
    async with engine.session(sid, group_id="g", group_size=group_size, sample_index=index) as h:
        await h.start()
        parent = [{"role": "system", "content": "parent"}, {"role": "user", "content": f"task {sid}"}]
        call = {"id": f"call_{sid}", "name": "Task", "arguments": {"prompt": f"search {sid}"}}
        a0 = {"role": "assistant", "content": "", "tool_calls": [call]}
        await h.record_turn(parent, [1, 2], output_ids=[3, 4], output_log_probs=[-1.0, -1.0], response_message=a0)
        sub = [{"role": "system", "content": "sub"}, {"role": "user", "content": f"search {sid}"}]
        await h.record_turn(sub, [5, 6], output_ids=[7], output_log_probs=[-1.0], response_message={"role": "assistant", "content": "x"})
        tool = {"role": "tool", "tool_call_id": call["id"], "content": "x"}
        await h.record_turn(parent + [a0, tool], [1, 2, 3, 4, 8], output_ids=[9], output_log_probs=[-1.0],
                            response_message={"role": "assistant", "content": "done"})
        await end(h)
