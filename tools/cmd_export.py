"""`agentlog export nats://host:port/stream DIR`: write a run's logs on
JetStream to ordinary log directories, frame for frame.

The stream's partitions go to ``DIR/rollout/p0003`` (a partition root, so
DIR is a run folder every reading command takes: ``agentlog stats DIR``),
its other logs to ``DIR/<name>`` (the learner's to ``DIR/learner``). A URL
naming one log (``nats://host:port/stream/p0003``) writes that log to DIR
itself. A run folder whose ``config.json`` keeps its logs on JetStream
(``[log] backend = "nats"``) stands for its stream. DIR must not exist yet,
or be empty.

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
from pathlib import Path

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("export", help="write a run's logs on JetStream (nats://host:port/stream) to log directories, frame for frame")
    p.add_argument("source", metavar="URL", help="nats://host:port/stream (every log of the run) or nats://host:port/stream/p0003 (one)")
    p.add_argument("directory", metavar="DIR", help="where to write: a new (or empty) directory")
    p.set_defaults(func=run)


def plan_export(remote, directory: Path) -> dict[str, Path]:
    """``{log name: directory}`` for every log the export writes."""
    from agentlog.events.log.partitions import parse_partition_name

    from agentlog.tools.cli_common import RUN_FOLDER_LOG

    if remote.name is not None:
        return {remote.name: directory}
    names = remote.run.names()
    if not names:
        raise CliError(f"{remote}: stream {remote.run.stream!r} holds no message: nothing to export", EXIT_USAGE)
    if RUN_FOLDER_LOG in names:
        raise CliError(f"{remote}: the stream has a log named {RUN_FOLDER_LOG!r}, which would clash with the "
                       f"partitions' folder {directory / RUN_FOLDER_LOG}; export it alone ({remote}/{RUN_FOLDER_LOG})", EXIT_USAGE)
    return {name: directory / RUN_FOLDER_LOG / name if parse_partition_name(name) is not None else directory / name for name in names}


def run(args) -> int:
    """Copy every log, print one line each, then the total."""
    from agentlog.events.log.api import LogError
    from agentlog.events.log.jetstream_read import is_nats_url

    from agentlog.tools.cli_common import nats_run_folder, open_remote
    from agentlog.tools.log_transfer import CopyError, export_log

    remote = None
    if not is_nats_url(args.source):
        remote = nats_run_folder(Path(args.source), allow_empty=True) if Path(args.source).is_dir() else None
        if remote is None:
            raise CliError(f"{args.source}: expected nats://host:port/stream, or a run folder whose logs are on JetStream "
                           "(export copies a run on JetStream to directories; agentlog import copies directories to JetStream)",
                           EXIT_USAGE)
    directory = Path(args.directory)
    if directory.exists() and (not directory.is_dir() or any(os.scandir(directory))):
        raise CliError(f"{directory}: exists and is {'not a directory' if not directory.is_dir() else 'not empty'}; "
                       "expected a new or empty directory to export into", EXIT_USAGE)
    if remote is None:
        remote = open_remote(args.source, allow_empty=True)
    copies = []
    for name, dest in plan_export(remote, directory).items():
        try:
            copies.append(export_log(remote.run.log(name), dest, name))
        except CopyError as exc:
            raise CliError(str(exc), EXIT_DATA) from None
        except LogError as exc:  # corruption on the stream, or the server stopped answering
            raise CliError(f"{remote}/{name}: {exc}", EXIT_DATA) from None
        except OSError as exc:
            raise CliError(f"{dest}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
        print(copies[-1].line())
    equal = all(c.equal for c in copies)
    print(f"exported {len(copies)} log(s), {sum(c.records for c in copies)} records, from {remote} to {directory}: "
          f"{'every log EQUAL' if equal else 'DIFFERENT (see above)'}")
    return EXIT_OK if equal else EXIT_DATA
