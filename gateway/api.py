"""The three wire APIs: request bodies in, responses (JSON or SSE) out.

Each API class turns a decoded request body into one :class:`TurnRequest`
(canonical messages, declared tools, sampling overrides, stream flag) and a
finished :class:`TurnResult` back into that API's JSON body or its SSE event
stream. Nothing here touches the engine or a backend: it is pure shape
translation, so each direction can be tested on its own.

Unknown fields are ignored, never rejected: real clients send many
(``thinking``, ``context_management``, ``output_config``, ``reasoning``,
``client_metadata``...).
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from .sampling import SAMPLING_RULES
from .chat import RequestError, ToolSpec, assistant_message, canonical_arguments, custom_tool_arguments, text_of

_enc = msgspec.json.Encoder()

#: Client fields that override sampling, per API: wire name -> our name.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}

#: Integers a request may carry: what the log's encoding holds (64 bits).
_INT_MAX = 2**63 - 1


class TurnRequest(msgspec.Struct):
    """One generation request, whatever API it arrived through."""

    api: str
    model: str
    messages: list[dict[str, Any]]
    tools: list[ToolSpec]
    stream: bool = False
    max_tokens: int | None = None
    #: Sampling parameters the client set explicitly (recorded with the turn).
    overrides: dict[str, Any] = {}
    include_usage: bool = False


class TurnResult(msgspec.Struct):
    """A finished turn, ready to be rendered for the client."""

    id: str
    model: str
    content: str
    tool_calls: list[dict[str, Any]]  # {"id", "name", "arguments"}
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    created: int = 0


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + _enc.encode(data) + b"\n\n"


def _dumps(obj: Any) -> str:
    return obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for wire, ours in _SAMPLING_KEYS.items():
        value = body.get(wire)
        if value is None:
            continue
        usable, expected = SAMPLING_RULES[ours]  # the range a sampler can use
        if not usable(value):
            raise RequestError(wire, expected, value)
        out[ours] = value
    # Stop strings are recorded as asked; no backend here honours them (the
    # template's stop ids end a turn), so the gateway records them as ignored.
    stop = body.get("stop", body.get("stop_sequences"))
    if stop:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise RequestError("stop" if "stop" in body else "stop_sequences", "a string or a list of strings", stop)
        out["stop"] = stop
    return out


def _tool_items(items: Any, where: str, what: str = "tool") -> list[dict[str, Any]]:
    """The tool definitions (or tool calls: ``what``) at ``where``: absent is none; anything but
    a list of objects is a RequestError (never silently read as none, nor a string's characters)."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise RequestError(where, f"a list of {what} objects", items)
    for i, t in enumerate(items):
        if not isinstance(t, dict):
            raise RequestError(f"{where}[{i}]", f"a {what} object", t)
    return items


def _max_tokens(body: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT_MAX:
            raise RequestError(key, "an int >= 1 within 64 bits", value)
        return value
    return None


def _require_list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise RequestError(key, "a list", value)
    return value


def _model(body: dict[str, Any]) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise RequestError("model", "a string", model)
    return model


def _stream(body: dict[str, Any]) -> bool:
    value = body.get("stream", False)
    if not isinstance(value, bool):
        raise RequestError("stream", "a boolean", value)
    return value


def _request(api: str, body: dict[str, Any], messages: list[dict[str, Any]], tools: list[ToolSpec],
             max_keys: tuple[str, ...], include_usage: bool = False) -> TurnRequest:
    """The TurnRequest of any API: the fields every API spells the same way."""
    return TurnRequest(
        api, _model(body), messages, tools, stream=_stream(body), max_tokens=_max_tokens(body, *max_keys),
        overrides=_sampling(body), include_usage=include_usage,
    )


class WireAPI:
    """A wire API: how one route's bodies become a TurnRequest and a TurnResult becomes its
    answer. Used as the class itself (every member is a static or class method)."""

    name = ""
    error_style = ""  # error_body's style: "openai" or "anthropic"

    @staticmethod
    def parse(body: dict[str, Any]) -> TurnRequest:
        """Body -> TurnRequest; RequestError names the offending field."""
        raise NotImplementedError

    @classmethod
    def render(cls, res: TurnResult, req: TurnRequest) -> dict[str, Any]:
        """The answer's JSON body."""
        raise NotImplementedError

    @classmethod
    def render_stream(cls, res: TurnResult, req: TurnRequest) -> list[bytes]:
        """The answer as server-sent events."""
        raise NotImplementedError


# ====================================================================== OpenAI Chat Completions


class ChatCompletionsAPI(WireAPI):
    """``POST /v1/chat/completions`` (OpenAI Chat Completions)."""

    name = "chat"
    error_style = "openai"

    @staticmethod
    def parse(body: dict[str, Any]) -> TurnRequest:
        """Body -> TurnRequest; RequestError names the offending field."""
        raw = _require_list(body, "messages")
        messages = []
        for i, m in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise RequestError(where, "a message object", m)
            role = m.get("role")
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant", "tool", "function"):
                raise RequestError(f"{where}.role", "system, developer, user, assistant or tool", role)
            content = text_of(m.get("content"), f"{where}.content")
            if role == "assistant":
                calls = []
                for j, tc in enumerate(_tool_items(m.get("tool_calls"), f"{where}.tool_calls", "tool call")):
                    fn = tc.get("function")
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise RequestError(f"{where}.tool_calls[{j}].function", "an object with a string name", tc)
                    calls.append({"id": str(tc.get("id", "")), "name": fn["name"], "arguments": fn.get("arguments")})
                messages.append(assistant_message(content, calls))
            elif role in ("tool", "function"):
                messages.append({"role": "tool", "content": content, "tool_call_id": str(m.get("tool_call_id") or m.get("name") or "")})
            else:
                messages.append({"role": role, "content": content})
        tools = []
        for i, t in enumerate(_tool_items(body.get("tools"), "tools")):
            fn = t.get("function")
            if t.get("type", "function") != "function" or not isinstance(fn, dict):
                continue  # hosted tools are not the model's to call
            if not isinstance(fn.get("name"), str):
                raise RequestError(f"tools[{i}].function.name", "a string", fn.get("name"))
            tools.append(ToolSpec(fn["name"], str(fn.get("description") or ""), fn.get("parameters")))
        n = body.get("n", 1)
        if n not in (1, None):
            raise RequestError("n", "1 (one choice per recorded turn)", n)
        opts = body.get("stream_options") or {}
        usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        return _request("chat", body, messages, tools, ("max_completion_tokens", "max_tokens"), include_usage=usage)

    @staticmethod
    def client_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonical (recorded) messages as a Chat Completions client sends them, each tool call's
        arguments as the JSON text :meth:`render` gave it: a resumed client's conversation, which
        :meth:`parse` turns back into the very messages recorded."""
        def wire(m: dict[str, Any]) -> dict[str, Any]:
            calls = [{"id": tc["id"], "type": "function", "function": {"name": tc["name"], "arguments": _dumps(tc["arguments"])}}
                     for tc in m.get("tool_calls") or ()]
            return {**m, "tool_calls": calls} if calls and m.get("role") == "assistant" else dict(m)
        return [wire(m) for m in messages]

    @staticmethod
    def _finish(res: TurnResult) -> str:
        if res.tool_calls:
            return "tool_calls"
        return res.finish_reason

    @staticmethod
    def _usage(res: TurnResult) -> dict[str, int]:
        return {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
        }

    @classmethod
    def render(cls, res: TurnResult, req: TurnRequest) -> dict[str, Any]:
        """The non-streaming response body."""
        msg: dict[str, Any] = {"role": "assistant", "content": res.content}
        if res.tool_calls:
            msg["tool_calls"] = [
                {"id": tc["id"], "type": "function", "function": {"name": tc["name"], "arguments": _dumps(tc["arguments"])}}
                for tc in res.tool_calls
            ]
        return {
            "id": res.id,
            "object": "chat.completion",
            "created": res.created,
            "model": res.model,
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": cls._finish(res)}],
            "usage": cls._usage(res),
        }

    @classmethod
    def render_stream(cls, res: TurnResult, req: TurnRequest) -> list[bytes]:
        """The SSE chunks of a streamed response, ``[DONE]`` last."""
        base = {"id": res.id, "object": "chat.completion.chunk", "created": res.created, "model": res.model}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return _sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

        out = [chunk({"role": "assistant", "content": ""})]
        if res.content:
            out.append(chunk({"content": res.content}))
        for i, tc in enumerate(res.tool_calls):
            fn = {"name": tc["name"], "arguments": _dumps(tc["arguments"])}
            out.append(chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function", "function": fn}]}))
        out.append(chunk({}, cls._finish(res)))
        if req.include_usage:
            out.append(_sse({**base, "choices": [], "usage": cls._usage(res)}))
        out.append(b"data: [DONE]\n\n")
        return out


# ====================================================================== Anthropic Messages


class MessagesAPI(WireAPI):
    """``POST /v1/messages`` (Anthropic Messages; what Claude Code speaks)."""

    name = "messages"
    error_style = "anthropic"

    @staticmethod
    def parse(body: dict[str, Any]) -> TurnRequest:
        """Body -> TurnRequest; RequestError names the offending field."""
        messages: list[dict[str, Any]] = []
        system = body.get("system")
        if system:
            messages.append({"role": "system", "content": text_of(system, "system")})
        for i, m in enumerate(_require_list(body, "messages")):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise RequestError(where, "a message object", m)
            role = m.get("role")
            content = m.get("content")
            if role == "system":  # Claude Code puts mid-conversation system entries here
                messages.append({"role": "system", "content": text_of(content, f"{where}.content")})
            elif role == "assistant":
                blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
                if not isinstance(blocks, list):
                    raise RequestError(f"{where}.content", "a string or a list of blocks", content)
                calls = []
                texts = []
                for j, b in enumerate(blocks):
                    if isinstance(b, dict) and b.get("type") == "tool_use":
                        if not isinstance(b.get("name"), str):
                            raise RequestError(f"{where}.content[{j}].name", "a string", b.get("name"))
                        calls.append({"id": str(b.get("id", "")), "name": b["name"], "arguments": b.get("input")})
                    else:
                        texts.append(b)
                messages.append(assistant_message(text_of(texts, f"{where}.content"), calls))
            elif role == "user":
                if isinstance(content, str):
                    messages.append({"role": "user", "content": content})
                    continue
                if not isinstance(content, list):
                    raise RequestError(f"{where}.content", "a string or a list of blocks", content)
                # Keep block order: runs of text become one user message,
                # each tool_result its own tool message.
                run: list[Any] = []
                for j, b in enumerate(content):
                    if isinstance(b, dict) and b.get("type") == "tool_result":
                        if run:
                            messages.append({"role": "user", "content": text_of(run, f"{where}.content")})
                            run = []
                        text = text_of(b.get("content"), f"{where}.content[{j}].content")
                        if b.get("is_error"):
                            text = "[error] " + text
                        messages.append({"role": "tool", "content": text, "tool_call_id": str(b.get("tool_use_id", ""))})
                    else:
                        run.append(b)
                if run:
                    messages.append({"role": "user", "content": text_of(run, f"{where}.content")})
            else:
                raise RequestError(f"{where}.role", "user, assistant or system", role)
        tools = []
        for i, t in enumerate(_tool_items(body.get("tools"), "tools")):
            if "input_schema" not in t:
                continue  # server tools (web_search_*, ...) are not the model's to call
            if not isinstance(t.get("name"), str):
                raise RequestError(f"tools[{i}].name", "a string", t.get("name"))
            tools.append(ToolSpec(t["name"], str(t.get("description") or ""), t.get("input_schema")))
        return _request("messages", body, messages, tools, ("max_tokens",))

    @staticmethod
    def _stop_reason(res: TurnResult) -> str:
        if res.tool_calls:
            return "tool_use"
        return "max_tokens" if res.finish_reason == "length" else "end_turn"

    @staticmethod
    def _blocks(res: TurnResult) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if res.content or not res.tool_calls:
            blocks.append({"type": "text", "text": res.content})
        for tc in res.tool_calls:
            args = tc["arguments"]
            blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["name"], "input": args if isinstance(args, dict) else {"input": args}})
        return blocks

    @classmethod
    def render(cls, res: TurnResult, req: TurnRequest) -> dict[str, Any]:
        """The non-streaming response body."""
        return {
            "id": res.id,
            "type": "message",
            "role": "assistant",
            "model": res.model,
            "content": cls._blocks(res),
            "stop_reason": cls._stop_reason(res),
            "stop_sequence": None,
            "usage": {"input_tokens": res.prompt_tokens, "output_tokens": res.completion_tokens},
        }

    @classmethod
    def render_stream(cls, res: TurnResult, req: TurnRequest) -> list[bytes]:
        """The SSE events of a streamed response, ``message_stop`` last."""
        start = cls.render(res, req)
        start.update(content=[], stop_reason=None, usage={"input_tokens": res.prompt_tokens, "output_tokens": 0})
        out = [_sse({"type": "message_start", "message": start}, "message_start"), _sse({"type": "ping"}, "ping")]
        for i, block in enumerate(cls._blocks(res)):
            if block["type"] == "text":
                first = {"type": "text", "text": ""}
                delta = {"type": "text_delta", "text": block["text"]}
            else:
                first = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            out.append(_sse({"type": "content_block_start", "index": i, "content_block": first}, "content_block_start"))
            out.append(_sse({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta"))
            out.append(_sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
        out.append(
            _sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": cls._stop_reason(res), "stop_sequence": None},
                    "usage": {"output_tokens": res.completion_tokens},
                },
                "message_delta",
            )
        )
        out.append(_sse({"type": "message_stop"}, "message_stop"))
        return out


# ====================================================================== OpenAI Responses


def _responses_tools(items: Any, where: str, out: list[ToolSpec], namespace: str = "") -> None:
    for i, t in enumerate(_tool_items(items, where)):
        kind = t.get("type")
        if kind == "namespace":
            _responses_tools(t.get("tools"), f"{where}[{i}].tools", out, str(t.get("name") or ""))
        elif kind in ("function", "custom"):
            if not isinstance(t.get("name"), str):
                raise RequestError(f"{where}[{i}].name", "a string", t.get("name"))
            params = t.get("parameters") if kind == "function" else None
            out.append(ToolSpec(t["name"], str(t.get("description") or ""), params, kind, namespace))
        # web_search, file_search, local_shell...: hosted tools, not the model's to call


class ResponsesAPI(WireAPI):
    """``POST /v1/responses`` (OpenAI Responses API; what the Codex CLI speaks)."""

    name = "responses"
    error_style = "openai"

    @staticmethod
    def parse(body: dict[str, Any]) -> TurnRequest:
        """Body -> TurnRequest; RequestError names the offending field."""
        if body.get("previous_response_id"):
            # The gateway stores no responses: a continuation by reference
            # would silently lose the conversation it points to.
            raise RequestError("previous_response_id", "absent (send the whole conversation in input; the gateway stores no responses)", body["previous_response_id"])
        messages: list[dict[str, Any]] = []
        tools: list[ToolSpec] = []
        _responses_tools(body.get("tools"), "tools", tools)
        instructions = body.get("instructions")
        if instructions:
            messages.append({"role": "system", "content": text_of(instructions, "instructions")})
        items = body.get("input")
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        if not isinstance(items, list):
            raise RequestError("input", "a string or a list of input items", items)
        for i, it in enumerate(items):
            where = f"input[{i}]"
            if not isinstance(it, dict):
                raise RequestError(where, "an input item object", it)
            kind = it.get("type", "message")
            if kind == "message":
                role = it.get("role")
                if role == "developer":
                    role = "system"
                if role not in ("system", "user", "assistant"):
                    raise RequestError(f"{where}.role", "system, developer, user or assistant", role)
                content = text_of(it.get("content"), f"{where}.content")
                messages.append(assistant_message(content) if role == "assistant" else {"role": role, "content": content})
            elif kind in ("function_call", "custom_tool_call"):
                if not isinstance(it.get("name"), str):
                    raise RequestError(f"{where}.name", "a string", it.get("name"))
                args = canonical_arguments(it.get("arguments")) if kind == "function_call" else custom_tool_arguments(it.get("input"))
                call = {"id": str(it.get("call_id", "")), "name": it["name"], "arguments": args}
                # Calls follow the assistant message of the same turn; without
                # one (no text was produced) they form an empty-text message.
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append(assistant_message(""))
                messages[-1].setdefault("tool_calls", []).append(call)
            elif kind in ("function_call_output", "custom_tool_call_output"):
                output = it.get("output")
                text = output if isinstance(output, str) else text_of(output, f"{where}.output")
                messages.append({"role": "tool", "content": text, "tool_call_id": str(it.get("call_id", ""))})
            elif kind == "additional_tools":  # Codex declares tools as an input item
                _responses_tools(it.get("tools"), f"{where}.tools", tools)
            # reasoning, compaction and other bookkeeping items carry no prompt text
        return _request("responses", body, messages, tools, ("max_output_tokens",))

    @staticmethod
    def _items(res: TurnResult, tools: list[ToolSpec]) -> list[dict[str, Any]]:
        custom = {t.name for t in tools if t.kind == "custom"}
        items: list[dict[str, Any]] = []
        if res.content or not res.tool_calls:
            items.append(
                {
                    "id": f"msg_{res.id}",
                    "type": "message",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": res.content, "annotations": []}],
                }
            )
        for tc in res.tool_calls:
            if tc["name"] in custom:
                args = tc["arguments"]
                text = args.get("input", "") if isinstance(args, dict) else str(args)
                items.append({"id": f"ctc_{tc['id']}", "type": "custom_tool_call", "status": "completed", "call_id": tc["id"], "name": tc["name"], "input": text})
            else:
                items.append(
                    {
                        "id": f"fc_{tc['id']}",
                        "type": "function_call",
                        "status": "completed",
                        "call_id": tc["id"],
                        "name": tc["name"],
                        "arguments": _dumps(tc["arguments"]),
                    }
                )
        return items

    @classmethod
    def _response(cls, res: TurnResult, req: TurnRequest, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {
            "id": res.id,
            "object": "response",
            "created_at": res.created,
            "status": status,
            "model": res.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": res.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": res.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": res.prompt_tokens + res.completion_tokens,
            },
        }

    @classmethod
    def render(cls, res: TurnResult, req: TurnRequest) -> dict[str, Any]:
        """The non-streaming response body."""
        status = "incomplete" if res.finish_reason == "length" and not res.tool_calls else "completed"
        return cls._response(res, req, status, cls._items(res, req.tools))

    @classmethod
    def render_stream(cls, res: TurnResult, req: TurnRequest) -> list[bytes]:
        """The SSE events of a streamed response, ``response.completed`` (or ``.incomplete``) last."""
        seq = 0
        out = []

        def emit(kind: str, **data: Any) -> None:
            nonlocal seq
            out.append(_sse({"type": kind, "sequence_number": seq, **data}, kind))
            seq += 1

        emit("response.created", response=cls._response(res, req, "in_progress", []))
        emit("response.in_progress", response=cls._response(res, req, "in_progress", []))
        items = cls._items(res, req.tools)
        for idx, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                emit("response.output_item.added", output_index=idx, item={**item, "status": "in_progress", "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
                emit("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0, part=part)
                if text:
                    emit("response.output_text.delta", item_id=item["id"], output_index=idx, content_index=0, delta=text)
                emit("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text)
                emit("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part={**part, "text": text})
            elif item["type"] == "function_call":
                emit("response.output_item.added", output_index=idx, item={**item, "status": "in_progress", "arguments": ""})
                emit("response.function_call_arguments.delta", item_id=item["id"], output_index=idx, delta=item["arguments"])
                emit("response.function_call_arguments.done", item_id=item["id"], output_index=idx, arguments=item["arguments"])
            else:
                emit("response.output_item.added", output_index=idx, item={**item, "status": "in_progress", "input": ""})
            emit("response.output_item.done", output_index=idx, item=item)
        final = cls.render(res, req)
        emit("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
        return out


APIS: dict[str, type[WireAPI]] = {"chat": ChatCompletionsAPI, "messages": MessagesAPI, "responses": ResponsesAPI}


def error_body(style: str, status: int, kind: str, message: str, code: str | None = None) -> dict[str, Any]:
    """An error body in the client's own dialect (OpenAI or Anthropic).
    ``code`` is OpenAI's machine-readable code (e.g. ``context_length_exceeded``);
    without one the status is given, and Anthropic's shape has no such field."""
    if style == "anthropic":
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "code": code if code is not None else status}}


def now_s() -> int:
    """Wall-clock seconds for ``created`` fields (the log keeps its own clock)."""
    return int(time.time())
