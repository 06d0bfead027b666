"""Which lineage of its session a turn belongs to: the engine's decision, made as the turn is recorded.

A session whose agent spawns subagents runs several conversations under one
key (:mod:`agentlog.events.schema.lineage`). :class:`LineageTracker` holds,
per live session, each lineage's context after its last turn (the same
:class:`~agentlog.events.schema.turn_delta.EncodingContext` the delta encoding
keeps: token bytes and 16-byte message digests, never the text), its key
(the digests of its system prompt and first user message) and the tool calls
of its last answer not yet matched to a subagent. A turn is placed:

1. **declared**: in the lineage its agent named (:class:`Declared`, from the
   gateway's header); a new id starts a lineage under the declared parent,
   which must exist, and a declared spawning call must be one of its calls;
2. **extends**: else in the lineage whose recorded context it extends (its
   messages repeat the lineage's last messages and answer; a turn without
   messages, its tokens), the most recently active first;
3. **same key**: else in the most recently active lineage with its system
   prompt and first user message: a history rewrite inside one lineage,
   which the reducers handle as REALIGN or FORK, as before lineages existed;
4. **new**: else it starts a lineage (``sub-1``, ``sub-2``, ...). Its parent
   is found by the spawning tool call: one whose arguments carry the new
   lineage's first user message (the ``prompt`` of Claude Code's ``Task``),
   else the newest pending call of a spawning tool (:data:`SPAWN_TOOLS`), else
   the newest turn of another lineage (no call named: a compacted history or a
   side request spawns nothing).

A turn without messages that extends no lineage goes to the one whose context
shares most of its prompt (the newest on a tie): its tokens alone cannot tell a
subagent from a rewrite, so token-only agents that spawn subagents declare them.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Sequence

import msgspec
from msgspec import UNSET, UnsetType

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.lineage import (
    CALL_ID_RE, HOW_DECLARED, HOW_ORDER, HOW_TOOL_CALL, LINEAGE_ID_RE, LINEAGE_KEY, ROOT_LINEAGE, Lineage, answered_calls,
    ToolCall, lineage_value, message_text, tool_calls, turn_lineage,
)
from agentlog.events.schema.turn_delta import DIGEST_BYTES, EncodingContext
from agentlog.events.schema.types import TurnDelta, TurnRecorded
from agentlog.events.schema.validation import READING_STORED

#: Tools whose calls spawn a subagent in the harnesses we know (Claude Code's ``Task``, later
#: ``Agent``; Codex's and common agent frameworks' names): what matching by order prefers.
SPAWN_TOOLS = frozenset({"Task", "Agent", "task", "agent", "spawn_agent", "spawn_subagent", "subagent", "delegate"})
#: Tool call ids a lineage remembers (the newest), and lineages whose last context is kept (the most recent).
_CALLS = 1024
_CONTEXTS = 32
_EMPTY = EncodingContext()
#: Pending tool calls a lineage keeps for matching subagents to (its newest).
_PENDING = 32
#: A prompt shorter than this matches a tool call's argument only when equal to it or its last line(s)
#: (Claude Code sends the prompt as the last text block of the subagent's first user message, after
#: its <system-reminder> block), never as a part elsewhere.
_MIN_CONTAINED = 32


class LineageError(AgentlogError, ValueError):
    """A declared lineage the session cannot take: an unknown parent or spawning call, or one
    that contradicts what the lineage declared before."""


class Declared(msgspec.Struct, frozen=True):
    """A lineage an agent declared for a turn: its ``id``, and for a new lineage
    optionally its ``parent`` lineage and the ``call`` id of the parent's tool
    call that spawned it."""

    id: str
    parent: str = ""
    call: str = ""

    def __post_init__(self) -> None:
        for name, value, pattern, empty_ok in (("id", self.id, LINEAGE_ID_RE, False), ("parent", self.parent, LINEAGE_ID_RE, True),
                                               ("call", self.call, CALL_ID_RE, True)):
            if not (empty_ok and value == "") and (type(value) is not str or not pattern.fullmatch(value)):
                raise LineageError(f"lineage {name}: expected {pattern.pattern}{' or nothing' if empty_ok else ''}, found {value!r}")
        if self.parent and self.parent == self.id:
            raise LineageError(f"lineage {self.id!r} names itself as its parent")


class _Thread(msgspec.Struct, gc=False):
    """One lineage of a live session.

    A struct for its untracked instances (``gc=False``), as the tracker's: a live
    session holds them for as long as it runs, so thousands in flight would sit in
    the collector's old generation. Neither holds anything that refers back to it."""

    id: str
    key: bytes
    #: What its first turn recorded (None for an undeclared root).
    first: Lineage | None
    context: EncodingContext = _EMPTY
    last_turn: int = -1
    #: (call id, tool name, argument texts) of its last answer's calls not matched to a subagent
    #: (an empty tuple until it has one: a tuple, unlike an empty list, is no object for the collector to walk).
    pending: Sequence[ToolCall] = ()
    #: Every tool call id its answers made -> the turn that made it (declared calls are looked up here).
    calls: dict[str, int] = {}


def _key(messages: list[Any], digests: bytes) -> bytes:
    """The digests of the first system message and the first user message (b"" without messages)."""
    key = [b"", b""]
    for i, m in enumerate(messages[: len(digests) // DIGEST_BYTES]):
        role = m.get("role") if isinstance(m, dict) else None
        slot = 0 if role == "system" else 1 if role == "user" else -1
        if slot >= 0 and not key[slot]:
            key[slot] = digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]
            if key[0] and key[1]:
                break
        if role == "assistant" and key[1]:
            break
    return key[0] + key[1]


def _unanswered(thread: _Thread | None, messages: list[Any] | None = None, answered: Collection[str] = ()) -> Sequence[ToolCall]:
    """The calls ``thread`` has pending that a turn does not answer: those its prompt
    (``messages``, read by :func:`~agentlog.events.schema.lineage.answered_calls` only when
    something is pending) or ``answered`` (a resume point's) leave open. The shared empty
    tuple when it answers them all, as an agent's next turn does."""
    if thread is None or not thread.pending:
        return ()
    if messages is not None:
        answered = answered_calls(messages)
    return tuple([c for c in thread.pending if c[0] not in answered]) if answered else thread.pending


def _first_user_text(messages: list[Any]) -> str:
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            return message_text(m.get("content"))
    return ""


class LineageTracker(msgspec.Struct, gc=False):
    """The lineages of one live session (see the module docstring). :meth:`place`
    decides a turn's lineage before it is appended; :meth:`commit` applies it
    once the turn is in the log (the session's lock is held in between)."""

    _threads: dict[str, _Thread] = {}
    #: Most recently active first. A tuple, rebuilt when the order changes (the common turn continues the
    #: newest): holding only untracked threads, it is itself no object for the collector to walk.
    _recent: tuple[_Thread, ...] = ()
    #: The turn placed last, until :meth:`commit` applies it: its lineage's id (None: nothing staged),
    #: that lineage's key, a new lineage's first-turn value, the answer's tool calls, and the calls the
    #: lineage had pending that the turn's prompt left unanswered. Fields, not a tuple: a turn in flight
    #: allocates nothing here for the collector to count.
    _staged_id: str | None = None
    _staged_key: bytes = b""
    _staged_first: Lineage | None = None
    _staged_calls: Sequence[ToolCall] = ()
    _staged_left: Sequence[ToolCall] = ()
    _subs: int = 0  # detected lineages named so far

    def __len__(self) -> int:
        return len(self._threads)

    # -------------------------------------------------------------- deciding

    @property
    def placed(self) -> str:
        """The id of the lineage the turn staged last (by :meth:`stamp` or :meth:`place`) was placed in:
        what ``turn_lineage`` reads back from its body."""
        assert self._staged_id is not None, "placed is read right after a turn was placed"
        return self._staged_id

    def check(self, declared: Declared) -> None:
        """Raise LineageError when ``declared`` cannot be taken now (what
        :meth:`place` would refuse), before anything runs."""
        self._declared_lineage(declared, None)

    def digests(self, before: EncodingContext, messages: list[Any], frozen: bool) -> bytes:
        """The message digests of a turn about to be encoded against ``before`` (the session's
        previous turn): from the context whose message objects it repeats, so a turn back from
        another lineage hashes only its new messages (:meth:`EncodingContext.digests_for`)."""
        source = before
        if frozen and messages and len(self._threads) > 1 and not (before.objects and messages[0] is before.objects[0]):
            source = next((t.context for t in self._recent if t.context.objects and messages[0] is t.context.objects[0]), before)
        return source.digests_for(messages, frozen)

    def stamp(self, turn: TurnRecorded, body: TurnDelta, before: EncodingContext, digests: bytes,
              declared: Declared | None = None) -> TurnDelta:
        """``body`` (``turn`` encoded against ``before``) with its lineage placed (:meth:`place`)
        and recorded in its sampling (:data:`~agentlog.events.schema.lineage.LINEAGE_KEY`).
        Raises LineageError when the caller's sampling already holds that key: the engine's
        placement, not a caller's copy (say of a recorded turn's sampling), names the lineage."""
        if LINEAGE_KEY in turn.sampling:
            raise LineageError(f"turn {turn.turn_index}: sampling[{LINEAGE_KEY!r}] is recorded by the engine, found"
                               f" {turn.sampling[LINEAGE_KEY]!r} passed in; declare a lineage with declared_lineage=Declared(...)")
        if turn.messages:
            held = len(before.digests) // DIGEST_BYTES
            extends = held > 0 and body.shared_messages == held and len(turn.messages) > held
        else:
            extends = bool(before.prompt) and body.shared_tokens * 4 == len(before.prompt) + len(before.output)
        lineage = self.place(turn, digests, extends, declared)
        if lineage is UNSET:
            return body
        token = READING_STORED.set(True)  # the body was checked when built, the lineage when placed
        try:
            return msgspec.structs.replace(body, sampling={**body.sampling, LINEAGE_KEY: lineage_value(lineage)})
        finally:
            READING_STORED.reset(token)

    def place(self, turn: TurnRecorded, digests: bytes, extends_previous: bool, declared: Declared | None = None) -> Lineage | UnsetType:
        """The ``lineage`` value to record with ``turn`` (UNSET on the root
        lineage), staged for :meth:`commit`. ``digests``: the turn's message
        digests (:func:`~agentlog.events.schema.turn_delta.message_digests`);
        ``extends_previous``: whether the turn extends the session's previous
        turn in log order (the delta encoding found all of it shared)."""
        messages = turn.messages
        calls = tool_calls(turn.response_message)
        if declared is not None:
            value = self._declared_lineage(declared, turn)
            existing = self._threads.get(declared.id)
            key = existing.key if existing is not None else _key(messages, digests)
            first = value if existing is None and isinstance(value, Lineage) else None  # a new lineage's origin
            self._stage(declared.id, key, first, calls, _unanswered(existing, messages))
            return value if (value is not UNSET or declared.id != ROOT_LINEAGE) else UNSET
        thread = self._extended(turn, digests, extends_previous)
        key = b""  # the key of a turn that starts a lineage: computed only when it continues none
        if thread is None:
            if messages:
                key = _key(messages, digests)
            if key:
                thread = next((t for t in self._recent if t.key == key), None)
            elif not messages and self._recent:
                # A rewrite of a lineage's tokens (a re-tokenised last response: REALIGN) shares most
                # of them with that lineage, not with whichever lineage spoke last; ties: the newest.
                prompt = turn.prompt_ids
                thread = max(self._recent, key=lambda t: t.context.shared_tokens(prompt)) if len(self._recent) > 1 else self._recent[0]
        if thread is not None:
            self._stage(thread.id, thread.key, None, calls, _unanswered(thread, messages))
            return UNSET if thread.id == ROOT_LINEAGE else Lineage(thread.id)
        if not self._threads:
            self._stage(ROOT_LINEAGE, key, None, calls, ())
            return UNSET
        lineage = self._spawned(self._new_id(), _first_user_text(messages))
        self._stage(lineage.id, key, lineage, calls, ())
        return lineage

    def _stage(self, lineage_id: str, key: bytes, first: Lineage | None, calls: Sequence[ToolCall],
               left: Sequence[ToolCall]) -> None:
        self._staged_id, self._staged_key, self._staged_first = lineage_id, key, first
        self._staged_calls, self._staged_left = calls, left

    def _extended(self, turn: TurnRecorded, digests: bytes, extends_previous: bool) -> _Thread | None:
        recent = self._recent
        if not recent:
            return None
        if extends_previous:
            return recent[0]
        messages = turn.messages
        for t in recent[1:]:
            held = t.context
            if messages:
                if held.digests and len(digests) > len(held.digests) and digests.startswith(held.digests):
                    return t
            elif held.prompt and held.shared_tokens(turn.prompt_ids) * 4 == len(held.prompt) + len(held.output):
                return t
        return None

    def _new_id(self) -> str:
        # Counted when the turn is in the log (_apply): a turn whose append failed takes no number.
        n = self._subs
        while True:
            n += 1
            name = f"sub-{n}"
            if name not in self._threads:
                return name

    def _spawned(self, lineage_id: str, prompt: str, *, parent: str = "", call: str = "", how: str = "") -> Lineage:
        """A new lineage's first-turn value, its parent found as the module docstring says."""
        if parent:
            owner = self._threads[parent]
            turn = owner.calls[call] if call else owner.last_turn
            return Lineage(lineage_id, parent=parent, parent_turn=turn, spawn_call=call, how=how or HOW_DECLARED)
        if call:
            for t in self._recent:
                if call in t.calls:
                    return Lineage(lineage_id, parent=t.id, parent_turn=t.calls[call], spawn_call=call, how=how or HOW_TOOL_CALL)
        if prompt:
            for t in self._recent:
                for call_id, _name, texts in t.pending:
                    if any(s == prompt or (s and prompt.endswith("\n" + s)) or (len(s) >= _MIN_CONTAINED and s in prompt) for s in texts):
                        return Lineage(lineage_id, parent=t.id, parent_turn=t.calls[call_id], spawn_call=call_id, how=HOW_TOOL_CALL)
        for t in self._recent:
            candidates = [c[0] for c in t.pending if c[1] in SPAWN_TOOLS]
            if candidates:
                # The newest answer's calls, first come first matched: parallel subagents start in call order.
                newest = max(t.calls[c] for c in candidates)
                call_id = next(c for c in candidates if t.calls[c] == newest)
                return Lineage(lineage_id, parent=t.id, parent_turn=newest, spawn_call=call_id, how=HOW_ORDER)
        # No call spawned it that we can tell (a compacted history, a side request): its parent is the
        # newest turn of another lineage, and no call is named (a Bash call is no spawn).
        t = self._recent[0]
        return Lineage(lineage_id, parent=t.id, parent_turn=t.last_turn, how=HOW_ORDER)

    def _declared_lineage(self, declared: Declared, turn: TurnRecorded | None) -> Lineage | UnsetType:
        existing = self._threads.get(declared.id)
        if existing is not None:
            first = existing.first
            recorded_parent = first.parent if first is not None else ""
            if declared.parent and declared.parent != recorded_parent:
                raise LineageError(f"lineage {declared.id!r} was recorded with parent {recorded_parent or 'none'!r};"
                                   f" this turn declares parent {declared.parent!r}")
            if declared.call and (first is None or declared.call != first.spawn_call):
                raise LineageError(f"lineage {declared.id!r} was recorded as spawned by call"
                                   f" {(first.spawn_call if first is not None else '') or 'none'!r}; this turn declares {declared.call!r}")
            return UNSET if declared.id == ROOT_LINEAGE else Lineage(declared.id)
        if declared.parent and declared.parent not in self._threads:
            known = ", ".join(repr(k) for k in self._threads) or "none yet"
            raise LineageError(f"lineage {declared.id!r} declares parent {declared.parent!r}, which the session has not recorded"
                               f" (its lineages: {known})")
        if declared.call:
            owners = [t for t in ([self._threads[declared.parent]] if declared.parent else self._recent) if declared.call in t.calls]
            if not owners:
                raise LineageError(f"lineage {declared.id!r} declares spawning call {declared.call!r}, which no recorded answer"
                                   f" {'of lineage ' + repr(declared.parent) + ' ' if declared.parent else ''}made")
        if turn is None:
            return UNSET
        if not self._threads:
            return Lineage(declared.id, how=HOW_DECLARED)  # the session's first lineage, named by its agent
        return self._spawned(declared.id, _first_user_text(turn.messages), parent=declared.parent, call=declared.call,
                             how=HOW_DECLARED if declared.parent else "")

    # -------------------------------------------------------------- applying

    def commit(self, turn_index: int, context: EncodingContext) -> None:
        """The staged turn is in the log as ``turn_index``, leaving ``context``."""
        lineage_id, self._staged_id = self._staged_id, None
        if lineage_id is None:
            return
        self._apply(lineage_id, self._staged_key, self._staged_first, self._staged_calls, turn_index, context,
                    self._staged_left)
        self._staged_first, self._staged_calls, self._staged_left = None, (), ()  # nothing of it kept (the key is bytes)

    def _apply(self, lineage_id: str, key: bytes, first: Lineage | None, calls: Sequence[ToolCall],
               turn_index: int, context: EncodingContext, left: Sequence[ToolCall] = ()) -> None:
        """Apply a turn of ``lineage_id`` that made ``calls``, its prompt leaving the lineage's
        pending calls ``left`` unanswered (:func:`_unanswered`)."""
        thread = self._threads.get(lineage_id)
        recent = self._recent
        if thread is None:
            thread = self._threads[lineage_id] = _Thread(lineage_id, key, first)
            if lineage_id_is_sub(lineage_id):
                self._subs = max(self._subs, int(lineage_id[4:]))
            if first is not None and first.spawn_call:
                parent = self._threads.get(first.parent)
                if parent is not None:
                    parent.pending = tuple([c for c in parent.pending if c[0] != first.spawn_call])
            self._recent = recent = (thread, *recent)
        elif recent[0] is not thread:  # every lineage is in _recent; the common turn continues the newest
            self._recent = recent = (thread, *(t for t in recent if t is not thread))
        thread.context = context
        thread.last_turn = turn_index
        # A call stays pending until a subagent claims it or a later prompt carries its result
        # (Claude Code answers a Task call only once its subagent ended); the newest _PENDING kept.
        # Tuples: the common turn answers every call pending and makes new ones, kept as they came.
        pending = (*left, *calls) if left else calls
        thread.pending = pending[-_PENDING:] if len(pending) > _PENDING else pending
        if calls:
            for call_id, _name, _texts in calls:
                thread.calls[call_id] = turn_index
            # Bounded per live session: the calls a lineage made (for declared spawning calls) and the
            # contexts of its most recently active lineages (an older one is still found by its key).
            while len(thread.calls) > _CALLS:
                del thread.calls[next(iter(thread.calls))]
        if len(recent) > _CONTEXTS:
            for old in recent[_CONTEXTS:]:
                old.context = _EMPTY

    def rebuild(self, last_turns: Iterable[TurnRecorded], origins: dict[str, Lineage],
                history: Iterable[tuple[str, int, tuple[ToolCall, ...], tuple[str, ...]]]) -> None:
        """The state a resumed session continues from: each lineage's last durable turn
        (full), each lineage's first-turn record, and every durable turn's
        ``(lineage, turn index, tool calls, calls its prompt answered)`` in log order
        (:class:`agentlog.reducers.resume.ResumePoint`): the calls made and still pending
        are the live tracker's. Each turn is applied as the live tracker applied it, so a
        subagent's first turn takes its spawning call off its parent's pending calls when it
        comes, as it did live (not before its parent made it: the newest 32 kept are the same)."""
        last = {turn_lineage(t): t for t in last_turns}
        contexts = {lid: EncodingContext().encode(t)[1] for lid, t in last.items()}
        empty = EncodingContext()
        for lineage_id, turn_index, calls, answered in history:
            turn = last.get(lineage_id)
            if turn is None:
                continue
            context = contexts[lineage_id] if turn_index == turn.turn_index else empty
            self._apply(lineage_id, _key(turn.messages, contexts[lineage_id].digests), origins.get(lineage_id), tuple(calls),
                        turn_index, context, _unanswered(self._threads.get(lineage_id), answered=answered))


def lineage_id_is_sub(lineage_id: str) -> bool:
    """Whether ``lineage_id`` is one the engine names (``sub-N``)."""
    return lineage_id.startswith("sub-") and lineage_id[4:].isdigit()
