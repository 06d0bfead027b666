"""What the reducers raise: a record they refuse, and one they cannot read.

:class:`ReduceError` names the LSN and session of a record the log should
never hold (a lifecycle or sequence violation, a group conflict). Its
subclass :class:`UnknownEventError` is a different story: the record is
sound, but a newer agentlog wrote an event type this version does not know,
so a fold that must interpret every event of the session cannot go on. The
cure is to upgrade, not to repair the log.
"""

from __future__ import annotations

from agentlog.events.errors import AgentlogError


class ReduceError(AgentlogError, ValueError):
    """The log holds something the reducers refuse; names the LSN and session."""

    def __init__(self, lsn: int, session_id: str, message: str, kind: str | None = None) -> None:
        self.lsn = lsn
        self.session_id = session_id
        #: The lifecycle violation's kind (``reducers.lifecycle_step.ViolationKind``), or None for other refusals.
        self.kind = kind
        super().__init__(f"lsn {lsn}, session {session_id!r}: {message}")

    @classmethod
    def of_violation(cls, violation) -> "ReduceError":
        """The error a fold that must not go on raises for a
        :class:`reducers.lifecycle_step.Violation`."""
        return cls(violation.lsn, violation.session_id, violation.describe(), violation.kind)


class UnknownEventError(ReduceError):
    """An event type this version of agentlog does not know (written by a
    newer one) in a session the fold must interpret; names the tag, LSN and
    session and says to upgrade."""

    def __init__(self, lsn: int, session_id: str, tag: str) -> None:
        self.tag = tag
        super().__init__(
            lsn,
            session_id,
            f"event type {tag!r} is unknown to this version of agentlog (the log was written by a newer one); "
            "upgrade agentlog to reduce this log",
        )
