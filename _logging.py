"""Library logging that stays quiet unless the application asked for logs.

Every library module logs through :func:`get_logger`. Its loggers decide, at
each call, where an event goes:

* through structlog, with the application's configuration, once the
  application has configured structlog (``structlog.is_configured()``; so
  ``structlog.testing.capture_logs`` captures them too);
* else through the stdlib ``logging`` logger of the same dotted name (under
  ``agentlog``), when the application configured stdlib logging (a handler
  on that logger or an ancestor, and the level enabled): the message is the
  event name followed by ``key=value`` pairs, and the raw values travel in
  the record's ``agentlog_event`` / ``agentlog_fields`` attributes;
* else nowhere, at the cost of a function call and two attribute reads:
  nothing is formatted.

**Failures on an event loop.** An error event that carries an exception
(``exception()``, or ``exc_info=`` on any level) and is emitted on a thread
running an asyncio event loop is logged as one line: ``error`` holds the
exception's type and message (cut to :data:`ERROR_TEXT_LIMIT` characters),
and no renderer ever sees the exception, so none can render a traceback with
every frame's locals while the loop waits (structlog's console renderer
does, with rich installed: one deep ``RecursionError`` froze a gateway for
minutes). The traceback follows as a separate ``<event>.traceback`` event at
debug level, plain text formatted on a worker thread, and only when debug is
enabled. Off the loop (a worker or writer thread) ``exc_info`` is passed on
as before.

Why not plain ``structlog.get_logger``: unconfigured structlog prints every
event (``log.segment.created`` at debug level included) to stdout, so merely
opening a ``FileLog`` from a script wrote to the console. The ``agentlog``
commands configure structlog themselves (``tools/cli.py``), so they print as
they always did.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from typing import Any

import structlog

#: Method name -> stdlib level.
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
}


#: Characters of an exception's message kept in a one-line ``error`` field.
ERROR_TEXT_LIMIT = 500
#: Innermost frames kept in a traceback logged at debug level, and its size cap.
_TRACEBACK_FRAMES = 50
_TRACEBACK_CHARS = 64 * 1024


def describe_error(exc: BaseException, limit: int = ERROR_TEXT_LIMIT) -> str:
    """``"Type: message"`` on one line, the message cut to ``limit`` characters."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def format_traceback(exc: BaseException) -> str:
    """The plain-text traceback of ``exc`` (its innermost frames, no locals), capped in size."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-_TRACEBACK_FRAMES))
    if len(text) > _TRACEBACK_CHARS:
        text = text[: _TRACEBACK_CHARS // 2] + "\n... (traceback cut) ...\n" + text[-_TRACEBACK_CHARS // 2 :]
    return text


def _on_event_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Logger:
    """A logger of the library: ``debug`` ... ``critical`` and ``exception`` take a
    dotted event name and keyword fields, as structlog's do; :meth:`bind` adds
    fields to every later event."""

    __slots__ = ("name", "_bound", "_structlog", "_stdlib")

    def __init__(self, name: str, bound: dict[str, Any]) -> None:
        self.name = name
        self._bound = bound
        # A lazy proxy: it reads structlog's configuration on every call, so a
        # configuration made after this module was imported still applies.
        self._structlog = structlog.get_logger(name, **bound)
        self._stdlib = logging.getLogger(name)

    def bind(self, **fields: Any) -> "Logger":
        """This logger with ``fields`` added to every event it emits."""
        return Logger(self.name, {**self._bound, **fields})

    def _emit(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if method == "exception" or fields.get("exc_info"):
            exc = _exception_of(fields.pop("exc_info", True))
            method = "error" if method == "exception" else method
            loop = _on_event_loop()
            if exc is not None and loop is not None:
                self._failure_on_loop(loop, method, event, fields, exc)
                return
            if exc is not None:
                fields["exc_info"] = exc
        self._write(method, event, fields)

    def _failure_on_loop(self, loop: asyncio.AbstractEventLoop, method: str, event: str, fields: dict[str, Any], exc: BaseException) -> None:
        """One line now; the traceback at debug level, formatted on a worker thread."""
        fields.setdefault("error", describe_error(exc))
        self._write(method, event, fields)
        if not self._enabled(logging.DEBUG):
            return
        context = {k: v for k, v in fields.items() if k != "error"}
        try:
            rendering = loop.run_in_executor(None, format_traceback, exc)
        except RuntimeError as why:  # the loop's executor is shut down (the loop is closing)
            self._write("debug", f"{event}.traceback", {**context, "traceback": f"not formatted: {why}"})
            return

        def logged(done: "asyncio.Future[str]") -> None:
            if done.cancelled():
                text = "not formatted: the loop closed first"
            elif done.exception() is not None:
                text = f"not formatted: {describe_error(done.exception())}"  # type: ignore[arg-type]
            else:
                text = done.result()
            self._write("debug", f"{event}.traceback", {**context, "traceback": text})

        rendering.add_done_callback(logged)

    def _enabled(self, level: int) -> bool:
        """Whether an event at ``level`` would be emitted anywhere."""
        if structlog.is_configured():
            bound = self._structlog.bind()
            check = getattr(bound, "is_enabled_for", None) or getattr(bound, "isEnabledFor", None)
            return True if check is None else bool(check(level))
        return self._stdlib.isEnabledFor(level) and self._stdlib.hasHandlers()

    def _write(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
            return
        std = self._stdlib
        level = _LEVELS[method]
        if not std.isEnabledFor(level) or not std.hasHandlers():
            return  # the application configured neither: stay silent
        exc_info = fields.pop("exc_info", None)
        values = {**self._bound, **fields}
        text = " ".join([event] + [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items()])
        std.log(level, "%s", text, exc_info=exc_info, stacklevel=4,
                extra={"agentlog_event": event, "agentlog_fields": values})

    def debug(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at debug level."""
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at info level."""
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at warning level."""
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at error level."""
        self._emit("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at error level with the exception being handled."""
        self._emit("exception", event, fields)

    def critical(self, event: str, **fields: Any) -> None:
        """Emit ``event`` at critical level."""
        self._emit("critical", event, fields)


def _exception_of(exc_info: Any) -> BaseException | None:
    """The exception an ``exc_info`` value names: an exception, a
    ``sys.exc_info()`` triple, or True (the one being handled); else None."""
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and isinstance(exc_info[1], BaseException):
        return exc_info[1]
    if exc_info is True:
        return sys.exc_info()[1]
    return None


def get_logger(name: str, **bound: Any) -> Logger:
    """The library logger ``name`` (dotted, under ``agentlog``) with ``bound``
    fields on every event; silent unless the application configured structlog
    or stdlib logging (see the module docstring)."""
    if name != "agentlog" and not name.startswith("agentlog."):
        raise ValueError(f"get_logger({name!r}): expected a name under 'agentlog' (e.g. 'agentlog.engine')")
    return Logger(name, dict(bound))

