"""What the session engine raises (:mod:`engine.core`): a reused session id, a
straggling in-session event, an exhausted wall-clock budget, a closed engine.

Each derives from the package's root, :class:`events.errors.AgentlogError`,
and keeps the builtin or lifecycle base its callers catch (``LifecycleError``,
``TimeoutError``, ``RuntimeError``). ``engine`` and ``engine.core`` re-export
them.
"""

from __future__ import annotations

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.lifecycle import IllegalTransition, LifecycleError, State

#: Reason recorded when a session's wall-clock budget runs out.
TIMEOUT_REASON = "wall_clock_timeout"


class DuplicateSession(LifecycleError):
    """open_session with an id the log (or a live session) already holds."""

    def __init__(self, session_id: str, state: State | None, where: str) -> None:
        self.session_id = session_id
        self.state = state
        super().__init__(
            f"session {session_id!r}: id already used ({where}"
            + (f", state {state}" if state is not None else "")
            + "); session ids are never reused, expected a fresh id"
        )


class StragglerRefused(IllegalTransition):
    """An in-session event (turn, command, reward) for a session that is not running.

    It is logged (``session.straggler_refused``) and never appended.
    """

    def __init__(self, session_id: str, what: str, state: State | None) -> None:
        super().__init__(
            session_id, what, state,
            detail="refused and not appended (straggler); only a running session takes it",
        )


class SessionTimeout(AgentlogError, TimeoutError):
    """Raised out of ``engine.session(...)`` when the wall-clock budget aborted the session."""

    def __init__(self, session_id: str, budget_s: float) -> None:
        self.session_id = session_id
        self.budget_s = budget_s
        super().__init__(f"session {session_id!r}: wall-clock budget of {budget_s}s exhausted; aborted with reason {TIMEOUT_REASON!r}")


class EngineClosed(AgentlogError, RuntimeError):
    """The engine was closed; it opens no further sessions."""


class RecordNotApplied(AgentlogError, RuntimeError):
    """A record the log acknowledged that the engine failed to apply to its session
    (a bug, never bad input): the record is in the log, and this engine's state of
    the session may disagree with it. The engine's health reports it."""

    def __init__(self, session_id: str, lsn: int | None, error: BaseException) -> None:
        self.session_id, self.lsn = session_id, lsn
        super().__init__(
            f"session {session_id!r}: the record at lsn {lsn} is in the log, but the engine failed to apply it "
            f"({type(error).__name__}: {error}); this engine's state of the session may disagree with the log: "
            "restart the engine (it folds the log)"
        )
