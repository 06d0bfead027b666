"""`agentlog verify LOG [--repair]`: check a log's every frame, then every
session's sequence and lifecycle; optionally cut a torn tail.

Two checks, in order. The frame check (``verify_log``: segment headers, frame
CRCs, LSNs, payloads) prints its one-line summary. When the frames are
readable, the lifecycle check follows: the one step every fold composes
(:func:`reducers.lifecycle_step.evolve`, through
:class:`reducers.lifecycle.LifecycleCheck`, reading only each record's
session, ``session_seq`` and event tag) over the whole log. Each lifecycle
violation (a ``session_seq`` gap or repeat, an event after the terminal one,
an illegal move, a reused id, ...) is printed on its own line naming its LSN,
session and kind (the first ``SHOWN``), and the command exits 1.

Exit 0 when the log is sound (or was repaired), with a note counting records
of unknown types (a newer writer's: sound, but not understood here); exit 1
naming the position when it has a torn tail or is corrupt, when records of
known types do not decode with this version's schema (SCHEMA MISMATCH:
upgrade agentlog), or when the lifecycle check finds violations; exit 2 for
a missing path or a directory that is not a log. A run folder stands for its
``rollout/`` log.

A partitioned log (``rollout/`` holding ``p%04d`` partitions) is verified
partition by partition, each with both checks: one summary line per
partition, prefixed by its name, its violations below it; the exit status is
the worst of them (``--repair`` repairs each partition's torn tail).
"""

from __future__ import annotations

from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError

#: Lifecycle violations printed one per line (the count covers all).
SHOWN = 10


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "verify",
        help="check every segment and frame, then every session's sequence and lifecycle (exit 1 if torn, corrupt or violated)",
    )
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument(
        "--repair",
        action="store_true",
        help="truncate a torn tail (needs the writer lock; never touches corruption in the middle of the log)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    """Verify, print the summary (and any lifecycle violations), return the exit status."""
    from agentlog.events import LogLocked, NotALog, verify_log

    from agentlog.tools.cli_common import check_log_path, partitioned

    path = check_log_path(args.log)  # a run folder stands for its rollout/ log
    if partitioned(path):
        from agentlog.events.partitions import list_partitions, partition_dir, partition_name

        worst = EXIT_OK
        for pid in list_partitions(path):
            try:
                code = _verify_one(partition_dir(path, pid), args, prefix=f"{partition_name(pid)}: ")
            except CliError as exc:  # one partition's error is its line; the others are still checked
                print(f"{partition_name(pid)}: {exc}")
                code = exc.code
            worst = max(worst, code)
        return worst
    return _verify_one(path, args)


def _verify_one(path: Any, args: Any, prefix: str = "") -> int:
    """Both checks of one log; its summary line starts with ``prefix``."""
    from agentlog.events import LogLocked, NotALog, verify_log

    try:
        report = verify_log(path, repair=args.repair)
    except FileNotFoundError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except (NotALog, LogLocked) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise CliError(f"{args.log}: {exc.strerror or exc}", EXIT_USAGE) from None
    print(prefix + report.summary())
    if report.status not in ("ok", "repaired", "schema"):
        return EXIT_DATA  # torn or corrupt: the frames after the problem cannot be read
    count, shown = check_lifecycle(path)
    for v in shown:
        print(f"  lsn {v.lsn} session {v.session_id!r}: {v.describe()}")
    if count:
        first = shown[0]
        raise CliError(
            f"{path}: {count} lifecycle violation(s); first at lsn {first.lsn}, session {first.session_id!r}: {first.describe()}",
            EXIT_DATA,
        )
    return EXIT_OK if report.ok else EXIT_DATA


def check_lifecycle(path: Any) -> tuple[int, list[Any]]:
    """The lifecycle check over the log at ``path``: ``(violations, the first SHOWN of them)``.
    Reads each record's tag only; no body is decoded."""
    import msgspec

    from agentlog.events.types import payload_tag
    from agentlog.reducers.lifecycle import LifecycleCheck
    from agentlog.tools.cli_common import read_records

    check = LifecycleCheck()
    feed = check.feed
    count = 0
    shown: list[Any] = []
    for rec in read_records(path, raw=True, quiet=True, desc="verify lifecycle"):
        try:
            tag = payload_tag(rec.payload)
        except msgspec.DecodeError as exc:  # the frame check decoded it; a payload without a tag is corrupt
            raise CliError(f"{path}: lsn {rec.lsn}, session {rec.session_id!r}: payload has no event tag: {exc}", EXIT_DATA) from None
        found = feed(rec.lsn, rec.session_id, rec.session_seq, tag)
        if found:
            count += len(found)
            shown.extend(found[: SHOWN - len(shown)])
    return count, shown
