"""The engine's compact encoding context: the same deltas as the reader's full
context for any sequence of turns, and a live session that holds its token
bytes and message digests, not its messages."""

from __future__ import annotations

import asyncio
import gc
import os
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine.core import SessionEngine
from agentlog.events import FileLog, MemoryLog
from agentlog.events.schema.turn_delta import DIGEST_BYTES, EncodingContext, ExtendedPrompt, TurnContext, common_prefix_tokens, message_digests
from agentlog.events.schema.types import TurnRecorded, encode_body

# A small alphabet, so consecutive prompts share prefixes of every length.
tokens = st.lists(st.integers(min_value=-3, max_value=3), max_size=12)
# Values that compare equal but encode differently (1, 1.0, True) must not count as shared.
contents = st.sampled_from(["a", "b", "", 1, 1.0, True, None, [1], {"k": "v"}])
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"]), "content": contents}), max_size=4)


@st.composite
def sessions(draw: Any) -> list[TurnRecorded]:
    """Turns whose prompts extend, cut or rewrite the previous turn's prompt +
    output, and whose messages repeat, extend or change the previous ones."""
    turns: list[TurnRecorded] = []
    prompt: list[int] = draw(tokens)
    msgs: list[Any] = draw(messages)
    for t in range(draw(st.integers(min_value=1, max_value=6))):
        output = draw(tokens)
        response = draw(st.one_of(st.none(), st.fixed_dictionaries({"role": st.just("assistant"), "content": contents})))
        turns.append(TurnRecorded(turn_index=t, messages=msgs, prompt_ids=prompt, output_ids=output, response_message=response))
        context = prompt + output
        how = draw(st.sampled_from(["extend", "cut", "rewrite", "fresh"]))
        if how == "extend":
            prompt = context + draw(tokens)
        elif how == "cut":
            prompt = context[: draw(st.integers(min_value=0, max_value=len(context)))]
        elif how == "rewrite" and context:
            i = draw(st.integers(min_value=0, max_value=len(context) - 1))
            prompt = context[:i] + [context[i] + 1] + context[i + 1 :]
        else:
            prompt = draw(tokens)
        held = msgs + ([response] if response is not None else [])
        # A new request is parsed anew: equal messages, never the same objects.
        msgs = [dict(m) for m in held[: draw(st.integers(min_value=0, max_value=len(held)))]] + draw(messages)
    return turns


@settings(max_examples=300, deadline=None)
@given(sessions())
def test_the_compact_context_encodes_every_turn_as_the_full_context_does(turns):
    full, compact = TurnContext(), EncodingContext()
    for turn in turns:
        expected = full.delta_of(turn)
        delta, after = compact.encode(turn)
        assert encode_body(delta) == encode_body(expected)  # the stored bytes do not change
        assert full.expand(delta) == turn
        full, compact = TurnContext.after(turn), after
        assert compact.tokens == full.tokens


@settings(max_examples=300, deadline=None)
@given(tokens, tokens)
def test_common_prefix_tokens_counts_the_leading_tokens_two_arrays_share(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    pa, pb = (np.asarray(x, dtype="<i4").tobytes() for x in (a, b))
    assert common_prefix_tokens(pa, pb) == n == common_prefix_tokens(pb, pa)
    assert EncodingContext(pa[: len(pa) // 2 // 4 * 4], pa[len(pa) // 2 // 4 * 4 :]).shared_tokens(pb) == n


def test_a_live_session_holds_its_token_bytes_and_message_digests_not_its_messages(tmp_path):
    # 20 live sessions, each at an 8k-token context whose messages hold 32 kB of
    # text: the engine keeps the 32 kB of token ids and 16 bytes a message.
    # A warm-up session first: what the first turn of a process builds once (lazy
    # imports, the schema's cached encoders) is not memory a live session holds,
    # and whether an earlier test in this worker built it is down to the order.
    n, context = 20, 8192

    async def go() -> float:
        log = FileLog.open(tmp_path / "log", fsync="never")
        eng = await SessionEngine.open(log, checkpoint_every=0)

        async def live_session(name: str) -> Any:
            h = await eng.open_session(name, group_id=f"g-{name}", group_size=1)
            await h.start()
            text = [{"role": "user", "content": os.urandom(2048).hex()} for _ in range(8)]  # 32 kB
            ids = np.random.randint(0, 50_000, size=context - 64, dtype=np.int32).tobytes()
            await h.record_turn(messages=text, prompt_ids=ids, output_ids=list(range(64)), response_message={"role": "assistant", "content": os.urandom(64).hex()})
            return h

        handles = [await live_session("warm-up")]
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(n):
                handles.append(await live_session(f"s{i}"))
            gc.collect()
            held = (tracemalloc.get_traced_memory()[0] - before) / n
        finally:
            tracemalloc.stop()
        await eng.close()
        log.close()
        return held

    held = asyncio.run(go())
    assert 4 * context <= held < 4 * context + 6 * 1024, f"{held:.0f} bytes held per live session"


@st.composite
def frozen_sessions(draw: Any) -> list[tuple[TurnRecorded, bool]]:
    """Turns, each recorded frozen or not, whose messages repeat the previous
    turn's message objects themselves (in place, shifted, twice), equal
    copies of them, or new messages: the cases identity could get wrong."""
    turns: list[tuple[TurnRecorded, bool]] = []
    prompt: list[int] = draw(tokens)
    msgs: list[Any] = draw(messages)
    for t in range(draw(st.integers(min_value=1, max_value=6))):
        output = draw(tokens)
        response = draw(st.one_of(st.none(), st.fixed_dictionaries({"role": st.just("assistant"), "content": contents})))
        turn = TurnRecorded(turn_index=t, messages=msgs, prompt_ids=prompt, output_ids=output, response_message=response)
        turns.append((turn, draw(st.booleans())))
        prompt = prompt + output + draw(tokens)
        held = msgs + ([response] if response is not None else [])
        keep = held[: draw(st.integers(min_value=0, max_value=len(held)))]
        how = draw(st.sampled_from(["same", "same", "copies", "shifted", "doubled"]))
        if how == "copies":
            keep = [dict(m) for m in keep]
        elif how == "shifted" and held:
            keep = [draw(st.sampled_from(held))] + keep
        elif how == "doubled":
            keep = keep + keep
        msgs = keep + draw(messages)
    return turns


@settings(max_examples=300, deadline=None)
@given(frozen_sessions())
def test_frozen_messages_reuse_digests_and_encode_every_turn_as_hashing_all_does(turns):
    # The fast path (a repeated object reuses its digest) and full hashing
    # store the same bytes and leave the same context, turn after turn.
    hashing, reusing = EncodingContext(), EncodingContext()
    for turn, frozen in turns:
        expected, hashing = hashing.encode(turn)
        delta, reusing = reusing.encode(turn, frozen=frozen)
        assert encode_body(delta) == encode_body(expected)
        assert reusing.digests == hashing.digests and reusing.tokens == hashing.tokens
        # What a frozen turn holds are the very objects it was given, one a digest.
        held = turn.messages + ([turn.response_message] if turn.response_message is not None else [])
        assert list(reusing.objects) == (held if frozen else [])
        assert all(a is b for a, b in zip(reusing.objects, held))


@settings(max_examples=40, deadline=None)
@given(frozen_sessions())
def test_the_engine_records_the_same_events_with_and_without_frozen_messages(turns):
    def record(frozen: bool) -> list[bytes]:
        return _recorded_bodies([dict(messages=turn.messages, prompt_ids=turn.prompt_ids, output_ids=turn.output_ids,
                                      response_message=turn.response_message, frozen_messages=frozen) for turn, _ in turns])

    assert record(True) == record(False)


def _recorded_bodies(turns: list[dict[str, Any]]) -> list[bytes]:
    """The stored bytes of each turn an engine records for one session, given ``record_turn``'s keywords per turn."""
    async def go() -> list[bytes]:
        eng = await SessionEngine.open(MemoryLog(), checkpoint_every=0)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        out = [encode_body((await h.record_turn(**kwargs)).body) for kwargs in turns]
        await h.finish()
        await eng.close()
        return out

    return asyncio.run(go())


def test_a_frozen_turn_hashes_only_its_new_messages(monkeypatch):
    import agentlog.events.schema.turn_delta as turn_delta

    hashed: list[Any] = []
    real = turn_delta.message_digests
    monkeypatch.setattr(turn_delta, "message_digests", lambda ms: real(hashed.extend(ms) or ms))
    history = [{"role": "user", "content": f"m{i}"} for i in range(50)]
    response = {"role": "assistant", "content": "ok"}
    _, ctx = EncodingContext().encode(TurnRecorded(turn_index=0, messages=history, response_message=response), frozen=True)
    hashed.clear()
    new = {"role": "tool", "content": "out"}
    ctx.encode(TurnRecorded(turn_index=1, messages=history + [response, new]), frozen=True)
    assert hashed == [new]
    hashed.clear()
    # Without the promise, every message is hashed.
    ctx.encode(TurnRecorded(turn_index=1, messages=history + [response, new]))
    assert len(hashed) == 52


# -- prompts built as an ExtendedPrompt of the previous prompt --------------------------------------


@st.composite
def extended_sessions(draw: Any) -> list[tuple[Any, list[int]]]:
    """Per turn: how its prompt is built from the previous turn's prompt bytes
    (keep a prefix of them, of any length, then a tail; or whole, no proof),
    and its output."""
    turns = []
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        how = draw(st.one_of(st.none(), st.tuples(st.floats(0, 1), tokens)))
        turns.append((how, draw(tokens)))
    return turns


def _packed(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


@settings(max_examples=300, deadline=None)
@given(extended_sessions(), st.booleans())
def test_a_prompt_built_as_an_extended_prompt_encodes_as_its_bytes_do(turns, same_base):
    """With the proof (its base the held prompt itself, or an equal copy that
    proves nothing), every turn's delta and context equal those of the same
    prompt given as plain bytes."""
    proven, plain = EncodingContext(), EncodingContext()
    previous = _packed([1, 2, 3])
    for t, (how, output) in enumerate(turns):
        if how is None:
            prompt, proof = _packed([7] * t), None
        else:
            frac, tail = how
            base = previous if same_base else bytes(bytearray(previous))
            proof = ExtendedPrompt(base, int(len(base) // 4 * frac) * 4, _packed(tail))
            prompt = proof.packed
        turn = TurnRecorded(turn_index=t, prompt_ids=prompt, output_ids=output)
        expected, plain = plain.encode(turn)
        delta, proven = proven.encode(turn, proof=proof)
        assert encode_body(delta) == encode_body(expected)
        assert proven.tokens == plain.tokens
        previous = prompt


def test_the_bytes_an_extended_prompt_kept_of_the_held_prompt_are_not_compared(monkeypatch):
    import agentlog.events.schema.turn_delta as turn_delta

    compared: list[int] = []
    real = turn_delta._shared_bytes
    monkeypatch.setattr(turn_delta, "_shared_bytes", lambda held, new, offset: compared.append(len(held)) or real(held, new, offset))
    first = _packed(list(range(100_000)))
    _, ctx = EncodingContext().encode(TurnRecorded(turn_index=0, prompt_ids=first, output_ids=_packed([5, 6])))
    proof = ExtendedPrompt(first, len(first) - 8, _packed([99_998, 99_999, 5, 6, 7]))
    delta, _ = ctx.encode(TurnRecorded(turn_index=1, prompt_ids=proof.packed), proof=proof)
    assert delta.shared_tokens == 100_002 and delta.new_prompt_ids == _packed([7])
    assert max(compared) <= 8  # the kept 399,992 bytes were taken as proven
    compared.clear()
    ctx.encode(TurnRecorded(turn_index=1, prompt_ids=proof.packed))  # without the proof: compared whole
    assert max(compared) == len(first)


def test_an_extended_prompt_is_built_only_from_whole_tokens_and_is_read_only():
    base = _packed([1, 2, 3])
    with pytest.raises(ValueError, match="whole number of its int32 tokens"):
        ExtendedPrompt(base, 13, b"")
    with pytest.raises(ValueError, match="whole number of its int32 tokens"):
        ExtendedPrompt(bytearray(base), 4, b"")
    with pytest.raises(ValueError, match="not whole int32 tokens"):
        ExtendedPrompt(base, 4, b"\x01\x02")
    p = ExtendedPrompt(base, 8, _packed([9]))
    assert p.packed == _packed([1, 2, 9]) and p.base is base
    with pytest.raises(AttributeError, match="read-only"):
        p.packed = base
    with pytest.raises(AttributeError, match="read-only"):
        del p.base


@settings(max_examples=40, deadline=None)
@given(extended_sessions())
def test_the_engine_records_the_same_events_given_an_extended_prompt_or_its_bytes(turns):
    prompts: list[Any] = []
    previous = _packed([1])
    for t, (how, _output) in enumerate(turns):
        prompt: Any = _packed([t])
        if how is not None:
            prompt = ExtendedPrompt(previous, int(len(previous) // 4 * how[0]) * 4, _packed(how[1]))
        prompts.append(prompt)
        previous = prompt.packed if isinstance(prompt, ExtendedPrompt) else prompt

    def record(proven: bool) -> list[bytes]:
        return _recorded_bodies([dict(prompt_ids=p if proven else getattr(p, "packed", p), output_ids=output)
                                 for p, (_how, output) in zip(prompts, turns)])

    assert record(True) == record(False)


def test_message_digests_stop_at_the_first_message_msgpack_cannot_hold():
    """As its docstring says, for every reason msgpack refuses a value (it raised OverflowError
    and UnicodeEncodeError through the engine's turn path: a 500 and the generation lost)."""
    ok = {"role": "user", "content": "hi"}
    for bad in ({"role": "user", "content": "\ud800"}, {"role": "tool", "content": "", "n": 2**70}, {"role": "user", "content": object()}):
        assert message_digests([ok, bad, ok]) == message_digests([ok])
        assert len(message_digests([ok, bad, ok])) == DIGEST_BYTES


def test_a_context_is_never_walked_by_the_cyclic_collector():
    """A live session holds its last turn's context for as long as it runs: untracked, the contexts of
    thousands of sessions in flight cost a full collection nothing. It holds bytes and the caller's
    frozen message objects (tracked themselves), never anything that refers back to it."""
    import gc

    history = [{"role": "user", "content": "hi"}]
    _, ctx = EncodingContext().encode(TurnRecorded(turn_index=0, messages=history, response_message={"role": "assistant", "content": "ok"}), frozen=True)
    assert ctx.objects and not gc.is_tracked(ctx)
