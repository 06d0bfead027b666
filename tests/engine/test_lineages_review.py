"""Lineage placement at its edges: a token-only parent's re-tokenised turn, a failed
append, tool-call argument text nested too deep to parse, a caller's own
``sampling["lineage"]``, the lineage header sent twice, and a resumed session's
tracker against the live one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from agentlog.engine import SessionEngine
from agentlog.engine.lineages import Declared, LineageError, LineageTracker
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.lineage import tool_calls, turn_lineage
from agentlog.events.schema.turn_delta import EncodingContext, full_turns
from agentlog.events.schema.types import TurnRecorded
from agentlog.gateway.turn import LINEAGE_HEADER, _Refused, declared_lineage
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.resume import resume_points

PARENT = [{"role": "system", "content": "parent"}, {"role": "user", "content": "task"}]
SPAWN = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "Task", "arguments": {"prompt": "search it"}}]}
SUB = [{"role": "system", "content": "sub"}, {"role": "user", "content": "search it"}]


def turn(messages: list[Any] | None, prompt: list[int], out: list[int], response: dict[str, Any] | None = None) -> dict[str, Any]:
    return dict(messages=messages, prompt_ids=prompt, output_ids=out, output_log_probs=[-1.0] * len(out), response_message=response)


class FailingOnceLog(MemoryLog):
    """A log whose next append fails (``fail_next``) before anything is staged: a full disk."""

    fail_next = False

    async def append(self, session_id: str, session_seq: int, body: Any) -> Any:
        if self.fail_next:
            self.fail_next = False
            raise OSError("no space left on device")
        return await super().append(session_id, session_seq, body)


async def recorded(steps: list[Any], log: MemoryLog | None = None) -> MemoryLog:
    """Each step: the keyword arguments of a record_turn, or a callable(log) run before the next one."""
    log = log if log is not None else MemoryLog()
    engine = await SessionEngine.open(log)
    async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
        await h.start()
        for step in steps:
            if callable(step):
                step(log)
                continue
            try:
                await h.record_turn(**step)
            except OSError:
                pass  # the failing append: the session goes on
        await h.finish(1.0)
    await engine.close()
    return log


def lineages(log: MemoryLog) -> list[str]:
    return [turn_lineage(e.body) for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]


def test_a_token_only_parent_that_re_tokenises_its_last_response_stays_in_its_own_lineage():
    # The subagent is declared, the parent (the root) is not; the parent's next prompt re-tokenises
    # its last response (10, 11, 12 -> 10, 13): a REALIGN of the parent's row, not a subagent turn.
    log = asyncio.run(recorded([
        turn(None, [1, 2, 3], [10, 11, 12]),
        dict(turn(None, [50, 51], [60, 61]), declared_lineage=Declared("w", parent="main")),
        turn(None, [1, 2, 3, 10, 13, 20], [30]),
    ]))
    assert lineages(log) == ["main", "w", "main"]
    rows = {s.metadata["lineage"]: s.metadata["turn_indices"] for s in reduce_log(log).samples}
    assert rows == {"main": [0, 2], "w": [1]}


def test_a_turn_whose_append_failed_takes_no_subagent_number():
    def fail_next(log: Any) -> None:
        log.fail_next = True

    log = asyncio.run(recorded([turn(PARENT, [1, 2], [3], SPAWN), fail_next, turn(SUB, [5, 6], [7]), turn(SUB, [5, 6], [7])],
                               FailingOnceLog()))
    assert lineages(log) == ["main", "sub-1"]


def test_tool_call_argument_text_nested_past_the_json_parsers_limit_does_not_fail_the_turn():
    deep = '{"a": ' + "[" * 20000 + "]" * 20000 + "}"
    call = {"id": "call_d", "type": "function", "function": {"name": "Task", "arguments": deep}}
    log = asyncio.run(recorded([turn(PARENT, [1, 2], [3], {"role": "assistant", "content": "", "tool_calls": [call]}),
                                turn(SUB, [5, 6], [7])]))
    assert lineages(log) == ["main", "sub-1"]


def _strings_spec(value: Any, depth: int = 0):
    """What placement reads of a call's arguments: every string, depth first, three levels down."""
    if isinstance(value, str):
        yield value
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _strings_spec(v, depth + 1)
    elif depth < 3 and isinstance(value, list):
        for v in value:
            yield from _strings_spec(v, depth + 1)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans())
def test_a_calls_argument_strings_are_read_as_the_spec_says_whatever_their_nesting(args, as_text):
    """``tool_calls`` appends the strings (no generator a level): the same strings, in the same order."""
    arguments = json.dumps(args) if as_text and isinstance(args, dict) else args
    if isinstance(args, str) and args.startswith("{"):  # text that may be JSON: read as what it parses to, if it does
        try:
            args = json.loads(args)
        except ValueError:
            pass
    (call,) = tool_calls({"tool_calls": [{"id": "c", "name": "Task", "arguments": arguments}]})
    assert call == ("c", "Task", tuple(_strings_spec(args)))


def test_a_callers_own_sampling_lineage_is_refused_naming_it():
    # Taken as given, it would name a lineage the engine never placed the turn in (the log and
    # the live tracker disagreeing from then on): refused before anything is appended.
    async def body() -> tuple[MemoryLog, str]:
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        async with engine.session("s", group_id="g", group_size=1, sample_index=0) as h:
            await h.start()
            with pytest.raises(LineageError, match=r"sampling\['lineage'\].*sub-4.*declared_lineage") as exc:
                await h.record_turn(**turn(PARENT, [1, 2], [3]), sampling={"temperature": 1.0, "lineage": {"id": "sub-4"}})
            await h.record_turn(**turn(PARENT, [1, 2], [3]))
            await h.finish(1.0)
        await engine.close()
        return log, str(exc.value)

    log, _ = asyncio.run(body())
    assert lineages(log) == ["main"]


def test_the_lineage_header_sent_twice_with_different_values_is_refused():
    async def body() -> list[Any]:
        engine = await SessionEngine.open(MemoryLog())
        h = await engine.open_session("s", group_id="g", group_size=1, sample_index=0)
        await h.start()
        await h.record_turn(**turn(PARENT, [1, 2], [3], SPAWN))
        out = []
        for values in (["w1; parent=main"], ["w1; parent=main", "w1; parent=main"], ["w1; parent=main", "main"]):
            request = make_mocked_request("POST", "/v1/chat/completions", headers=CIMultiDict((LINEAGE_HEADER, v) for v in values))
            try:
                out.append(declared_lineage(request, h))
            except _Refused as exc:
                out.append((exc.status, str(exc)))
        await engine.close()
        return out

    one, same_twice, different = asyncio.run(body())
    assert one == same_twice == Declared("w1", parent="main")
    assert different[0] == 400 and "different values" in different[1] and "'main'" in different[1]


# ---------------------------------------------------------------- resume


ORCHESTRATOR = [{"role": "system", "content": "orchestrator"}, {"role": "user", "content": "do it"}]
BACKGROUND = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_t1", "name": "Task", "arguments": {"prompt": "research the history of the parser module"}}]}
BASH = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_b1", "name": "Bash", "arguments": {"command": "ls"}}]}
# An orchestrator that starts a subagent in the background and goes on before the subagent's first turn.
BEFORE_THE_SUBAGENT = [turn(ORCHESTRATOR, [1, 2], [3], BACKGROUND),
                       turn(ORCHESTRATOR + [BACKGROUND, {"role": "user", "content": "(running)"}], [1, 2, 3, 4], [5], BASH)]


def live_and_rebuilt() -> tuple[LineageTracker, LineageTracker]:
    async def live() -> tuple[LineageTracker, MemoryLog]:
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        h = await engine.open_session("s", group_id="g", group_size=1, sample_index=0)
        await h.start()
        for step in BEFORE_THE_SUBAGENT:
            await h.record_turn(**step)
        return h._lineages, log

    tracker, log = asyncio.run(live())
    point = resume_points(log.read(), ["s"])["s"]
    rebuilt = LineageTracker()
    rebuilt.rebuild(point.lineage_turns.values(), point.lineage_origins, point.lineage_history)
    return tracker, rebuilt


def _agent_with_subagents(seed: int) -> tuple[LineageTracker, MemoryLog]:
    """A session of 30 turns drawn from ``seed``: conversations that go on (answering some of their last
    calls) or start (a subagent's prompt), answers that make 0 to 40 calls (Task or Bash), and now and
    then a lineage declared with a parent and one of its calls. Returns the live tracker and the log."""
    import random

    rng = random.Random(seed)

    async def run() -> tuple[LineageTracker, MemoryLog]:
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        h = await engine.open_session("s", group_id="g", group_size=1, sample_index=0)
        await h.start()
        conversations: list[dict[str, Any]] = []
        next_call = 0
        for step in range(30):
            if conversations and rng.random() < 0.75:
                conv = rng.choice(conversations)
                messages = list(conv["messages"])
                messages += [{"role": "tool", "tool_call_id": c, "content": "ok"} for c in conv["calls"] if rng.random() < 0.6]
                messages.append({"role": "user", "content": f"go {step}"})
            else:
                conv = {"messages": [], "calls": []}
                conversations.append(conv)
                messages = [{"role": "system", "content": rng.choice("abc")}, {"role": "user", "content": rng.choice(["search it", "p1", "p2"])}]
            calls = []
            for _ in range(rng.choice([0, 1, 2, 3, 40])):
                calls.append({"id": f"c{next_call}", "name": rng.choice(["Task", "Bash"]),
                              "arguments": {"prompt": rng.choice(["search it", "p1", "p2"])}})
                next_call += 1
            response: dict[str, Any] = {"role": "assistant", "content": f"r{step}"}
            if calls:
                response["tool_calls"] = calls
            declared = None
            if len(h._lineages) and rng.random() < 0.2:
                parent = rng.choice(list(h._lineages._threads))
                made = list(h._lineages._threads[parent].calls)
                declared = Declared(f"d{step}", parent=parent, call=rng.choice(made) if made and rng.random() < 0.7 else "")
            try:
                await h.record_turn(messages=messages, prompt_ids=[1, step + 2], output_ids=[5], output_log_probs=[-1.0],
                                    response_message=response, declared_lineage=declared)
            except LineageError:
                continue  # a declared call another lineage already claimed: refused, nothing recorded
            conv["messages"], conv["calls"] = messages + [response], [c["id"] for c in calls]
        return h._lineages, log

    return asyncio.run(run())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_a_resumed_session_rebuilds_every_lineages_pending_and_made_calls_as_the_live_tracker_holds_them(seed):
    """Resuming a session rebuilds its lineages from every durable turn: each lineage's calls still pending
    (what a later subagent is matched to) and the calls it made (what a declared subagent names) are the
    live tracker's, also where subagents claimed calls and where an answer made more calls than are kept."""
    live, log = _agent_with_subagents(seed)
    point = resume_points(log.read(), ["s"])["s"]
    rebuilt = LineageTracker()
    rebuilt.rebuild(point.lineage_turns.values(), point.lineage_origins, point.lineage_history)

    def kept(tracker: LineageTracker) -> dict[str, tuple]:
        return {k: (tuple(t.pending), dict(t.calls), t.last_turn, t.first) for k, t in tracker._threads.items()}

    assert kept(rebuilt) == kept(live)


def test_a_resumed_session_takes_a_subagent_declared_by_an_earlier_call_as_the_live_one_does():
    live, rebuilt = live_and_rebuilt()
    declared = Declared("A", parent="main", call="call_t1")
    live.check(declared)
    rebuilt.check(declared)


def test_a_resumed_session_matches_a_subagent_to_an_earlier_pending_call_as_the_live_one_does():
    live, rebuilt = live_and_rebuilt()
    first = TurnRecorded(turn_index=2, messages=[{"role": "system", "content": "sub"},
                                                 {"role": "user", "content": "research the history of the parser module"}],
                         prompt_ids=[7, 8], output_ids=[9], output_log_probs=[-1.0], response_message={"role": "assistant", "content": "x"})
    digests = EncodingContext().digests_for(first.messages)
    assert rebuilt.place(first, digests, False) == live.place(first, digests, False)
