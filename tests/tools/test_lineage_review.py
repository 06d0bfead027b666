"""Lineage displays at their edges: the report's bounded lineage gatherer never claims a spawning
call was absent when it only stopped holding it, and the ui's lineage tree lists only the rows the
view shows (an aborted session with subagents makes one placeholder row, not one per lineage)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentlog.engine import SessionEngine
from agentlog.engine.lineages import Declared
from agentlog.events.log.api import MemoryLog
from agentlog.tools.lineage_view import HOW_SHOWN, SessionLineages, spawn_text

#: Tool-call turns the lead records before its subagents start (each spawning one of them).
LEAD_CALLS = 4


def _m(role: str, content: str, **extra) -> dict:
    return {"role": role, "content": content, **extra}


async def _lead_then_workers(h) -> None:
    """The lead's LEAD_CALLS turns, each calling Task (call_k, answered), then one declared worker per call."""
    msgs, prompt = [_m("system", "lead"), _m("user", "do it")], [1, 2]
    for k in range(LEAD_CALLS):
        call = {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{k}", "name": "Task", "arguments": {"prompt": f"job {k}"}}]}
        await h.record_turn(messages=list(msgs), prompt_ids=list(prompt), output_ids=[100 + k], output_log_probs=[-0.1], response_message=call)
        msgs, prompt = msgs + [call, _m("tool", "started", tool_call_id=f"call_{k}")], prompt + [100 + k, 7]
    for k in range(LEAD_CALLS):
        await h.record_turn(messages=[_m("system", "worker"), _m("user", f"job {k}")], prompt_ids=[40, 50 + k], output_ids=[60],
                            output_log_probs=[-0.5], response_message=_m("assistant", "ok"),
                            declared_lineage=Declared(id=f"w{k}", parent="main", call=f"call_{k}"))


def _lineage_log() -> MemoryLog:
    async def build() -> MemoryLog:
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
            await h.start()
            await _lead_then_workers(h)
            await h.finish(1.0)
        await engine.close()
        return log

    return asyncio.run(build())


def test_a_bounded_gatherer_says_a_spawning_call_was_not_kept_never_that_it_was_absent():
    envs = list(_lineage_log().read())
    full, bounded = SessionLineages(), SessionLineages(keep_turns=2)  # the report keeps LINEAGE_CALL_TURNS
    for env in envs:
        full.feed(env)
        bounded.feed(env)
    for k, (a, b) in enumerate(zip(full.lineages[1:], bounded.lineages[1:])):
        assert a.id == b.id == f"w{k}"
        assert a.spawn.name == "Task" and f'"job {k}"' in spawn_text(a, False)
        text = spawn_text(b, False)
        assert "not among the parent turn's tool calls" not in text, text
        if k < LEAD_CALLS - 2:  # its call's turn is older than the two kept
            assert b.spawn.forgotten and "not kept" in text and text.endswith(HOW_SHOWN["declared"]), text
        else:
            assert text == spawn_text(a, False)


def test_the_ui_lineage_tree_lists_only_the_rows_an_aborted_sessions_view_shows(tmp_path):
    from agentlog.events import FileLog
    from agentlog.events.log.source import open_source
    from agentlog.reducers.config import ReduceConfig
    from agentlog.tools.ui.views import RunViews

    async def build(path: Path) -> None:
        log = FileLog.open(path, fsync="never")
        engine = await SessionEngine.open(log, drain_s=0.1)
        h = await engine.open_session("ab", group_id="g", group_size=1, sample_index=0)
        await h.start()
        await _lead_then_workers(h)
        await h.abort("wall_clock_timeout", error="budget")
        await engine.close()
        log.close()

    asyncio.run(build(tmp_path / "log"))
    source = open_source(str(tmp_path / "log"))
    try:
        envs = [e for e in source.read() if e.session_id == "ab"]
        view = RunViews(source, None, ReduceConfig(), None).session({"session_id": "ab"}, envs)
    finally:
        source.close()
    shown = {r["row"]: r["lineage"] for r in view["rows"]}
    assert len(view["lineages"]) == 1 + LEAD_CALLS and len(shown) == 1  # an aborted session: one placeholder row
    listed = {row: lineage["id"] for lineage in view["lineages"] for row in lineage["rows"]}
    assert listed == shown, (listed, shown)


def test_the_bounded_gatherer_keeps_only_the_arguments_it_shows_and_shows_what_the_full_one_does():
    from agentlog.tools.lineage_view import SPAWN_ARGS_SHOWN

    long_prompt = "review the change " + "x" * 5000

    async def build() -> MemoryLog:
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
            await h.start()
            call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "name": "Task", "arguments": {"prompt": long_prompt}}]}
            await h.record_turn(messages=[_m("system", "lead"), _m("user", "do it")], prompt_ids=[1, 2], output_ids=[3],
                                output_log_probs=[-0.1], response_message=call)
            await h.record_turn(messages=[_m("system", "worker"), _m("user", long_prompt)], prompt_ids=[4, 5], output_ids=[6],
                                output_log_probs=[-0.1], response_message=_m("assistant", "ok"))
            await h.finish(reward=1.0)
        await engine.close()
        return log

    envs = list(asyncio.run(build()).read())
    bounded, full = SessionLineages(keep_turns=8), SessionLineages()
    for env in envs:
        bounded.feed(env)
        full.feed(env)
    (_, b_sub), (_, f_sub) = bounded.lineages, full.lineages
    assert len(b_sub.spawn.arguments) == SPAWN_ARGS_SHOWN < len(f_sub.spawn.arguments) == b_sub.spawn.arguments_chars
    assert spawn_text(b_sub, False) == spawn_text(f_sub, False) == spawn_text(b_sub, True)
    assert "chars)" in spawn_text(b_sub, False) and "x" * 200 in spawn_text(f_sub, True)
