"""The two logs of a run, opened through ``agentlog.events``: one writer each, any number of readers.

The rollout worker writes ``<run>/rollout`` and reads ``<run>/learner``; the
learner writes ``<run>/learner`` and reads ``<run>/rollout``. Readers in
another process see only durable records.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator

from agentlog.events.log_api import EventLog
from agentlog.events.types import Envelope


def open_log(path: Path, fsync: str = "batch", *, fence: bool = False) -> EventLog:
    """Open (or create) the log at ``path`` as its single writer; ``fence``
    takes a new writer epoch, so a stale incarnation can append nothing more."""
    from agentlog.events import FileLog

    return FileLog.open(path, fsync=fsync, fence=fence)


def rollout_log_path(run_dir: Path, partition: int | None) -> Path:
    """The rollout log a worker writes: ``<run>/rollout``, or its partition ``<run>/rollout/pNNNN``."""
    from agentlog.events.partitions import partition_dir

    root = Path(run_dir) / "rollout"
    return root if partition is None else partition_dir(root, partition)


def rollout_sources(run_dir: Path, partitions: list[int] | None) -> dict[int, Path]:
    """Partition id -> log path of a run's rollout logs: ``{0: <run>/rollout}``
    for a single log (``partitions`` None), else one entry per partition."""
    if partitions is None:
        return {0: rollout_log_path(run_dir, None)}
    return {pid: rollout_log_path(run_dir, pid) for pid in partitions}


def exists(path: Path) -> bool:
    """Whether a log has been created at ``path``."""
    from agentlog.events.log_format import is_log_dir

    path = Path(path)
    return path.is_dir() and is_log_dir(path)


def durable_end(path: Path) -> int:
    """The next LSN after the durable records of the log at ``path`` (0 before it exists)."""
    from agentlog.events.log_format import read_watermark

    mark = read_watermark(Path(path))
    return mark.lsn if mark else 0


def read(path: Path, from_lsn: int = 0) -> Iterator[Envelope]:
    """Durable records of the log at ``path`` from ``from_lsn`` (another process may be writing)."""
    from agentlog.events import read_log

    return read_log(path, from_lsn)


async def follow_partitions(sources: dict[int, Path], from_lsn: dict[int, int] | None = None, *,
                            poll_s: float = 0.01, idle_s: float | None = None):
    """Tail every rollout log of ``sources`` (partition id -> path) forever,
    yielding ``(partition id, envelope)``; logs not created yet are picked up
    when they are. With ``idle_s``, ``(None, None)`` after each ``idle_s``
    with nothing new (:func:`agentlog.events.follow_logs`)."""
    from agentlog.events import follow_logs

    async for item in follow_logs(sources, from_lsn, poll_s=poll_s, idle_s=idle_s):
        yield item


async def follow(path: Path, from_lsn: int = 0, *, poll_s: float = 0.01) -> AsyncIterator[Envelope]:
    """Tail the log at ``path`` forever, waiting for it to be created first."""
    from agentlog.events import follow_log

    while not exists(path):
        await asyncio.sleep(poll_s)
    async for env in follow_log(path, from_lsn, poll_s=poll_s):
        yield env
