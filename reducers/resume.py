"""Where an interrupted session can continue from: its resume point, a pure fold of the log.

A worker killed mid-session leaves the session open or running in the log.
The log holds everything a new incarnation needs to continue it:

* the conversation: the session's prompt (``session_opened``) and every
  turn acknowledged before the crash. A turn in flight at the crash was never
  acknowledged, so it is not in the log and not in the sample;
* the sandbox: the ``sandbox_snapshotted`` events name, per turn, the
  snapshot of the sandbox as that turn's request found it (after every
  command before the turn);
* the harness (``session_started.harness``) and how often the session was
  resumed already (``session_resumed``).

:func:`resume_points` folds the records of the given sessions into one
:class:`ResumePoint` each. The rule for continuing is
:meth:`ResumePoint.snapshot_to_resume`: with ``n`` durable turns the new
incarnation restores the snapshot taken before turn ``n - 1`` (before turn 0
when no turn was durable), rebuilds the conversation up to turn ``n - 1``'s
answer, runs that answer's tool calls again in the restored sandbox, and
asks for turn ``n``. Restoring any other snapshot would put the agent on a
sandbox from another turn, so there is no fallback: without that snapshot
the session is aborted.

Pure: no clock, randomness or I/O; the caller reads the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from msgspec import UNSET

from agentlog.events.schema.lineage import ROOT_LINEAGE, Lineage, ToolCall, answered_calls, tool_calls, turn_lineage
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import (
    Envelope, SandboxSnapshotted, SessionOpened, SessionResumed, SessionStarted, TeacherScored, TurnRecorded,
)
from agentlog.events.schema.turn import scored_against


@dataclass
class ResumePoint:
    """What the log holds of one interrupted session (see the module docstring)."""

    session_id: str
    group_id: str = ""
    group_size: int = 1
    sample_index: int = 0
    #: The session's prompt messages (from ``session_opened``).
    prompt: list[dict[str, Any]] = field(default_factory=list)
    #: The aborted member it replaces (per-sample refill), "" for an original member.
    replaces: str = ""
    #: When the session opened and when its last record was written (ns since the epoch).
    opened_ns: int = 0
    last_ns: int = 0
    #: When its newest incarnation began (``session_opened``'s, else its last ``session_resumed``'s
    #: time), and the seconds its earlier incarnations ran: see :attr:`spent_s`.
    incarnation_ns: int = -1
    earlier_s: float = 0.0
    #: Whether ``session_started`` is in the log, and the harness it named.
    started: bool = False
    harness: str = ""
    #: Turns acknowledged before the crash (turn indexes 0 .. durable_turns - 1).
    durable_turns: int = 0
    #: The last durable turn in full (deltas expanded), None before the first.
    last_turn: TurnRecorded | None = None
    #: The last durable turn of each lineage (subagents), least recently active first, and each
    #: lineage's first-turn record: what the engine's lineage tracker continues from.
    lineage_turns: dict[str, TurnRecorded] = field(default_factory=dict)
    lineage_origins: dict[str, Lineage] = field(default_factory=dict)
    #: Every durable turn's (lineage, turn index, its answer's tool calls, the calls its prompt
    #: answered), in log order: which calls each lineage made and which are still pending.
    lineage_history: list[tuple[str, int, tuple[ToolCall, ...], tuple[str, ...]]] = field(default_factory=list)
    #: Per durable turn: output tokens and sampling temperature (NaN when not a number),
    #: what the engine checks a teacher's scores of an earlier turn against.
    turn_outputs: list[int] = field(default_factory=list)
    turn_temperatures: list[float] = field(default_factory=list)
    #: Per turn index: the digest of the last ``sandbox_snapshotted`` for it.
    snapshots: dict[int, str] = field(default_factory=dict)
    #: ``session_resumed`` events so far (the next incarnation is this + 1).
    resumes: int = 0
    #: The LSN of the session's ``session_opened``.
    opened_lsn: int = -1
    #: ``(turn_index, teacher)`` of every ``teacher_scored`` (scores or a failure) in the log: a
    #: worker killed while it recorded a session's scores left some, which must not be recorded twice.
    scored: set[tuple[int, str]] = field(default_factory=set)
    #: Every durable turn in full, oldest first: kept only by ``resume_points(..., keep_turns=True)``
    #: (a teacher scores them before the resumed session ends), else empty.
    turns: list[TurnRecorded] = field(default_factory=list)

    @property
    def spent_s(self) -> float:
        """The wall-clock budget the session used: each incarnation's time from its start to its
        last record (a crash's downtime, between a dead incarnation's last record and the next's
        ``session_resumed``, is not the session's)."""
        start = self.opened_ns if self.incarnation_ns < 0 else self.incarnation_ns
        return self.earlier_s + max(0.0, (self.last_ns - start) / 1e9)

    @property
    def snapshot_turn(self) -> int:
        """The turn whose snapshot a resume restores: the last durable one (0 before any)."""
        return max(self.durable_turns - 1, 0)

    def snapshot_to_resume(self) -> str | None:
        """The digest of the snapshot a resume must restore, or None when the log names none
        for :attr:`snapshot_turn` (the session cannot resume: no other snapshot matches)."""
        return self.snapshots.get(self.snapshot_turn)

    def why_not_resumable(self) -> str | None:
        """Why the log alone rules a resume out (one line), or None when it allows one."""
        if not self.started:
            return "it never started (no session_started in the log)"
        if self.snapshot_to_resume() is None:
            held = ", ".join(str(t) for t in sorted(self.snapshots)) or "none"
            return (f"no sandbox snapshot of turn {self.snapshot_turn}, the last durable turn's "
                    f"({self.durable_turns} durable turns; snapshots of turns: {held})")
        return None

    @property
    def root_lineage(self) -> str:
        """The lineage of the session's first durable turn: ``main``, or the id its agent declared."""
        return self.lineage_history[0][0] if self.lineage_history else ROOT_LINEAGE

    def conversation(self) -> list[dict[str, Any]]:
        """The messages up to and including the answer of the last durable turn of the session's
        root lineage, the one its first turn began (the prompt before any): a subagent's turn
        recorded after it is the subagent's conversation, not the one the resumed agent continues.
        The sandbox a resume restores is still the last durable turn's (:attr:`snapshot_turn`),
        so it holds what a subagent did after the root lineage's last turn."""
        turn = self.lineage_turns.get(self.root_lineage, self.last_turn)
        if turn is None:
            return [dict(m) for m in self.prompt]
        messages = [dict(m) for m in turn.messages]
        if turn.response_message is not None:
            messages.append(dict(turn.response_message))
        return messages


def resume_points(envelopes: Iterable[Envelope], session_ids: Iterable[str], *, keep_turns: bool = False) -> dict[str, ResumePoint]:
    """One :class:`ResumePoint` for each of ``session_ids`` that ``envelopes`` (a log, in LSN
    order) opened; the records of every other session are skipped before any turn is expanded.
    ``keep_turns``: keep every durable turn in full (:attr:`ResumePoint.turns`; memory: each
    turn's whole prompt), not just the last."""
    wanted = set(session_ids)
    points: dict[str, ResumePoint] = {}
    mine = (env for env in envelopes if env.session_id in wanted)
    for env in full_turns(mine):
        body = env.body
        sid = env.session_id
        if type(body) is SessionOpened:
            points[sid] = ResumePoint(sid, body.group_id, body.group_size, body.sample_index, list(body.prompt),
                                      body.replaces if isinstance(body.replaces, str) else "", env.ts_ns, opened_lsn=env.lsn)
        point = points.get(sid)
        if point is None:
            continue  # a record of a session the slice did not see open: not one of ours
        if type(body) is SessionResumed:  # the dead incarnation's time, to its last record, before this one starts
            point.earlier_s, point.incarnation_ns = point.spent_s, env.ts_ns
        point.last_ns = env.ts_ns
        if type(body) is SessionStarted:
            point.started, point.harness = True, body.harness
        elif type(body) is TurnRecorded:
            point.durable_turns = body.turn_index + 1
            point.last_turn = body
            lineage = turn_lineage(body)
            point.lineage_turns.pop(lineage, None)
            point.lineage_turns[lineage] = body
            if body.lineage is not UNSET and body.lineage.how:
                point.lineage_origins[lineage] = body.lineage
            point.lineage_history.append((lineage, body.turn_index, tuple(tool_calls(body.response_message)),
                                          tuple(answered_calls(body.messages))))
            n_out, temperature = scored_against(body)
            point.turn_outputs.append(n_out)
            point.turn_temperatures.append(temperature)
            if keep_turns:
                point.turns.append(body)
        elif type(body) is TeacherScored:
            point.scored.add((body.turn_index, body.teacher))
        elif type(body) is SandboxSnapshotted:
            point.snapshots[body.turn_index] = body.digest
        elif type(body) is SessionResumed:
            point.resumes += 1
            # Snapshots past the restored one were the dead incarnation's: its sandbox, not this one's.
            point.snapshots = {t: d for t, d in point.snapshots.items() if t <= body.snapshot_turn}
    return points


__all__ = ["ResumePoint", "resume_points"]
