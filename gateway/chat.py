"""Canonical chat messages, chat templates and tool-call parsers.

Every API the gateway speaks (Chat Completions, Responses, Messages) is
normalised to one canonical message form before anything else happens. The
canonical form is what the log records in ``turn_recorded.messages`` and
``response_message``, so it must be *stable*: the assistant message a client
echoes back in its next request must normalise to exactly the dict we
recorded as the response, whatever API it came through. That is what lets the
trajectory reducer route turn n+1 under turn n by plain dict equality.

Canonical message::

    {"role": "system" | "user" | "assistant" | "tool", "content": str}
    assistant messages add  "tool_calls": [{"id": str, "name": str, "arguments": dict | str}]
    tool messages add       "tool_call_id": str

Arguments are parsed JSON objects when they parse (clients re-serialise JSON
with different spacing), else the raw string. Client-side ids, cache hints,
thinking blocks and other decoration are dropped.
"""

from __future__ import annotations

import abc
import json
import re
from typing import Any, Callable

import msgspec
import numpy as np

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.turn_delta import ExtendedPrompt
from .json_depth import JSONTooDeep, loads_json_text


# ---------------------------------------------------------------- messages


class RequestError(AgentlogError, ValueError):
    """A request body that cannot be understood; ``where`` names the JSON path."""

    def __init__(self, where: str, expected: str, found: Any) -> None:
        shown = repr(found)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{where}: expected {expected}, found {shown}")
        self.where = where


def canonical_arguments(args: Any) -> Any:
    """Tool-call arguments as a dict when they are (or parse as) a JSON object."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            parsed = loads_json_text(args, "tool call arguments")
        except ValueError:  # not JSON, or nested past the limit: kept as the text it is
            return args
        return parsed if isinstance(parsed, dict) else args
    return {} if args is None else args


def unrecordable(value: Any) -> str | None:
    """What in ``value`` (JSON a client or the model wrote) the log could not store, in
    words, or None when it can: valid JSON may hold an integer beyond 64 bits or a
    ``"\\ud800"`` escape (a lone surrogate), which msgpack refuses."""
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        return "an integer outside 64 bits; expected -2**63 <= n < 2**64"
    except RecursionError:
        return "values nested too deeply to record"
    except UnicodeEncodeError as exc:
        return f"a string holding a lone surrogate ({exc.object[exc.start:exc.end]!r}); expected Unicode text"
    except (TypeError, ValueError) as exc:
        return f"a value msgpack cannot hold ({exc})"
    return None


def custom_tool_arguments(text: Any) -> Any:
    """A custom tool call's arguments (the Responses API's ``custom_tool_call``, whose
    ``input`` is free text): recorded as ``{"input": text}``, the form the gateway renders
    back as the text, so an echoed call parses to what was recorded."""
    return {"input": text} if isinstance(text, str) else canonical_arguments(text)


def text_of(content: Any, where: str) -> str:
    """Flatten message content (a str, or a list of typed parts) to text.

    Text-bearing parts (``text``, ``input_text``, ``output_text``) are joined
    as they are; images and files become a short placeholder so the prompt
    still says something was there; thinking/reasoning parts are dropped.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, "a string or a list of content parts", content)
    out = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, dict):
            raise RequestError(f"{where}[{i}]", "a content part object", part)
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            text = part.get("text", "")
            if not isinstance(text, str):
                raise RequestError(f"{where}[{i}].text", "a string", text)
            out.append(text)
        elif kind in ("image", "image_url", "input_image", "document", "input_file", "file"):
            out.append(f"[{kind}]")
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        # thinking, redacted_thinking, reasoning and unknown parts carry no prompt text
    return "".join(out)


def assistant_message(content: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A canonical assistant message (``tool_calls`` only when there are some)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [
            {"id": tc["id"], "name": tc["name"], "arguments": canonical_arguments(tc.get("arguments"))} for tc in tool_calls
        ]
    return msg


# ---------------------------------------------------------------- tools


class ToolSpec(msgspec.Struct, frozen=True):
    """A tool the client declared: name, description, JSON-schema parameters.

    ``kind`` is ``function`` for JSON-argument tools and ``custom`` for
    free-form ones (Responses API custom tools); ``namespace`` keeps the
    Responses API namespace a tool was declared under.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    kind: str = "function"
    namespace: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for templates and the recorded sampling metadata."""
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out


class ParsedOutput(msgspec.Struct, frozen=True):
    """The model's decoded text split into content and tool calls."""

    content: str
    tool_calls: list[dict[str, Any]]  # {"name", "arguments"}; ids assigned by the gateway
    ill_formed: bool = False
    error: str = ""


class ToolCallParser(abc.ABC):
    """Turns generated text into content and tool calls (pluggable per model family)."""

    name = ""

    @abc.abstractmethod
    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedOutput:
        """Split ``text``; set ``ill_formed`` with a reason when a call cannot be parsed."""

    @abc.abstractmethod
    def render(self, name: str, arguments: Any) -> str:
        """How the model writes one call (used by the built-in template)."""


class HermesToolParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5/3).

    A call is ill-formed when its block is unterminated, its body is not a
    JSON object with a string ``name`` and object ``arguments``, or it names
    a tool the request did not declare. An ill-formed output is returned as
    plain content with no tool calls, so the agent sees what the model wrote.
    """

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def render(self, name: str, arguments: Any) -> str:
        return f"{self.OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{self.CLOSE}"

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedOutput:
        if self.OPEN not in text:
            return ParsedOutput(text, [])
        declared = {t.name for t in tools}
        calls = []
        for i, m in enumerate(self._block.finditer(text)):
            try:
                obj = loads_json_text(m.group(1), f"tool call {i}")
            except JSONTooDeep as exc:
                return ParsedOutput(text, [], True, str(exc))
            except ValueError as exc:
                return ParsedOutput(text, [], True, f"tool call {i}: invalid JSON: {exc}")
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ParsedOutput(text, [], True, f"tool call {i}: expected an object with a string 'name', found {m.group(1)[:80]!r}")
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = canonical_arguments(args)
            if not isinstance(args, dict):
                return ParsedOutput(text, [], True, f"tool call {i}: expected object 'arguments', found {type(args).__name__}")
            if declared and obj["name"] not in declared:
                return ParsedOutput(text, [], True, f"tool call {i}: unknown tool {obj['name']!r} (declared: {sorted(declared)[:10]})")
            problem = unrecordable((obj["name"], args))  # what the log will store of the call
            if problem is not None:
                return ParsedOutput(text, [], True, f"tool call {i}: {problem}: the log cannot record it")
            calls.append({"name": obj["name"], "arguments": args})
        rest = self._block.sub("", text)
        if self.OPEN in rest or self.CLOSE in rest:
            return ParsedOutput(text, [], True, "unterminated or stray <tool_call> block")
        # Only the newlines that separate calls from text go: any other
        # whitespace is the model's and must survive to re-render exactly.
        return ParsedOutput(rest.rstrip("\n"), calls)


class NoToolParser(ToolCallParser):
    """Never parses tool calls: all output is content."""

    name = "none"

    def parse(self, text: str, tools: list[ToolSpec]) -> ParsedOutput:
        return ParsedOutput(text, [])

    def render(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


TOOL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesToolParser, "none": NoToolParser}


def tool_parser(name: str) -> ToolCallParser:
    """A parser by name; an unknown name raises listing the valid ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; valid: {', '.join(sorted(TOOL_PARSERS))}") from None


# ---------------------------------------------------------------- templates


def pack_ids(ids: Any) -> bytes:
    """Token ids as the log stores them: little-endian int32 bytes."""
    return np.asarray(ids, dtype=_TOKEN_DTYPE).tobytes()


_TOKEN_DTYPE = np.dtype("<i4")


class ChatTemplate(abc.ABC):
    """Messages (+ tools) -> prompt token ids; output ids -> text.

    A template may also encode a conversation *incrementally*
    (:meth:`encode_packed` then :meth:`extend_packed`): an agent's next
    prompt repeats its previous conversation and adds a few messages, and
    re-encoding the whole conversation at every turn costs O(context) per
    turn. Whatever a template does there, its result must equal
    :meth:`encode_prompt` token for token."""

    #: Token ids that end generation.
    stop_ids: tuple[int, ...] = ()
    name = ""

    @abc.abstractmethod
    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[int]:
        """Token ids of the rendered conversation, ending with the generation prompt."""

    @abc.abstractmethod
    def decode(self, output_ids: list[int]) -> str:
        """Text of generated ids (stop tokens removed)."""

    def encode_packed(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> tuple[bytes, Any]:
        """A full encode: the prompt as packed int32 bytes and what
        :meth:`extend_packed` continues from (None: this template cannot
        continue, every prompt is encoded whole)."""
        return pack_ids(self.encode_prompt(messages, tools)), None

    def extend_packed(self, state: Any, messages: list[dict[str, Any]], tools: list[ToolSpec],
                      shared: int) -> tuple[ExtendedPrompt | bytes, Any] | None:
        """The packed prompt of ``messages`` and the state after it, from the
        ``state`` an earlier encode left, when that encode was of exactly
        ``messages[:shared]`` with exactly these ``tools`` (the caller checked
        both); None when the template cannot prove the result equal to a full
        encode (the caller then encodes whole). A prompt that keeps the
        earlier prompt's first bytes is built as an
        :class:`~agentlog.events.schema.turn_delta.ExtendedPrompt` of those
        very bytes, so the engine need not compare them again."""
        return None


class ByteChatTemplate(ChatTemplate):
    """The built-in model's tokenizer and template: one id per ASCII character.

    Ids 0..127 are ASCII characters, ``EOS`` (128) ends a message; any other
    character is encoded as ``?``. Every id the model can emit decodes to one
    character that encodes back to the same id, so an echoed response
    re-tokenises exactly (no drift) whatever the model generated.

    A message renders as ``<role>\\n`` + content (+ tool calls, one per line)
    + EOS; declared tools go in a ``# Tools`` block of the first system
    message; the generation prompt is ``<assistant>\\n``.
    """

    EOS = 128
    VOCAB_SIZE = 129
    stop_ids = (EOS,)
    name = "builtin-ascii"

    def __init__(self, parser: ToolCallParser | None = None) -> None:
        self.parser = parser or HermesToolParser()

    def encode_text(self, text: str) -> list[int]:
        """ASCII ids of ``text`` (non-ASCII characters become ``?``)."""
        raw = text.encode("ascii", "replace")  # one '?' per non-ASCII char
        return list(raw)

    def render_body(self, content: str, tool_calls: list[dict[str, Any]] | None = None) -> str:
        """A message's text after its role line: the content, then each tool
        call on its own line (what the model is expected to generate)."""
        parts = [content] if content else []
        parts += [self.parser.render(tc["name"], tc.get("arguments")) for tc in tool_calls or ()]
        return "\n".join(parts)

    def _render(self, msg: dict[str, Any]) -> str:
        role = msg["role"]
        head = f"<{role}>\n"
        if role == "tool":
            head += f"[{msg.get('tool_call_id', '')}] "
        return head + self.render_body(msg.get("content") or "", msg.get("tool_calls"))

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[dict[str, Any]]:
        msgs = list(messages)
        if tools:
            block = "# Tools\n" + "\n".join(json.dumps(t.to_dict(), ensure_ascii=False) for t in tools)
            if msgs and msgs[0]["role"] == "system":
                msgs[0] = {**msgs[0], "content": (msgs[0].get("content") or "") + "\n\n" + block}
            else:
                msgs.insert(0, {"role": "system", "content": block})
        return msgs

    def _rendered(self, msgs: list[dict[str, Any]]) -> bytes:
        """The messages as bytes, one byte per id, each message closed by EOS
        (the text is ASCII, so EOS, 128, cannot occur inside it)."""
        eos = bytes([self.EOS])
        return b"".join(self._render(m).encode("ascii", "replace") + eos for m in msgs)

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[int]:
        return list(self._rendered(self._with_tools(messages, tools)) + self._GENERATION_PROMPT)

    _GENERATION_PROMPT = b"<assistant>\n"

    # A message renders on its own (the tools block goes into the first
    # message only), so the prompt of a longer conversation is the previous
    # one's messages followed by the new ones. The state is the previous
    # prompt itself (the generation prompt ends it); the next one is built
    # with one allocation, since a fresh buffer of the context's size costs
    # its page faults, the larger part of the copy.
    def encode_packed(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> tuple[bytes, Any]:
        packed = _widen(self._rendered(self._with_tools(messages, tools)) + self._GENERATION_PROMPT)
        return packed, packed

    def extend_packed(self, state: Any, messages: list[dict[str, Any]], tools: list[ToolSpec],
                      shared: int) -> tuple[ExtendedPrompt | bytes, Any] | None:
        if shared == 0:  # the tools block lands in the first message: nothing rendered to continue from
            return None
        prompt = ExtendedPrompt(state, len(state) - 4 * len(self._GENERATION_PROMPT),
                                _widen(self._rendered(messages[shared:]) + self._GENERATION_PROMPT))
        return prompt, prompt.packed

    def decode(self, output_ids: list[int]) -> str:
        return "".join(chr(i) for i in output_ids if 0 <= i < 128)


def _widen(byte_ids: bytes) -> bytes:
    """One-byte ids as packed int32 ids."""
    return np.frombuffer(byte_ids, dtype=np.uint8).astype(_TOKEN_DTYPE).tobytes()


class HFChatTemplate(ChatTemplate):
    """A Hugging Face tokenizer and its own chat template (needs ``transformers``).

    Canonical messages are handed to ``apply_chat_template`` in the OpenAI
    shape the Hugging Face templates expect: assistant tool calls as
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with
    the arguments as a dict when they parsed (templates ``tojson`` them), and
    tool results as ``{"role": "tool", "content", "tool_call_id", "name"}``,
    the name looked up from the call they answer (some templates print it).
    Generated ids decode with special tokens skipped, so the stop token goes
    and added tokens such as ``<tool_call>`` stay for the ``parser``.
    """

    name = "hf"

    def __init__(self, tokenizer: Any, parser: ToolCallParser | None = None) -> None:
        self.tok = tokenizer
        self.parser = parser or HermesToolParser()
        eos = tokenizer.eos_token_id
        self.stop_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()

    @classmethod
    def from_pretrained(cls, name_or_path: str, parser: ToolCallParser | None = None) -> "HFChatTemplate":
        """Load ``AutoTokenizer.from_pretrained(name_or_path)`` from local files only (never a hub)."""
        from transformers import AutoTokenizer  # optional dependency

        return cls(AutoTokenizer.from_pretrained(name_or_path, local_files_only=True), parser)

    @staticmethod
    def _hf_message(msg: dict[str, Any], call_names: dict[str, str]) -> dict[str, Any]:
        out = {"role": msg["role"], "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            out["tool_calls"] = [
                {"id": tc["id"], "type": "function", "function": {"name": tc["name"], "arguments": tc.get("arguments")}}
                for tc in msg["tool_calls"]
            ]
        if msg["role"] == "tool":
            out["tool_call_id"] = msg.get("tool_call_id", "")
            if out["tool_call_id"] in call_names:
                out["name"] = call_names[out["tool_call_id"]]
        return out

    def hf_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonical messages in the shape ``apply_chat_template`` takes."""
        call_names = {tc["id"]: tc["name"] for m in messages for tc in (m.get("tool_calls") or ())}
        return [self._hf_message(m, call_names) for m in messages]

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[int]:
        ids = self.tok.apply_chat_template(
            self.hf_messages(messages), tools=self._hf_tools(tools), add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    @staticmethod
    def _hf_tools(tools: list[ToolSpec]) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": t.to_dict()} for t in tools] or None

    def _render_text(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> str:
        return self.tok.apply_chat_template(
            self.hf_messages(messages), tools=self._hf_tools(tools), add_generation_prompt=True, tokenize=False
        )

    # Incremental encoding. ``apply_chat_template(tokenize=True)`` renders the
    # conversation to text, then tokenizes that text with no added specials.
    # A fast tokenizer first splits the text at every added token it finds
    # (leftmost, longest), then tokenizes the pieces between on their own. So
    # when the new text repeats the old text up to the end of an added token
    # T that nothing can absorb or extend (no strip, no single-word rule, not
    # normalized, and no other added token contains T's text), the tokens
    # before T are the old ones, and the tokens from T on are those of the new
    # text from T on. The jinja rendering stays O(context) (a template may
    # re-render earlier messages, e.g. drop old reasoning, and only the text
    # tells); the tokenization, by far the larger cost, becomes O(new text).
    # The state: the rendered text, the packed ids, and the cut points
    # (start, end, token index, token id) of every such T in the text.
    @property
    def _cut_ids(self) -> frozenset[int]:
        cached = self.__dict__.get("_cut_ids_cache")
        if cached is None:
            cached = frozenset()
            if getattr(self.tok, "is_fast", False):
                added = {i: t for i, t in self.tok.added_tokens_decoder.items()}
                texts = [str(t) for t in added.values()]
                cached = frozenset(
                    i for i, t in added.items()
                    if str(t) and not (getattr(t, "lstrip", True) or getattr(t, "rstrip", True)
                                       or getattr(t, "single_word", True) or getattr(t, "normalized", True))
                    and sum(str(t) in other for other in texts) == 1
                )
            self.__dict__["_cut_ids_cache"] = cached
        return cached

    def _tokenize(self, text: str, base_char: int, base_token: int) -> tuple[bytes, list[tuple[int, int, int, int]]]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        cut_ids = self._cut_ids
        cuts = [(base_char + a, base_char + b, base_token + j, t)
                for j, (t, (a, b)) in enumerate(zip(ids, enc["offset_mapping"])) if t in cut_ids]
        return pack_ids(ids), cuts

    def encode_packed(self, messages: list[dict[str, Any]], tools: list[ToolSpec]) -> tuple[bytes, Any]:
        if not self._cut_ids:
            return super().encode_packed(messages, tools)
        text = self._render_text(messages, tools)
        packed, cuts = self._tokenize(text, 0, 0)
        return packed, (text, packed, cuts)

    def extend_packed(self, state: Any, messages: list[dict[str, Any]], tools: list[ToolSpec],
                      shared: int) -> tuple[ExtendedPrompt | bytes, Any] | None:
        if state is None:
            return None
        old_text, old_packed, cuts = state
        text = self._render_text(messages, tools)
        # The last cut point whose text, up to its end, the new text repeats
        # (a binary search: repeating up to a later end implies an earlier).
        lo, hi = 0, len(cuts)
        while lo < hi:
            mid = (lo + hi) // 2
            end = cuts[mid][1]
            if text[:end] == old_text[:end]:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        start, _end, index, token = cuts[lo - 1]
        tail, tail_cuts = self._tokenize(text[start:], start, index)
        if tail[:4] != pack_ids([token]):  # T did not stand alone at the cut: encode whole
            return None
        prompt = ExtendedPrompt(old_packed, index * 4, tail)
        return prompt, (text, prompt.packed, cuts[: lo - 1] + tail_cuts)

    def decode(self, output_ids: list[int]) -> str:
        return self.tok.decode(output_ids, skip_special_tokens=True)
