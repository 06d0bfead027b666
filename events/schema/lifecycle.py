"""The session lifecycle, defined once.

The grammar is declared as data and built into a ``transitions.Machine``
(``auto_transitions=False``, so no ``to_<state>`` shortcut can skip a rule).
From that single machine we derive an immutable ``(state, trigger) -> dest``
table. The engine decides with the table; the reducers validate with it
(one step, ``reducers.lifecycle_step.evolve``, that every fold composes);
nobody adds per-session models to the shared machine (that is O(n) in
``transitions`` and keeps every model alive).
"""

from __future__ import annotations

from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping

from transitions import Machine

from ..errors import AgentlogError
from .types import (
    CommandRan, RewardAssigned, SandboxSnapshotted, SessionOpened, TeacherScored, TurnDelta, TurnRecorded, TurnUndelivered,
)


class State(str, Enum):
    """Where a session is in its lifecycle."""

    OPEN = "open"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    DROPPED = "dropped"

    def __str__(self) -> str:  # "open", not "State.OPEN", in messages
        return self.value

    # Hash as the value string, in C: consistent with ``State.OPEN == "open"`` and
    # cheap in the reducers' per-event ``(state, tag)`` table lookups.
    __hash__ = str.__hash__


TERMINAL_STATES = frozenset({State.FINISHED, State.ABORTED, State.DROPPED})

#: The lifecycle as data: trigger, sources, destination, the event it emits.
LIFECYCLE_SPEC: tuple[dict[str, Any], ...] = (
    {"trigger": "start", "source": ["open"], "dest": "running", "event": "session_started"},
    {"trigger": "finish", "source": ["running"], "dest": "finished", "event": "session_finished"},
    {"trigger": "abort", "source": ["open", "running"], "dest": "aborted", "event": "session_aborted"},
    {"trigger": "drop", "source": ["open", "running"], "dest": "dropped", "event": "session_dropped"},
    # A new incarnation continues a running session whose previous one died: never after a terminal event.
    {"trigger": "resume", "source": ["running"], "dest": "running", "event": "session_resumed"},
)

#: Event bodies that are legal only while the session is running; they
#: happen inside it without changing its state.
RUNNING_ONLY_EVENTS: tuple[type, ...] = (
    TurnRecorded, TurnUndelivered, CommandRan, RewardAssigned, TurnDelta, TeacherScored, SandboxSnapshotted,
)
#: The same events by tag (for folds over projections that carry tags only).
IN_SESSION_EVENTS: tuple[str, ...] = tuple(t.__struct_config__.tag for t in RUNNING_ONLY_EVENTS)


def _build_machine() -> Machine:
    return Machine(
        model=None,
        states=[s.value for s in State],
        transitions=[{k: v for k, v in t.items() if k != "event"} for t in LIFECYCLE_SPEC],
        initial="open",
        auto_transitions=False,
        send_event=False,
    )


#: The single transitions.Machine; used to derive TRANSITIONS and for docs.
MACHINE = _build_machine()


def _derive_table(machine: Machine) -> Mapping[tuple[State, str], State]:
    table: dict[tuple[State, str], State] = {}
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for tr in transitions:
                table[(State(source), trigger)] = State(tr.dest)
    return MappingProxyType(table)


#: Immutable ``(state, trigger) -> dest``, derived from MACHINE.
TRANSITIONS: Mapping[tuple[State, str], State] = _derive_table(MACHINE)
TRIGGERS: tuple[str, ...] = tuple(t["trigger"] for t in LIFECYCLE_SPEC)

#: Which trigger each transition event fires, by tag (from LIFECYCLE_SPEC).
TRIGGER_OF_TAG: Mapping[str, str] = MappingProxyType({spec["event"]: spec["trigger"] for spec in LIFECYCLE_SPEC})
#: The tag that brings a session into existence.
OPENED_TAG: str = SessionOpened.__struct_config__.tag
#: Every tag the lifecycle knows: opened, the transition events and the in-session events.
SESSION_TAGS: frozenset[str] = frozenset({OPENED_TAG, *TRIGGER_OF_TAG, *IN_SESSION_EVENTS})


class LifecycleError(AgentlogError):
    """Base of lifecycle violations."""


class IllegalTransition(LifecycleError):
    """A trigger (or in-session event) is not allowed in the session's state."""

    def __init__(self, session_id: str, trigger: str, state: State | str | None, detail: str = "") -> None:
        self.session_id = session_id
        self.trigger = trigger
        self.state = state
        allowed = sorted(str(s) for (s, t) in TRANSITIONS if t == trigger) or ["running"]
        msg = (
            f"session {session_id!r}: illegal {trigger!r} in state {str(state) if state is not None else 'unknown'!r}"
            f" (allowed from: {', '.join(allowed)})"
        )
        super().__init__(msg + (f"; {detail}" if detail else ""))


class SessionClosed(IllegalTransition):
    """finish/abort on a session that already reached a terminal state."""

    def __init__(self, session_id: str, trigger: str, state: State) -> None:
        super().__init__(session_id, trigger, state, detail=f"the session is already {state} (terminal states are absorbing)")


def next_state(session_id: str, state: State, trigger: str) -> State | None:
    """Apply one trigger by the table.

    Returns the destination, or None for the only legal no-op (``drop`` on a
    terminal session). Raises SessionClosed for finish/abort on a terminal
    session and IllegalTransition for every other move the table lacks.
    """
    dest = TRANSITIONS.get((state, trigger))
    if dest is not None:
        return dest
    if state in TERMINAL_STATES:
        if trigger == "drop":
            return None
        if trigger in ("finish", "abort"):
            raise SessionClosed(session_id, trigger, state)
    raise IllegalTransition(session_id, trigger, state)


def render_mermaid() -> str:
    """The lifecycle as a Mermaid stateDiagram (for docs and `agentlog lifecycle`)."""
    lines = ["stateDiagram-v2", "    [*] --> open: session_opened"]
    for spec in LIFECYCLE_SPEC:
        for src in spec["source"]:
            lines.append(f"    {src} --> {spec['dest']}: {spec['trigger']} / {spec['event']}")
    for s in sorted(TERMINAL_STATES, key=lambda s: s.value):
        lines.append(f"    {s.value} --> [*]")
    return "\n".join(lines)


def render_table() -> str:
    """The lifecycle as a plain-text table."""
    rows = [("trigger", "from", "to", "event")]
    for spec in LIFECYCLE_SPEC:
        rows.append((spec["trigger"], ", ".join(spec["source"]), spec["dest"], spec["event"]))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append("drop on a terminal session: no-op; finish/abort on one: SessionClosed")
    return "\n".join(out)
