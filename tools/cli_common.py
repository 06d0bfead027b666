"""What the `agentlog` reading commands share: opening a log path with one-line
errors, reading it with a progress bar, and formatting times.

A run folder (``agentlog demo --out DIR``) stands for its ``rollout/`` log.
A ``nats://host:port/stream`` URL stands for a run's stream on JetStream (all
its partitions, read merged as a partition root is), and
``nats://host:port/stream/p0003`` (or ``/learner``) for one of its logs:
:func:`check_log_path` opens it as a :class:`RemoteLog` and every helper here
takes one wherever it takes a directory, so the commands need not know where
a log lives (:func:`close_remotes` ends the connections at exit).
Errors become :class:`tools.cli.CliError`: a missing path, an unreadable one
or a directory that is not a log exits 2 (with a "did you mean" naming the
logs found below it); corruption found while reading exits 1 and names the
segment, offset and LSN (the log layer's message), prefixed by the path.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from agentlog.tools.cli import EXIT_DATA, EXIT_USAGE, CliError
from agentlog.tools.progress import new_bar

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
    from agentlog.events.log.format import is_log_dir

    from agentlog.events.log.partitions import is_partition_root

    inner = path / RUN_FOLDER_LOG
    return is_log_dir(inner) or is_partition_root(inner) or (allow_empty and inner.is_dir() and (path / "config.json").is_file())


def partitioned(path: Any) -> bool:
    """True when the (checked) log path is a partition root: a folder of
    ``p%04d`` partition logs, or a run's whole stream on JetStream, read as
    one merged log (:func:`read_tagged`)."""
    if isinstance(path, RemoteLog):
        return path.name is None
    from agentlog.events.log.format import is_log_dir
    from agentlog.events.log.partitions import is_partition_root

    return not is_log_dir(path) and is_partition_root(path)


def record_id(pid: int | None, lsn: int) -> str:
    """How an event is named: its LSN in a single log, ``p0003:1234`` (partition, LSN) in a partitioned one."""
    return str(lsn) if pid is None else f"p{pid:04d}:{lsn}"


#: The learner log inside a run folder (its PolicyUpdated records).
RUN_FOLDER_LEARNER_LOG = "learner"


def learner_log_of(arg: Any) -> Any:
    """The learner log of the run folder ``arg`` (or of the run folder whose
    rollout log ``arg`` is; or the ``learner`` subject of a run's stream, a
    :class:`RemoteLog`), or None when there is none."""
    from agentlog.events.log.format import is_log_dir

    if isinstance(arg, RemoteLog):
        return arg.sibling(RUN_FOLDER_LEARNER_LOG) if RUN_FOLDER_LEARNER_LOG in arg.run.names() else None
    arg = Path(arg)

    for run in (arg, arg.parent if arg.name == RUN_FOLDER_LOG else None):
        if run is not None and is_log_dir(run / RUN_FOLDER_LEARNER_LOG):
            return run / RUN_FOLDER_LEARNER_LOG
    return None


def run_folder_of(path: Any) -> Path | None:
    """The loop run folder the (checked) log ``path`` belongs to: the folder whose
    ``config.json`` sits beside its ``rollout/`` (``path`` is that ``rollout/``, a
    partition of it, or the run's stream named through the run folder); None for
    a bare log."""
    if isinstance(path, RemoteLog):
        return path.run_dir
    path = Path(path)
    for run in (path.parent if path.name == RUN_FOLDER_LOG else None,
                path.parent.parent if path.parent.name == RUN_FOLDER_LOG else None):
        if run is not None and (run / "config.json").is_file():
            return run
    return None


def reduce_config_of(path: Any) -> Any:
    """The :class:`~agentlog.reducers.config.ReduceConfig` every reading command folds
    the (checked) log ``path`` with: its run folder's own settings, the ones the
    learner trained with (:func:`agentlog.loop.config.run_reduce_config`), or the
    reducers' defaults for a bare log. An unreadable ``config.json`` exits 2 naming it."""
    from agentlog.reducers.config import DEFAULT_CONFIG

    run = run_folder_of(path)
    if run is None:
        return DEFAULT_CONFIG
    from agentlog.loop.config import ConfigError, run_reduce_config

    try:
        return run_reduce_config(run) or DEFAULT_CONFIG
    except ConfigError as exc:
        raise CliError(f"{exc} (the run's reduce settings)", EXIT_USAGE) from None


def logs_below(path: Path, *, depth: int = DID_YOU_MEAN_DEPTH, max_dirs: int = DID_YOU_MEAN_MAX_DIRS) -> list[Path]:
    """Log directories and run folders below ``path`` (not ``path`` itself), breadth first, at most
    ``depth`` levels down and through at most ``max_dirs`` folders; hidden and
    unreadable folders are passed over (this only suggests, it never decides)."""
    from agentlog.events.log.format import is_log_dir

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


def note_incomplete_run(path: Path) -> None:
    """A note on stderr when ``path`` is a run folder marked incomplete (or its ``rollout/``):
    what it holds ends where the run stopped (``loop.run_marker``'s file says why)."""
    from agentlog.loop.run_marker import incomplete_reason

    for run in (path, path.parent) if path.name == RUN_FOLDER_LOG else (path,):
        why = incomplete_reason(run)
        if why is not None:
            print(f"agentlog: note: {run} is an incomplete run ({why}); its logs end where it stopped", file=sys.stderr)
            return


def check_log_path(arg: str, *, allow_empty: bool = False) -> Any:
    """The log directory named on the command line, or a one-line exit-2 error.

    A run folder (it holds a ``rollout/`` log) stands for that log. Any other
    directory that is not a log gets a "did you mean" naming the logs found
    below it. ``allow_empty`` also accepts a directory that holds no log yet
    (nothing but a writer's lock or index): a log about to be written.
    A ``nats://`` URL gives a :class:`RemoteLog` (see :func:`open_remote`)."""
    from agentlog.events.log.format import DURABLE_NAME, INDEX_NAME, LOCK_NAME, is_log_dir
    from agentlog.events.log.jetstream_read import is_nats_url

    if is_nats_url(arg):
        return open_remote(arg, allow_empty=allow_empty)
    path = Path(arg)
    if not path.exists():
        raise CliError(f"{arg}: no such log directory", EXIT_USAGE)
    if not path.is_dir():
        raise CliError(f"{arg}: is a file, expected a log directory", EXIT_USAGE)
    note_incomplete_run(path)
    remote = nats_run_folder(path, allow_empty=allow_empty)
    if remote is not None:  # a run whose config.json keeps its logs on JetStream
        return remote
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
    exit-2 error of :func:`events.log.partitions.list_partitions` naming the
    entries that are not partitions (a generic "not a log" would hide them)."""
    from agentlog.events.log.partitions import NotALog, list_partitions, parse_partition_name

    if path.is_dir() and any(parse_partition_name(n) is not None for n in os.listdir(path)):
        try:
            list_partitions(path)
        except NotALog as exc:
            raise CliError(str(exc), EXIT_USAGE) from None


def log_bytes(path: Any) -> int:
    """Total size of the log's segment files (of a whole stream on JetStream:
    the stream's bytes, as the server counts them; of one subject: 0, the
    server does not count a subject's bytes)."""
    from agentlog.events.log.format import list_segments, segment_name

    if isinstance(path, RemoteLog):
        return path.stream_bytes() if path.name is None else 0

    if partitioned(path):
        from agentlog.events.log.partitions import list_partitions, partition_dir

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
    :func:`events.log.partitions.read_partitions` (``from_lsn`` must be 0 there:
    LSNs are per partition)."""
    from agentlog.events import read_log

    bar = _progress(path, quiet, desc)
    if partitioned(path):
        from agentlog.events.log.partitions import read_partitions

        if from_lsn:
            raise CliError(f"{path}: a partitioned log has one LSN sequence per partition; read from LSN {from_lsn} in one partition (e.g. {path}/p0000)", EXIT_USAGE)
        it = read_partitions(path.run if isinstance(path, RemoteLog) else path, raw=True)
    else:
        it = ((None, rec) for rec in read_log(path.ref() if isinstance(path, RemoteLog) else path, from_lsn, raw=True))
    pending = 0
    with contextlib.closing(_guarded(path, it, bar)) as records:
        for pid, rec in records:
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


def _guarded(path: Any, it: Iterator[Any], bar: Any) -> Iterator[Any]:
    """The items of ``it``, with a read error raised as the CliError that
    names ``path`` (:func:`_read_error`); ``it`` and the progress bar are
    closed however the read ends."""
    from agentlog.events.log.api import LogError

    try:
        yield from it
    except (OSError, LogError) as exc:
        raise _read_error(path, exc) from None
    finally:
        it.close()
        if bar is not None:
            bar.close()


def log_partitions(path: Any) -> list[int]:
    """The partition ids of a (checked, :func:`partitioned`) partition root or run stream, ascending."""
    if isinstance(path, RemoteLog):
        return path.run.partitions()
    from agentlog.events.log.partitions import list_partitions

    return list_partitions(path)


def partition_log(path: Any, pid: int) -> Any:
    """Partition ``pid`` of a partition root (its directory) or of a run's
    stream (a :class:`RemoteLog` naming its subject)."""
    if isinstance(path, RemoteLog):
        from agentlog.events.log.partitions import partition_name

        return path.sibling(partition_name(pid))
    from agentlog.events.log.partitions import partition_dir

    return partition_dir(path, pid)


class RecordDigest:
    """sha256 over a log's records as stored: each record's LSN, session seq,
    timestamp, terminal flag, session id and payload, length-prefixed (the
    fields its frame is made of). Equal for two logs exactly when their
    frames are byte-identical: a log on JetStream and its export to a
    directory, a directory and its import (``verify --digest`` prints it)."""

    def __init__(self) -> None:
        import hashlib

        self._h = hashlib.sha256()
        self.records = 0

    def update(self, rec: Any) -> None:
        """Take the next record (a RawRecord)."""
        import struct

        sid = rec.session_id.encode("utf-8")
        self._h.update(struct.pack("<QQqBIQ", rec.lsn, rec.session_seq, rec.ts_ns, bool(rec.terminal), len(sid), len(rec.payload)))
        self._h.update(sid)
        self._h.update(rec.payload)
        self.records += 1

    def hexdigest(self) -> str:
        """``sha256:<hex>``."""
        return f"sha256:{self._h.hexdigest()}"


# ---------------------------------------------------------------- logs on JetStream


class RemoteLog:
    """A log named by a ``nats://`` URL: a run's whole stream (``name`` None:
    its partitions, read merged as a partition root is) or one log of it
    (``name``: ``p0003``, ``learner``). ``str()`` is the URL, so every
    message that names a directory names the URL instead."""

    def __init__(self, run: Any, base: str, name: str | None, run_dir: Path | None = None) -> None:
        self.run, self.base, self.name = run, base, name
        #: The run folder whose config.json named this stream (None for a URL given as such).
        self.run_dir = run_dir

    def __str__(self) -> str:
        return self.base if self.name is None else f"{self.base}/{self.name}"

    def __repr__(self) -> str:
        return f"RemoteLog({str(self)!r})"

    def sibling(self, name: str) -> "RemoteLog":
        """Another log of the same stream."""
        return RemoteLog(self.run, self.base, name, self.run_dir)

    def ref(self) -> Any:
        """The :class:`~agentlog.events.log.jetstream_read.JetStreamRef` of this one log."""
        if self.name is None:
            raise CliError(f"{self}: names a whole stream, expected one of its logs (e.g. {self.base}/p0000)", EXIT_USAGE)
        return self.run.log(self.name)

    def stream_bytes(self) -> int:
        """The stream's size in bytes as the server counts it (every subject, headers included)."""
        return int(self.run.bridge.call(self.run.js.stream_info(self.run.stream)).state.bytes or 0)


class StreamMissing(CliError):
    """The stream a ``nats://`` URL (or a run folder on JetStream) names does not exist (yet): ``tail`` waits for it."""


#: Runs on JetStream opened by this process, by (servers, stream): one connection each, closed by close_remotes().
_REMOTES: dict[tuple[str, str], Any] = {}


def open_remote(text: str, *, allow_empty: bool = False) -> RemoteLog:
    """The :class:`RemoteLog` a ``nats://host:port/stream[/log]`` URL names,
    its stream opened read-only (one connection per stream, kept until
    :func:`close_remotes`). Exit-2 errors name the URL and what was expected:
    a malformed URL, a server that cannot be reached, a missing stream, a
    stream without partitions, or a log the stream does not hold (the logs
    it does hold listed). ``allow_empty`` (tail) accepts a stream or log with
    no message yet."""
    from agentlog.events.log.jetstream_read import parse_nats_url

    try:
        servers, stream, name = parse_nats_url(text)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    hosts = text[len("nats://"):].partition("/")[0]
    return _open_stream(text, servers, stream, RemoteLog(None, f"nats://{hosts}/{stream}", name), allow_empty)


def nats_run_folder(path: Path, *, allow_empty: bool = False) -> RemoteLog | None:
    """For a run folder whose ``config.json`` says ``[log] backend = "nats"``
    (:class:`agentlog.loop.logs.RunLogs`), the :class:`RemoteLog` of its
    stream (the run folder stands for its rollout partitions, as a file run
    folder stands for its ``rollout/``); None for any other directory."""
    import json

    config = path / "config.json"
    try:
        backend = json.loads(config.read_text()).get("log", {}).get("backend") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None  # not a loop run's config: the directory is judged as any other
    if backend != "nats":
        return None
    from agentlog.loop.config import ConfigError
    from agentlog.loop.logs import RunLogs

    try:
        run_logs = RunLogs.of(path)
    except (ConfigError, ValueError, TypeError) as exc:
        raise CliError(f"{config}: {exc}", EXIT_USAGE) from None
    from agentlog.events.log.jetstream_read import parse_nats_url

    base = f"{run_logs.cfg.log.url}/{run_logs.stream}"  # the config checked the URL: it parses
    servers, stream, _ = parse_nats_url(base)
    return _open_stream(f"{path} (its logs: {base})", servers, stream, RemoteLog(None, base, None, run_dir=path), allow_empty)


def _open_stream(text: str, servers: str, stream: str, remote: RemoteLog, allow_empty: bool) -> RemoteLog:
    """``remote`` with its stream opened (one connection per stream and process) and checked (see :func:`open_remote`)."""
    from agentlog.events.log.api import LogError, NotALog
    from agentlog.events.log.jetstream_read import JetStreamRun

    run = _REMOTES.get((servers, stream))
    if run is None:
        import logging

        check_reachable(text, servers)
        # nats-py logs each failed connection attempt with a traceback; the one-line error below says it all.
        nats_logger = logging.getLogger("nats")
        level = nats_logger.level
        nats_logger.setLevel(logging.CRITICAL)
        try:
            run = JetStreamRun.open(servers, stream)
        except NotALog as exc:  # no such stream
            raise StreamMissing(f"{text}: {exc}", EXIT_USAGE) from None
        except LogError as exc:  # cannot connect, nats-py missing
            raise CliError(f"{text}: {exc}", EXIT_USAGE) from None
        finally:
            nats_logger.setLevel(level)
        _REMOTES[(servers, stream)] = run
    remote.run = run
    if allow_empty:
        return remote
    name = remote.name
    names = run.names()
    held = f"it holds {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else "it holds no message"
    if name is None and not run.partitions():
        raise CliError(f"{text}: stream {stream!r} holds no partition log (expected subjects {stream}.p0000 ...); {held}", EXIT_USAGE)
    if name is not None and name not in names:
        raise CliError(f"{text}: stream {stream!r} holds no log {name!r} (no message on subject {stream}.{name}); {held}", EXIT_USAGE)
    return remote


#: Seconds to wait for a TCP connection to a NATS server before saying it cannot be reached.
CONNECT_TIMEOUT_S = 3.0


def check_reachable(text: str, servers: str) -> None:
    """Exit 2 at once, naming each server and why, when no server of the URL
    accepts a TCP connection (nats-py would retry for seconds first)."""
    import socket

    why = []
    for url in servers.split(","):
        host, _, port = url[len("nats://"):].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
            return
        except OSError as exc:
            why.append(f"{host}:{port}: {exc.strerror or exc}")
    raise CliError(f"{text}: cannot connect to a NATS server ({'; '.join(why)}); expected a running nats-server with JetStream", EXIT_USAGE)


def close_remotes() -> None:
    """Close every stream connection :func:`open_remote` opened (the CLI's exit)."""
    while _REMOTES:
        _, run = _REMOTES.popitem()
        run.close()


def read_frame_batches(path: Path, *, quiet: bool = False, desc: str = "read") -> Iterator[list[Any]]:
    """Every durable record of the (single, not partitioned) log at ``path``
    as lists of undecoded frames (:func:`events.log.read.read_frame_batches`:
    lsn, session_id, session_seq, ts_ns, flags, payload), with the progress
    bar and the errors of :func:`read_tagged`."""
    from agentlog.events.log.read import read_frame_batches as read_batches

    bar = _progress(path, quiet, desc)
    with contextlib.closing(_guarded(path, read_batches(path.ref() if isinstance(path, RemoteLog) else path), bar)) as batches:
        for batch in batches:
            if bar is not None:
                bar.update(batch[-1].end - batch[0].offset)
            yield batch


def _progress(path: Path, quiet: bool, desc: str) -> Any:
    """A byte progress bar on stderr for a log over PROGRESS_MIN_BYTES, unless ``quiet``; else None."""
    if quiet or log_bytes(path) < PROGRESS_MIN_BYTES:
        return None
    return new_bar(log_bytes(path), desc, unit="B", unit_scale=True)


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
