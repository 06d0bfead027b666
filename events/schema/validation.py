"""What the event bodies' write-time checks share: the error they raise, the
switch that stands them aside while a stored record is decoded, and the
helper that words a failure (event, field, what was expected, what was found).

Every body module (:mod:`.types`, :mod:`.packing`, :mod:`.turn`) builds its
checks on these, so the rule "validated on write, tolerant on read" is
implemented once.
"""

from __future__ import annotations

import contextvars
from typing import Any, NoReturn

from ..errors import AgentlogError


class EventValidationError(AgentlogError, ValueError):
    """An event field holds a value the schema does not allow.

    The message names the event type, the field and the offending value.
    """


#: True while a stored record is decoded (:func:`.types.decode_body`) or a
#: body is rebuilt from one (:mod:`.turn_delta`): the bodies' checks then
#: stand aside (see :mod:`.types`). Also while the engine stages a turn it
#: built, whose value checks ran when it was built: the log's write-time
#: check then decodes it strictly without running them again
#: (``engine.handle.stage_built_turn``, set while a log that stages
#: synchronously stages it, reset before the engine's code goes on). A context variable, not a global, so a
#: reader in one thread never switches off a writer's checks in another, and
#: set per decode call (never across a generator's yield, which would leak it
#: into the consumer's code).
READING_STORED: contextvars.ContextVar[bool] = contextvars.ContextVar("events_reading_stored", default=False)

#: None, except while the write-time check of a batch rebuilds its decoded
#: bodies (:mod:`.batch_check`): then a list to which a turn body's check
#: hands its log-probs instead of scanning them for NaN/inf itself. The batch
#: check scans them all in one numpy pass (one call per body costs four times
#: as much) and, when one is not finite, checks the bodies one by one, each
#: scanning its own, to name the record and position.
DEFERRED_FINITE_SCANS: contextvars.ContextVar[list | None] = contextvars.ContextVar("events_deferred_finite_scans", default=None)


def fail(event: str, field: str, expected: str, found: Any) -> NoReturn:
    """Raise EventValidationError: ``event.field: expected ..., found ...``
    (the found value's repr cut to 120 characters)."""
    shown = repr(found)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    raise EventValidationError(f"{event}.{field}: expected {expected}, found {shown}")


def check_count(event: str, field: str, value: Any) -> None:
    """An int >= 0 (not a bool), else EventValidationError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        fail(event, field, "an int >= 0", value)
