"""Incremental prompt encoding (gateway/prompt_cache.py): a session's next
prompt, encoded from its previous one, equals a full encode token for token,
whatever the conversation does (grows, rewrites its history, changes its
tools, re-renders earlier messages), with the built-in template and with
Hugging Face tokenizers built in code."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events.schema.turn_delta import ExtendedPrompt
from agentlog.gateway.chat import ByteChatTemplate, HFChatTemplate, ToolSpec, assistant_message
from agentlog.gateway.prompt_cache import PromptCache

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOOLS = [ToolSpec("bash", "run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})]
OTHER_TOOLS = [ToolSpec("read", "read a file", {"type": "object", "properties": {"path": {"type": "string"}}})]

# Text that stresses the joins: the templates' own markers and added tokens,
# whitespace at both ends, non-ASCII.
_pieces = st.sampled_from(["ls", " ", "\n", "def add(a, b):", "<|im_start|>", "<|im_end|>", "<tool_call>",
                           "</tool_response>", "é", "  x", "\t", "assistant", "{\"a\": 1}", "▁y"])
_text = st.lists(_pieces, max_size=6).map("".join)
_args = st.sampled_from([{"command": "ls"}, {"command": 1}, {"command": 1.0}, {"command": True},
                         {"a": 1, "b": 2}, {"b": 2, "a": 1}, "not json"])


@st.composite
def _step(draw, index: int):
    """What happens between two requests: the assistant's answer (as recorded,
    or as echoed changed), tool results or a user message; sometimes a
    rewritten history or other tools."""
    calls = [{"id": f"c{index}_{j}", "name": "bash", "arguments": draw(_args)} for j in range(draw(st.integers(0, 2)))]
    response = assistant_message(draw(_text), calls)
    echoed = response if draw(st.booleans()) else assistant_message(draw(_text), calls)
    new = [{"role": "tool", "content": draw(_text), "tool_call_id": c["id"]} for c in calls]
    if not calls or draw(st.booleans()):
        new.append({"role": "user", "content": draw(_text)})
    return {"response": response, "echoed": echoed, "new": new, "rewrite": draw(st.integers(0, 6)),
            "tools": draw(st.sampled_from([TOOLS, TOOLS, TOOLS, OTHER_TOOLS, []]))}


@st.composite
def _conversation(draw):
    first = [{"role": "system", "content": draw(_text)}] if draw(st.booleans()) else []
    first.append({"role": "user", "content": draw(_text)})
    return first, [draw(_step(i)) for i in range(draw(st.integers(1, 6)))]


def _play(template, first, steps, check):
    """Encode a conversation turn by turn through one PromptCache; ``check``
    gets each request and its encode. Returns how many were incremental."""
    cache = PromptCache()
    messages, tools = first, TOOLS
    incremental = 0
    last = None
    for step in steps + [None]:
        prompt = cache.encode(template, [dict(m) for m in messages], tools)  # fresh objects, as a request decodes
        check(messages, tools, prompt)
        incremental += prompt.incremental
        if prompt.incremental:
            # Built from the very bytes recorded last turn, which the engine holds: those it kept are not compared again.
            assert type(prompt.recorded) is ExtendedPrompt and prompt.recorded.packed is prompt.packed
            assert last is not None and prompt.recorded.base is last.packed
        else:
            assert prompt.recorded is prompt.packed
        last = prompt
        if step is None:
            break
        cache.remember(prompt, step["response"])
        messages = messages + [step["echoed"]] + step["new"]
        if step["rewrite"] == 0 and len(messages) > 1:  # an agent that rewrites (compacts) its history
            messages = [messages[0], {"role": "user", "content": "summary"}] + messages[-1:]
        elif step["rewrite"] == 1:
            tools = step["tools"]
    return incremental


def _equals_full(template):
    def check(messages, tools, prompt):
        assert prompt.ids.tolist() == template.encode_prompt(messages, tools)
        assert prompt.packed == np.asarray(template.encode_prompt(messages, tools), dtype="<i4").tobytes()
    return check


@settings(max_examples=150, deadline=None)
@given(_conversation())
def test_builtin_template_incremental_encode_equals_a_full_encode(conv):
    _play(ByteChatTemplate(), *conv, _equals_full(ByteChatTemplate()))


def test_a_growing_conversation_is_encoded_incrementally_and_repeated_messages_are_the_recorded_objects():
    template = ByteChatTemplate()
    cache = PromptCache()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    first = cache.encode(template, msgs, TOOLS)
    assert not first.incremental
    response = assistant_message("", [{"id": "c1", "name": "bash", "arguments": {"command": "ls"}}])
    cache.remember(first, response)
    echoed = assistant_message("", [{"id": "c1", "name": "bash", "arguments": {"command": "ls"}}])
    nxt = [dict(m) for m in msgs] + [echoed, {"role": "tool", "content": "out", "tool_call_id": "c1"}]
    second = cache.encode(template, nxt, TOOLS)
    assert second.incremental
    assert second.ids.tolist() == template.encode_prompt(nxt, TOOLS)
    # The engine compares with its previous turn by identity first: the repeated
    # messages and the echoed response are the objects it recorded.
    assert second.messages[0] is first.messages[0] and second.messages[1] is first.messages[1]
    assert second.messages[2] is response and second.messages[3] is nxt[3]


def test_tools_msgpack_cannot_hold_are_encoded_whole_at_every_turn_never_refused():
    """Tools are never recorded, so a schema with an integer beyond 64 bits is the client's to
    send: the cache cannot key its reuse on them and encodes the prompt whole (it raised
    OverflowError, a 500 on every turn of the session)."""
    template = ByteChatTemplate()
    tools = [ToolSpec("bash", "run", {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**64}}})]
    cache = PromptCache()
    msgs = [{"role": "user", "content": "u"}]
    first = cache.encode(template, msgs, tools)
    cache.remember(first, assistant_message("ok"))
    nxt = msgs + [assistant_message("ok"), {"role": "user", "content": "again"}]
    second = cache.encode(template, nxt, tools)
    assert not second.incremental and second.ids.tolist() == template.encode_prompt(nxt, tools)
    assert first.ids.tolist() == template.encode_prompt(msgs, tools)


def test_an_argument_equal_but_not_identical_is_not_repeated():
    """``1 == 1.0 == True``, and dicts equal in another key order, render
    apart: such a message is new, and the prompt is what a full encode gives."""
    template = ByteChatTemplate()
    for was, now in [({"n": 1}, {"n": 1.0}), ({"n": 1}, {"n": True}), ({"a": 1, "b": 2}, {"b": 2, "a": 1})]:
        cache = PromptCache()
        msgs = [{"role": "user", "content": "u"}, assistant_message("", [{"id": "c", "name": "bash", "arguments": was}]),
                {"role": "tool", "content": "o", "tool_call_id": "c"}]
        cache.remember(cache.encode(template, msgs, TOOLS), assistant_message("ok"))
        changed = msgs[:1] + [assistant_message("", [{"id": "c", "name": "bash", "arguments": now}])] + msgs[2:] + [
            assistant_message("ok"), {"role": "user", "content": "again"}]
        prompt = cache.encode(template, changed, TOOLS)
        assert not prompt.incremental and prompt.messages[1] is changed[1]
        assert prompt.ids.tolist() == template.encode_prompt(changed, TOOLS)


# ---------------------------------------------------------------- Hugging Face tokenizers built in code


def _hf(variant: str):
    pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from agentlog.learner import hf_tiny

    if variant == "byte-level":
        return HFChatTemplate(hf_tiny.build_tokenizer())
    # A sentencepiece-like tokenizer: Metaspace marks the first piece of the
    # text only (prepend_scheme "first"), so a piece tokenized on its own
    # would differ from the same piece inside the whole text.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    specials = ["<unk>", hf_tiny.PAD, hf_tiny.BOS, hf_tiny.IM_START]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(hf_tiny._CORPUS * 4 + ["é ▁y\t"], trainer=trainer)
    # <|im_end|> swallows the whitespace after it: never a place to cut.
    tok.add_special_tokens([AddedToken(hf_tiny.IM_END, rstrip=True, normalized=False)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in hf_tiny.TOOL_TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=hf_tiny.BOS, eos_token=hf_tiny.IM_END,
                                   pad_token=hf_tiny.PAD, unk_token="<unk>", clean_up_tokenization_spaces=False)
    template = hf_tiny.CHAT_TEMPLATE
    if variant == "re-renders":
        # Like templates that drop old reasoning: an assistant message renders
        # differently once a later user message exists.
        template = template.replace("{{ m.content if m.content else '' }}",
                                    "{{ (m.content if m.content else '') if loop.index0 >= ns_last else '[old]' }}")
        template = template.replace("{% for m in messages %}",
                                    "{% set ns_last = messages | map(attribute='role') | list | length - 2 %}{% for m in messages %}", 1)
    fast.chat_template = template
    return HFChatTemplate(fast)


_HF = {}


def _hf_once(variant):
    if variant not in _HF:
        _HF[variant] = _hf(variant)
    return _HF[variant]


@pytest.mark.parametrize("variant", ["byte-level", "metaspace-rstrip", "re-renders"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=_conversation())
def test_hf_template_incremental_encode_equals_a_full_encode(variant, conv):
    template = _hf_once(variant)
    _play(template, *conv, _equals_full(template))


def test_hf_growing_conversation_is_encoded_incrementally():
    """The byte-level tiny tokenizer: a conversation that only grows is
    encoded from its previous prompt after the first turn; an added token
    that strips whitespace is never a cut point."""
    template = _hf_once("byte-level")
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "fix it"}]
    steps = [{"response": assistant_message("", [{"id": f"c{i}", "name": "bash", "arguments": {"command": "ls"}}]),
              "new": [{"role": "tool", "content": f"out {i}\n", "tool_call_id": f"c{i}"}], "rewrite": 6, "tools": TOOLS}
             for i in range(4)]
    for s in steps:
        s["echoed"] = s["response"]
    assert _play(template, first, steps, _equals_full(template)) == 4
    im_end = _hf_once("metaspace-rstrip").tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in _hf_once("metaspace-rstrip")._cut_ids and _hf_once("metaspace-rstrip")._cut_ids


def test_the_gateway_hashes_only_the_new_messages_of_a_growing_conversation(monkeypatch):
    """The gateway records its prompts frozen: the repeated messages, which
    the prompt cache hands on as the objects recorded before, keep their
    digests, and a turn hashes its new message and its response only."""
    import agentlog.events.schema.turn_delta as turn_delta

    from gateway_helpers import oa_client, open_running, rig, run, turns_of

    hashed: list[int] = []
    real = turn_delta.message_digests
    monkeypatch.setattr(turn_delta, "message_digests", lambda ms: real(ms if hashed.append(len(ms)) else ms))

    async def body() -> None:
        async with rig() as (gw, engine, log):
            h = await open_running(engine, "s-frozen")
            client = oa_client(gw, "s-frozen")
            msgs: list = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
            for k in range(3):
                hashed.clear()
                r = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=1.0)
                msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"more {k}"}]
            # Turn 3: five messages, of which the new user message is hashed, then the response.
            assert hashed == [1, 1]
            await h.finish(reward=0.0)
            assert [len(t.messages) for t in turns_of(log, "s-frozen")] == [2, 4, 6]

    run(body())
