"""`agentlog verify LOG [--repair]`: check a log's every frame, then every
session's sequence and lifecycle; optionally cut a torn tail.

Two checks, in order. The frame check (``verify_log``: segment headers, frame
CRCs, LSNs, payloads) prints its one-line summary. When the frames are
readable, the lifecycle check follows: the one step every fold composes
(:func:`reducers.lifecycle_step.evolve`, through
:class:`reducers.lifecycle.LifecycleCheck`, reading only each record's
session, ``session_seq`` and event tag) over the whole log. Each lifecycle
violation (a ``session_seq`` gap or repeat, an event after the terminal one,
an illegal move, a reused id (confirmed by the log's ids when the check's
id filter alone says so: the filter has false positives), ...) is printed on its own line naming its LSN,
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
partition, prefixed by its name, its violations below it (``--repair``
repairs each partition's torn tail). Then the one check no partition can make
alone: a session never spans partitions, so a session id opened in two
partitions is a reused id; each is printed naming every place it was opened
(``p0000:3 and p0003:0``, partition:LSN), and the command exits 1. The exit
status is the worst of all these.

A log on JetStream (``nats://host:port/stream``: every partition of the run's
stream, as a partition root; ``.../stream/p0003``: one) is verified the same
way, except for what a stream does not have: every message's frame is
checked (CRC, length, LSN continuity from 0, the payload decoding as a
schema-v1 event), then each session's sequence and lifecycle, then the ids
reused across partitions. There are no segments, no DURABLE watermark and no
torn tail (the server stores only acknowledged messages, and a record split
into chunks is read whole or not at all), so the summary names the subject
and counts frame bytes instead of segments, and ``--repair`` is refused.

``--digest`` adds, under each log's summary, ``records sha256:<hex>`` over
every record's (LSN, session, seq, timestamp, terminal flag, payload):
equal for a log on JetStream and its ``agentlog export`` (or a directory
and its ``agentlog import``), whose frames are byte-identical.
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
    p.add_argument("--digest", action="store_true", help="print each log's records sha256 (equal across export/import)")
    p.add_argument(
        "--repair",
        action="store_true",
        help="truncate a torn tail (needs the writer lock; never touches corruption in the middle of the log)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    """Verify, print the summary (and any lifecycle violations), return the exit status."""
    from agentlog.tools.cli_common import check_log_path

    path = check_log_path(args.log)  # a run folder stands for its rollout/ log
    if args.repair and not path.repairable:
        raise CliError(f"{path}: --repair cuts a log directory's torn tail; a log on JetStream has none "
                       "(the server stores only acknowledged messages)", EXIT_USAGE)
    if path.partitioned:
        from agentlog.events.log.partitions import partition_name

        worst = EXIT_OK
        opened: dict[int, OpenedIds] = {}
        for pid in path.partitions():
            opened[pid] = OpenedIds()
            try:
                code = _verify_one(path.partition(pid), args, prefix=f"{partition_name(pid)}: ", opened=opened[pid])
            except CliError as exc:  # one partition's error is its line; the others are still checked
                print(f"{partition_name(pid)}: {exc}")
                code = exc.code
            worst = max(worst, code)
        reused = reused_across_partitions(path, opened)
        if reused:
            print(f"across partitions: {len(reused)} session id(s) opened in more than one partition"
                  " (a session never spans partitions; ids are never reused)")
            for sid, places in reused[:SHOWN]:
                names = [f"p{pid:04d}:{lsn}" for pid, lsn in places]
                print(f"  session {sid!r}: opened at {', '.join(names[:-1])} and {names[-1]}")
            worst = max(worst, EXIT_DATA)
        return worst
    return _verify_one(path, args)


def _verify_one(path: Any, args: Any, prefix: str = "", opened: "OpenedIds | None" = None) -> int:
    """Both checks of one log; its summary line starts with ``prefix``."""
    from agentlog.events import LogLocked, NotALog

    from agentlog.events.log.api import LogCorruption, LogError
    from agentlog.tools.cli_common import RecordDigest
    from agentlog.tools.progress import ProgressBar

    try:
        with ProgressBar("verify", unit="B", unit_scale=True) as bar:
            report = path.verify(repair=args.repair, progress=bar)
    except FileNotFoundError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except (NotALog, LogLocked) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise CliError(f"{args.log}: {exc.strerror or exc}", EXIT_USAGE) from None
    except LogError as exc:  # the server stopped answering mid-read: the log's soundness is unknown
        if isinstance(exc, LogCorruption):
            raise
        raise CliError(f"{path}: {exc}", EXIT_DATA) from None
    print(prefix + report.summary())
    if report.status not in ("ok", "repaired", "schema"):
        return EXIT_DATA  # torn or corrupt: the frames after the problem cannot be read
    digest = RecordDigest() if getattr(args, "digest", False) else None
    count, shown = check_lifecycle(path, opened=opened, digest=digest)
    if digest is not None:
        print(f"{prefix}records {digest.hexdigest()}")
    for v in shown:
        print(f"  lsn {v.lsn} session {v.session_id!r}: {v.describe()}")
    if count:
        first = shown[0]
        raise CliError(
            f"{path}: {count} lifecycle violation(s); first at lsn {first.lsn}, session {first.session_id!r}: {first.describe()}",
            EXIT_DATA,
        )
    return EXIT_OK if report.ok else EXIT_DATA


class OpenedIds:
    """The session_opened records of one partition, as (hash of the session id,
    LSN) in two flat arrays (16 bytes a session, whatever the id's length):
    enough to find the ids that two partitions both opened, which
    :func:`reused_across_partitions` then confirms by their exact ids."""

    __slots__ = ("hashes", "lsns")

    def __init__(self) -> None:
        from array import array

        self.hashes = array("q")
        self.lsns = array("q")

    def add(self, session_id: str, lsn: int) -> None:
        """Note that ``session_id`` was opened at ``lsn``."""
        self.hashes.append(hash(session_id))  # str hashes are stable within this process: all the check needs
        self.lsns.append(lsn)


def reused_across_partitions(root: Any, opened: dict[int, OpenedIds]) -> list[tuple[str, list[tuple[int, int]]]]:
    """The session ids opened in more than one partition under ``root``:
    ``[(session_id, [(partition, lsn), ...]), ...]``, sorted by id, places in
    partition order. ``opened`` holds each partition's session_opened records
    (hashes, from the lifecycle check's pass); the partitions that share a
    hash are read again for the exact ids, so a hash collision is never reported."""
    import msgspec
    import numpy as np

    from agentlog.events.schema.types import payload_tag
    from agentlog.tools.cli_common import read_records

    if len(opened) < 2:
        return []
    hashes = np.concatenate([np.frombuffer(o.hashes, dtype=np.int64) for o in opened.values()])
    pids = np.concatenate([np.full(len(o.hashes), pid, dtype=np.int64) for pid, o in opened.items()])
    order = np.lexsort((pids, hashes))
    hashes, pids = hashes[order], pids[order]
    # A hash shared by two adjacent entries of different partitions (sorted by hash, then partition).
    shared = (hashes[1:] == hashes[:-1]) & (pids[1:] != pids[:-1])
    candidates = set(hashes[1:][shared].tolist())
    if not candidates:
        return []
    suspects = sorted(set(pids[1:][shared].tolist()) | set(pids[:-1][shared].tolist()))
    places: dict[str, list[tuple[int, int]]] = {}
    for pid in suspects:
        try:
            for rec in read_records(root.partition(pid), raw=True, quiet=True, desc="verify across partitions"):
                if hash(rec.session_id) in candidates and payload_tag(rec.payload) == _OPENED_TAG:
                    places.setdefault(rec.session_id, []).append((pid, rec.lsn))
        except (CliError, msgspec.DecodeError):
            continue  # unreadable past some record: the partition's own line already says so (exit 1); its ids read so far count
    return sorted((sid, at) for sid, at in places.items() if len({pid for pid, _ in at}) > 1)


_OPENED_TAG = "session_opened"


def check_lifecycle(path: Any, *, opened: OpenedIds | None = None, digest: Any = None,
                    new_check: Any = None) -> tuple[int, list[Any]]:
    """The lifecycle check over the log at ``path``: ``(violations, the first SHOWN of them)``.
    Reads each record's tag only; no body is decoded. ``opened``, when given,
    collects every session_opened record (for the check across partitions);
    ``digest`` (a :class:`~agentlog.tools.cli_common.RecordDigest`), when given, takes every record.
    ``new_check``: makes the :class:`~agentlog.reducers.lifecycle.LifecycleCheck` (its defaults
    when None).

    The check's id filter has false positives (~3.4e-7 of fresh ids; a log of ten million
    sessions holds a few), which alone it would report as reused ids. So an opening the filter
    alone calls a reuse is only noted in the first pass; when there are any, one more pass finds
    the first LSN of each such id, and if any of them is fresh after all, the check runs again
    with that exact answer (as the restart fold confirms by a scan, and the engine at open).
    A sound log is read once; the extra passes read ids and tags only."""
    from agentlog.reducers.lifecycle import LifecycleCheck

    make = new_check or LifecycleCheck
    suspects: dict[str, int] = {}  # id -> LSN of its first opening the filter alone called a reuse

    def note_suspect(session_id: str, lsn: int) -> bool:
        suspects.setdefault(session_id, lsn)
        return True  # refused for now; confirmed below

    count, shown = _check_pass(path, make(), note_suspect, opened=opened, digest=digest)
    if not suspects:
        return count, shown
    first = _first_lsns(path, set(suspects))
    if all(first[sid] < lsn for sid, lsn in suspects.items()):
        return count, shown  # every one a real reuse: the first pass's answer is exact

    def used_before(session_id: str, lsn: int) -> bool:
        if session_id not in first:  # an id the second run suspects alone (its window moved): rare twice over
            first.update(_first_lsns(path, {session_id}))
        return first[session_id] < lsn

    return _check_pass(path, make(), used_before)


def _check_pass(path: Any, check: Any, confirm_used: Any, *, opened: OpenedIds | None = None,
                digest: Any = None) -> tuple[int, list[Any]]:
    """One pass of ``check`` over the log, its id filter's maybe-used openings answered by ``confirm_used``."""
    import msgspec

    from agentlog.events.schema.types import payload_tag
    from agentlog.tools.cli_common import read_records

    check.fold.confirm_used = confirm_used
    feed = check.feed
    count = 0
    shown: list[Any] = []
    for rec in read_records(path, raw=True, quiet=True, desc="verify lifecycle"):
        try:
            tag = payload_tag(rec.payload)
        except msgspec.DecodeError as exc:  # the frame check decoded it; a payload without a tag is corrupt
            raise CliError(f"{path}: lsn {rec.lsn}, session {rec.session_id!r}: payload has no event tag: {exc}", EXIT_DATA) from None
        if opened is not None and tag == _OPENED_TAG:
            opened.add(rec.session_id, rec.lsn)
        if digest is not None:
            digest.update(rec)
        found = feed(rec.lsn, rec.session_id, rec.session_seq, tag)
        if found:
            count += len(found)
            shown.extend(found[: SHOWN - len(shown)])
    return count, shown


def _first_lsns(path: Any, ids: set[str]) -> dict[str, int]:
    """The LSN of the first record of each of ``ids`` in the log at ``path`` (ids only are read)."""
    from agentlog.engine.ids import first_lsns
    from agentlog.tools.cli_common import read_records

    return first_lsns(read_records(path, raw=True, quiet=True, desc="verify reused ids"), ids)
