"""The lineages of one session, as ``agentlog show``, ``agentlog ui`` and the report display them.

A session whose agent spawns subagents holds several conversations, its
lineages (:mod:`agentlog.events.schema.lineage`): each turn names its lineage,
and a lineage's first turn names its parent lineage, the parent's turn whose
tool call spawned it, that call's id and how the engine matched them
(:mod:`agentlog.engine.lineages`). :class:`SessionLineages` gathers, as a
session's envelopes pass (so the report's streaming reader keeps only this per
session in flight), each lineage's turns and where it came from, with the
spawning tool call read off the parent turn's response: its tool name and
arguments (the gateway's flat ``{"id", "name", "arguments"}`` or OpenAI's
``{"id", "function": {"name", "arguments"}}``). A session without subagents
has one lineage, ``main``, and nothing of this is shown for it
(:attr:`SessionLineages.shown`): its display stays as it was.

The tree puts each lineage under its parent, in the order the lineages began
(:meth:`SessionLineages.tree`); ``show`` prints it (:meth:`SessionLineages.lines`),
the ui and the report take :meth:`SessionLineages.to_json`.
"""

from __future__ import annotations

import collections
import json
from typing import Any, NamedTuple

from msgspec import UNSET

from agentlog.events.schema.lineage import HOW_DECLARED, HOW_ORDER, HOW_TOOL_CALL, ROOT_LINEAGE, Lineage, turn_lineage
from agentlog.events.schema.types import TurnDelta, TurnRecorded

#: Characters of a spawning call's arguments shown (``show --full`` shows all).
SPAWN_ARGS_SHOWN = 120
#: Turn indices listed per lineage before the list is cut (``show --full`` lists all).
TURNS_SHOWN = 24
#: How each way of finding a lineage's parent reads in the display.
HOW_SHOWN = {
    HOW_DECLARED: "declared by the agent (X-Agentlog-Lineage header)",
    HOW_TOOL_CALL: "matched by the tool call (its id or the prompt it passed)",
    HOW_ORDER: "matched by time and order (the newest pending call, else the newest turn)",
}


class SpawnCall(NamedTuple):
    """The tool call of a parent turn that spawned a lineage."""

    turn: int
    call_id: str
    #: The tool's name, "" when the parent turn's response holds no call with that id.
    name: str
    #: Its arguments as JSON text (a string argument as it is), "" when unknown.
    arguments: str
    #: Whether the parent turn's calls were no longer held when the lineage began (a bounded
    #: :class:`SessionLineages` keeps only each lineage's latest turns with calls): name unknown.
    forgotten: bool = False
    #: The arguments' full length in characters (a bounded SessionLineages keeps only the
    #: first SPAWN_ARGS_SHOWN of them in ``arguments``).
    arguments_chars: int = 0


class LineageEntry:
    """One lineage of a session: its id, its first turn's record (None for a root), its
    turns in log order and, for a spawned lineage, the call that spawned it."""

    __slots__ = ("id", "origin", "turns", "spawn")

    def __init__(self, lineage_id: str, origin: Lineage | None) -> None:
        self.id = lineage_id
        self.origin = origin
        self.turns: list[int] = []
        self.spawn: SpawnCall | None = None

    @property
    def parent(self) -> str:
        """The parent lineage's id, "" for a root."""
        return self.origin.parent if self.origin is not None else ""


def _call_fields(call: Any) -> tuple[str, str, Any] | None:
    """(id, name, arguments) of a recorded tool call in either form, None for no call."""
    if not isinstance(call, dict):
        return None
    inner = call.get("function")
    fn: dict = inner if isinstance(inner, dict) else call
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        return None
    name = fn.get("name")
    return call_id, name if isinstance(name, str) else "", fn.get("arguments", "")


def _compact(call: Any, cut: int | None) -> tuple[str, str, str, int] | None:
    """(id, name, arguments as text cut to ``cut`` characters, the text's full length) of a
    recorded tool call, None for no call."""
    fields = _call_fields(call)
    if fields is None:
        return None
    text = _arguments_text(fields[2])
    return fields[0], fields[1], text if cut is None else text[:cut], len(text)


def _arguments_text(args: Any) -> str:
    if isinstance(args, str):
        return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False, default=str)


class SessionLineages:
    """A session's lineages, gathered from its envelopes in log order (:meth:`feed`).

    ``keep_turns``: the tool calls of only that many of each lineage's latest turns with
    calls are kept to name a later subagent's spawning call (None: all; the report, which
    streams, bounds it, since a subagent is spawned by its parent's latest turns)."""

    __slots__ = ("keep_turns", "_lineages", "_calls", "_called", "_dropped")

    def __init__(self, keep_turns: int | None = None) -> None:
        self.keep_turns = keep_turns
        self._lineages: dict[str, LineageEntry] = {}
        # Turn index -> its response's tool calls (bounded: their _compact forms).
        self._calls: dict[int, list] = {}
        self._called: dict[str, collections.deque] = {}  # lineage -> its turns in _calls, oldest first
        self._dropped: dict[str, int] = {}  # lineage -> the newest of its turns whose calls keep_turns dropped

    def feed(self, env: Any) -> None:
        """Take one of the session's envelopes (in log order); only turns matter."""
        body = env.body
        kind = type(body)
        if kind is not TurnRecorded and kind is not TurnDelta:
            return
        lineage_id = turn_lineage(body)
        entry = self._lineages.get(lineage_id)
        if entry is None:
            origin = body.lineage if body.lineage is not UNSET and body.lineage.spawned else None
            entry = self._lineages[lineage_id] = LineageEntry(lineage_id, origin)
            if origin is not None:
                entry.spawn = self._spawn_call(origin)
        entry.turns.append(body.turn_index)
        response = body.response_message
        calls = response.get("tool_calls") if isinstance(response, dict) else None
        if calls and isinstance(calls, list):
            if self.keep_turns is None:
                self._calls[body.turn_index] = calls  # read only when a lineage names one of them
            else:
                # A bounded SessionLineages (the report, over sessions in flight) keeps only the
                # arguments' first characters it shows.
                self._calls[body.turn_index] = [c for c in (_compact(call, SPAWN_ARGS_SHOWN) for call in calls) if c]
                called = self._called.setdefault(lineage_id, collections.deque())
                called.append(body.turn_index)
                while len(called) > self.keep_turns:
                    dropped = called.popleft()
                    self._calls.pop(dropped, None)
                    self._dropped[lineage_id] = max(dropped, self._dropped.get(lineage_id, dropped))

    def _spawn_call(self, origin: Lineage) -> SpawnCall:
        """The parent turn's call ``origin`` names (name and arguments "" when not found)."""
        if origin.spawn_call:
            for call in self._calls.get(origin.parent_turn, ()):
                compact = call if type(call) is tuple else _compact(call, None)
                if compact is not None and compact[0] == origin.spawn_call:
                    call_id, name, text, chars = compact
                    return SpawnCall(origin.parent_turn, call_id, name, text, arguments_chars=chars)
        forgotten = origin.parent_turn not in self._calls and origin.parent_turn <= self._dropped.get(origin.parent, -1)
        return SpawnCall(origin.parent_turn, origin.spawn_call, "", "", forgotten)

    @property
    def lineages(self) -> list[LineageEntry]:
        """The lineages, in the order they began."""
        return list(self._lineages.values())

    @property
    def shown(self) -> bool:
        """Whether the session's display names lineages: it has more than one, or one an
        agent declared under another id than ``main``."""
        return len(self._lineages) > 1 or any(lid != ROOT_LINEAGE for lid in self._lineages)

    def tree(self) -> list[tuple[int, LineageEntry]]:
        """``(depth, lineage)`` depth-first: each lineage under its parent, siblings in the
        order they began; a lineage whose parent recorded no turn is a root."""
        children: dict[str, list[LineageEntry]] = {}
        roots = []
        for entry in self._lineages.values():
            if entry.parent and entry.parent in self._lineages:
                children.setdefault(entry.parent, []).append(entry)
            else:
                roots.append(entry)
        out: list[tuple[int, LineageEntry]] = []
        stack = [(0, e) for e in reversed(roots)]
        seen: set[str] = set()
        while stack:
            depth, entry = stack.pop()
            if entry.id in seen:  # a parent cycle cannot be recorded; never loop on one
                continue
            seen.add(entry.id)
            out.append((depth, entry))
            stack.extend((depth + 1, c) for c in reversed(children.get(entry.id, ())))
        return out

    def lines(self, full: bool, rows_of: dict[str, list[int]] | None = None) -> list[str]:
        """``show``'s lineage tree: per lineage (indented under its parent) its turns and
        rows, then for a spawned one the parent turn, the call and how they were matched."""
        out = []
        for depth, entry in self.tree():
            pad = "  " * (depth + 1)
            rows = (rows_of or {}).get(entry.id, [])
            made = f"  row(s) {', '.join(map(str, rows))}" if rows else "  no row"
            out.append(f"{pad}{entry.id}  {len(entry.turns)} turn(s): {turn_list(entry.turns, full)}{made}")
            if entry.origin is not None:
                out.append(f"{pad}  spawned by {spawn_text(entry, full)}")
        return out

    def to_json(self, rows_of: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
        """The lineages in tree order (:meth:`tree`), as the ui's session view and the report take them."""
        out = []
        for depth, entry in self.tree():
            o, spawn = entry.origin, entry.spawn
            out.append({
                "id": entry.id, "depth": depth, "parent": o.parent if o is not None else None,
                "parent_turn": o.parent_turn if o is not None else None, "spawn_call": (o.spawn_call or None) if o is not None else None,
                "how": (o.how or None) if o is not None else None, "turns": list(entry.turns),
                "rows": list((rows_of or {}).get(entry.id, [])),
                "spawn": None if spawn is None else {"turn": spawn.turn, "call_id": spawn.call_id or None,
                                                     "name": spawn.name or None, "arguments": spawn.arguments or None},
                "spawned_by": spawn_text(entry, False) if o is not None else None,
                "matched": HOW_SHOWN.get(o.how, o.how) if o is not None and o.how else None,
            })
        return out


def turn_list(turns: list[int], full: bool) -> str:
    """``0, 3, 5`` (cut to the first and last few beyond :data:`TURNS_SHOWN` unless ``full``)."""
    if full or len(turns) <= TURNS_SHOWN:
        return ", ".join(map(str, turns))
    head, tail = turns[: TURNS_SHOWN - 4], turns[-4:]
    return f"{', '.join(map(str, head))}, ...({len(turns) - len(head) - len(tail)} more)..., {', '.join(map(str, tail))}"


def spawn_text(entry: LineageEntry, full: bool) -> str:
    """``main turn 0, call call_1 Task({"prompt": "..."}); matched by the tool call ...``."""
    o = entry.origin
    assert o is not None
    spawn = entry.spawn
    text = f"{o.parent} turn {o.parent_turn}"
    if o.spawn_call:
        text += f", call {o.spawn_call}"
        if spawn is not None and spawn.name:
            args = spawn.arguments
            if spawn.arguments_chars > SPAWN_ARGS_SHOWN and (not full or len(args) < spawn.arguments_chars):
                args = args[:SPAWN_ARGS_SHOWN] + f"... (+{spawn.arguments_chars - SPAWN_ARGS_SHOWN} chars)"
            text += f" {spawn.name}({' '.join(args.split())})"
        elif spawn is not None and spawn.forgotten:
            text += " (its tool and arguments not kept: only each lineage's latest turns with calls are)"
        else:
            text += " (not among the parent turn's tool calls)"
    else:
        text += " (no tool call named)"
    return text + f"; {HOW_SHOWN.get(o.how, o.how or 'matched how: not recorded')}"


def session_lineages(envs: list, keep_turns: int | None = None) -> SessionLineages:
    """:class:`SessionLineages` of a session's envelopes."""
    got = SessionLineages(keep_turns)
    for env in envs:
        got.feed(env)
    return got


def row_lineages(rows: Any) -> dict[str, list[int]]:
    """Lineage id -> the indices of its rows, for trajectory rows or samples (a row
    without a lineage, an aborted session's placeholder, is left out)."""
    out: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        lineage = getattr(row, "lineage", None)
        if lineage is None:
            metadata = getattr(row, "metadata", None) or {}
            lineage = metadata.get("lineage")
            i = getattr(row, "row_index", i)
        if lineage:
            out.setdefault(lineage, []).append(i)
    return out
