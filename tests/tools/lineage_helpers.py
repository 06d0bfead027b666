"""A log whose agent spawns subagents, recorded through the real engine on a FileLog: what the
lineage displays (show, ui, report, export-dataset, reconstruct) are checked on.

Session ``lin-0`` (group ``g-lin``): the lead agent's turn 0 calls ``Task`` (the gateway's flat
tool-call form) and subagent ``sub-1`` runs three turns (1-3); the lead's turn 4 calls ``Task``
twice (OpenAI's nested form, arguments as JSON text) and two subagents run in parallel, their
turns interleaved (5-8); the lead's turn 9 reads both results; reward 1.0. Session ``plain-1``,
the other member (reward 0.0), spawns nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

#: The session with subagents and the one without.
LINEAGE_SESSION, PLAIN_SESSION = "lin-0", "plain-1"
#: Each lineage of LINEAGE_SESSION: (its turns, parent, parent turn, spawning call id, the tool's prompt).
EXPECTED_LINEAGES = {
    "main": ((0, 4, 9), None, None, None, None),
    "sub-1": ((1, 2, 3), "main", 0, "call_1", "find the file that defines foo"),
    "sub-2": ((5, 7), "main", 4, "call_2", "write tests for foo"),
    "sub-3": ((6, 8), "main", 4, "call_3", "update the docs of foo"),
}


def _m(role: str, content: str, **extra: Any) -> dict:
    return {"role": role, "content": content, **extra}


async def _record(path: Path) -> None:
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    log = FileLog.open(path, fsync="never")
    eng = await SessionEngine.open(log, drain_s=0.1)
    lead, task = _m("system", "You are the lead agent."), _m("user", "Fix the bug in foo.")
    a0 = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "name": "Task", "arguments": {"prompt": "find the file that defines foo"}}]}
    h = await eng.open_session(LINEAGE_SESSION, group_id="g-lin", group_size=2, sample_index=0)
    await h.start()
    await h.record_turn(messages=[lead, task], prompt_ids=[1, 2, 3], output_ids=[10, 11], output_log_probs=[-0.1, -0.2], response_message=a0)
    search, ask = _m("system", "You are a search subagent."), _m("user", "find the file that defines foo")
    b0, b1, go, more = _m("assistant", "looking"), _m("assistant", "still looking"), _m("user", "go on"), _m("user", "and?")
    await h.record_turn(messages=[search, ask], prompt_ids=[5, 6], output_ids=[30], output_log_probs=[-0.3], response_message=b0)
    await h.record_turn(messages=[search, ask, b0, go], prompt_ids=[5, 6, 30, 7], output_ids=[31], output_log_probs=[-0.3], response_message=b1)
    await h.record_turn(messages=[search, ask, b0, go, b1, more], prompt_ids=[5, 6, 30, 7, 31, 8], output_ids=[32],
                        output_log_probs=[-0.3], response_message=_m("assistant", "foo.py"))
    t1 = _m("tool", "foo.py", tool_call_id="call_1")
    a1 = {"role": "assistant", "content": "Two helpers.", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "Task", "arguments": '{"prompt": "write tests for foo"}'}},
        {"id": "call_3", "type": "function", "function": {"name": "Task", "arguments": '{"prompt": "update the docs of foo"}'}}]}
    await h.record_turn(messages=[lead, task, a0, t1], prompt_ids=[1, 2, 3, 10, 11, 20], output_ids=[12, 13], output_log_probs=[-0.1, -0.1],
                        response_message=a1)
    worker = _m("system", "You are a worker subagent.")
    ua, ub, ca, cb, ok = (_m("user", "write tests for foo"), _m("user", "update the docs of foo"), _m("assistant", "tests written"),
                          _m("assistant", "docs updated"), _m("user", "ok"))
    await h.record_turn(messages=[worker, ua], prompt_ids=[40, 41], output_ids=[50], output_log_probs=[-0.5], response_message=ca)
    await h.record_turn(messages=[worker, ub], prompt_ids=[40, 42], output_ids=[60], output_log_probs=[-0.6], response_message=cb)
    await h.record_turn(messages=[worker, ua, ca, ok], prompt_ids=[40, 41, 50, 43], output_ids=[51], output_log_probs=[-0.5],
                        response_message=_m("assistant", "done a"))
    await h.record_turn(messages=[worker, ub, cb, ok], prompt_ids=[40, 42, 60, 43], output_ids=[61], output_log_probs=[-0.6],
                        response_message=_m("assistant", "done b"))
    t2, t3 = _m("tool", "tests written", tool_call_id="call_2"), _m("tool", "docs updated", tool_call_id="call_3")
    await h.record_turn(messages=[lead, task, a0, t1, a1, t2, t3], prompt_ids=[1, 2, 3, 10, 11, 20, 12, 13, 21, 22], output_ids=[14],
                        output_log_probs=[-0.1], response_message=_m("assistant", "Fixed."))
    await h.finish(reward=1.0)
    h = await eng.open_session(PLAIN_SESSION, group_id="g-lin", group_size=2, sample_index=1)
    await h.start()
    await h.record_turn(messages=[lead, task], prompt_ids=[1, 2, 3], output_ids=[15], output_log_probs=[-0.2],
                        response_message=_m("assistant", "No."))
    await h.finish(reward=0.0)
    await eng.close()
    log.close()


def write_lineage_log(path: Path) -> Path:
    """Record the log (see the module docstring) at ``path``; returns it."""
    asyncio.run(_record(path))
    return path
