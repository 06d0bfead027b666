"""Lineages: the conversation threads inside one session.

An agent that spawns subagents (Claude Code's ``Task`` tool, Codex's
sub-tasks, a user's own orchestrator) runs several conversations under one
session: the parent's, and one per subagent, each with its own system prompt
or first user message, their turns interleaved in the log. Each conversation
is a *lineage*. The engine places every turn in one (see
:mod:`agentlog.engine.lineages`) and the turn records it in its ``lineage``
field; the reducers build one trajectory per lineage.

The turn records it beside its sampling settings, as ``sampling["lineage"]``
(:data:`LINEAGE_KEY`: a :class:`Lineage` as a map, its default fields left
out), the way it records the fleet server that generated it: a sixteenth turn
field would change the stored bytes of every turn_delta (msgpack's map header
grows past 15 entries). The key is absent on the turns of the session's first
lineage, :data:`ROOT_LINEAGE`, unless an agent declared that lineage under
another id. A session without subagents therefore stores every turn byte for
byte as before lineages existed, and a reader that predates lineages reads an
extra sampling key it does not use, and sees one conversation, as it always
did. Read it with the turn's ``lineage`` property (:func:`lineage_of`).

Every turn of another lineage carries its ``id``; the lineage's first turn
also says where it came from: the ``parent`` lineage, the ``parent_turn``
whose tool call spawned it, that call's id (``spawn_call``) when it is known,
and ``how`` the parent was found (:data:`HOW_VALUES`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from msgspec import UNSET

from .validation import READING_STORED, fail

#: The id of a session's first lineage when nobody declared another.
ROOT_LINEAGE = "main"

#: A lineage id: a letter or digit, then up to 63 letters, digits, ``.``, ``_``, ``:`` or ``-``
#: (it is shown in tables and sent in a header).
LINEAGE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
#: A tool call id, as agents and APIs make them (``call_...``, ``toolu_...``).
CALL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

#: How a lineage's parent was found: the agent declared the lineage (a header); the parent's
#: tool call was matched by its id or by the prompt it passed; or by time and order (the
#: newest pending tool call, else the newest turn, of another lineage).
HOW_DECLARED = "declared"
HOW_TOOL_CALL = "tool_call"
HOW_ORDER = "order"
HOW_VALUES = (HOW_DECLARED, HOW_TOOL_CALL, HOW_ORDER)


class Lineage(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The lineage a turn belongs to (see the module docstring). Only the
    lineage's first turn carries the fields after ``id``; a root lineage has
    no parent (``parent`` "" and ``parent_turn`` -1)."""

    id: str
    parent: str = ""
    parent_turn: int = -1
    spawn_call: str = ""
    how: str = ""

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        event = "turn.lineage"
        if type(self.id) is not str or not LINEAGE_ID_RE.fullmatch(self.id):
            fail(event, "id", f"a lineage id matching {LINEAGE_ID_RE.pattern}", self.id)
        if self.parent:
            if type(self.parent) is not str or not LINEAGE_ID_RE.fullmatch(self.parent):
                fail(event, "parent", f"a lineage id matching {LINEAGE_ID_RE.pattern} or ''", self.parent)
            if self.parent == self.id:
                fail(event, "parent", "another lineage than the turn's own", self.parent)
        if type(self.parent_turn) is not int or self.parent_turn < -1 or (self.parent_turn >= 0) != bool(self.parent):
            fail(event, "parent_turn", "a turn index >= 0 with a parent, -1 without one", self.parent_turn)
        if self.spawn_call and (type(self.spawn_call) is not str or not CALL_ID_RE.fullmatch(self.spawn_call)):
            fail(event, "spawn_call", f"a tool call id matching {CALL_ID_RE.pattern} or ''", self.spawn_call)
        if self.how and self.how not in HOW_VALUES:
            fail(event, "how", f"one of {'/'.join(HOW_VALUES)} or ''", self.how)

    @property
    def spawned(self) -> bool:
        """Whether this is a lineage's first turn that names its parent."""
        return bool(self.parent)


#: The ``sampling`` key a turn's lineage is recorded under.
LINEAGE_KEY = "lineage"


def lineage_value(lineage: Lineage) -> dict[str, Any]:
    """What ``sampling["lineage"]`` holds for ``lineage``: its fields, the defaults left out."""
    return msgspec.to_builtins(lineage)


def lineage_of(sampling: Any) -> Any:
    """The :class:`Lineage` a turn's ``sampling`` records, UNSET when none (the root lineage).
    Reads what was checked when written: no checks run again. A ``sampling`` that is no dict
    (a turn not checked yet, which the log will refuse) records none."""
    value = sampling.get(LINEAGE_KEY) if isinstance(sampling, dict) else None
    if value is None:
        return UNSET
    token = READING_STORED.set(True)
    try:
        return msgspec.convert(value, Lineage)
    except msgspec.ValidationError:
        return UNSET  # not ours: a newer writer's form, or a caller's own key (never written by this one)
    finally:
        READING_STORED.reset(token)


def check_lineage(event: str, value: Any) -> None:
    """The write-time check of ``sampling["lineage"]``: a Lineage's map, every field valid."""
    try:
        msgspec.convert(value, Lineage)
    except msgspec.ValidationError as exc:
        fail(event, f"sampling.{LINEAGE_KEY}", "a lineage map (id, parent, parent_turn, spawn_call, how)", f"{value!r} ({exc})")


def turn_lineage(body: Any) -> str:
    """The id of the lineage a turn (either encoding) belongs to."""
    lineage = lineage_of(getattr(body, "sampling", None))
    return ROOT_LINEAGE if lineage is UNSET else lineage.id


# ------------------------------------------------ what placing a turn reads of its messages

#: A tool call as lineage placement reads it: (id, tool name, the strings in its arguments).
ToolCall = tuple[str, str, tuple[str, ...]]


def message_text(content: Any) -> str:
    """A message's text: its str content, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str) else "" for p in content)
    return ""


def _strings(value: Any, out: list[str], depth: int = 0) -> list[str]:
    """The strings inside a tool call's arguments (a few levels deep), appended to ``out``, in
    order. Appended, not yielded: a generator a level would be two more objects and frames a
    call, and every answer of an agent session has its calls read (:func:`tool_calls`)."""
    if isinstance(value, str):
        out.append(value)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            if type(v) is str:  # the common argument: no call
                out.append(v)
            else:
                _strings(v, out, depth + 1)
    elif depth < 3 and isinstance(value, list):
        for v in value:
            _strings(v, out, depth + 1)
    return out


def tool_calls(response: Any) -> tuple[ToolCall, ...]:
    """(id, name, argument strings) of an answer's tool calls, in order (a tuple: the engine keeps
    them while they are pending, and an answer without calls gives the shared empty tuple)."""
    calls = response.get("tool_calls") if isinstance(response, dict) else None
    if not isinstance(calls, list):
        return ()
    out = []
    for c in calls:
        if not isinstance(c, dict):
            continue
        fn: dict[str, Any] = c["function"] if isinstance(c.get("function"), dict) else c  # OpenAI's nesting, or the gateway's flat form
        call_id, name = c.get("id"), fn.get("name")
        args = fn.get("arguments")
        if isinstance(args, str) and args.startswith("{"):  # OpenAI's wire form: a JSON object as text
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass  # not JSON after all, or nested too deep to parse: matched as the text it is
        if isinstance(call_id, str) and call_id:
            out.append((call_id, name if isinstance(name, str) else "", tuple(_strings(args, []))))
    return tuple(out)


def answered_calls(messages: list[Any]) -> set[str]:
    """The tool call ids answered by the tool results after the prompt's last assistant message."""
    out = set()
    for m in reversed(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "assistant":
            break
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            out.add(m["tool_call_id"])
    return out
