"""turn_delta: a session recorded as deltas reduces to the same samples and
digest as the same session recorded with full prompts; an old reader stops on
it with a schema error instead of misreading it."""

from __future__ import annotations

import asyncio
from typing import Any, Union

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reduce_streams import RandomStream

from agentlog.engine.core import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.turn_delta import TurnContext, message_digests
from agentlog.events.schema.types import (
    EVENT_TYPES,
    Envelope,
    TurnDelta,
    TurnRecorded,
    UnknownEvent,
    encode_body,
)
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.errors import UnknownEventError
from agentlog.reducers.pipeline import Reducer, reduce_log, session_trajectory
from agentlog.reducers.samples import encode_sample

seeds = st.integers(min_value=0, max_value=2**32 - 1)
configs = st.sampled_from(
    [ReduceConfig(), ReduceConfig(fork_threshold=0), ReduceConfig(fork_threshold=3, max_context_tokens=12, min_valid=1)]
)


def delta_log(full: MemoryLog) -> tuple[MemoryLog, int]:
    """The same log with every turn_recorded re-encoded as a turn_delta (what
    the engine writes), and how many turns shared a non-empty prefix."""
    out = MemoryLog(clock=lambda: 0)
    contexts: dict[str, TurnContext] = {}
    shared = 0
    for env in full.read(0):
        body = env.body
        if type(body) is TurnRecorded:
            ctx = contexts.get(env.session_id, TurnContext())
            delta = ctx.delta_of(body)
            # Round trip: the delta, stored and read back, expands to the very bytes of the full turn.
            stored = msgspec.msgpack.decode(encode_body(delta), type=TurnDelta)
            assert encode_body(ctx.expand(stored)) == encode_body(body)
            shared += delta.shared_tokens > 0 or delta.shared_messages > 0
            contexts[env.session_id] = TurnContext.after(body)
            body = delta
        out.append_batch([(env.session_id, env.session_seq, body)])
    return out, shared


@settings(max_examples=150, deadline=None)
@given(seeds, configs)
def test_delta_encoded_log_reduces_to_the_same_samples_and_digest(seed, config):
    # RandomStream sessions continue, branch (forks), rewrite the last
    # assistant message, retry, drift (REALIGN / FORK), go token-only and
    # finish with "length"; one config also cuts rows at 12 tokens.
    full = RandomStream(seed).log()
    deltas, _ = delta_log(full)
    a, b = reduce_log(full, config), reduce_log(deltas, config)
    assert [encode_sample(s) for s in b.samples] == [encode_sample(s) for s in a.samples]
    assert b.digest == a.digest
    for sid in {e.session_id for e in full.read(0)}:
        try:
            expected = session_trajectory(full.read(0), sid, config)
        except KeyError:
            continue
        assert session_trajectory(deltas.read(0), sid, config) == expected


def test_a_continuing_session_stores_only_the_new_tokens():
    system = [{"role": "system", "content": "s"}]
    prompt, msgs = list(range(50)), list(system)
    records: list[Any] = []
    for t in range(5):
        out = [1000 + t, 1001 + t]
        records.append(TurnRecorded(turn_index=t, messages=msgs, prompt_ids=prompt, output_ids=out, output_log_probs=[-0.5, -0.5],
                                    response_message={"role": "assistant", "content": f"r{t}"}))
        msgs = msgs + [{"role": "assistant", "content": f"r{t}"}, {"role": "tool", "content": f"t{t}"}]
        prompt = prompt + out + [7, 8, 9]
    ctx = TurnContext()
    for body in records:
        delta = ctx.delta_of(body)
        if body.turn_index:
            assert len(delta.new_prompt_ids) // 4 == 3  # the tool output only
            assert [m["role"] for m in delta.new_messages] == ["tool"]
        ctx = TurnContext.after(body)


def test_a_rewritten_prompt_shares_a_shorter_prefix_and_stays_exact():
    first = TurnRecorded(turn_index=0, messages=[{"role": "user", "content": "a"}], prompt_ids=[1, 2, 3], output_ids=[4],
                         response_message={"role": "assistant", "content": "x"})
    # Same content, different encoding (1 == 1.0): must not count as shared.
    second = TurnRecorded(turn_index=1, messages=[{"role": "user", "content": "a", "n": 1.0}], prompt_ids=[9, 2, 3, 4],
                          output_ids=[5])
    ctx = TurnContext.after(first)
    delta = ctx.delta_of(second)
    assert (delta.shared_tokens, delta.shared_messages) == (0, 0)
    assert encode_body(ctx.expand(delta)) == encode_body(second)


def _engine_session(turns: list[dict[str, Any]]) -> tuple[MemoryLog, list[Any]]:
    """Record turns through the engine; returns its log and the handle's
    context after each turn and after the end."""

    async def go():
        log = MemoryLog(clock=lambda: 0)
        held = []
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        for kw in turns:
            await h.record_turn(**kw)
            held.append(h._context)
        await h.finish(reward=1.0)
        held.append(h._context)
        await eng.close()
        return log, held

    return asyncio.run(go())


def test_engine_writes_deltas_that_reduce_like_full_prompts_and_holds_only_the_last_context():
    turns = []
    prompt, msgs = [1, 2, 3], [{"role": "user", "content": "task"}]
    for t in range(4):
        out = [50 + t, 60 + t]
        turns.append(dict(messages=msgs, prompt_ids=prompt, output_ids=out, output_log_probs=[-0.1, -0.2],
                          response_message={"role": "assistant", "content": f"r{t}"}))
        msgs = msgs + [{"role": "assistant", "content": f"r{t}"}, {"role": "tool", "content": f"t{t}"}]
        prompt = prompt + out + [70 + t]
    turns[2]["prompt_ids"] = [9] + turns[2]["prompt_ids"][1:]  # a drifted prompt: shares nothing
    log, held = _engine_session(turns)
    bodies = [e.body for e in log.read(0)]
    assert [type(b) for b in bodies if type(b) in (TurnRecorded, TurnDelta)] == [TurnDelta] * 4
    full = MemoryLog(clock=lambda: 0)
    for e in log.read(0):
        b = e.body
        if type(b) is TurnDelta:
            b = TurnRecorded(turn_index=b.turn_index, **turns[b.turn_index])
        full.append_batch([(e.session_id, e.session_seq, b)])
    a, b = reduce_log(full, ReduceConfig(min_valid=1)), reduce_log(log, ReduceConfig(min_valid=1))
    assert a.samples and [encode_sample(s) for s in b.samples] == [encode_sample(s) for s in a.samples]
    assert a.digest == b.digest
    # O(current context): after each turn the engine holds that turn's prompt + output and messages + response only.
    for kw, ctx in zip(turns, held):
        assert ctx.tokens == TurnRecorded(turn_index=0, prompt_ids=kw["prompt_ids"], output_ids=kw["output_ids"]).prompt_ids + TurnRecorded(turn_index=0, output_ids=kw["output_ids"]).output_ids
        assert ctx.digests == message_digests(kw["messages"] + [kw["response_message"]])  # the messages, as digests
    assert held[-1] is None  # dropped when the session ended


# The schema-v1 union as it was before turn_delta: what an old reader decodes with.
_OLD_EVENT = Union[tuple(t for t in EVENT_TYPES if t is not TurnDelta)]  # type: ignore[misc]
_OLD_TAGS = frozenset(t.__struct_config__.tag for t in EVENT_TYPES if t is not TurnDelta)


def _old_decode_body(payload: bytes) -> Any:
    """decode_body of the code before turn_delta: an unknown tag -> UnknownEvent."""
    try:
        return msgspec.msgpack.Decoder(_OLD_EVENT).decode(payload)
    except msgspec.ValidationError:
        data = msgspec.msgpack.decode(payload)
        tag = data.pop("type")
        assert tag not in _OLD_TAGS, "an old reader must not know the tag"
        return UnknownEvent(tag, data)


def test_an_old_reader_stops_on_a_delta_with_a_schema_error_naming_the_event():
    log, _ = _engine_session([dict(messages=[{"role": "user", "content": "q"}], prompt_ids=[1, 2], output_ids=[3],
                                   output_log_probs=[-0.5], response_message={"role": "assistant", "content": "a"})])
    old = [Envelope(e.lsn, e.session_id, e.session_seq, e.ts_ns, _old_decode_body(encode_body(e.body))) for e in log.read(0)]
    assert [type(e.body).__name__ for e in old if e.session_seq == 2] == ["UnknownEvent"]
    assert not any(type(e.body) is TurnRecorded for e in old)  # never taken for a full prompt
    with pytest.raises(UnknownEventError) as err:
        Reducer(ReduceConfig(min_valid=1)).feed_many(old)
    assert err.value.tag == "turn_delta"
    assert "'turn_delta' is unknown" in str(err.value) and "upgrade agentlog" in str(err.value)


def test_a_live_session_in_the_reducer_holds_its_new_tokens_not_every_prompt():
    # 30 turns of a growing context: the full prompts sum to ~30x the final
    # context; the reducer must hold about one context's worth of tokens.
    prompt, turns = list(range(100)), []
    for t in range(30):
        out = list(range(1000 + 10 * t, 1010 + 10 * t))
        turns.append(TurnRecorded(turn_index=t, prompt_ids=prompt, output_ids=out, output_log_probs=[-0.5] * 10))
        prompt = prompt + out + [5] * 20
    ctx, log = TurnContext(), MemoryLog(clock=lambda: 0)
    from agentlog.events.schema.types import SessionOpened, SessionStarted

    records: list[Any] = [SessionOpened(group_id="g", group_size=1), SessionStarted()]
    for body in turns:
        records.append(ctx.delta_of(body))
        ctx = TurnContext.after(body)
    log.append_batch([("s", i, b) for i, b in enumerate(records)])
    reducer = Reducer(ReduceConfig(min_valid=1))
    reducer.feed_many(log.read(0))
    traj = reducer._sessions["s"].trajectory
    held = sum(len(getattr(t.body, "prompt_ids", b"")) + len(getattr(t.body, "new_prompt_ids", b"")) + len(t.body.output_ids)
               for t in traj._turns.values())
    final_context = len(turns[-1].prompt_ids) + len(turns[-1].output_ids)
    assert held == final_context  # each token once
    assert traj._context.tokens == b""  # the expansion context keeps messages and a count only
