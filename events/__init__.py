"""events: schema-v1 event types, the session lifecycle grammar, and the append-only log."""

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
from .log_api import EventLog, LogClosed, LogError, MemoryLog, PendingRecord, SchemaError, SequenceError  # noqa: F401
