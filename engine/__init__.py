"""engine: the SessionEngine runtime that drives sessions through the lifecycle and appends their events."""

from .core import RESTART_REASON, SessionEngine, SessionHandle  # noqa: F401
from .errors import TIMEOUT_REASON, DuplicateSession, EngineClosed, SessionTimeout, StragglerRefused  # noqa: F401
from .sandbox import CommandResult, LocalSandbox, Sandbox, read_done_marker  # noqa: F401
