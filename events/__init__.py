"""events: the event schema and the append-only log, in two subpackages.

- :mod:`agentlog.events.schema`: the schema-v1 event types, the session
  lifecycle grammar and the turn encoding. Pure data: no I/O.
- :mod:`agentlog.events.log`: the log. The interface every log honours and
  the in-memory log (``api``), the file WAL (``format``, ``scan``, ``writer``
  with ``commit``, ``fence`` and ``osops``, ``recovery``, ``read``,
  ``verify``, ``lock``), partitions, the JetStream backend, and ``source``:
  the one reader type for a log wherever it lives (``open_source``).

Beside them: ``errors`` (the one error root) and ``fs`` (atomic file writes).
The public names are exported here."""

from .schema.types import (  # noqa: F401
    SCHEMA_VERSION,
    CommandRan,
    Envelope,
    Event,
    EventValidationError,
    PolicyUpdated,
    RewardAssigned,
    SandboxSnapshotted,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionResumed,
    SessionStarted,
    TeacherScored,
    TurnDelta,
    TurnRecorded,
    TurnUndelivered,
    UnknownEvent,
    log_probs_view,
    pack_log_probs,
    pack_tokens,
    tokens_view,
)
from .schema.lifecycle import IllegalTransition, SessionClosed, State  # noqa: F401
from .log.api import (  # noqa: F401
    EventLog,
    LogClosed,
    LogCorruption,
    LogError,
    LogFenced,
    LogLocked,
    MemoryLog,
    NotALog,
    PendingRecord,
    SchemaError,
    SequenceError,
)

# The file log is loaded on first use, so that importing the event types (as
# every layer does) does not also load the writer, the readers and verify.
_LAZY = {
    "FSYNC_POLICIES": "log.writer",
    "FileLog": "log.writer",
    "JetStreamLog": "log.jetstream",
    "LogSource": "log.source",
    "SourceError": "log.source",
    "follow_sources": "log.source",
    "open_source": "log.source",
    "OsOps": "log.writer",
    "RawRecord": "log.read",
    "follow_log": "log.read",
    "follow_logs": "log.read",
    "read_log": "log.read",
    "read_frame_batches": "log.read",
    "VerifyReport": "log.verify",
    "list_partitions": "log.partitions",
    "open_partition": "log.partitions",
    "partition_dir": "log.partitions",
    "verify_log": "log.verify",
}


def __getattr__(name: str):
    """The file log's public names, imported from their modules on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
