"""The engine's lineage placement: the partition of a session's turns into
lineages does not depend on how their turns interleave, and equals the
lineages the agent declared; spawning calls are matched; a resumed session
continues its lineages."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.engine.lineages import Declared, LineageTracker
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.lineage import ROOT_LINEAGE, turn_lineage
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import TurnRecorded
from agentlog.reducers.pipeline import reduce_log


def conversation(lineage: int, n_turns: int, token_only: bool = False) -> list[dict[str, Any]]:
    """Lineage ``lineage``'s turns, in order: each extends the one before (its messages and tokens).
    Lineage 0 is the parent; it spawns lineage k by a Task call whose prompt is k's first message."""
    base = 1000 * (lineage + 1)
    system = {"role": "system", "content": "parent" if lineage == 0 else f"subagent {lineage} system"}
    user = {"role": "user", "content": "solve the task" if lineage == 0 else f"the prompt of subagent {lineage}"}
    messages: list[dict[str, Any]] = [system, user]
    tokens = [base, base + 1]
    turns = []
    for j in range(n_turns):
        out = [base + 100 + 10 * j, base + 101 + 10 * j]
        if lineage == 0:
            calls = [{"id": f"call_{k}", "name": "Task", "arguments": {"prompt": f"the prompt of subagent {k}"}} for k in range(1, 4)]
            response = {"role": "assistant", "content": f"step {j}", "tool_calls": calls if j == 0 else []}
        else:
            response = {"role": "assistant", "content": f"sub {lineage} step {j}"}
        turns.append({"messages": [] if token_only else list(messages), "prompt_ids": list(tokens), "output_ids": out,
                      "output_log_probs": [-0.5] * len(out), "response_message": response})
        messages += [response, {"role": "user", "content": f"observation {j}"}]
        tokens += out + [base + 50 + j]
    return turns


async def record(schedule: list[tuple[int, int]], lengths: list[int], declare: bool, token_only: bool = False) -> MemoryLog:
    """Record the lineages' turns in ``schedule`` order ((lineage, step) pairs) through the engine."""
    convs = [conversation(k, n, token_only) for k, n in enumerate(lengths)]
    log = MemoryLog()
    engine = await SessionEngine.open(log)
    async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
        await h.start()
        for lineage, step in schedule:
            declared = None
            if declare:
                declared = Declared(f"L{lineage}", parent="" if lineage == 0 else "L0",
                                    call="" if lineage == 0 else f"call_{lineage}") if step == 0 else Declared(f"L{lineage}")
            if step % 2:  # the gateway's begin_turn, whose pending turn names the lineage placed
                pending = h.begin_turn(declared_lineage=declared, **convs[lineage][step])
                assert pending.lineage == turn_lineage((await pending.durable).body)
            else:
                await h.record_turn(declared_lineage=declared, **convs[lineage][step])
        await h.finish(1.0)
    await engine.close()
    return log


def partition(log: MemoryLog, schedule: list[tuple[int, int]]) -> set[frozenset[tuple[int, int]]]:
    """The recorded lineages as sets of (declared lineage, step), whatever their ids."""
    groups: dict[str, set[tuple[int, int]]] = {}
    turns = [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]
    for body, item in zip(turns, schedule):
        groups.setdefault(turn_lineage(body), set()).add(item)
    return {frozenset(g) for g in groups.values()}


@st.composite
def interleavings(draw: Any) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
    """1 to 4 lineages of 1 to 4 turns, and two schedules: the parent's first turn first (it
    spawns the others), the rest interleaved at random, each lineage's turns in order."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    pending = [(k, j) for k, n in enumerate(lengths) for j in range(n)][1:]

    def schedule() -> list[tuple[int, int]]:
        order = [(0, 0)]
        nexts = {k: (1 if k == 0 else 0) for k in range(len(lengths))}
        for _ in range(len(pending)):
            ready = sorted(k for k, j in nexts.items() if j < lengths[k])
            k = draw(st.sampled_from(ready))
            order.append((k, nexts[k]))
            nexts[k] += 1
        return order

    return lengths, schedule(), schedule()


@settings(max_examples=40, deadline=None)
@given(interleavings())
def test_the_lineage_partition_is_independent_of_interleaving_and_equals_the_declared_one(case):
    lengths, first, second = case
    declared = {frozenset((k, j) for j in range(n)) for k, n in enumerate(lengths)}
    for schedule in (first, second):
        detected = asyncio.run(record(schedule, lengths, declare=False))
        assert partition(detected, schedule) == declared
        by_header = asyncio.run(record(schedule, lengths, declare=True))
        turns = [e.body for e in full_turns(by_header.read()) if isinstance(e.body, TurnRecorded)]
        assert [turn_lineage(t) for t in turns] == [f"L{k}" for k, _ in schedule]
        # One linear row per lineage, every generated token trained once.
        samples = reduce_log(detected).samples
        assert len(samples) == len(lengths)
        assert sum(int(s.mask.sum()) for s in samples) == 2 * sum(lengths)


def test_subagents_name_the_call_that_spawned_them_matched_by_its_prompt():
    schedule = [(0, 0), (2, 0), (1, 0), (2, 1), (0, 1), (3, 0)]
    log = asyncio.run(record(schedule, [2, 1, 2, 1], declare=False))
    turns = [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]
    assert turns[0].lineage is not None and turn_lineage(turns[0]) == ROOT_LINEAGE
    firsts = {turn_lineage(t): t.lineage for t in turns if turn_lineage(t) != ROOT_LINEAGE and t.lineage.how}
    # Subagent 2 began first (sub-1), yet each is tied to its own call by the prompt it carries.
    assert [(k, o.parent, o.parent_turn, o.spawn_call, o.how) for k, o in firsts.items()] == [
        ("sub-1", "main", 0, "call_2", "tool_call"), ("sub-2", "main", 0, "call_1", "tool_call"),
        ("sub-3", "main", 0, "call_3", "tool_call")]
    # Later turns carry the id alone.
    assert [t.lineage.how for t in turns if turn_lineage(t) == "sub-1"] == ["tool_call", ""]


def test_token_only_turns_extending_a_lineage_find_it_and_the_rest_stay_with_the_newest():
    # Without messages a turn is placed by its tokens: returning to the parent is found exactly.
    schedule = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2)]
    log = asyncio.run(record(schedule, [3, 2], declare=True, token_only=True))
    assert partition(log, schedule) == {frozenset({(0, 0), (0, 1), (0, 2)}), frozenset({(1, 0), (1, 1)})}
    plain = asyncio.run(record([(0, 0), (0, 1), (0, 2)], [3], declare=False, token_only=True))
    assert len(partition(plain, [(0, 0), (0, 1), (0, 2)])) == 1


def test_a_session_without_subagents_records_no_lineage_field():
    log = asyncio.run(record([(0, 0), (0, 1), (0, 2)], [3], declare=False))
    assert all(b"lineage" not in bytes(e.body.__struct_config__.tag, "ascii") for e in log.read())
    turns = [e.body for e in log.read() if hasattr(e.body, "turn_index") and hasattr(e.body, "output_ids")]
    import msgspec
    assert all(t.lineage is msgspec.UNSET for t in turns)
    assert all(b"lineage" not in msgspec.msgpack.encode(t) for t in turns)


def test_a_rebuilt_tracker_places_the_next_turns_as_the_live_one_does():
    schedule = [(0, 0), (1, 0), (2, 0), (1, 1), (0, 1)]
    later = [(2, 1), (1, 2), (0, 2)]
    lengths = [3, 3, 2]
    whole = asyncio.run(record(schedule + later, lengths, declare=False))
    turns = [e.body for e in full_turns(whole.read()) if isinstance(e.body, TurnRecorded)]
    head = turns[: len(schedule)]
    last: dict[str, TurnRecorded] = {}
    for t in head:
        last.pop(turn_lineage(t), None)
        last[turn_lineage(t)] = t
    origins = {turn_lineage(t): t.lineage for t in head if turn_lineage(t) != ROOT_LINEAGE and t.lineage.how}
    from agentlog.reducers.resume import resume_points

    # What a resume point holds of the turns before the cut: every turn's calls, in log order.
    history = [h for h in resume_points(whole.read(), ["s"])["s"].lineage_history if h[1] < len(schedule)]
    tracker = LineageTracker()
    tracker.rebuild(last.values(), origins, history)
    from agentlog.events.schema.turn_delta import EncodingContext
    for t in turns[len(schedule):]:
        bare = TurnRecorded(turn_index=t.turn_index, messages=t.messages, prompt_ids=t.prompt_ids, output_ids=t.output_ids,
                            output_log_probs=t.output_log_probs, response_message=t.response_message)
        digests = EncodingContext().digests_for(bare.messages)
        placed = tracker.place(bare, digests, False)
        assert (ROOT_LINEAGE if placed is None or not hasattr(placed, "id") else placed.id) == turn_lineage(t)
        _, ctx = EncodingContext().encode(bare)
        tracker.commit(t.turn_index, ctx)
    assert np.array_equal(np.sort([t.turn_index for t in turns]), np.arange(len(turns)))


def test_openai_shaped_calls_with_json_text_arguments_are_matched_by_their_prompt():
    import json

    async def body():
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
            await h.start()
            calls = [{"id": f"call_{x}", "type": "function",
                      "function": {"name": "Task", "arguments": json.dumps({"prompt": f"search for {x} in the repository"})}}
                     for x in ("a", "b")]
            parent = [{"role": "system", "content": "parent"}, {"role": "user", "content": "task"}]
            await h.record_turn(parent, [1, 2], output_ids=[3], output_log_probs=[-1.0],
                                response_message={"role": "assistant", "content": "", "tool_calls": calls})
            for x in ("b", "a"):  # the second call's subagent starts first
                sub = [{"role": "system", "content": "sub"}, {"role": "user", "content": f"search for {x} in the repository"}]
                await h.record_turn(sub, [5, ord(x)], output_ids=[6], output_log_probs=[-1.0],
                                    response_message={"role": "assistant", "content": "found"})
            await h.finish(1.0)
        await engine.close()
        return [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]

    turns = asyncio.run(body())
    assert [(t.lineage.spawn_call, t.lineage.how) for t in turns[1:]] == [("call_b", "tool_call"), ("call_a", "tool_call")]


def test_a_compacted_history_is_a_new_lineage_spawned_by_no_call():
    async def body():
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
            await h.start()
            system = {"role": "system", "content": "agent"}
            bash = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_b", "name": "Bash", "arguments": {"command": "ls"}}]}
            await h.record_turn([system, {"role": "user", "content": "the task"}], [1, 2], output_ids=[3], output_log_probs=[-1.0],
                                response_message=bash)
            # The agent compacted its history: same system prompt, a summary as its first message.
            await h.record_turn([system, {"role": "user", "content": "summary of the work so far"}], [1, 9], output_ids=[4],
                                output_log_probs=[-1.0], response_message={"role": "assistant", "content": "go on"})
            await h.finish(1.0)
        await engine.close()
        return [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]

    first, compacted = asyncio.run(body())
    assert turn_lineage(first) == ROOT_LINEAGE
    o = compacted.lineage
    assert (o.id, o.parent, o.parent_turn, o.spawn_call, o.how) == ("sub-1", "main", 0, "", "order")
