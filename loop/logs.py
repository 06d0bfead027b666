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


def open_log(path: Path, fsync: str = "batch") -> EventLog:
    """Open (or create) the log at ``path`` as its single writer."""
    from agentlog.events import FileLog

    return FileLog.open(path, fsync=fsync)


def exists(path: Path) -> bool:
    """Whether a log has been created at ``path``."""
    from agentlog.events.log_format import is_log_dir

    path = Path(path)
    return path.is_dir() and is_log_dir(path)


def read(path: Path, from_lsn: int = 0) -> Iterator[Envelope]:
    """Durable records of the log at ``path`` from ``from_lsn`` (another process may be writing)."""
    from agentlog.events import read_log

    return read_log(path, from_lsn)


async def follow(path: Path, from_lsn: int = 0, *, poll_s: float = 0.01) -> AsyncIterator[Envelope]:
    """Tail the log at ``path`` forever, waiting for it to be created first."""
    from agentlog.events import follow_log

    while not exists(path):
        await asyncio.sleep(poll_s)
    async for env in follow_log(path, from_lsn, poll_s=poll_s):
        yield env
