"""The logs of a run, for both backends: the one place that maps a run to its logs.

A run has rollout logs (one, or one partition per worker) and a learner log.
Each has one writer and any number of readers; readers in another process
see only durable (file) or acknowledged (JetStream) records.

Where they live is the run's ``[log]`` table (:class:`~agentlog.loop.config.LogConfig`):

- ``file``: ``<run>/rollout`` (or its partitions ``<run>/rollout/pNNNN``) and
  ``<run>/learner``, log directories;
- ``nats``: the subjects ``<stream>.pNNNN`` (a single rollout log is partition
  0) and ``<stream>.learner`` of one JetStream stream; the run folder still
  holds ``config.json`` and the checkpoints.

:class:`RunLogs` hands out the *sources* (a log directory, or a
:class:`~agentlog.events.log.jetstream_read.JetStreamRef`) and opens the
writers. The module-level :func:`read`, :func:`exists`, :func:`durable_end`,
:func:`follow_partitions` and :func:`follow` take either kind of source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator, Iterator

from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import Envelope

#: The learner log's name: ``<run>/learner``, or the subject ``<stream>.learner``.
LEARNER_LOG = "learner"

#: A log a reader can take: a log directory, or a log on JetStream (a JetStreamRef).
Source = Any


def open_log(path: Path, fsync: str = "batch", *, fence: bool = False) -> EventLog:
    """Open (or create) the file log at ``path`` as its single writer; ``fence``
    takes a new writer epoch, so a stale incarnation can append nothing more."""
    from agentlog.events import FileLog

    return FileLog.open(path, fsync=fsync, fence=fence)


def rollout_log_path(run_dir: Path, partition: int | None) -> Path:
    """The file rollout log a worker writes: ``<run>/rollout``, or its partition ``<run>/rollout/pNNNN``."""
    from agentlog.events.log.partitions import partition_dir

    root = Path(run_dir) / "rollout"
    return root if partition is None else partition_dir(root, partition)


def rollout_sources(run_dir: Path, partitions: list[int] | None) -> dict[int, Path]:
    """Partition id -> log path of a run's file rollout logs: ``{0: <run>/rollout}``
    for a single log (``partitions`` None), else one entry per partition."""
    if partitions is None:
        return {0: rollout_log_path(run_dir, None)}
    return {pid: rollout_log_path(run_dir, pid) for pid in partitions}


def _remote(source: Source) -> bool:
    return hasattr(source, "cursor")  # a JetStreamRef (agentlog.events.log.jetstream_read)


def exists(source: Source) -> bool:
    """Whether a log has been created at ``source`` (a JetStream subject: holds a message)."""
    if _remote(source):
        return source.exists()
    from agentlog.events.log.format import is_log_dir

    path = Path(source)
    return path.is_dir() and is_log_dir(path)


def durable_end(source: Source) -> int:
    """The next LSN after the durable records of the log at ``source`` (0 before it exists)."""
    if _remote(source):
        return source.next_lsn()
    from agentlog.events.log.format import read_watermark

    mark = read_watermark(Path(source))
    return mark.lsn if mark else 0


def read(source: Source, from_lsn: int = 0) -> Iterator[Envelope]:
    """Durable records of the log at ``source`` from ``from_lsn`` (another process may be writing)."""
    from agentlog.events import read_log

    return read_log(source, from_lsn)


async def follow_partitions(sources: dict[int, Source], from_lsn: dict[int, int] | None = None, *,
                            poll_s: float = 0.01, idle_s: float | None = None):
    """Tail every rollout log of ``sources`` (partition id -> source) forever,
    yielding ``(partition id, envelope)``; logs not created yet are picked up
    when they are. With ``idle_s``, ``(None, None)`` after each ``idle_s``
    with nothing new (:func:`agentlog.events.follow_logs`)."""
    from agentlog.events import follow_logs

    async for item in follow_logs(sources, from_lsn, poll_s=poll_s, idle_s=idle_s):
        yield item


async def follow(source: Source, from_lsn: int = 0, *, poll_s: float = 0.01) -> AsyncIterator[Envelope]:
    """Tail the log at ``source`` forever, waiting for it to be created first."""
    async for _, env in follow_partitions({0: source}, {0: from_lsn}, poll_s=poll_s):
        yield env


class LogTail:
    """New records of one log since the last :meth:`poll`, synchronously (a
    worker following the learner log). A file log is re-read from the next
    LSN each time; a JetStream log keeps one ordered consumer open, so a
    poll with nothing new costs no request."""

    def __init__(self, source: Source, from_lsn: int = 0) -> None:
        self.source = source
        self.next_lsn = from_lsn
        self._cursor: Any = None  # a jetstream_read.SubjectCursor, opened by the first poll

    def poll(self, limit: int = 4096) -> list[Envelope]:
        """The records appended since the last poll (at most ``limit`` per call for JetStream)."""
        if not _remote(self.source):
            if not exists(self.source):
                return []
            out = list(read(self.source, self.next_lsn))
        else:
            bridge = self.source.run.bridge
            if self._cursor is None:
                from agentlog.events.log.jetstream_read import SubjectCursor

                ref = self.source
                cur = SubjectCursor(ref.run.js, ref.run.stream, ref.subject, ref.where, self.next_lsn, raw=False, to_end=False)
                bridge.call(cur.start())
                self._cursor = cur
            out = bridge.call(self._cursor.take(limit, 0.0))
        if out:
            self.next_lsn = out[-1].lsn + 1
        return out

    def close(self) -> None:
        """Drop the JetStream consumer, if one was opened."""
        cur, self._cursor = self._cursor, None
        if cur is not None and self.source.run.bridge.loop.is_running():
            self.source.run.bridge.call(cur.close(), timeout=10)


class RunLogs:
    """The logs of one run, on its ``[log]`` backend: sources to read, writers to open.

    ``RunLogs.of(run_dir, cfg)``; close it when done (or use ``with``): on
    JetStream it holds one read-only connection, opened on first use."""

    def __init__(self, run_dir: Path, cfg) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.backend = cfg.log.backend
        #: The rollout partition ids, or None for a run with a single rollout log.
        self.partitions: list[int] | None = cfg.rollout.partitions() if cfg.rollout.partitioned else None
        #: nats: the run's stream.
        self.stream = cfg.log.stream_for(self.run_dir) if self.backend == "nats" else ""
        self._run = None
        self._tails: list[LogTail] = []

    @classmethod
    def of(cls, run_dir: Path, cfg=None) -> "RunLogs":
        """The logs of the run at ``run_dir`` (``cfg``: its LoopConfig; default: ``<run>/config.json``)."""
        if cfg is None:
            from .config import LoopConfig

            cfg = LoopConfig.load(Path(run_dir) / "config.json")
        return cls(run_dir, cfg)

    @property
    def nats(self) -> bool:
        """Whether the logs live on JetStream."""
        return self.backend == "nats"

    def describe(self) -> str:
        """Where the logs are, in words (for a summary line)."""
        if self.nats:
            return f"{self.cfg.log.url}/{self.stream} (subjects {self.stream}.pNNNN, {self.stream}.{LEARNER_LOG})"
        return f"{self.run_dir / 'rollout'}, {self.run_dir / LEARNER_LOG} (learner)"

    # -- JetStream ------------------------------------------------------------

    def stream_run(self):
        """The run's stream opened read-only (a JetStreamRun; NotALog naming it while no writer has created it)."""
        if self._run is None:
            from agentlog.events import JetStreamRun

            self._run = JetStreamRun.open(self.cfg.log.servers(), self.stream)
        return self._run

    def stream_exists(self) -> bool:
        """nats: whether the run's stream has been created (by its first writer)."""
        from agentlog.events.log.api import NotALog

        try:
            self.stream_run()
        except NotALog:
            return False
        return True

    # -- sources --------------------------------------------------------------

    def rollout_source(self, partition: int | None) -> Source:
        """The rollout log a worker writes (``partition`` None: the run's single rollout log)."""
        if self.nats:
            return self.stream_run().log(0 if partition is None else partition)
        return rollout_log_path(self.run_dir, partition)

    def rollout_sources(self) -> dict[int, Source]:
        """Partition id -> rollout log: ``{0: single log}`` or one entry per partition."""
        return {pid: self.rollout_source(None if self.partitions is None else pid) for pid in (self.partitions or [0])}

    def learner_source(self) -> Source:
        """The learner log."""
        return self.stream_run().log(LEARNER_LOG) if self.nats else self.run_dir / LEARNER_LOG

    def learner_exists(self) -> bool:
        """Whether the learner has created its log (nats: no stream yet counts as none)."""
        if self.nats and not self.stream_exists():
            return False
        return exists(self.learner_source())

    def learner_tail(self) -> LogTail:
        """A :class:`LogTail` of the learner log (closed with this RunLogs). The
        stream must exist (a worker opens its own log first, which creates it)."""
        tail = LogTail(self.learner_source())
        self._tails.append(tail)
        return tail

    def existing_rollout_sources(self) -> dict[int, Source]:
        """The rollout logs that have been created (nats: none while the stream does not exist)."""
        if self.nats and not self.stream_exists():
            return {}
        return {pid: src for pid, src in self.rollout_sources().items() if exists(src)}

    # -- writers --------------------------------------------------------------

    def open_rollout(self, partition: int | None, *, fence: bool) -> EventLog:
        """Open the rollout log of ``partition`` (None: the single log) as its one writer.
        ``fence`` takes a new writer epoch (a JetStream writer always does)."""
        if self.nats:
            return self._open_nats(0 if partition is None else partition)
        return open_log(rollout_log_path(self.run_dir, partition), self.cfg.fsync, fence=fence)

    def open_learner(self) -> EventLog:
        """Open the learner log as its one writer."""
        if self.nats:
            return self._open_nats(LEARNER_LOG)
        return open_log(self.run_dir / LEARNER_LOG, self.cfg.fsync)

    def _open_nats(self, name: int | str) -> EventLog:
        from agentlog.events import JetStreamLog

        c = self.cfg.log
        return JetStreamLog.open(c.servers(), self.stream, name, replicas=c.replicas, duplicate_window_s=c.duplicate_window_s)

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Close the tails and the read-only connection (nothing to close for files)."""
        tails, self._tails = self._tails, []
        run, self._run = self._run, None
        try:
            for tail in tails:
                tail.close()
        finally:
            if run is not None:
                run.close()

    def __enter__(self) -> "RunLogs":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
