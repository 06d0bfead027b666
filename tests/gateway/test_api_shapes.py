"""Request shapes real clients send, and the canonical-message round trip the trajectory tree relies on."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.gateway import ByteChatTemplate, ChatCompletionsAPI, HermesToolParser, MessagesAPI, ResponsesAPI, TurnResult, ToolSpec
from agentlog.gateway.chat import assistant_message

# Trimmed from what Claude Code 2.1 sent on the wire (POST /v1/messages?beta=true).
CLAUDE_CODE_BODY = {
    "model": "claude-opus-4-8",
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
        {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>\n\n"}, {"type": "text", "text": "run ls", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Available agent types: ..."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.txt"}]}, {"type": "text", "text": "<system-reminder>r</system-reminder>"}]},
    ],
    "tools": [
        {"name": "Bash", "description": "Executes a bash command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ],
    "metadata": {"user_id": "{}"},
    "max_tokens": 64000,
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "stream": True,
}

# Trimmed from what Codex 0.171 sent (POST /v1/responses).
CODEX_BODY = {
    "model": "gpt-4.1",
    "stream": True,
    "input": [
        {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [{"type": "namespace", "name": "functions", "tools": [{"type": "custom", "name": "exec", "description": "JS", "format": {}}]}]},
        {"type": "message", "id": "msg_1", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "id": "msg_2", "role": "user", "content": [{"type": "input_text", "text": "run ls"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xx"},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": "{\"cmd\":  \"ls\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
    ],
    "tools": [
        {"type": "function", "name": "exec_command", "strict": False, "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}]},
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "low", "context": "all_turns"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "k",
    "text": {"verbosity": "low"},
    "client_metadata": {"turn_id": "t"},
}


def test_claude_code_request_normalises_to_canonical_messages():
    req = MessagesAPI.parse(CLAUDE_CODE_BODY)
    assert req.stream and req.max_tokens == 64000
    assert [t.name for t in req.tools] == ["Bash"]  # the server tool is not the model's
    assert req.messages == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.197;You are a Claude agent."},
        {"role": "user", "content": "<system-reminder>ctx</system-reminder>\n\nrun ls"},
        {"role": "system", "content": "Available agent types: ..."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "name": "Bash", "arguments": {"command": "ls"}}]},
        {"role": "tool", "content": "a.txt", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "<system-reminder>r</system-reminder>"},
    ]


def test_codex_request_normalises_to_canonical_messages_and_tools():
    req = ResponsesAPI.parse(CODEX_BODY)
    assert req.stream
    names = {(t.namespace, t.name, t.kind) for t in req.tools}
    assert names == {("", "exec_command", "function"), ("multi_agent_v1", "spawn_agent", "function"), ("functions", "exec", "custom")}
    assert req.messages == [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "run ls"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "exec_command", "arguments": {"cmd": "ls"}}]},
        {"role": "tool", "content": "a.txt", "tool_call_id": "call_1"},
    ]


_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
_args = st.dictionaries(st.text("abcxyz", min_size=1, max_size=5), st.one_of(st.integers(-5, 5), _text, st.booleans()), max_size=3)
_calls = st.lists(st.tuples(st.sampled_from(["Bash", "get_weather"]), _args), max_size=3)


def _result(content: str, calls: list, prefix: str) -> TurnResult:
    tcs = [{"id": f"{prefix}{i}", "name": n, "arguments": a} for i, (n, a) in enumerate(calls)]
    return TurnResult("r1", "m", content, tcs, "stop", 3, 4)


def _through_json(obj):
    return json.loads(msgspec.json.encode(obj))


@settings(max_examples=60, deadline=None)
@given(content=_text, calls=_calls)
def test_echoed_response_normalises_to_the_recorded_response_message_in_every_api(content, calls):
    """Turn n+1 routes under turn n only if the client's echo of our answer
    normalises to exactly the response_message we recorded."""
    tools = [ToolSpec("Bash"), ToolSpec("get_weather")]
    user = {"role": "user", "content": "q"}
    # Chat Completions: the client echoes choices[0].message
    res = _result(content, calls, "call_")
    expected = assistant_message(res.content, res.tool_calls)
    echoed = _through_json(ChatCompletionsAPI.render(res, None))["choices"][0]["message"]
    assert ChatCompletionsAPI.parse({"messages": [user, echoed]}).messages[1] == expected
    # Anthropic Messages: the client echoes the content blocks
    res = _result(content, calls, "toolu_")
    expected = assistant_message(res.content, res.tool_calls)
    blocks = _through_json(MessagesAPI.render(res, None))["content"]
    assert MessagesAPI.parse({"messages": [user, {"role": "assistant", "content": blocks}]}).messages[1] == expected
    # Responses: the client echoes the output items
    req = ResponsesAPI.parse({"input": "q", "tools": [{"type": "function", "name": t.name} for t in tools]})
    items = _through_json(ResponsesAPI.render(res, req))["output"]
    assert ResponsesAPI.parse({"input": [user] + items}).messages[1] == expected


@settings(max_examples=40, deadline=None)
@given(content=_text, inputs=st.lists(_text, max_size=3))
def test_an_echoed_custom_tool_call_normalises_to_the_recorded_one(content, inputs):
    """A Responses custom tool (Codex's apply_patch) is called with its input text, recorded as
    {"input": text} and sent back as the text alone: the echo parses to the recorded form again
    (it parsed to the bare text, so every such turn drifted and was left untrained)."""
    req = ResponsesAPI.parse({"input": "q", "tools": [{"type": "custom", "name": "apply_patch", "description": "patch"}]})
    res = TurnResult("r1", "m", content, [{"id": f"call_{i}", "name": "apply_patch", "arguments": {"input": t}} for i, t in enumerate(inputs)], "stop", 3, 4)
    items = _through_json(ResponsesAPI.render(res, req))["output"]
    assert {it["type"] for it in items} <= {"message", "custom_tool_call"}
    echoed = ResponsesAPI.parse({"input": [{"role": "user", "content": "q"}] + items}).messages[1]
    assert echoed == assistant_message(res.content, res.tool_calls)


@settings(max_examples=60, deadline=None)
@given(content=_text, calls=_calls)
def test_builtin_template_renders_an_echoed_turn_exactly_as_generated(content, calls):
    """What the Hermes parser reads back from generated text re-renders to the
    same token ids, so the next prompt extends the last one (CLEAN drift)."""
    parser = HermesToolParser()
    tpl = ByteChatTemplate(parser)
    text = tpl.render_body(content, [{"name": n, "arguments": a} for n, a in calls])
    out = tpl.encode_text(text) + [tpl.EOS]
    parsed = parser.parse(tpl.decode(out), [ToolSpec("Bash"), ToolSpec("get_weather")])
    assert not parsed.ill_formed
    msg = assistant_message(parsed.content, [{"id": f"c{i}", **c} for i, c in enumerate(parsed.tool_calls)])
    prompt = tpl.encode_prompt([{"role": "user", "content": "q"}], [])
    nxt = tpl.encode_prompt([{"role": "user", "content": "q"}, msg, {"role": "user", "content": "more"}], [])
    assert nxt[: len(prompt) + len(out)] == prompt + out


def test_hermes_parser_flags_ill_formed_calls_with_a_reason():
    p = HermesToolParser()
    tools = [ToolSpec("Bash")]
    cases = {
        '<tool_call>{"name": "Bash", "arguments": {</tool_call>': "invalid JSON",
        '<tool_call>{"arguments": {}}</tool_call>': "string 'name'",
        '<tool_call>{"name": "Rm", "arguments": {}}</tool_call>': "unknown tool",
        '<tool_call>{"name": "Bash", "arguments": [1]}</tool_call>': "object 'arguments'",
        'text <tool_call>{"name": "Bash", "arguments": {}}': "unterminated",
        # Valid JSON the log cannot hold: the turn is recorded as the text the model wrote (it was a 500, the turn lost).
        '<tool_call>{"name": "Bash", "arguments": {"n": 100000000000000000000}}</tool_call>': "cannot record",
        '<tool_call>{"name": "Bash", "arguments": {"command": "\\ud800"}}</tool_call>': "cannot record",
    }
    for text, reason in cases.items():
        out = p.parse(text, tools)
        assert out.ill_formed and reason in out.error and out.tool_calls == [] and out.content == text
    ok = p.parse('hi <tool_call>{"name": "Bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>', tools)
    assert not ok.ill_formed and ok.tool_calls == [{"name": "Bash", "arguments": {"command": "ls"}}] and ok.content == "hi "


def test_hf_template_passes_canonical_messages_and_tools_to_the_tokenizer_template():
    from agentlog.gateway import HFChatTemplate

    class Tok:  # stands in for a transformers tokenizer: records what the template gets
        eos_token_id = 2

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
            self.seen = (messages, tools, add_generation_prompt, tokenize)
            return [1, 5, 6]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(96 + i) for i in ids if not (skip_special_tokens and i == 2))

    tok = Tok()
    tpl = HFChatTemplate(tok)
    msgs = [{"role": "user", "content": "q"}, assistant_message("", [{"id": "c1", "name": "Bash", "arguments": {"command": "ls"}}]), {"role": "tool", "content": "a", "tool_call_id": "c1"}]
    assert tpl.encode_prompt(msgs, [ToolSpec("Bash", "run", {"type": "object"})]) == [1, 5, 6]
    seen_msgs, tools, gen_prompt, tokenize = tok.seen
    assert gen_prompt and tokenize and tools == [{"type": "function", "function": {"name": "Bash", "description": "run", "parameters": {"type": "object"}}}]
    assert seen_msgs[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}]
    assert seen_msgs[2] == {"role": "tool", "content": "a", "tool_call_id": "c1", "name": "Bash"}  # named after its call
    assert tpl.stop_ids == (2,) and tpl.decode([1, 2, 3]) == "ac"


_text = st.text(max_size=20)
_calls = st.lists(st.fixed_dictionaries({
    "id": st.text(min_size=1, max_size=8), "name": st.sampled_from(["bash", "edit"]),
    "arguments": st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), _text), max_size=3)}), max_size=3)
_message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _text),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, **({"tool_calls": calls} if calls else {})}, _text, _calls),
    st.builds(lambda c, i: {"role": "tool", "content": c, "tool_call_id": i}, _text, st.text(min_size=1, max_size=8)),
)


@given(st.lists(_message, min_size=1, max_size=6))
def test_recorded_messages_sent_again_by_a_chat_client_parse_back_to_themselves(messages):
    """What a resumed agent sends (the recorded conversation in the Chat Completions wire
    shape) parses back to the very messages recorded, so its prompt re-encodes exactly."""
    canonical = [assistant_message(m["content"], m.get("tool_calls")) if m["role"] == "assistant" else m for m in messages]
    again = ChatCompletionsAPI.parse({"model": "m", "messages": ChatCompletionsAPI.client_messages(canonical)})
    assert again.messages == canonical
