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

Each side holds one context per live session, dropped when the session
ends. A reader holds a :class:`TurnContext`: the previous turn's prompt +
output token ids and its messages + response message, which it needs to
expand a delta. The engine, which only encodes, holds an
:class:`EncodingContext`: the same token ids, as the turn's own packed
bytes, and a 16-byte digest of each message instead of the message, so a
live session costs its context's token bytes plus 16 bytes a message
(about 33 kB at an 8k-token context, where the messages' text alone is
about as much again). A caller that promises never to change the message
objects it records (the gateway: they are parsed from each request, or
the very objects recorded the turn before) lets the engine also keep a
reference to each of them, a pointer a message: a message that is the very
object seen last turn then reuses its digest, and a turn hashes only its
new messages instead of its whole context.
"""

from __future__ import annotations

from hashlib import sha256
from operator import is_
from typing import Any, Callable, Iterable, Iterator

import msgspec
import numpy as np

from ..errors import AgentlogError
from . import speedups
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
_DELTA_TAG = str(TurnDelta.__struct_config__.tag)


class TurnDeltaError(AgentlogError, ValueError):
    """A turn_delta references more of the previous turn than that turn held."""


def common_prefix_tokens(a: bytes | bytearray, b: bytes | bytearray) -> int:
    """Number of leading int32 tokens two packed arrays share."""
    if len(a) <= len(b):
        if b.startswith(a):  # the common case, an extended context: one memcmp, no array built
            return len(a) // 4
    elif a.startswith(b):
        return len(b) // 4
    return _shared_bytes(a, b, 0) // 4


def _shared_bytes(held: bytes | bytearray | memoryview, new: bytes | bytearray, offset: int) -> int:
    """Bytes of ``held`` that ``new`` repeats from ``offset`` on, in whole
    int32 tokens (``offset`` is a multiple of 4)."""
    if new.startswith(held, offset):  # compared where it lies: no slice is copied
        return len(held)
    n = min(len(held), len(new) - offset) // 4
    if n <= 0:
        return 0
    # Views, not slices: no copy of either array.
    differ = np.frombuffer(held, dtype="<i4", count=n) != np.frombuffer(new, dtype="<i4", count=n, offset=offset)
    first = int(differ.argmax())
    return 4 * (first if differ[first] else n)


class ExtendedPrompt:
    """A packed prompt built as the first ``keep`` bytes of ``base`` (an
    earlier prompt's packed bytes) followed by ``tail``: the proof, by
    construction, that ``packed[:keep] == base[:keep]``.

    The constructor joins the bytes itself and the object is read-only, so
    the proof cannot be claimed for bytes that were not built so. When
    ``base`` is the very object the engine holds as the session's previous
    prompt, the delta encoding takes those ``keep`` bytes as shared without
    comparing them (:meth:`EncodingContext.shared_tokens`): at a 100k-token
    context, 400 kB against 400 kB, a quarter of a turn's cost. A chat
    template that extends its previous encode builds one
    (:meth:`~agentlog.gateway.chat.ChatTemplate.extend_packed`); the engine's
    ``record_turn`` takes it as ``prompt_ids``."""

    __slots__ = ("packed", "base", "keep")

    packed: bytes
    base: bytes
    keep: int

    def __init__(self, base: bytes, keep: int, tail: bytes | bytearray | memoryview) -> None:
        if type(base) is not bytes or type(keep) is not int or not 0 <= keep <= len(base) or keep % 4:
            raise ValueError(f"ExtendedPrompt: expected bytes and a whole number of its int32 tokens to keep, found "
                             f"{type(base).__name__} of {len(base) if isinstance(base, bytes) else '?'} bytes, keep={keep!r}")
        packed = b"".join((memoryview(base)[:keep], tail))
        if len(packed) % 4:
            raise ValueError(f"ExtendedPrompt: a tail of {len(packed) - keep} bytes is not whole int32 tokens")
        for name, value in (("packed", packed), ("base", base), ("keep", keep)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ExtendedPrompt is read-only (its {name} is part of its proof)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ExtendedPrompt is read-only (its {name} is part of its proof)")

    def __repr__(self) -> str:
        return f"ExtendedPrompt({len(self.packed) // 4} tokens, the first {self.keep // 4} of a {len(self.base) // 4}-token base)"


#: Bytes of a message digest (SHA-256, cut): two different messages share one with probability 2**-128.
#: SHA-256, not BLAKE2b, because CPUs hash it in hardware (x86 SHA extensions, ARMv8): about twice as fast here.
DIGEST_BYTES = 16


def message_digests(messages: Iterable[Any]) -> bytes:
    """The digests of the messages' msgpack encodings, concatenated
    (:data:`DIGEST_BYTES` each). Stops at the first message that cannot be
    encoded: the log refuses that turn and names the field, so it never
    becomes a context."""
    out = []
    for m in messages:
        try:
            data = _encode(m)
        except (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError):
            # Not a msgpack value, a lone surrogate (UnicodeEncodeError), an integer beyond 64 bits, too deep.
            break
        out.append(sha256(data).digest()[:DIGEST_BYTES])
    return b"".join(out)


def _repeated_objects(new: list[Any], held: tuple[Any, ...]) -> int:
    """Leading items of ``new`` that are the very objects of ``held`` (identity, not equality).
    Compiled (:mod:`.speedups`), the pointers are compared without reading the objects."""
    fast = speedups.native
    if fast is not None and type(new) is list:
        return fast.leading_identical(new, held)
    n = min(len(new), len(held))
    if all(map(is_, new, held)):  # the common case, compared in C (map stops at the shorter)
        return n
    i = 0
    while new[i] is held[i]:
        i += 1
    return i


class EncodingContext(msgspec.Struct, frozen=True, gc=False):
    """What the engine keeps of a live session's previous turn to encode the
    next one: its prompt and output token ids (the turn's own packed bytes,
    never concatenated) and the digests of its messages followed by its
    response message (:func:`message_digests`). Empty before the first turn.

    :meth:`encode` gives the delta :meth:`TurnContext.delta_of` gives for the
    same previous turn, without holding the messages: a message counts as
    shared when its encoding's digest (16 bytes of SHA-256) is the held one (for
    different encodings, a chance of 2**-128), where the reader's context
    compares the encodings themselves.

    ``objects``: the message objects those digests are of, one for one, held
    only when the turn was encoded with ``frozen=True`` (empty otherwise).
    Holding them keeps them alive, so an identity test against them is never
    one against a recycled ``id()``.

    A struct, not a class of our own, for its untracked instances (``gc=False``):
    a live session holds its context for as long as it runs, so thousands in
    flight would sit in the collector's old generation, walked by every full
    collection. It holds bytes and the caller's message objects, never
    anything that refers back to it, so it is never part of a cycle."""

    prompt: bytes = b""
    output: bytes = b""
    digests: bytes = b""
    objects: tuple[Any, ...] = ()

    @property
    def tokens(self) -> bytes:
        """The previous turn's prompt + output ids, packed (a copy: for inspection)."""
        return self.prompt + self.output

    def shared_tokens(self, prompt: bytes, proof: ExtendedPrompt | None = None) -> int:
        """Leading tokens of ``prompt`` that repeat the held prompt + output.
        ``proof``: ``prompt`` built as an :class:`ExtendedPrompt`; when its
        base is the held prompt itself, the bytes it kept are not compared."""
        if type(proof) is ExtendedPrompt and proof.base is self.prompt and proof.packed is prompt and proof.keep:
            keep = proof.keep  # proven shared; only the rest of the held prompt is compared (a view: no copy)
            held = keep + _shared_bytes(memoryview(self.prompt)[keep:], prompt, keep)
        else:
            held = _shared_bytes(self.prompt, prompt, 0)
        if held == len(self.prompt) and self.output:
            held += _shared_bytes(self.output, prompt, held)
        return held // 4

    def shared_messages(self, digests: bytes) -> int:
        """Leading messages whose digests (:func:`message_digests`) repeat the held ones."""
        held = self.digests
        if digests.startswith(held):
            return len(held) // DIGEST_BYTES
        n = 0
        for i in range(0, min(len(held), len(digests)), DIGEST_BYTES):
            if held[i : i + DIGEST_BYTES] != digests[i : i + DIGEST_BYTES]:
                break
            n += 1
        return n

    def digests_for(self, messages: list[Any], frozen: bool = False) -> bytes:
        """The digests of ``messages`` (:func:`message_digests`); with ``frozen``
        (see :meth:`encode`), a leading message that is the very object this
        context holds reuses its digest instead of being hashed."""
        if not messages:
            return b""
        if frozen and self.objects:
            reused = _repeated_objects(messages, self.objects)
            if reused:
                return self.digests[: reused * DIGEST_BYTES] + message_digests(messages[reused:])
        return message_digests(messages)

    def encode(self, turn: TurnRecorded, frozen: bool = False, digests: bytes | None = None,
               proof: ExtendedPrompt | None = None) -> tuple[TurnDelta, "EncodingContext"]:
        """The delta that :meth:`TurnContext.expand` turns back into ``turn``
        exactly, and the context ``turn`` leaves for the next one.

        ``frozen``: the caller promises that ``turn``'s message objects and
        response message (and everything inside them) are never changed
        afterwards. The next context then holds them, and a message of the
        next frozen turn that is the very object held reuses its digest
        instead of being hashed: the delta is the same (what the digest is of
        cannot have changed), and a turn costs its new messages, not its
        whole context. Without the promise every message is hashed.
        ``digests``: the turn's message digests when the caller has them
        (:meth:`digests_for`, maybe of another context); else computed here.
        ``proof``: the :class:`ExtendedPrompt` ``turn``'s prompt was built as
        (see :meth:`shared_tokens`); the delta is the same with or without it.

        ``turn`` was checked when it was built (see :meth:`TurnContext.delta_of`),
        so the delta is built without running the same checks again; the
        delta's own fields (the shared counts, the new prompt's bytes) are
        checked here, since the engine's log takes the turn as checked when
        built (:func:`agentlog.engine.handle.stage_built_turn`). This
        runs for every turn the engine records: the common cases (a prompt
        that extends the held context, no messages) take no call they can skip."""
        messages, prompt = turn.messages, turn.prompt_ids
        if digests is None:
            digests = self.digests_for(messages, frozen)
        shared_messages = self.shared_messages(digests) if self.digests else 0
        shared_tokens = self.shared_tokens(prompt, proof)  # an extended context: two memcmps (or a proof), no array built
        new_messages = messages[shared_messages:]
        token = READING_STORED.set(True)
        try:
            delta = _delta_from(turn, shared_tokens, prompt[shared_tokens * 4 :], shared_messages,
                                new_messages if type(new_messages) is list else list(new_messages))
        finally:
            READING_STORED.reset(token)
        delta._check_prompt(_DELTA_TAG)
        if turn.response_message is not None and len(digests) == DIGEST_BYTES * len(messages):
            digests += message_digests((turn.response_message,))
        # The objects the digests are of, one for one (a message that cannot be encoded ends both).
        objects = (*messages, turn.response_message)[: len(digests) // DIGEST_BYTES] if frozen else ()
        return delta, EncodingContext(prompt, turn.output_ids, digests, objects)


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
