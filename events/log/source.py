"""One reader type for every log, wherever it lives: :class:`LogSource`,
opened by the one factory :func:`open_source`.

A location is a log directory, a partition root (``rollout/`` holding
``pNNNN`` log directories), a run folder (standing for its ``rollout/``), a
``nats://host:port/stream`` URL (a run's stream: its partitions, read merged
as a partition root is) or ``nats://host:port/stream/p0003`` (one subject).
The backend is chosen here, once: the implementations live in
:mod:`.source_file` and :mod:`.source_nats`, and code above ``events/log/``
only ever holds a LogSource. ``str(source)`` is the path or URL, so every
message that names a log names what the user typed.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Generator, Iterator, Mapping

from .api import EventLog, NotALog

#: A run folder's rollout log (or partition root) and learner log, and the config beside them.
RUN_ROLLOUT_LOG = "rollout"
RUN_LEARNER_LOG = "learner"
RUN_CONFIG = "config.json"

#: How often a follower of a partitioned source lists its partitions again, or looks for a log not created yet (seconds).
DISCOVER_S = 0.5


class SourceError(NotALog):
    """A location that names no log (or not the kind expected): the message
    names the location, what was found and what was expected."""


class StreamMissing(SourceError):
    """The JetStream stream a location names does not exist (yet)."""


class LogTail:
    """New records of one log since the last :meth:`poll`, synchronously (a
    worker following the learner log). Made by :meth:`LogSource.tail`."""

    next_lsn: int

    def poll(self, limit: int = 4096) -> list:
        """The records appended since the last poll (at most ``limit``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the tail holds (a JetStream consumer)."""


class LogSource:
    """A log to read, or a set of partition logs read as one merged log.

    ``partitioned`` sources (a partition root, a run's stream) read as
    ``(partition id, record)`` pairs in the merged order of
    :func:`~agentlog.events.log.partitions.read_partitions`; single logs read
    their records in LSN order. ``raw`` gives RawRecords (payload undecoded);
    ``batches`` gives lists of undecoded frames (single logs only)."""

    #: True for a partition root or a run's stream: records are read per partition and merged.
    partitioned: bool = False
    #: True when :meth:`verify` can cut a torn tail (a log directory, or each partition of a
    #: partition root; JetStream has none: the server keeps only acknowledged messages).
    repairable: bool = False
    #: The run folder this source is a log of, when known (its ``config.json`` holds the run's settings).
    run_dir: Path | None = None

    def __str__(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    @property
    def location(self) -> str:
        """The path or URL this source was opened from."""
        raise NotImplementedError

    # -- reading ---------------------------------------------------------------

    def read(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False) -> Generator[Any, None, None]:
        """Every durable (file) or acknowledged (JetStream) record from
        ``from_lsn`` to the end as of the call; a partitioned source gives its
        records merged (``from_lsn`` must be 0: LSNs are per partition)."""
        if not self.partitioned:
            raise NotImplementedError
        self._check_merged(from_lsn, batches)
        return (rec for _pid, rec in self.read_tagged(raw=raw))

    def read_tagged(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[tuple[int | None, Any]]:
        """:meth:`read` with each record's partition id: ``(None, record)`` for
        a single log, ``(pid, record)`` in merged order for a partitioned one."""
        if self.partitioned:
            from .partitions import merge_partitions

            self._check_merged(from_lsn, False)
            parts = {pid: self.partition(pid) for pid in self.partitions()}
            return merge_partitions({pid: (p.location, lambda raw, p=p: p.read(raw=raw)) for pid, p in parts.items()}, raw=raw)
        return ((None, rec) for rec in self.read(from_lsn, raw=raw))

    def _check_merged(self, from_lsn: int, batches: bool) -> None:
        if from_lsn:
            raise ValueError(f"{self}: a partitioned log has one LSN sequence per partition; "
                             f"read from LSN {from_lsn} in one partition (e.g. {self.partition_location(0)})")
        if batches:
            raise ValueError(f"{self}: frame batches are read from one log; read each partition (e.g. {self.partition_location(0)})")

    def partition_location(self, pid: int) -> str:
        """Where partition ``pid`` of this source lives (its path or URL)."""
        from .partitions import partition_name

        return f"{self}/{partition_name(pid)}"

    def follow(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False, poll_s: float = 0.05) -> AsyncIterator[Any]:
        """Tail one log forever from ``from_lsn`` (waiting for it to be created first)."""
        if self.partitioned:
            raise ValueError(f"{self}: a partitioned log has one LSN sequence per partition; "
                             f"follow it with follow_tagged, or one partition (e.g. {self.partition_location(0)})")
        return _untagged(follow_sources({0: self}, {0: from_lsn}, poll_s=poll_s, raw=raw, batches=batches))

    async def follow_tagged(self, *, raw: bool = False, batches: bool = False, poll_s: float = 0.05,
                            discover_s: float = DISCOVER_S) -> AsyncIterator[tuple[int | None, Any]]:
        """Follow forever: ``(None, record)`` for a single log (RawRecords with
        ``raw``, lists of undecoded frames with ``batches``), ``(pid, envelope)``
        for a partitioned one (its partitions listed again every ``discover_s``,
        so one created later is picked up), in arrival order. A log not created
        yet (a directory that holds neither) is looked for every ``discover_s``."""
        while not self.exists():
            await asyncio.sleep(discover_s)
        if self.partitioned:
            async for pid, env in follow_sources(LivePartitions(self, discover_s), poll_s=poll_s):
                yield pid, env
            return
        async for rec in self.follow(raw=raw, batches=batches, poll_s=poll_s):
            yield None, rec

    def tail(self, from_lsn: int = 0) -> LogTail:
        """A synchronous :class:`LogTail` of this log from ``from_lsn``."""
        raise NotImplementedError(f"{self}: a partitioned log has no single tail; tail one partition")

    def next_lsn(self) -> int:
        """The LSN after the last durable (acknowledged) record: 0 before the log exists."""
        raise NotImplementedError(f"{self}: a partitioned log has one LSN sequence per partition")

    def exists(self) -> bool:
        """Whether the log (any partition of it) has been created."""
        raise NotImplementedError

    # -- shape -----------------------------------------------------------------

    def partitions(self) -> list[int]:
        """The partition ids a partitioned source holds now, ascending ([] for a single log)."""
        return []

    def log_names(self) -> list[str]:
        """The logs held beside each other where this source lives, by name:
        a stream's subjects (``learner``, ``p0000``, ...), a partition root's
        partitions; [] for a single log directory."""
        from .partitions import partition_name

        return [partition_name(pid) for pid in self.partitions()]

    def partition(self, pid: int) -> "LogSource":
        """Partition ``pid`` of a partitioned source (it need not exist yet)."""
        raise ValueError(f"{self}: a single log has no partitions (expected a partition root or a run's stream)")

    def sibling(self, name: str) -> "LogSource":
        """The log ``name`` beside this one: a directory's neighbour, another
        subject of the same stream (the ``learner`` beside the rollout)."""
        raise NotImplementedError

    def run_sibling(self, name: str) -> "LogSource | None":
        """The log ``name`` of the run this source is the rollout of (its
        ``learner``), or None when it is no run's rollout (a bare log)."""
        return self.sibling(name)

    def describe(self) -> str:
        """Where the log is, in words (for a summary line)."""
        return self.location

    def byte_size(self) -> int:
        """The log's size in bytes, for a progress bar (0 where the backend does not count it)."""
        return 0

    # -- writing and checking --------------------------------------------------

    def open_writer(self, *, fsync: str = "batch", fence: bool = False, replicas: int = 1,
                    duplicate_window_s: float = 120.0, clock: Callable[[], int] | None = None,
                    compression: str | None = None) -> EventLog:
        """Open (or create) this log as its one writer. ``fsync``: a file
        log's policy; ``fence`` takes a new writer epoch (a JetStream writer
        always does); ``replicas`` and ``duplicate_window_s``: the stream's
        settings, used when the writer creates it; ``clock``: the records'
        timestamps (default: the wall clock; a copy replays the source's);
        ``compression``: a file log's record batches, "zstd" or "none" (None:
        what the log's last segment records; a new log: none). A log that
        cannot compress (JetStream) refuses "zstd" with ValueError."""
        raise ValueError(f"{self}: a partitioned log is written one partition at a time (open partition(pid)'s writer)")

    def fence_epoch(self) -> int | None:
        """The newest writer epoch taken on this log, where it is kept beside
        the log (a directory's FENCE file); None where only the writer knows it."""
        return None

    def verify(self, *, repair: bool = False, progress: Any = None) -> Any:
        """The frame check of one log (:class:`~agentlog.events.log.verify.VerifyReport`;
        its ``summary()`` is the one-line verdict). ``repair`` cuts a torn tail
        (only where :attr:`repairable`)."""
        raise ValueError(f"{self}: verify a partitioned log one partition at a time")

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """Release what the source holds (a JetStream connection); a no-op for files."""

    def __enter__(self) -> "LogSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internal: what follow_logs takes for this (single) log -----------------

    def _follow_target(self) -> Any:
        raise NotImplementedError


async def _untagged(tagged: AsyncIterator[tuple[Any, Any]]) -> AsyncIterator[Any]:
    async for _pid, rec in tagged:
        yield rec


class LivePartitions(Mapping):
    """The partitions of a partitioned source as ``{pid: LogSource}``, listed
    afresh at most every ``every_s``: :func:`follow_sources` reads its mapping
    each round, so a partition a new worker creates is followed from then on
    (and a stray entry beside the partitions raises NotALog, naming it)."""

    def __init__(self, root: LogSource, every_s: float = DISCOVER_S) -> None:
        self.root, self.every_s = root, every_s
        self._listed_at = -math.inf
        self._parts: dict[int, LogSource] = {}

    def _fresh(self) -> dict[int, LogSource]:
        now = time.monotonic()
        if now - self._listed_at >= self.every_s:
            self._parts = {pid: self._parts.get(pid) or self.root.partition(pid) for pid in self.root.partitions()}
            self._listed_at = now
        return self._parts

    def __getitem__(self, pid: int) -> LogSource:
        return self._fresh()[pid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._fresh())

    def __len__(self) -> int:
        return len(self._fresh())


class _Targets(Mapping):
    """``sources`` seen as follow_logs takes them (paths, JetStream subjects), read afresh each round."""

    def __init__(self, sources: Mapping[int, LogSource]) -> None:
        self.sources = sources

    def __getitem__(self, pid: int) -> Any:
        return self.sources[pid]._follow_target()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.sources))

    def __len__(self) -> int:
        return len(self.sources)


async def follow_sources(sources: Mapping[int, LogSource], from_lsn: Mapping[int, int] | None = None, *,
                         poll_s: float = 0.05, idle_s: float | None = None, raw: bool = False,
                         batches: bool = False, chunk: int = 512) -> AsyncIterator[tuple[Any, Any]]:
    """Tail several single logs at once (the partitions of a run), forever:
    ``(partition id, record)`` with each log's records in LSN order; a log
    not created yet is picked up when it is; ``sources`` is read afresh each
    round. With ``idle_s``, ``(None, None)`` after each ``idle_s`` with
    nothing new (:func:`agentlog.events.log.read.follow_logs`, which this drives)."""
    from .read import follow_logs

    async for item in follow_logs(_Targets(sources), from_lsn, poll_s=poll_s, idle_s=idle_s, raw=raw,
                                  batches=batches, chunk=chunk):
        yield item


def open_source(location: str | Path, *, allow_empty: bool = False, label: str | None = None,
                check: bool = True, partitioned: bool | None = None) -> LogSource:
    """The :class:`LogSource` at ``location``: a log directory, a partition
    root, a run folder (its ``rollout/``), or a ``nats://host:port/stream[/log]``
    URL (its stream opened read-only, one connection per source; close it).

    Raises :class:`SourceError` (a NotALog) naming the location and what was
    expected: no such directory, a file, a directory that is no log (with a
    "did you mean" naming the logs below it), a malformed URL, an unreachable
    server, a missing stream (:class:`StreamMissing`) or log; OSError for a
    directory the OS will not list. ``allow_empty`` accepts a log not written
    yet (a directory holding nothing but a writer's lock or index, a stream
    or subject with no message), to be followed or written. ``label`` names
    the location in messages in place of ``location`` (a run folder's stream).

    ``check=False`` opens nothing and checks nothing (a run's logs before
    their writers create them; the stream is connected to on first use). A
    directory is then a single log (``partitioned`` False), a partition root
    (True) or whichever it holds when read (None); a stream URL is always
    partitioned, a subject URL never."""
    from .jetstream_url import is_nats_url

    if is_nats_url(str(location)):
        from .source_nats import open_nats

        return open_nats(str(location), allow_empty=allow_empty, label=label, check=check)
    from .source_file import directory_source, open_directory

    if not check:
        return directory_source(location, partitioned=partitioned)
    return open_directory(str(location), allow_empty=allow_empty)


def is_location_url(text: str) -> bool:
    """Whether ``text`` is a URL location (``nats://...``) rather than a path."""
    from .jetstream_url import is_nats_url

    return is_nats_url(text)
