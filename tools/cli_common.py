"""What the `agentlog` reading commands share: opening a log path with one-line
errors, reading it with a progress bar, and formatting times.

A run folder (``agentlog demo --out DIR``) stands for its ``rollout/`` log.
Errors become :class:`tools.cli.CliError`: a missing path, an unreadable one
or a directory that is not a log exits 2 (with a "did you mean" naming the
logs found below it); corruption found while reading exits 1 and names the
segment, offset and LSN (the log layer's message), prefixed by the path.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from agentlog.tools.cli import EXIT_DATA, EXIT_USAGE, CliError

#: Logs smaller than this are read without a progress bar.
PROGRESS_MIN_BYTES = 4 << 20


def add_quiet(parser: Any) -> None:
    """The shared ``--quiet`` option."""
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


#: The rollout log inside a run folder (what `agentlog demo` / `train` make).
RUN_FOLDER_LOG = "rollout"
#: How deep, and through how many folders, "did you mean" looks for logs below a directory.
DID_YOU_MEAN_DEPTH = 3
DID_YOU_MEAN_MAX_DIRS = 2000


def _unreadable(arg: str, exc: OSError) -> CliError:
    """The one-line exit-2 error for an OSError met while reading the log at ``arg``:
    it names the file or directory the OS refused (a segment, the directory itself)."""
    where = exc.filename or arg
    return CliError(f"{where}: cannot read: {exc.strerror or exc}", EXIT_USAGE)


def _is_run_folder(path: Path, *, allow_empty: bool) -> bool:
    """A run folder: its ``rollout/`` holds a log (or, for a log about to be
    written, exists next to the run's ``config.json``)."""
    from agentlog.events.log_format import is_log_dir

    from agentlog.events.partitions import is_partition_root

    inner = path / RUN_FOLDER_LOG
    return is_log_dir(inner) or is_partition_root(inner) or (allow_empty and inner.is_dir() and (path / "config.json").is_file())


def partitioned(path: Path) -> bool:
    """True when the (checked) log path is a partition root: a folder of
    ``p%04d`` partition logs, read as one merged log (:func:`read_tagged`)."""
    from agentlog.events.log_format import is_log_dir
    from agentlog.events.partitions import is_partition_root

    return not is_log_dir(path) and is_partition_root(path)


def record_id(pid: int | None, lsn: int) -> str:
    """How an event is named: its LSN in a single log, ``p0003:1234`` (partition, LSN) in a partitioned one."""
    return str(lsn) if pid is None else f"p{pid:04d}:{lsn}"


#: The learner log inside a run folder (its PolicyUpdated records).
RUN_FOLDER_LEARNER_LOG = "learner"


def learner_log_of(arg: Path) -> Path | None:
    """The learner log of the run folder ``arg`` (or of the run folder whose
    rollout log ``arg`` is), or None when there is none."""
    from agentlog.events.log_format import is_log_dir

    for run in (arg, arg.parent if arg.name == RUN_FOLDER_LOG else None):
        if run is not None and is_log_dir(run / RUN_FOLDER_LEARNER_LOG):
            return run / RUN_FOLDER_LEARNER_LOG
    return None


def logs_below(path: Path, *, depth: int = DID_YOU_MEAN_DEPTH, max_dirs: int = DID_YOU_MEAN_MAX_DIRS) -> list[Path]:
    """Log directories and run folders below ``path`` (not ``path`` itself), breadth first, at most
    ``depth`` levels down and through at most ``max_dirs`` folders; hidden and
    unreadable folders are passed over (this only suggests, it never decides)."""
    from agentlog.events.log_format import is_log_dir

    found: list[Path] = []
    level = [path]
    visited = 0
    for _ in range(depth):
        nxt: list[Path] = []
        for d in level:
            try:
                children = sorted((e for e in os.scandir(d) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")), key=lambda e: e.name)
            except OSError:
                continue
            for e in children:
                visited += 1
                if visited > max_dirs:
                    return found
                child = Path(e.path)
                if is_log_dir(child) or _is_run_folder(child, allow_empty=False):
                    found.append(child)  # a run folder is named itself: it stands for its rollout/ log
                else:
                    nxt.append(child)
        level = nxt
    return found


def check_log_path(arg: str, *, allow_empty: bool = False) -> Path:
    """The log directory named on the command line, or a one-line exit-2 error.

    A run folder (it holds a ``rollout/`` log) stands for that log. Any other
    directory that is not a log gets a "did you mean" naming the logs found
    below it. ``allow_empty`` also accepts a directory that holds no log yet
    (nothing but a writer's lock or index): a log about to be written."""
    from agentlog.events.log_format import DURABLE_NAME, INDEX_NAME, LOCK_NAME, is_log_dir

    path = Path(arg)
    if not path.exists():
        raise CliError(f"{arg}: no such log directory", EXIT_USAGE)
    if not path.is_dir():
        raise CliError(f"{arg}: is a file, expected a log directory", EXIT_USAGE)
    try:
        if is_log_dir(path):
            return path
        if partitioned(path):  # a run's rollout/ of p%04d partitions
            return path
        if _is_run_folder(path, allow_empty=allow_empty):
            return path / RUN_FOLDER_LOG
        _check_partition_root(path)
        _check_partition_root(path / RUN_FOLDER_LOG)
        strangers = sorted(n for n in os.listdir(path) if n not in (LOCK_NAME, INDEX_NAME) and not n.startswith("."))
    except OSError as exc:  # e.g. a directory we may not list (chmod 000)
        raise _unreadable(arg, exc) from None
    if allow_empty and not strangers:
        return path
    held = f"; holds {', '.join(strangers[:3])}" if strangers else ""
    below = logs_below(path)
    hint = f"; did you mean {' or '.join(str(p) for p in below[:3])}{' (and more)' if len(below) > 3 else ''}?" if below else ""
    raise CliError(f"{arg}: not an agentlog log directory (no segment files, no {DURABLE_NAME}{held}){hint}", EXIT_USAGE)


def _check_partition_root(path: Path) -> None:
    """When ``path`` holds a ``p%04d`` folder but is not a partition root, the
    exit-2 error of :func:`events.partitions.list_partitions` naming the
    entries that are not partitions (a generic "not a log" would hide them)."""
    from agentlog.events.partitions import NotALog, list_partitions, parse_partition_name

    if path.is_dir() and any(parse_partition_name(n) is not None for n in os.listdir(path)):
        try:
            list_partitions(path)
        except NotALog as exc:
            raise CliError(str(exc), EXIT_USAGE) from None


def log_bytes(path: Path) -> int:
    """Total size of the log's segment files."""
    from agentlog.events.log_format import list_segments, segment_name

    if partitioned(path):
        from agentlog.events.partitions import list_partitions, partition_dir

        return sum(log_bytes(partition_dir(path, pid)) for pid in list_partitions(path))
    total = 0
    for first in list_segments(path):
        try:
            total += (path / segment_name(first)).stat().st_size
        except FileNotFoundError:  # rotated away under a live writer
            pass
    return total


def read_records(
    path: Path, *, raw: bool = False, from_lsn: int = 0, quiet: bool = False, desc: str = "read"
) -> Iterator[Any]:
    """Every durable record of the log at ``path`` from ``from_lsn`` (Envelopes,
    or RawRecords with ``raw``), with a byte progress bar on stderr for logs
    over PROGRESS_MIN_BYTES unless ``quiet``. Corruption raises CliError(1).
    A partition root is read merged (:func:`read_tagged`, tags dropped)."""
    for _pid, rec in read_tagged(path, raw=raw, from_lsn=from_lsn, quiet=quiet, desc=desc):
        yield rec


def read_tagged(
    path: Path, *, raw: bool = False, from_lsn: int = 0, quiet: bool = False, desc: str = "read"
) -> Iterator[tuple[int | None, Any]]:
    """:func:`read_records` with each record's partition id: ``(None, record)``
    for a single log; for a partition root, ``(pid, record)`` for every
    partition's records in the merged order of
    :func:`events.partitions.read_partitions` (``from_lsn`` must be 0 there:
    LSNs are per partition)."""
    from agentlog.events import read_log
    from agentlog.events.log_api import LogError

    bar = _progress(path, quiet, desc)
    if partitioned(path):
        from agentlog.events.partitions import read_partitions

        if from_lsn:
            raise CliError(f"{path}: a partitioned log has one LSN sequence per partition; read from LSN {from_lsn} in one partition (e.g. {path}/p0000)", EXIT_USAGE)
        it = read_partitions(path, raw=True)
    else:
        it = ((None, rec) for rec in read_log(path, from_lsn, raw=True))
    pending = 0
    try:
        for pid, rec in it:
            if bar is not None:
                # Frame overhead is ~40 bytes plus the session id; close enough for a bar.
                pending += len(rec.payload) + 40 + len(rec.session_id)
                if pending >= 1 << 20:
                    bar.update(pending)
                    pending = 0
            if raw:
                yield pid, rec
                continue
            try:
                env = rec.decode()
            except ValueError as exc:  # msgspec decode/validation errors are ValueErrors
                where = path if pid is None else f"{path}/p{pid:04d}"
                raise CliError(
                    f"{where}: lsn {rec.lsn}, session {rec.session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA
                ) from None
            yield pid, env
    except (OSError, LogError) as exc:
        raise _read_error(path, exc) from None
    finally:
        it.close()
        if bar is not None:
            bar.close()


def read_frame_batches(path: Path, *, quiet: bool = False, desc: str = "read") -> Iterator[list[Any]]:
    """Every durable record of the (single, not partitioned) log at ``path``
    as lists of undecoded frames (:func:`events.log_read.read_frame_batches`:
    lsn, session_id, session_seq, ts_ns, flags, payload), with the progress
    bar and the errors of :func:`read_tagged`."""
    from agentlog.events.log_api import LogError
    from agentlog.events.log_read import read_frame_batches as read_batches

    bar = _progress(path, quiet, desc)
    it = read_batches(path)
    try:
        for batch in it:
            if bar is not None:
                bar.update(batch[-1].end - batch[0].offset)
            yield batch
    except (OSError, LogError) as exc:
        raise _read_error(path, exc) from None
    finally:
        it.close()
        if bar is not None:
            bar.close()


def _progress(path: Path, quiet: bool, desc: str) -> Any:
    """A byte progress bar on stderr for a log over PROGRESS_MIN_BYTES, unless ``quiet``; else None."""
    if quiet or log_bytes(path) < PROGRESS_MIN_BYTES:
        return None
    from tqdm import tqdm

    return tqdm(total=log_bytes(path), unit="B", unit_scale=True, desc=desc, leave=False, file=sys.stderr, disable=None)


def _read_error(path: Path, exc: BaseException) -> CliError:
    """The CliError for an error met while reading the log at ``path``: a
    missing or unreadable path, or a directory that is not a log, exits 2;
    corruption (a LogError) exits 1."""
    from agentlog.events import NotALog

    if isinstance(exc, FileNotFoundError):
        return CliError(f"{path}: {exc}", EXIT_USAGE)
    if isinstance(exc, NotALog):
        return CliError(str(exc), EXIT_USAGE)
    if isinstance(exc, OSError):
        return _unreadable(str(path), exc)
    return CliError(f"{path}: {exc}", EXIT_DATA)  # LogCorruption and friends: a problem in the data


def fmt_ts(ts_ns: int) -> str:
    """``2026-11-30T17:21:15.123Z`` (UTC, milliseconds)."""
    t = _dt.datetime.fromtimestamp(ts_ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _int_at_least(text: str, low: int) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= {low}, found {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected an int >= {low}, found {value}")
    return value


def nonneg_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, say)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, found {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, found {text}")
    return value
