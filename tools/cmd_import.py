"""`agentlog import DIR nats://host:port/stream [--replicas N] [--resume]`:
write log directories to a run's stream on JetStream, frame for frame (the
reverse of ``agentlog export``).

DIR is what the reading commands take: a run folder (its ``rollout/``, one
log or ``p%04d`` partitions, and its ``learner/`` log when there is one), a
partition root, or one log directory. Partition ``p0003`` goes to the
subject ``<stream>.p0003``, a single log to ``<stream>.p0000``, the learner
log to ``<stream>.learner``. A URL naming one log
(``nats://host:port/stream/p0003``) takes a single log directory.

The stream is created (file storage, ``--replicas``) when missing. A stream
that already holds messages is refused, so an import never mixes two runs;
``--resume`` continues an interrupted import instead: each subject's records
must then be the directory's first ones (compared record by record), and the
rest is appended after them.

Every record keeps its LSN, session, seq, timestamp and payload
(:mod:`agentlog.tools.log_transfer`): each subject is read back and its line
names the records' digest and ``EQUAL`` (as ``agentlog verify --digest``
prints on both), or ``DIFFERENT`` (exit 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentlog.events.log.source import LogSource
from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("import", help="write log directories to a run's stream on JetStream (nats://host:port/stream), frame for frame")
    p.add_argument("directory", metavar="DIR", help="a run folder, a partition root or one log directory")
    p.add_argument("dest", metavar="URL", help="nats://host:port/stream (or nats://host:port/stream/p0003 for one log)")
    p.add_argument("--replicas", type=int, choices=range(1, 6), default=1, metavar="N", help="replicas of a stream the import creates (1..5; default 1)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted import: the stream's records must be the directory's first ones")
    p.set_defaults(func=run)


def plan_import(arg: str, log_name: str | None) -> dict[Any, LogSource]:
    """``{partition id or log name: log}`` for every log the import writes."""
    from agentlog.events.log.source import is_location_url
    from agentlog.loop.config import ConfigError
    from agentlog.loop.run_folder import Run

    from agentlog.tools.cli_common import check_log_path, learner_log_of

    try:
        run = None if is_location_url(arg) or not Path(arg).is_dir() else Run.at(arg)
    except ConfigError:
        run = None  # judged as any other directory below
    path = check_log_path(arg)
    if is_location_url(arg) or (run is not None and run.logs_elsewhere):
        raise CliError(f"{arg}: this run keeps its logs on JetStream already ({path}); "
                       "expected log directories to import (agentlog export copies a stream to directories)", EXIT_USAGE)
    if path.partitioned:
        plan: dict[Any, LogSource] = {pid: path.partition(pid) for pid in path.partitions()}
    else:
        plan = {0: path}
    learner = learner_log_of(path)
    if learner is not None:
        plan["learner"] = learner
    if log_name is not None:
        if len(plan) != 1:
            raise CliError(f"{arg}: holds {len(plan)} logs ({', '.join(str(p) for p in plan.values())}); "
                           "import them into a stream (nats://host:port/stream), not into one log", EXIT_USAGE)
        plan = {log_name: next(iter(plan.values()))}
    return plan


def run(args) -> int:
    """Refuse a non-empty stream (unless --resume), copy every log, print one line each, then the total."""
    from agentlog.events.log.api import LogError
    from agentlog.events.log.partitions import partition_name
    from agentlog.events.log.source import SourceError, StreamMissing, is_location_url, open_source

    from agentlog.tools.log_transfer import CopyError, import_log

    if not is_location_url(args.dest):
        raise CliError(f"{args.dest}: expected nats://host:port/stream to import into", EXIT_USAGE)
    try:
        dest = open_source(args.dest, check=False)  # the URL parsed, nothing opened yet
    except SourceError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    # nats://host:port/stream or nats://host:port/stream/<log>
    stream, log_name = (str(dest).rsplit("/", 1)[-1], None) if dest.partitioned else str(dest).rsplit("/", 2)[-2:]
    plan = plan_import(args.directory, log_name)
    dest.close()
    try:
        dest = open_source(args.dest, allow_empty=True)
        held = dest.log_names()
    except StreamMissing:
        held = []  # no such stream yet: the first log's writer creates it
        dest = open_source(args.dest, check=False)
    except (SourceError, LogError) as exc:
        raise CliError(str(exc) if isinstance(exc, SourceError) else f"{args.dest}: {exc}", EXIT_USAGE) from None
    if held and not args.resume:
        dest.close()
        raise CliError(f"{args.dest}: stream {stream!r} already holds logs ({', '.join(held[:8])}); "
                       "import into a new stream, or pass --resume to continue an interrupted import", EXIT_USAGE)
    foreign = sorted(set(held) - {partition_name(log) if isinstance(log, int) else log for log in plan}) if log_name is None else []
    if foreign:  # --resume continues this directory's own import; a log it does not hold is another run's
        dest.close()
        raise CliError(f"{args.dest}: stream {stream!r} holds logs {args.directory} does not ({', '.join(foreign[:8])}); "
                       "--resume continues an import of this directory only: import into a new stream", EXIT_USAGE)
    copies = []
    try:
        for log, source in plan.items():
            target = dest if not dest.partitioned else dest.sibling(partition_name(log) if isinstance(log, int) else log)
            try:
                copies.append(import_log(source, target, replicas=args.replicas, resume=args.resume))
            except CopyError as exc:
                raise CliError(str(exc), EXIT_DATA) from None
            except LogError as exc:  # corruption in the directory, a refused publish, a stream of other replicas
                raise CliError(f"{source}: {exc}", EXIT_DATA) from None
            print(copies[-1].line())
    finally:
        dest.close()
    equal = all(c.equal for c in copies)
    print(f"imported {len(copies)} log(s), {sum(c.records for c in copies)} records, from {args.directory} to "
          f"{args.dest}: {'every log EQUAL' if equal else 'DIFFERENT (see above)'}")
    return EXIT_OK if equal else EXIT_DATA
