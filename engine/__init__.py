"""engine: the SessionEngine runtime that drives sessions through the lifecycle and appends their events."""

from .core import SessionEngine  # noqa: F401
from .handle import SessionHandle  # noqa: F401
from .restart import RESTART_REASON  # noqa: F401
from .errors import TIMEOUT_REASON, DuplicateSession, EngineClosed, SessionTimeout, StragglerRefused  # noqa: F401
from .sandbox import CommandResult, LocalSandbox, Sandbox, read_done_marker  # noqa: F401
from .snapshots import SnapshotDamaged, SnapshotError, SnapshotInfo, SnapshotMissing, SnapshotStore  # noqa: F401
