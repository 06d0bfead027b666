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

Why not plain ``structlog.get_logger``: unconfigured structlog prints every
event (``log.segment.created`` at debug level included) to stdout, so merely
opening a ``FileLog`` from a script wrote to the console. The ``agentlog``
commands configure structlog themselves (``tools/cli.py``), so they print as
they always did.
"""

from __future__ import annotations

import logging
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
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
            return
        std = self._stdlib
        level = _LEVELS[method]
        if not std.isEnabledFor(level) or not std.hasHandlers():
            return  # the application configured neither: stay silent
        exc_info = fields.pop("exc_info", None)
        if method == "exception" and exc_info is None:
            exc_info = True
        values = {**self._bound, **fields}
        text = " ".join([event] + [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items()])
        std.log(level, "%s", text, exc_info=exc_info, stacklevel=3,
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


def get_logger(name: str, **bound: Any) -> Logger:
    """The library logger ``name`` (dotted, under ``agentlog``) with ``bound``
    fields on every event; silent unless the application configured structlog
    or stdlib logging (see the module docstring)."""
    if name != "agentlog" and not name.startswith("agentlog."):
        raise ValueError(f"get_logger({name!r}): expected a name under 'agentlog' (e.g. 'agentlog.engine')")
    return Logger(name, dict(bound))

