"""events: schema-v1 event types, the session lifecycle grammar, and the append-only log.

The log, one module per concept: ``log_api`` (the interface every log
honours, its errors, the in-memory log), ``log_format`` (segments, frames,
watermark, checkpoint), ``log_scan`` (the one scanner), ``log_writer``
(:class:`FileLog`) with ``log_commit`` (group commit), ``log_fence`` (fence,
spare segments) and ``log_os`` (the OS seam), ``log_recovery``, ``log_read`` (readers and
followers), ``log_verify`` and ``log_lock`` (the one-writer lock). The public
names are exported here."""

from .types import (  # noqa: F401
    SCHEMA_VERSION,
    CommandRan,
    Envelope,
    Event,
    EventValidationError,
    PolicyUpdated,
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
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
from .lifecycle import IllegalTransition, SessionClosed, State  # noqa: F401
from .log_api import (  # noqa: F401
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
    "FSYNC_POLICIES": "log_writer",
    "FileLog": "log_writer",
    "JetStreamLog": "log_jetstream",
    "JetStreamRef": "log_jetstream_read",
    "JetStreamRun": "log_jetstream_read",
    "is_nats_url": "log_jetstream_read",
    "parse_nats_url": "log_jetstream_read",
    "OsOps": "log_writer",
    "RawRecord": "log_read",
    "follow_log": "log_read",
    "follow_logs": "log_read",
    "read_log": "log_read",
    "read_frame_batches": "log_read",
    "VerifyReport": "log_verify",
    "list_partitions": "partitions",
    "open_partition": "partitions",
    "partition_dir": "partitions",
    "verify_log": "log_verify",
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
