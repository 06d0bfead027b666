"""A session's prompt, encoded from what its previous turn left.

An agent sends its whole conversation at every turn: the previous messages,
the response it got, and a few new messages (tool results, the user). At a
100k-token context, encoding all of it again at every turn is O(context)
per turn and O(turns x context) per session. :class:`PromptCache` holds,
per live session (in the gateway's per-session entry, dropped with it), the
conversation the previous prompt was encoded from and the template's state
after it; the next prompt encodes only what is new when the request repeats
that conversation exactly, and encodes whole otherwise.

*Exactly*: a message counts as repeated only when it is equal and encodes
to the same bytes (``1``, ``1.0`` and ``True`` are equal but render apart,
and so do dicts in another key order), and the tools must encode the same.
The template then proves the result equal to a full encode or declines
(:meth:`~agentlog.gateway.chat.ChatTemplate.extend_packed`). The recorded
prompt is therefore the one a full encode gives, token for token, and the
reducers' retokenization-drift rules see what they always saw.

Repeated messages are handed on as the very objects recorded last turn, and
the gateway records them as frozen (never changed afterwards), so the engine
reuses their digests by identity and hashes only the new messages
(:meth:`~agentlog.events.schema.turn_delta.EncodingContext.encode`).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from agentlog.events.schema.turn_delta import ExtendedPrompt

from .chat import ChatTemplate, ToolSpec

_encode = msgspec.msgpack.Encoder().encode


def _same(new: Any, held: Any) -> bool:
    # Equal encodings are the exact test (1, 1.0 and True, or two key orders,
    # encode apart), and imply equal values: no deep == besides.
    return new is held or _encode(new) == _encode(held)


class EncodedPrompt:
    """One request's prompt: ``packed`` (int32 bytes, what the log records),
    ``ids`` (a read-only int32 view of them, what the backend gets),
    ``messages`` (the request's messages, the repeated ones replaced by the
    objects recorded before), ``incremental`` (True when it was encoded
    from the previous encode, False when whole) and ``recorded`` (what the
    engine's ``record_turn`` takes as ``prompt_ids``: the template's
    :class:`~agentlog.events.schema.turn_delta.ExtendedPrompt` when it built
    one, so the bytes it kept are not compared again, else ``packed``)."""

    __slots__ = ("packed", "ids", "messages", "incremental", "recorded", "_tools", "_state")

    def __init__(self, prompt: ExtendedPrompt | bytes, messages: list[Any], incremental: bool, tools: bytes | None, state: Any) -> None:
        self.recorded = prompt
        self.packed: bytes = prompt.packed if isinstance(prompt, ExtendedPrompt) else prompt
        self.ids = np.frombuffer(self.packed, dtype="<i4")
        self.messages = messages
        self.incremental = incremental
        self._tools = tools
        self._state = state


class PromptCache:
    """The previous encode of one session (see the module docstring)."""

    __slots__ = ("_messages", "_rendered", "_tools", "_state")

    def __init__(self) -> None:
        #: The messages last recorded, then the response recorded with them.
        self._messages: list[Any] = []
        #: How many of ``_messages`` the template ``_state`` was encoded from.
        self._rendered = 0
        #: The msgpack of the tools they were encoded with (None: tools msgpack cannot hold, never reused).
        self._tools: bytes | None = b""
        self._state: Any = None

    def encode(self, template: ChatTemplate, messages: list[Any], tools: list[ToolSpec]) -> EncodedPrompt:
        """``messages`` and ``tools`` encoded by ``template``, from the
        previous encode when the request repeats its conversation exactly."""
        held = self._messages
        n = min(len(held), len(messages))
        shared = 0
        while shared < n and _same(messages[shared], held[shared]):
            shared += 1
        if shared:
            messages = held[:shared] + messages[shared:]
        try:
            tools_key: bytes | None = _encode(tools)
        except (TypeError, ValueError, OverflowError, RecursionError):
            # Tools are never recorded, so any schema is theirs to send (an integer beyond 64 bits in a
            # "maximum"); one msgpack cannot hold only costs the reuse: the prompt is encoded whole.
            tools_key = None
        out = None
        if self._state is not None and shared >= self._rendered and tools_key is not None and tools_key == self._tools:
            out = template.extend_packed(self._state, messages, tools, self._rendered)
        if out is None:
            packed, state = template.encode_packed(messages, tools)
            return EncodedPrompt(packed, messages, False, tools_key, state)
        prompt, state = out
        return EncodedPrompt(prompt, messages, True, tools_key, state)

    def remember(self, prompt: EncodedPrompt, response_message: dict[str, Any] | None) -> None:
        """``prompt`` was recorded with ``response_message``: the next
        request is encoded against them."""
        self._messages = prompt.messages + ([response_message] if response_message is not None else [])
        self._rendered = len(prompt.messages)
        self._tools = prompt._tools
        self._state = prompt._state


class LineagePrompts:
    """The previous encode of each lineage of one session (its agent's
    subagents, :mod:`agentlog.engine.lineages`): a turn that returns to a lineage
    encodes from that lineage's last prompt, not from whichever lineage spoke
    last. Which cache a request extends is a guess (the engine decides the
    turn's lineage after it is generated); a wrong guess only costs a full
    encode, since :meth:`PromptCache.encode` proves every extension exact."""

    __slots__ = ("_caches",)

    #: Lineages a session keeps a cache for (the least recently used is dropped beyond).
    LIMIT = 32

    def __init__(self) -> None:
        self._caches: dict[str, PromptCache] = {}  # least recently recorded first

    def pick(self, messages: list[Any], lineage: str | None = None) -> PromptCache:
        """The cache to encode ``messages`` from: the declared ``lineage``'s, else the most
        recent one whose conversation starts with the same first two messages, else a new one."""
        if lineage is not None:
            return self._caches.get(lineage) or PromptCache()
        head = messages[:2]
        for cache in reversed(self._caches.values()):
            held = cache._messages
            if len(held) >= len(head) and all(_same(m, h) for m, h in zip(head, held)):
                return cache
        return PromptCache()

    def remember(self, lineage: str, cache: PromptCache, prompt: EncodedPrompt, response_message: dict[str, Any] | None) -> None:
        """``prompt`` (encoded from ``cache``) was recorded in ``lineage`` with ``response_message``."""
        cache.remember(prompt, response_message)
        self._caches.pop(lineage, None)
        self._caches[lineage] = cache
        if len(self._caches) > self.LIMIT:
            del self._caches[next(iter(self._caches))]
