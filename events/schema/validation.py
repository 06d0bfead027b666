"""What the event bodies' write-time checks share: the error they raise, the
switch that stands them aside while a stored record is decoded, the helper
that words a failure (event, field, what was expected, what was found), the
checks of ids and rewards, and a fresh stack for a payload nested near the
recursion limit.

Every body module (:mod:`.types`, :mod:`.packing`, :mod:`.turn`) builds its
checks on these, so the rule "validated on write, tolerant on read" is
implemented once.
"""

from __future__ import annotations

import contextvars
import math
import re
import threading
from typing import Any, Callable, NoReturn

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


def is_number(value: Any, *, above: float | None = None, at_least: float | None = None, finite: bool = True) -> bool:
    """Whether ``value`` is a real number (an int or a float, not a bool, not NaN), finite unless
    ``finite`` is False, and ``> above`` / ``>= at_least`` when given: the one rule behind the
    numeric options and fields every layer checks. A huge int compares exactly (``math.isfinite``
    would convert it to a float and raise OverflowError past 1.8e308)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return False
    if finite and isinstance(value, float) and not math.isfinite(value):
        return False
    return (above is None or value > above) and (at_least is None or value >= at_least)


def check_count(event: str, field: str, value: Any) -> None:
    """An int >= 0 (not a bool), else EventValidationError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        fail(event, field, "an int >= 0", value)


# ---------------------------------------------------------------- ids and rewards

#: Longest session / group id accepted, in UTF-8 bytes.
MAX_ID_BYTES = 256
#: Forbidden in ids: a path separator (ids end up in file names and URLs),
#: a C0 control or DEL..C1 control, a lone surrogate (no UTF-8 encoding: the
#: file log could not frame it, where the memory log would keep it).
_ID_BAD_CHAR = re.compile(r"[/\\\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def validate_id(kind: str, value: Any) -> str:
    """Check a session or group id: a non-empty str of at most MAX_ID_BYTES
    UTF-8 bytes with no path separators, no control characters and no lone
    surrogates, and neither ``.`` nor ``..``."""
    if not isinstance(value, str) or not value:
        raise EventValidationError(f"{kind}: expected a non-empty str, found {value!r}")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise EventValidationError(
            f"{kind}: expected at most {MAX_ID_BYTES} UTF-8 bytes, found {len(value.encode('utf-8', 'surrogatepass'))} in {value[:40]!r}..."
        )
    if value == "." or value == "..":  # a path's own names: a URL or a file named so is another place
        raise EventValidationError(f"{kind}: expected an id other than '.' or '..', found {value!r}")
    bad = _ID_BAD_CHAR.search(value)  # one C-level scan; ids are checked on every append
    if bad is not None:
        i, ch = bad.start(), bad.group()
        raise EventValidationError(
            f"{kind}: expected no path separator, control character or lone surrogate, found {ch!r} at index {i} in {value!r}"
        )
    return value


# ---------------------------------------------------------------- rewards

#: The largest int a float holds exactly: a reward beyond it would be stored as another number.
_EXACT_INT = 2**53


def normalize_reward(event: str, field: str, value: Any, *, optional: bool = False) -> Any:
    """Rewards are finite floats (int and bool converted) or dicts of them."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, int)) and not isinstance(value, float):
        if abs(value) > _EXACT_INT:
            fail(event, field, "a finite float (an int beyond 2**53 would not be stored as given)", value)
        return float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(event, field, "a finite float", value)
        return value
    if isinstance(value, dict):
        out = {}
        for key, v in value.items():
            if not isinstance(key, str):
                fail(event, f"{field}[{key!r}]", "a str key", key)
            if isinstance(v, (bool, int)) and not isinstance(v, float):
                if abs(v) > _EXACT_INT:
                    fail(event, f"{field}[{key!r}]", "a finite float (an int beyond 2**53 would not be stored as given)", v)
                v = float(v)
            if not isinstance(v, float) or not math.isfinite(v):
                fail(event, f"{field}[{key!r}]", "a finite float", v)
            out[key] = v
        return out
    fail(event, field, "a finite float or a dict of finite floats" + (" or None" if optional else ""), value)


def on_fresh_stack(fn: Callable[[Any], Any], arg: Any) -> Any:
    """``fn(arg)`` run in this context (``READING_STORED`` with it) on a new thread, at the
    bottom of its stack: msgspec counts a payload's nesting against the interpreter's
    recursion limit from the current depth, so a reader deep in its stack can fail on a
    payload the writer's check decoded with more stack left. Only on that rare path."""
    ctx = contextvars.copy_context()
    out: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            out.append((True, ctx.run(fn, arg)))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread, raised there
            out.append((False, exc))

    t = threading.Thread(target=run, name="agentlog-deep-decode")
    t.start()
    t.join()
    ok, value = out[0]
    if ok:
        return value
    raise value
