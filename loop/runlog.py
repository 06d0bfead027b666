"""structlog set-up for the loop's processes: JSON lines to a file in the run
folder, and (for the process the user watches) short human lines on the console."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog


class _Tee:
    """Final processor: write the event as one JSON line to the file, and as a
    human line to the console when it is at least ``console_level``."""

    _LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

    def __init__(self, file: TextIO, console: TextIO | None, console_level: str) -> None:
        self.file = file
        self.console = console
        self.console_level = self._LEVELS[console_level]
        self.render = structlog.dev.ConsoleRenderer(colors=False)

    def __call__(self, logger: Any, name: str, event_dict: dict[str, Any]) -> str:
        self.file.write(json.dumps(event_dict, default=str, sort_keys=True) + "\n")
        self.file.flush()
        if self.console is not None and self._LEVELS.get(name, 20) >= self.console_level:
            self.console.write(self.render(logger, name, dict(event_dict)) + "\n")
            self.console.flush()
        raise structlog.DropEvent


class restore_logging:
    """Context manager: put structlog's configuration back as it was on exit
    (the demo runs in-process from tests and other tools; it must not leave
    its run folder's file as everyone's log)."""

    def __enter__(self) -> "restore_logging":
        self.config = structlog.get_config()
        self.context = structlog.contextvars.get_contextvars()
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in structlog.get_config().get("processors", []):
            if isinstance(proc, _Tee):
                proc.file.close()
        structlog.configure(**self.config)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**self.context)


def configure_process_logging(run_dir: Path, name: str, *, console: TextIO | None = None, console_level: str = "warning") -> Path:
    """Route structlog to ``<run_dir>/logs/<name>.jsonl`` (and the console if given); returns the file path."""
    path = Path(run_dir) / "logs" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a", encoding="utf-8")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _Tee(fh, console, console_level),
        ],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        # Every level reaches the file (the console filters in _Tee): the CLI may have set a
        # filtering wrapper for its own console, which would otherwise stay in force here.
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(process=name)
    return path
