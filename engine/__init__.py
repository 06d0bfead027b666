"""engine: the SessionEngine runtime that drives sessions through the lifecycle and appends their events."""

from .core import (  # noqa: F401
    RESTART_REASON,
    TIMEOUT_REASON,
    DuplicateSession,
    EngineClosed,
    SessionEngine,
    SessionHandle,
    SessionTimeout,
    StragglerRefused,
)
from .sandbox import CommandResult, LocalSandbox, Sandbox, read_done_marker  # noqa: F401
