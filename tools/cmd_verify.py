"""`agentlog verify LOG [--repair]`: check a log's every frame; optionally cut a torn tail.

Exit 0 with a one-line summary when the log is sound (or was repaired),
with a note counting records of unknown types (a newer writer's: sound, but
not understood here); exit 1 naming the position when it has a torn tail or
is corrupt, or when records of known types do not decode with this version's
schema (SCHEMA MISMATCH: upgrade agentlog); exit 2 for a missing path or a
directory that is not a log. A run folder stands for its ``rollout/`` log.
"""

from __future__ import annotations

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("verify", help="check every segment, frame and sequence of a log (exit 1 if torn or corrupt)")
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument(
        "--repair",
        action="store_true",
        help="truncate a torn tail (needs the writer lock; never touches corruption in the middle of the log)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    """Verify, print one line, return the exit status."""
    from agentlog.events import LogLocked, NotALog, verify_log

    from agentlog.tools.cli_common import check_log_path

    path = check_log_path(args.log)  # a run folder stands for its rollout/ log
    try:
        report = verify_log(path, repair=args.repair)
    except FileNotFoundError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except (NotALog, LogLocked) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise CliError(f"{args.log}: {exc.strerror or exc}", EXIT_USAGE) from None
    print(report.summary())
    return EXIT_OK if report.ok else EXIT_DATA
