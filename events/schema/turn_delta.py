"""Delta encoding of turns: the one place that turns a full turn into a
:class:`~agentlog.events.schema.turn.TurnDelta` and a delta back into the full
:class:`~agentlog.events.schema.turn.TurnRecorded` it stands for. Only the
prompt is converted; every other field (:data:`~.turn.TURN_BODY_FIELDS`) is
copied as it is, by name, so a new turn field needs no change here.

An agent's prompt usually repeats the previous turn's prompt and output and
adds the tool's answer, so storing each prompt whole makes a session's log
grow with the square of its turns. A delta references the longest prefix the
new prompt shares with the previous turn's context and stores only the rest.
A prompt that diverges (a rewritten history, a REALIGN, a FORK) shares a
shorter prefix, down to none: the encoding is exact for every prompt.

Both sides hold one :class:`TurnContext` per live session: the previous
turn's prompt + output token ids and its messages + response message, that
is O(current context), and drop it when the session ends.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import msgspec
import numpy as np

from ..errors import AgentlogError
from .turn import TURN_BODY_FIELDS, TurnDelta, TurnRecorded
from .types import TERMINAL_EVENT_TYPES, Envelope
from .validation import READING_STORED

_encode = msgspec.msgpack.Encoder().encode


def _copying(target: type, prompt: tuple[str, ...]) -> Callable[..., Any]:
    """A function ``(turn, *prompt) -> target``: the ``target`` body with the
    given prompt fields and every field of ``turn`` in :data:`TURN_BODY_FIELDS`,
    copied by name. Generated once from the field list, as dataclasses
    generate ``__init__``: it runs for every turn the engine records, and
    passing the fields as a built dict (``**``) costs about four times as much."""
    assert all(name.isidentifier() for name in prompt + TURN_BODY_FIELDS)
    fields = [f"{name}={name}" for name in prompt] + [f"{name}=turn.{name}" for name in TURN_BODY_FIELDS]
    source = f"def build(turn, {', '.join(prompt)}):\n    return target({', '.join(fields)})\n"
    namespace: dict[str, Any] = {"target": target}
    exec(source, namespace)  # noqa: S102 - identifiers from the schema's own field list
    return namespace["build"]


_delta_from = _copying(TurnDelta, ("shared_tokens", "new_prompt_ids", "shared_messages", "new_messages"))
_recorded_from = _copying(TurnRecorded, ("messages", "prompt_ids"))


class TurnDeltaError(AgentlogError, ValueError):
    """A turn_delta references more of the previous turn than that turn held."""


def common_prefix_tokens(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """Number of leading int32 tokens two packed arrays share."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    # Views, not slices: no copy of either array.
    differ = np.frombuffer(a, dtype="<i4", count=n) != np.frombuffer(b, dtype="<i4", count=n)
    first = int(differ.argmax())
    return first if differ[first] else n


class TurnContext:
    """What a session's next turn is encoded against: the previous turn's
    prompt + output token ids (packed int32) and its messages followed by its
    response message (when it had one). Empty before the first turn."""

    __slots__ = ("tokens", "messages", "_encoded")

    def __init__(self, tokens: bytes = b"", messages: list[dict[str, Any]] | None = None) -> None:
        self.tokens = tokens
        self.messages: list[Any] = messages if messages is not None else []
        # msgpack bytes of each message, computed on the first delta_of only
        # (readers never need them).
        self._encoded: list[bytes] | None = None

    @classmethod
    def after(cls, turn: TurnRecorded) -> "TurnContext":
        """The context a turn leaves for the next one."""
        messages = list(turn.messages)
        if turn.response_message is not None:
            messages.append(turn.response_message)
        return cls(turn.prompt_ids + turn.output_ids, messages)

    def _shared_messages(self, messages: list[Any]) -> int:
        # Exact: a message counts as shared only when it encodes to the same
        # bytes (1 == 1.0 == True, and dict order, would otherwise slip by).
        held = self.messages
        if self._encoded is None:
            self._encoded = [_encode(m) for m in held]
        enc = self._encoded
        n = min(len(held), len(messages))
        i = 0
        while i < n:
            new = messages[i]
            if new is not held[i] and (new != held[i] or _encode(new) != enc[i]):
                break
            i += 1
        return i

    def delta_of(self, turn: TurnRecorded) -> TurnDelta:
        """The delta that :meth:`expand` turns back into ``turn`` exactly.

        ``turn`` was checked when it was built (by the engine, from the
        caller's values), and every field of the delta is one of its fields or
        a slice of one, so the delta is built without running the same checks
        again; the log's write path still decodes the stored bytes with every
        check on before it acknowledges them."""
        shared_tokens = common_prefix_tokens(self.tokens, turn.prompt_ids)
        shared_messages = self._shared_messages(turn.messages)
        token = READING_STORED.set(True)
        try:
            return self._delta(turn, shared_tokens, shared_messages)
        finally:
            READING_STORED.reset(token)

    @staticmethod
    def _delta(turn: TurnRecorded, shared_tokens: int, shared_messages: int) -> TurnDelta:
        return _delta_from(
            turn, shared_tokens, turn.prompt_ids[shared_tokens * 4 :], shared_messages, list(turn.messages[shared_messages:])
        )

    def expand_messages(self, delta: TurnDelta, where: str = "", held_tokens: int | None = None) -> list[Any]:
        """The full message list of a delta, after checking that it shares no
        more tokens (``held_tokens``, default this context's) and messages
        than the previous turn held. Raises TurnDeltaError (prefixed with
        ``where``)."""
        if held_tokens is None:
            held_tokens = len(self.tokens) // 4
        if delta.shared_tokens > held_tokens:
            raise TurnDeltaError(
                f"{where}turn_delta.shared_tokens: expected at most {held_tokens} (the previous turn's prompt + output),"
                f" found {delta.shared_tokens} in turn {delta.turn_index}"
            )
        if delta.shared_messages > len(self.messages):
            raise TurnDeltaError(
                f"{where}turn_delta.shared_messages: expected at most {len(self.messages)} (the previous turn's"
                f" messages + response), found {delta.shared_messages} in turn {delta.turn_index}"
            )
        return self.messages[: delta.shared_messages] + delta.new_messages

    def expand(self, delta: TurnDelta, where: str = "") -> TurnRecorded:
        """The full turn a delta stands for. Raises TurnDeltaError (prefixed
        with ``where``) when it shares more than this context holds."""
        messages = self.expand_messages(delta, where)
        shared = delta.shared_tokens * 4
        prompt = delta.new_prompt_ids if not shared else self.tokens[:shared] + delta.new_prompt_ids
        # Built as a stored record is read: the checks ran when it was written.
        token = READING_STORED.set(True)
        try:
            return _recorded_from(delta, messages, prompt)
        finally:
            READING_STORED.reset(token)


def prompt_token_count(body: TurnRecorded | TurnDelta) -> int:
    """Prompt tokens a turn saw, from either encoding, without its context."""
    if type(body) is TurnDelta:
        return body.shared_tokens + len(body.new_prompt_ids) // 4
    return len(body.prompt_ids) // 4


def full_turns(envelopes: Iterable[Envelope]) -> Iterator[Envelope]:
    """The envelopes with every turn_delta replaced by the full turn_recorded
    it stands for (same LSN, session, sequence and time): for readers that
    want each turn's whole prompt (``show``, tests, exports). Holds one
    context per session in flight, dropped at its terminal event. Raises
    TurnDeltaError naming the LSN on a delta its previous turn cannot
    satisfy."""
    contexts: dict[str, TurnContext] = {}
    for env in envelopes:
        body = env.body
        if type(body) is TurnDelta:
            body = contexts.get(env.session_id, _EMPTY).expand(body, f"lsn {env.lsn}, session {env.session_id!r}: ")
            env = Envelope(env.lsn, env.session_id, env.session_seq, env.ts_ns, body)
        if type(body) is TurnRecorded:
            contexts[env.session_id] = TurnContext.after(body)
        elif isinstance(body, TERMINAL_EVENT_TYPES):
            contexts.pop(env.session_id, None)
        yield env


_EMPTY = TurnContext()
