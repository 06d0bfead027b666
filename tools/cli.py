"""The `agentlog` command line.

Each subcommand lives in its own module ``tools/cmd_<name>.py`` exposing
``register(subparsers)``; that keeps commands thin and independent. Exit
codes: 0 ok, 1 a problem found in the data, 2 usage or I/O error (also any
``AgentlogError`` a command leaves unhandled: one line, no traceback).
"""

from __future__ import annotations

import argparse
from typing import NoReturn
import importlib
import os
import pkgutil
import sys
from importlib.metadata import PackageNotFoundError, version

from agentlog.events.errors import AgentlogError

EXIT_OK = 0
EXIT_DATA = 1
EXIT_USAGE = 2
#: Interrupted by SIGINT (Ctrl-C), as a shell reports it (128 + 2).
EXIT_INTERRUPTED = 130


class CliError(AgentlogError):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


def _version() -> str:
    try:
        return version("agentlog")
    except PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


class _Parser(argparse.ArgumentParser):
    """The CLI's parser: errors as one line, and an ``epilog`` that may be a
    callable, made into text only when help is printed (``train`` and
    ``demo`` generate their config reference from the config types' source,
    which every run would otherwise pay for at start-up)."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()

    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        # main() prints "agentlog: error: "; a subcommand's parser adds its own name once.
        command = self.prog.removeprefix("agentlog").strip()
        raise CliError(f"{command}: {message}" if command else message, EXIT_USAGE)


def unknown_command(name: str, commands: list[str]) -> CliError:
    """The error for a command that does not exist, with the closest ones (difflib) as "did you mean"."""
    import difflib

    close = difflib.get_close_matches(name, commands, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return CliError(f"unknown command {name!r}{hint} (commands: {', '.join(commands)}; agentlog --help describes them)",
                    EXIT_USAGE)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The root parser with every ``tools.cmd_*`` subcommand registered; or,
    when ``argv`` names a command (``tools/cmd_<name>.py``), that one only, so
    a command never pays for another's imports at start-up (some register()
    calls import torch)."""
    parser = _Parser(prog="agentlog", description="Durable, replayable agent-RL session logs.")
    parser.add_argument("--version", action="version", version=f"agentlog {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    import agentlog.tools as tools
    names = sorted(m.name for m in pkgutil.iter_modules(tools.__path__) if m.name.startswith("cmd_"))
    # The root parser takes no option with a value, so the first word is the command.
    first = next((a for a in argv or () if not a.startswith("-")), None)
    # A command named with a hyphen (verify-tokens) lives in cmd_verify_tokens.py.
    module = None if first is None else f"cmd_{first.replace('-', '_')}"
    if module is not None and module in names:
        names = [module]
    elif first is not None:
        raise unknown_command(first, [n.removeprefix("cmd_").replace("_", "-") for n in names])
    for name in names:
        importlib.import_module(f"agentlog.tools.{name}").register(sub)
    return parser


#: The level from which the commands print the library's log events (``AGENTLOG_LOG_LEVEL`` changes it).
LOG_LEVEL_VAR = "AGENTLOG_LOG_LEVEL"

#: ``agentlog serve`` is a service whose output is its log (sessions opened
#: and ended, turns refused): its events go to stdout from level info, and its
#: stderr keeps the one-line error contract. Every other command prints only
#: its own output on stdout and the library's events on stderr from warning
#: (``train`` and ``demo`` then route their run's events themselves:
#: ``loop.runlog``).
SERVICE_OUTPUT = {"serve": ("info", "stdout")}


def default_log_output(argv: list[str]) -> tuple[str, str]:
    """(level, stream) a command prints the library's log events at when ``$AGENTLOG_LOG_LEVEL`` is unset."""
    return SERVICE_OUTPUT.get(argv[0] if argv else "", ("warning", "stderr"))


def configure_output(default_level: str = "warning", stream: str = "stderr") -> None:
    """The commands print the library's log events with structlog's console
    output on ``stream``, from ``default_level`` up (``$AGENTLOG_LOG_LEVEL``:
    debug, info, warning or error, overrides it), and a traceback as plain
    text without locals. stdout otherwise holds only a command's own output
    (a table, JSON lines, samples), so it can be piped. The library itself
    stays silent until an application configures logging
    (``agentlog._logging``); a caller that configured structlog already (a
    test, an embedding program) keeps its own."""
    import logging

    import structlog

    if structlog.is_configured():
        return
    name = os.environ.get(LOG_LEVEL_VAR, default_level).strip().lower()
    level = logging.getLevelNamesMapping().get(name.upper())
    if level is None or name not in ("debug", "info", "warning", "error"):
        raise CliError(f"${LOG_LEVEL_VAR}: expected debug, info, warning or error, found {name!r}", EXIT_USAGE)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            # Plain text, never rich with every frame's locals (structlog's default when rich is
            # installed): minutes on the event loop for one deep RecursionError.
            structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStream(stream)),
    )


class _CurrentStream:
    """``sys.stderr`` (or ``sys.stdout``) as it is at each write, not at configure time
    (a caller may swap it, as pytest's capture does, and close the old one)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agentlog`` console script."""
    try:
        if argv is None:
            argv = sys.argv[1:]
        configure_output(*default_log_output(argv))
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_USAGE
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"agentlog: error: {exc}", file=sys.stderr)
        return exc.code
    except AgentlogError as exc:
        # A refusal of the library that the command did not turn into a CliError of its own: its
        # message names what was wrong and where, so the user gets it as a usage/I-O error, not a traceback.
        print(f"agentlog: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `agentlog replay LOG | head` is normal use
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        _close_sources()


def _close_sources() -> None:
    """Close the logs a command opened (the JetStream connections of nats:// logs), if any."""
    common = sys.modules.get("agentlog.tools.cli_common")
    if common is not None:
        common.close_sources()


if __name__ == "__main__":
    # `python -m agentlog.tools.cli`: run the imported module's main, so the commands'
    # `from agentlog.tools.cli import CliError` is the class this main catches.
    from agentlog.tools.cli import main as _main

    sys.exit(_main())
