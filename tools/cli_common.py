"""What the `agentlog` reading commands share: opening the log named on the
command line with one-line errors, reading it with a progress bar, and
formatting times.

A run folder (``agentlog demo --out DIR``) stands for its rollout logs.
A ``nats://host:port/stream`` URL stands for a run's stream on JetStream (all
its partitions, read merged as a partition root is), and
``nats://host:port/stream/p0003`` (or ``/learner``) for one of its logs:
:func:`check_log_path` opens any of them as a
:class:`~agentlog.events.log.source.LogSource` (through ``open_source``), so
the commands need not know where a log lives (:func:`close_sources` ends the
connections at exit).
Errors become :class:`tools.cli.CliError`: a missing path, an unreadable one
or a directory that is not a log exits 2 (with a "did you mean" naming the
logs found below it); corruption found while reading exits 1 and names the
segment, offset and LSN (the log layer's message), prefixed by the path.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, NamedTuple

from agentlog.events.log.source import LogSource, open_source
from agentlog.tools.cli import EXIT_DATA, EXIT_USAGE, CliError
from agentlog.tools.progress import new_bar

#: Logs smaller than this are read without a progress bar.
PROGRESS_MIN_BYTES = 4 << 20


def add_quiet(parser: Any) -> None:
    """The shared ``--quiet`` option."""
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _unreadable(arg: str, exc: OSError) -> CliError:
    """The one-line exit-2 error for an OSError met while reading the log at ``arg``:
    it names the file or directory the OS refused (a segment, the directory itself)."""
    where = exc.filename or arg
    return CliError(f"{where}: cannot read: {exc.strerror or exc}", EXIT_USAGE)


def record_id(pid: int | None, lsn: int) -> str:
    """How an event is named: its LSN in a single log, ``p0003:1234`` (partition, LSN) in a partitioned one."""
    return str(lsn) if pid is None else f"p{pid:04d}:{lsn}"


def learner_log_of(source: LogSource) -> LogSource | None:
    """The learner log of the run whose rollout ``source`` is (a run folder
    stands for its rollout), or None when there is none (a bare log)."""
    from agentlog.events.log.source import RUN_LEARNER_LOG

    learner = source.run_sibling(RUN_LEARNER_LOG)
    return learner if learner is not None and learner.exists() else None


def reduce_config_of(source: LogSource, config_file: str | None = None) -> Any:
    """The :class:`~agentlog.reducers.config.ReduceConfig` every reading command folds
    the (checked) log with: the settings of the run whose config file is ``config_file``
    when given (a copy of a run's log without its config, such as its JetStream stream),
    else its run folder's own settings, the ones the learner trained with
    (:meth:`agentlog.loop.config.LoopConfig.reduce_config`), or the reducers' defaults for
    a bare log. A config that does not load exits 2 naming it."""
    from agentlog.reducers.config import DEFAULT_CONFIG

    if config_file is not None:
        from agentlog.loop.config import ConfigError as LoopConfigError, LoopConfig

        try:
            return LoopConfig.load(Path(config_file)).reduce_config()
        except LoopConfigError as exc:
            raise CliError(f"--config: {exc}", EXIT_USAGE) from None
    if source.run_dir is None:
        return DEFAULT_CONFIG
    from agentlog.loop.config import ConfigError
    from agentlog.loop.run_folder import Run

    try:
        run = Run.at(source.run_dir)
    except ConfigError as exc:
        raise CliError(f"{exc} (the run's reduce settings)", EXIT_USAGE) from None
    return run.config.reduce_config() if run is not None else DEFAULT_CONFIG


def note_incomplete_run(path: Path) -> None:
    """A note on stderr when ``path`` is a run folder marked incomplete (or its ``rollout/``):
    what it holds ends where the run stopped (``loop.run_marker``'s file says why)."""
    from agentlog.events.log.source import RUN_ROLLOUT_LOG
    from agentlog.loop.run_marker import incomplete_reason

    for run in (path, path.parent) if path.name == RUN_ROLLOUT_LOG else (path,):
        why = incomplete_reason(run)
        if why is not None:
            print(f"agentlog: note: {run} is an incomplete run ({why}); its logs end where it stopped", file=sys.stderr)
            return


class StreamMissing(CliError):
    """The stream a ``nats://`` URL (or a run folder on JetStream) names does not exist (yet): ``tail`` waits for it."""


#: The sources :func:`check_log_path` opened in this process, closed by :func:`close_sources` (the CLI's exit).
_OPENED: list[LogSource] = []


def check_log_path(arg: str, *, allow_empty: bool = False) -> LogSource:
    """The log named on the command line as a :class:`~agentlog.events.log.source.LogSource`
    (:func:`~agentlog.events.log.source.open_source`), or a one-line exit-2 error.

    A run folder stands for its rollout logs (in its ``rollout/``, or on the
    JetStream stream its ``config.json`` names). Any other directory that is
    not a log gets a "did you mean" naming the logs found below it.
    ``allow_empty`` also accepts a log not written yet (a directory holding
    nothing but a writer's lock or index, a stream with no message)."""
    from agentlog.events.log.source import SourceError, StreamMissing as NoStream, is_location_url

    config_error = None
    try:
        source = None
        if not is_location_url(arg) and Path(arg).is_dir():
            note_incomplete_run(Path(arg))
            source, config_error = _run_folder_logs(Path(arg), allow_empty)
        if source is None:
            source = open_source(arg, allow_empty=allow_empty)
    except NoStream as exc:
        raise StreamMissing(str(exc), EXIT_USAGE) from None
    except SourceError as exc:
        raise CliError(str(config_error or exc), EXIT_USAGE) from None
    except OSError as exc:  # e.g. a directory we may not list (chmod 000)
        raise _unreadable(arg, exc) from None
    _OPENED.append(source)
    return source


def check_output_path(source: LogSource, output: str | None, option: str = "-o") -> None:
    """Refuse (exit 2) an output path that is, or is inside, a log ``source`` reads (a segment,
    its DURABLE or INDEX, a partition), or its run folder's learner log or ``config.json``. A
    typo or a tab completion there would replace the log with the command's output: a reading
    command never modifies a log. Call it before anything is opened for writing."""
    from agentlog.events.log.source import RUN_CONFIG, RUN_LEARNER_LOG, is_location_url

    if output is None or output == "-":
        return
    protected = [] if is_location_url(source.location) else [Path(source.location)]
    if source.run_dir is not None:
        protected += [source.run_dir / RUN_LEARNER_LOG, source.run_dir / RUN_CONFIG]
    out = Path(output).resolve()  # through symlinks: a link into the log is the log
    for place in protected:
        place = place.resolve()
        if out == place or place in out.parents:
            raise CliError(f"{option} {output}: is {'' if out == place else 'inside '}{place}, which this command reads; "
                           "write the output elsewhere", EXIT_USAGE)


def _run_folder_logs(path: Path, allow_empty: bool) -> tuple[LogSource | None, Exception | None]:
    """The rollout logs of the run folder ``path`` when its config keeps them
    elsewhere than its ``rollout/`` (on JetStream); ``(None, None)`` for any other
    directory, judged by :func:`open_source`. A config that does not load is
    returned as the error to report should the folder hold no log either."""
    from agentlog.loop.config import ConfigError
    from agentlog.loop.run_folder import Run

    try:
        run = Run.at(path)
    except ConfigError as exc:
        return None, exc
    if run is None or not run.logs_elsewhere:
        return None, None
    return run.open_rollout_view(allow_empty=allow_empty), None


def close_sources() -> None:
    """Close every source :func:`check_log_path` opened (the CLI's exit)."""
    while _OPENED:
        _OPENED.pop().close()


def read_records(
    source: LogSource, *, raw: bool = False, from_lsn: int = 0, quiet: bool = False, desc: str = "read"
) -> Iterator[Any]:
    """Every durable record of the log from ``from_lsn`` (Envelopes,
    or RawRecords with ``raw``), with a byte progress bar on stderr for logs
    over PROGRESS_MIN_BYTES unless ``quiet``. Corruption raises CliError(1).
    A partitioned log is read merged (:func:`read_tagged`, tags dropped)."""
    for _pid, rec in read_tagged(source, raw=raw, from_lsn=from_lsn, quiet=quiet, desc=desc):
        yield rec


def read_tagged(
    source: LogSource, *, raw: bool = False, from_lsn: int = 0, quiet: bool = False, desc: str = "read"
) -> Generator[tuple[int | None, Any], None, None]:
    """:func:`read_records` with each record's partition id: ``(None, record)``
    for a single log; for a partitioned one, ``(pid, record)`` for every
    partition's records in the merged order of
    :func:`events.log.partitions.read_partitions` (``from_lsn`` must be 0 there:
    LSNs are per partition)."""
    try:
        it = source.read_tagged(from_lsn, raw=True)
    except ValueError as exc:  # a merged read from an LSN
        raise CliError(str(exc), EXIT_USAGE) from None
    bar = _progress(source, quiet, desc)
    pending = 0
    with contextlib.closing(_guarded(source, it, bar)) as records:
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
                where = source if pid is None else f"{source}/p{pid:04d}"
                raise CliError(
                    f"{where}: lsn {rec.lsn}, session {rec.session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA
                ) from None
            yield pid, env


def _guarded(source: Any, it: Iterator[Any], bar: Any) -> Iterator[Any]:
    """The items of ``it``, with a read error raised as the CliError that
    names ``source`` (:func:`_read_error`); ``it`` and the progress bar are
    closed however the read ends."""
    from agentlog.events.log.api import LogError

    try:
        yield from it
    except (OSError, LogError) as exc:
        raise _read_error(source, exc) from None
    finally:
        it.close()
        if bar is not None:
            bar.close()


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


def id_scans_of(source: LogSource) -> Any:
    """``of(pid)``: the ``confirm_used`` of a fold of ``source``'s partition ``pid`` (of a log that is
    not partitioned: the log itself, whatever ``pid`` says, None or the 0 a reducer keys it by), an
    :class:`engine.ids.IdScans` reading it again: an opening the id filter alone calls a reuse is
    confirmed by a scan, so trace, tail, report, replay, reconstruct, export-dataset and stats show
    what verify finds."""

    def of(pid: int | None) -> Any:
        from agentlog.engine.ids import IdScans

        if not source.partitioned:
            part = source
        elif pid is None:
            raise ValueError(f"{source}: a fold of a partitioned log confirms in one partition; expected its id, found None")
        else:
            part = source.partition(pid)
        return IdScans(lambda: read_records(part, raw=True, quiet=True, desc="confirm a reused id"), str(part))

    return of


def merged_id_scans(source: LogSource) -> Any:
    """:func:`id_scans_of` for one fold over a partitioned log read merged, whose LSNs are
    positions in :func:`read_tagged`'s order (``agentlog replay``)."""
    from agentlog.engine.ids import IdScans

    return IdScans(lambda: _merged_positions(source), str(source))


class _Position(NamedTuple):
    lsn: int
    session_id: str


def _merged_positions(source: LogSource) -> Iterator[_Position]:
    """``(position, session id)`` of every record of a partitioned log, in :func:`read_tagged`'s merged order."""
    records = read_tagged(source, raw=True, quiet=True, desc="confirm a reused id")
    try:
        for pos, (_pid, rec) in enumerate(records):
            yield _Position(pos, rec.session_id)
    finally:
        records.close()


def read_frame_batches(source: LogSource, *, quiet: bool = False, desc: str = "read") -> Iterator[list[Any]]:
    """Every durable record of the (single, not partitioned) log as lists of
    undecoded frames (lsn, session_id, session_seq, ts_ns, flags, payload;
    ``LogSource.read(batches=True)``), with the progress bar and the errors
    of :func:`read_tagged`."""
    bar = _progress(source, quiet, desc)
    with contextlib.closing(_guarded(source, source.read(batches=True), bar)) as batches:
        for batch in batches:
            if bar is not None:
                bar.update(batch[-1].end - batch[0].offset)
            yield batch


def _progress(source: LogSource, quiet: bool, desc: str) -> Any:
    """A byte progress bar on stderr for a log over PROGRESS_MIN_BYTES, unless ``quiet``; else None."""
    if quiet:
        return None
    size = source.byte_size()
    return new_bar(size, desc, unit="B", unit_scale=True) if size >= PROGRESS_MIN_BYTES else None


def _read_error(path: Any, exc: BaseException) -> CliError:
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


def _parsed(text: str, parse: Callable[[str], Any], ok: Callable[[Any], bool], expected: str, unparsed: str = "") -> Any:
    """What the argparse types below share: ``parse(text)``, refused naming ``expected`` (or
    ``unparsed`` when it does not parse at all) unless ``ok`` of it."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {unparsed or expected}, found {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, found {text}")
    return value


def nonneg_int(text: str) -> int:
    """argparse type: an int >= 0."""
    return _parsed(text, int, lambda v: v >= 0, "an int >= 0")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    return _parsed(text, int, lambda v: v >= 1, "an int >= 1")


def http_base_url(text: str) -> str:
    """argparse type: an http(s) base URL a client can connect to ("" passes: none given),
    by the rule the config's server URLs follow (``http_json.base_url_problem``)."""
    from agentlog.gateway.http_json import base_url_problem

    if text and (problem := base_url_problem(text)):
        raise argparse.ArgumentTypeError(f"expected an http(s) base URL such as http://127.0.0.1:30000, found {text!r}: {problem}")
    return text


def tcp_port(text: str) -> int:
    """argparse type: a TCP port, 0 to 65535 (0: any free port)."""
    return _parsed(text, int, lambda v: 0 <= v <= 65535, "a port 0-65535")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds, say)."""
    return _parsed(text, float, lambda v: v > 0 and math.isfinite(v), "a number > 0")


def finite_float(text: str) -> float:
    """argparse type: any finite number (a reward threshold, say)."""
    return _parsed(text, float, math.isfinite, "a finite number", "a number")


def json_text(data: Any, *, compact: bool = False) -> str:
    """``data`` as strict JSON (what ``--json`` prints, the UI's API answers and ``trace``
    writes): a NaN or an infinity, which no JSON has (an engine that scored NaN, a turn's
    ``generate_s``), becomes the string Python prints for it ("nan", "inf", "-inf"), as
    ``agentlog show`` shows it. ``compact``: no spaces, non-ASCII kept as it is."""
    encode = _STRICT_COMPACT if compact else _STRICT
    try:
        return encode(data)
    except ValueError:
        return encode(_finite(data))


#: The encoders of :func:`json_text`, made once (a trace encodes one event at a time).
_STRICT = json.JSONEncoder(allow_nan=False, default=str).encode
_STRICT_COMPACT = json.JSONEncoder(allow_nan=False, default=str, ensure_ascii=False, separators=(",", ":")).encode


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
