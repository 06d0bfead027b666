"""`agentlog export nats://host:port/stream DIR`: write a run's logs on
JetStream to ordinary log directories, frame for frame.

The stream's partitions go to ``DIR/rollout/p0003`` (a partition root, so
DIR is a run folder every reading command takes: ``agentlog stats DIR``),
its other logs to ``DIR/<name>`` (the learner's to ``DIR/learner``). A URL
naming one log (``nats://host:port/stream/p0003``) writes that log to DIR
itself. A run folder whose ``config.json`` keeps its logs on JetStream
(``[log] backend = "nats"``) stands for its stream. DIR must not exist yet,
or be empty. ``--compression zstd`` stores the copies' records compressed
(each write's records together, as ``FileLog.open(compression="zstd")``
does); the records, and so the digests, are the same either way.

Every record keeps its LSN, session, seq, timestamp and payload
(:mod:`agentlog.tools.log_transfer`), so the directories' frames are
byte-identical to the stream's: each log is read back after it is written,
and its line names the records' digest (the one ``agentlog verify --digest``
prints, on the stream and on the copy) and ``EQUAL``, or ``DIFFERENT`` with
the source's digest (exit 1). ``verify``, ``reconstruct`` and the other
reading commands give the same results on DIR as on the stream.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from agentlog.events.log.format import COMPRESSIONS
from agentlog.events.log.source import LogSource
from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("export", help="write a run's logs on JetStream (nats://host:port/stream) to log directories, frame for frame")
    p.add_argument("source", metavar="URL", help="nats://host:port/stream (every log of the run) or nats://host:port/stream/p0003 (one)")
    p.add_argument("directory", metavar="DIR", help="where to write: a new (or empty) directory")
    p.add_argument("--compression", choices=COMPRESSIONS, default="none",
                   help="how the copies store their records: zstd compresses the records each write takes together "
                        "(FileLog.open's compression; default none)")
    p.set_defaults(func=run)


def plan_export(source: LogSource, directory: Path) -> dict[str, Path]:
    """``{log name: directory}`` for every log the export writes (``source``:
    a run's stream, or one log of it)."""
    from agentlog.events.log.partitions import parse_partition_name
    from agentlog.events.log.source import RUN_ROLLOUT_LOG

    if not source.partitioned:
        return {str(source).rsplit("/", 1)[-1]: directory}
    names = source.log_names()
    if not names:
        stream = str(source).rsplit("/", 1)[-1]
        raise CliError(f"{source}: stream {stream!r} holds no message: nothing to export", EXIT_USAGE)
    if RUN_ROLLOUT_LOG in names:
        raise CliError(f"{source}: the stream has a log named {RUN_ROLLOUT_LOG!r}, which would clash with the "
                       f"partitions' folder {directory / RUN_ROLLOUT_LOG}; export it alone ({source}/{RUN_ROLLOUT_LOG})", EXIT_USAGE)
    return {name: directory / RUN_ROLLOUT_LOG / name if parse_partition_name(name) is not None else directory / name for name in names}


def run(args) -> int:
    """Copy every log, print one line each, then the total."""
    from agentlog.events.log.api import LogError
    from agentlog.events.log.source import is_location_url
    from agentlog.loop.config import ConfigError
    from agentlog.loop.run_folder import Run

    from agentlog.tools.cli_common import check_log_path
    from agentlog.tools.log_transfer import CopyError, export_log

    if not is_location_url(args.source):
        try:
            run = Run.at(args.source) if Path(args.source).is_dir() else None
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        if run is None or not run.logs_elsewhere:
            raise CliError(f"{args.source}: expected nats://host:port/stream, or a run folder whose logs are on JetStream "
                           "(export copies a run on JetStream to directories; agentlog import copies directories to JetStream)",
                           EXIT_USAGE)
    directory = Path(args.directory)
    if directory.exists() and (not directory.is_dir() or any(os.scandir(directory))):
        raise CliError(f"{directory}: exists and is {'not a directory' if not directory.is_dir() else 'not empty'}; "
                       "expected a new or empty directory to export into", EXIT_USAGE)
    if directory.exists() and directory.resolve() == Path.cwd().resolve():
        # DIR is renamed into place at the end, which would leave the shell standing in a removed folder.
        raise CliError(f"{directory}: is the current directory; expected a new or empty folder other than it to export "
                       "into (the export is written beside it and renamed into place)", EXIT_USAGE)
    source = check_log_path(args.source, allow_empty=True)
    plan = plan_export(source, directory)
    # Written into a hidden sibling and renamed to DIR once every log is copied: an export
    # that fails part way (or is interrupted) leaves no DIR that reads as a complete run.
    try:
        where = directory.absolute()  # "." has no name, and its parent is itself
        where.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{where.name}.", suffix=".export-partial", dir=where.parent))
    except OSError as exc:
        raise CliError(f"{directory}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    copies = []
    try:
        for name, dest in plan.items():
            staged = staging / dest.relative_to(directory)
            try:
                copies.append(export_log(source.sibling(name), staged, name, args.compression))
            except CopyError as exc:
                raise CliError(str(exc), EXIT_DATA) from None
            except LogError as exc:  # corruption on the stream, or the server stopped answering
                raise CliError(f"{source.sibling(name)}: {exc}", EXIT_DATA) from None
            except OSError as exc:
                raise CliError(f"{dest}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
            copies[-1].dest = str(dest)
            print(copies[-1].line())
        try:
            os.replace(staging, where)  # DIR is missing or empty (checked above): replaced whole
        except OSError as exc:
            raise CliError(f"{directory}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    equal = all(c.equal for c in copies)
    print(f"exported {len(copies)} log(s), {sum(c.records for c in copies)} records, from {source} to {directory}: "
          f"{'every log EQUAL' if equal else 'DIFFERENT (see above)'}")
    return EXIT_OK if equal else EXIT_DATA
