"""Subagent lineages through the real gateway: a parent that spawns a 3-turn
subagent by a tool call, runs again, then spawns two subagents that run in
parallel; and the X-Agentlog-Lineage header, declared and refused."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
from gateway_helpers import ScriptedBackend, bearer, open_running, rig, run, turns_of

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.lineage import turn_lineage
from agentlog.gateway.turn import LINEAGE_HEADER
from agentlog.reducers.pipeline import Reducer, reduce_log

PARENT_SYSTEM = "You are the lead engineer. Delegate searches to subagents."
SUB_SYSTEM = "You are a search subagent. Answer with what you found."
TASK = "Fix the failing test in the repository."
SEARCH_FOO = "Find the file that defines the function foo and report its path."
SEARCH_TESTS = "List the test files that import foo."
SEARCH_DOCS = "Find the documentation page that mentions foo."
TOOLS = [{"type": "function", "function": {"name": "Task", "description": "Run a subagent",
                                           "parameters": {"type": "object", "properties": {"prompt": {"type": "string"}}}}}]


def task_call(*prompts: str) -> str:
    # Laid out as the template renders the recorded call, so the next prompt repeats it token for token.
    return "\n" + "\n".join(f'<tool_call>{{"name": "Task", "arguments": {json.dumps({"prompt": p})}}}</tool_call>' for p in prompts)


def reply(prompt: str) -> str:
    """The scripted model: the parent delegates, the subagents search."""
    if PARENT_SYSTEM in prompt:
        if "found tests" in prompt:
            return "All done: the fix is in foo.py."
        if "found foo" in prompt:
            return "Two more searches." + task_call(SEARCH_TESTS, SEARCH_DOCS)
        return "Delegating the search." + task_call(SEARCH_FOO)
    step = prompt.count("observation")
    return f"searching step {step}" if step < 2 else "found it"


async def post(http, gw, sid, messages, headers=None):
    body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 400}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={**bearer(gw, sid), **(headers or {})}) as r:
        return r.status, await r.json()


async def subagent(http, gw, sid, prompt, turns, headers=None):
    """A subagent's conversation: ``turns`` turns, each answered by an observation; returns its last answer."""
    messages = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": prompt}]
    for _ in range(turns):
        status, out = await post(http, gw, sid, messages, headers)
        assert status == 200, out
        answer = out["choices"][0]["message"]
        messages += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "observation"}]
        await asyncio.sleep(0)
    return answer["content"]


def assistant(out):
    m = out["choices"][0]["message"]
    msg = {"role": "assistant", "content": m["content"] or ""}
    if m.get("tool_calls"):
        msg["tool_calls"] = m["tool_calls"]
    return msg


async def parent_with_subagents(gw, sid):
    """Parent turn, a 3-turn subagent, parent, two 2-turn subagents in parallel, parent."""
    async with aiohttp.ClientSession() as http:
        messages = [{"role": "system", "content": PARENT_SYSTEM}, {"role": "user", "content": TASK}]
        status, out = await post(http, gw, sid, messages)
        assert status == 200, out
        (call,) = out["choices"][0]["message"]["tool_calls"]
        found = await subagent(http, gw, sid, SEARCH_FOO, 3)
        messages += [assistant(out), {"role": "tool", "tool_call_id": call["id"], "content": f"found foo: {found}"}]
        status, out = await post(http, gw, sid, messages)
        assert status == 200, out
        calls = out["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 2
        results = await asyncio.gather(subagent(http, gw, sid, SEARCH_TESTS, 2), subagent(http, gw, sid, SEARCH_DOCS, 2))
        messages.append(assistant(out))
        for c, r in zip(calls, results):
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": f"found tests: {r}"})
        status, out = await post(http, gw, sid, messages)
        assert status == 200, out
    return [call] + calls


def test_a_parent_and_its_subagents_train_as_one_trajectory_per_lineage():
    async def body():
        log = MemoryLog()
        async with rig(ScriptedBackend(reply), log=log) as (gw, engine, _):
            h = await open_running(engine, "s")
            calls = await parent_with_subagents(gw, "s")
            await h.finish(1.0)
        return log, calls

    log, calls = run(body())
    turns = turns_of(log, "s")
    by_lineage: dict[str, list] = {}
    for t in turns:
        by_lineage.setdefault(turn_lineage(t), []).append(t)
    assert [len(v) for v in by_lineage.values()] == [3, 3, 2, 2]
    main, foo, tests_, docs = by_lineage.values()
    assert turn_lineage(main[0]) == "main"
    # Each subagent names the parent turn and the very tool call that spawned it, matched by its prompt.
    origins = {t.lineage.id: t.lineage for t in (foo[0], tests_[0], docs[0])}
    assert [(o.parent, o.parent_turn, o.spawn_call, o.how) for o in origins.values()] == [
        ("main", main[0].turn_index, calls[0]["id"], "tool_call"),
        ("main", main[1].turn_index, calls[1]["id"], "tool_call"),
        ("main", main[1].turn_index, calls[2]["id"], "tool_call"),
    ]
    # The two parallel subagents really interleaved in the log.
    order = [turn_lineage(t) for t in turns]
    assert order.index(tests_[0].lineage.id) < max(i for i, x in enumerate(order) if x == docs[0].lineage.id)

    result = reduce_log(log)
    samples = result.samples
    assert [s.metadata["lineage"] for s in samples] == list(by_lineage)  # one row per lineage, none per switch
    for s, lineage_turns in zip(samples, by_lineage.values()):
        assert s.metadata["turn_indices"] == [t.turn_index for t in lineage_turns]
        last = lineage_turns[-1]
        # Masks and log-probs exact: the lineage's last prompt + output, mask 1 on each of its turns' outputs only.
        assert s.tokens == last.prompt_ids + last.output_ids
        mask = np.zeros(s.response_length, np.uint8)
        prompt_len = len(lineage_turns[0].prompt_ids) // 4
        for t in lineage_turns:
            start = len(t.prompt_ids) // 4 - prompt_len
            mask[start : start + len(t.output_ids) // 4] = 1
        assert s.mask.tolist() == mask.tolist()
        assert np.all(s.log_probs[mask == 1] == np.float32(-0.25)) and np.all(s.log_probs[mask == 0] == 0)
    # Every generated token trained exactly once.
    assert sum(int(s.mask.sum()) for s in samples) == sum(len(t.output_ids) // 4 for t in turns)
    # Spawned lineages name their parent and call on every row.
    assert [(s.metadata.get("parent_lineage"), s.metadata.get("spawn_call")) for s in samples[1:]] == [
        ("main", c["id"]) for c in calls]
    # The reducer fed record by record (the live loop) gives the very samples a batch replay gives.
    live = Reducer()
    for env in log.read():
        live.feed(env)
    assert live.digest.hexdigest() == result.digest


def _declared(sid_headers):
    return {LINEAGE_HEADER: sid_headers}


def test_declared_lineages_are_recorded_as_declared_and_bad_ones_are_refused_with_400():
    async def body():
        log = MemoryLog()
        async with rig(ScriptedBackend(lambda p: "ok"), log=log) as (gw, engine, _):
            h = await open_running(engine, "s")
            async with aiohttp.ClientSession() as http:
                msgs = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": "same prompt"}]
                statuses = [(await post(http, gw, "s", msgs, _declared("planner")))[0]]
                # The same system prompt and first message: detection alone would call it a rewrite of the
                # planner's history; the header makes it a lineage of its own.
                statuses.append((await post(http, gw, "s", msgs, _declared("worker-1; parent=planner")))[0])
                refused = {}
                for value in ("", "bad id!", "w2; parent=nobody", "w2; parent=planner; call=call_unknown",
                              "w2; colour=red", "w2; parent=w2", "worker-1; parent=main"):
                    status, out = await post(http, gw, "s", msgs, _declared(value))
                    refused[value] = (status, out["error"]["message"])
            await h.finish(1.0)
        return log, statuses, refused

    log, statuses, refused = run(body())
    assert statuses == [200, 200]
    assert all(status == 400 for status, _ in refused.values()), refused
    assert "X-Agentlog-Lineage" in refused["bad id!"][1] and "expected" in refused["bad id!"][1]
    assert "'nobody'" in refused["w2; parent=nobody"][1] and "'planner'" in refused["w2; parent=nobody"][1]
    assert "call_unknown" in refused["w2; parent=planner; call=call_unknown"][1]
    assert "colour=red" in refused["w2; colour=red"][1]
    assert "recorded with parent 'planner'" in refused["worker-1; parent=main"][1]
    turns = turns_of(log, "s")
    assert len(turns) == 2  # nothing refused was recorded
    assert [(t.lineage.id, t.lineage.parent, t.lineage.how) for t in turns] == [("planner", "", "declared"),
                                                                              ("worker-1", "planner", "declared")]
    samples = reduce_log(log).samples
    assert [s.metadata["lineage"] for s in samples] == ["planner", "worker-1"]
