"""`agentlog report LOG|RUN_FOLDER -o report.html`: one self-contained HTML page
(no network needed to open it) that stays small at any size: outcomes,
reasons, reward and solve rate over time and per policy version, turns and
tokens per session, latency distributions, staleness, the learner's curves
(for a run folder) and a bounded sessions table with a token drill-down.
Built in one streaming pass in bounded memory; see :mod:`tools.report`.
The full per-session timeline is ``agentlog trace``.

A partitioned log (a run folder whose ``rollout/`` holds ``p%04d``
partitions, or that ``rollout/`` itself) is read merged by time; the
aggregates are over all partitions, and the page and the closing line add
each partition's events, sessions and outcomes (see :mod:`tools.report.data`).
"""

from __future__ import annotations

from typing import Any, Iterable

from agentlog.events.fs import atomic_file
from agentlog.tools.cli import EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import (
    add_quiet, check_log_path, check_output_path, id_scans_of, learner_log_of, nonneg_int, read_records, read_tagged,
    reduce_config_of,
)


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("report", help="write a self-contained HTML report (aggregates, learner curves, sessions table)")
    p.add_argument("log", metavar="LOG", help="the log directory, or a run folder (then the learner's curves too)")
    p.add_argument("-o", "--output", required=True, metavar="HTML", help="the HTML file to write")
    p.add_argument("--worst", type=nonneg_int, default=20, metavar="N", help="table: the N finished sessions with the lowest reward (default 20)")
    p.add_argument("--per-reason", type=nonneg_int, default=3, metavar="N", help="table: the first N aborted sessions of each reason (default 3)")
    p.add_argument("--sample", type=nonneg_int, default=30, metavar="N", help="table: a random sample of N other sessions (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample (default 0)")
    add_quiet(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Collect, render, write atomically."""
    from agentlog.tools.report.data import collect
    from agentlog.tools.report.render import render

    path = check_log_path(args.log)
    check_output_path(path, args.output)
    learner = learner_log_of(path)
    envelopes: Iterable[Any]
    if path.partitioned:
        pids: list[int] | None = path.partitions()
        envelopes = read_tagged(path, quiet=args.quiet, desc="report")
    else:
        pids, envelopes = None, read_records(path, quiet=args.quiet, desc="report")
    data = collect(
        envelopes, str(path),
        worst=args.worst, per_reason=args.per_reason, sample=args.sample, seed=args.seed,
        learner=read_records(learner, quiet=True) if learner is not None else (),
        learner_log=str(learner or ""), partitions=pids, config=reduce_config_of(path), confirm_for=id_scans_of(path),
    )
    page = render(data)
    try:
        # Not fsynced (durable=False): a report is rebuilt from the log.
        with atomic_file(args.output, "w", encoding="utf-8", durable=False) as f:
            f.write(page)
    except OSError as exc:
        raise CliError(f"{args.output}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    summary = ", ".join(f"{k} {v}" for k, v in sorted(data.outcomes.items()) if v)
    shown = f" ({summary})" if summary else ""
    print(f"{args.output}: {data.sessions} sessions{shown}, {data.events} events, {len(data.table)} in the table, "
          f"{len(page.encode('utf-8')) / 1e6:.1f} MB")
    for name, p in data.partitions.items():
        ended = ", ".join(f"{o} {p[o]}" for o in ("finished", "aborted", "dropped", "running", "open") if p[o])
        print(f"  {name}: {p['events']} events, {p['sessions']} sessions" + (f" ({ended})" if ended else ""))
    return EXIT_OK
