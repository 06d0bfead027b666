"""`agentlog report LOG -o report.html`: one self-contained HTML page (no
network needed to open it): session timeline coloured by outcome with turn
ticks, reward per group, abort and drop reasons, and a per-session
drill-down with tokens highlighted by loss mask. See :mod:`tools.report`.
"""

from __future__ import annotations

import os

from agentlog.tools.cli import EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import add_quiet, check_log_path, nonneg_int, read_records


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("report", help="write a self-contained HTML report (timeline, rewards, reasons, tokens)")
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("-o", "--output", required=True, metavar="HTML", help="the HTML file to write")
    p.add_argument("--max-sessions-detail", type=nonneg_int, default=300, metavar="N", help="keep token-level detail for the first N sessions (default 300)")
    add_quiet(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Collect, render, write atomically."""
    from agentlog.tools.report.data import collect
    from agentlog.tools.report.render import render

    path = check_log_path(args.log)
    data = collect(read_records(path, quiet=args.quiet, desc="report"), str(path), max_drill=args.max_sessions_detail)
    page = render(data)
    tmp = f"{args.output}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, args.output)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CliError(f"{args.output}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    counts = {}
    for s in data.sessions:
        counts[s.status] = counts.get(s.status, 0) + 1
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    shown = f" ({summary})" if summary else ""
    print(f"{args.output}: {len(data.sessions)} sessions{shown}, {data.events} events, {len(page) / 1e6:.1f} MB")
    return EXIT_OK
