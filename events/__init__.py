"""events: schema-v1 event types, the session lifecycle grammar, and the append-only log.

The log, one module per concept: ``log_api`` (the interface every log
honours, its errors, the in-memory log), ``log_format`` (segments, frames,
watermark, checkpoint), ``log_scan`` (the one scanner), ``log_writer``
(:class:`FileLog`, group commit), ``log_recovery``, ``log_read`` (readers and
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
    LogLocked,
    MemoryLog,
    NotALog,
    PendingRecord,
    SchemaError,
    SequenceError,
)
from .log_read import RawRecord, follow_log, read_log  # noqa: F401
from .log_verify import VerifyReport, verify_log  # noqa: F401
from .log_writer import FSYNC_POLICIES, FileLog, OsOps  # noqa: F401
