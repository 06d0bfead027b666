"""The file implementations of :class:`~agentlog.events.log.source.LogSource`:
one log directory (:class:`FileLogSource`) and a partition root
(:class:`PartitionRootSource`), and :func:`open_directory`, which judges a
path (a run folder stands for its ``rollout/``) with one-line errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

from .api import EventLog, NotALog
from .source import RUN_CONFIG, RUN_ROLLOUT_LOG, LogSource, LogTail, SourceError

#: How deep, and through how many folders, "did you mean" looks for logs below a directory.
DID_YOU_MEAN_DEPTH = 3
DID_YOU_MEAN_MAX_DIRS = 2000


class _Directory(LogSource):
    path: Path

    @property
    def location(self) -> str:
        return str(self.path)

    def sibling(self, name: str) -> LogSource:
        return FileLogSource(self.path.parent / name)

    def run_sibling(self, name: str) -> LogSource | None:
        # A run's rollout is its folder's rollout/; any other directory is a bare log.
        return self.sibling(name) if self.path.name == RUN_ROLLOUT_LOG else None


class FileLogSource(_Directory):
    """One log directory (segments, DURABLE watermark, INDEX)."""

    repairable = True

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def read(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False) -> Generator[Any, None, None]:
        from .read import read_frame_batches, read_log

        if batches:
            return read_frame_batches(self.path, from_lsn)
        return read_log(self.path, from_lsn, raw=raw)

    def tail(self, from_lsn: int = 0) -> LogTail:
        return _FileTail(self, from_lsn)

    def next_lsn(self) -> int:
        from .format import read_watermark

        mark = read_watermark(self.path)
        return mark.lsn if mark else 0

    def exists(self) -> bool:
        from .format import is_log_dir

        return self.path.is_dir() and is_log_dir(self.path)

    def byte_size(self) -> int:
        from .format import list_segments, segment_name

        total = 0
        for first in list_segments(self.path):
            try:
                total += (self.path / segment_name(first)).stat().st_size
            except FileNotFoundError:  # rotated away under a live writer
                pass
        return total

    def open_writer(self, *, fsync: str = "batch", fence: bool = False, replicas: int = 1,
                    duplicate_window_s: float = 120.0, clock: Callable[[], int] | None = None,
                    compression: str | None = None) -> EventLog:
        from .writer import FileLog

        options: dict[str, Any] = {} if clock is None else {"clock": clock}
        return FileLog.open(self.path, fsync=fsync, fence=fence, compression=compression, **options)

    def fence_epoch(self) -> int | None:
        from .format import read_fence

        return read_fence(self.path)

    def verify(self, *, repair: bool = False, progress: Any = None) -> Any:
        from .verify import verify_log

        return verify_log(self.path, repair=repair, progress=progress)

    def _follow_target(self) -> Any:
        return self.path


class _FileTail(LogTail):
    """A file log re-read from the next LSN at each poll."""

    def __init__(self, source: FileLogSource, from_lsn: int) -> None:
        self.source, self.next_lsn = source, from_lsn

    def poll(self, limit: int = 4096) -> list:
        if not self.source.exists():
            return []
        out = list(self.source.read(self.next_lsn))
        if out:
            self.next_lsn = out[-1].lsn + 1
        return out


class PartitionRootSource(_Directory):
    """A directory of ``pNNNN`` partition log directories, read merged."""

    partitioned = True
    repairable = True  # each partition's torn tail, verified one at a time

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def read_tagged(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[tuple[int | None, Any]]:
        from .partitions import read_partitions

        self._check_merged(from_lsn, False)
        return read_partitions(self.path, raw=raw)

    def exists(self) -> bool:
        from .partitions import is_partition_root

        return is_partition_root(self.path)

    def partitions(self) -> list[int]:
        from .partitions import list_partitions

        return list_partitions(self.path)

    def partition(self, pid: int) -> LogSource:
        from .partitions import partition_dir

        return FileLogSource(partition_dir(self.path, pid))

    def byte_size(self) -> int:
        return sum(self.partition(pid).byte_size() for pid in self.partitions())


class PendingDirectorySource(_Directory):
    """A directory that holds no log yet (``allow_empty``): a single log or a
    partition root once a writer creates one, judged afresh at each call
    (a single log until partitions appear)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def _now(self) -> LogSource:
        root = PartitionRootSource(self.path)
        return root if not FileLogSource(self.path).exists() and root.exists() else FileLogSource(self.path)

    @property
    def partitioned(self) -> bool:  # type: ignore[override]
        return self._now().partitioned

    @property
    def repairable(self) -> bool:  # type: ignore[override]
        return self._now().repairable

    def read(self, from_lsn: int = 0, *, raw: bool = False, batches: bool = False) -> Generator[Any, None, None]:
        return self._now().read(from_lsn, raw=raw, batches=batches)

    def read_tagged(self, from_lsn: int = 0, *, raw: bool = False) -> Iterator[tuple[int | None, Any]]:
        return self._now().read_tagged(from_lsn, raw=raw)

    def tail(self, from_lsn: int = 0) -> LogTail:
        return self._now().tail(from_lsn)

    def next_lsn(self) -> int:
        return self._now().next_lsn()

    def exists(self) -> bool:
        return self._now().exists()

    def partitions(self) -> list[int]:
        return self._now().partitions()

    def partition(self, pid: int) -> LogSource:
        return PartitionRootSource(self.path).partition(pid)

    def byte_size(self) -> int:
        return self._now().byte_size()

    def open_writer(self, **kw: Any) -> EventLog:
        return FileLogSource(self.path).open_writer(**kw)

    def verify(self, *, repair: bool = False, progress: Any = None) -> Any:
        return self._now().verify(repair=repair, progress=progress)

    def _follow_target(self) -> Any:
        return self.path


def directory_source(path: str | os.PathLike, *, partitioned: bool | None = None) -> LogSource:
    """The source of a directory that need not exist yet: a single log
    (``partitioned`` False), a partition root (True), or whichever it holds
    when it is read (None)."""
    if partitioned is None:
        return PendingDirectorySource(path)
    return PartitionRootSource(path) if partitioned else FileLogSource(path)


def is_run_folder(path: Path, *, allow_empty: bool) -> bool:
    """A run folder: its ``rollout/`` holds a log (or, for a log about to be
    written, exists next to the run's ``config.json``)."""
    from .format import is_log_dir
    from .partitions import is_partition_root

    inner = path / RUN_ROLLOUT_LOG
    return is_log_dir(inner) or is_partition_root(inner) or (allow_empty and inner.is_dir() and (path / RUN_CONFIG).is_file())


def open_directory(arg: str, *, allow_empty: bool = False) -> LogSource:
    """The source the directory ``arg`` names (see :func:`~agentlog.events.log.source.open_source`),
    with its ``run_dir`` when it is a run's ``rollout/`` or a partition of it."""
    source = _judge(arg, allow_empty)
    path = source.path  # type: ignore[attr-defined]
    for run in (path.parent if path.name == RUN_ROLLOUT_LOG else None,
                path.parent.parent if path.parent.name == RUN_ROLLOUT_LOG else None):
        if run is not None and (run / RUN_CONFIG).is_file():
            source.run_dir = run
            break
    return source


def _judge(arg: str, allow_empty: bool) -> LogSource:
    from .format import DURABLE_NAME, INDEX_NAME, LOCK_NAME, is_log_dir
    from .partitions import is_partition_root

    path = Path(arg)
    if not path.exists():
        raise SourceError(f"{arg}: no such log directory")
    if not path.is_dir():
        raise SourceError(f"{arg}: is a file, expected a log directory")
    if is_log_dir(path):
        return FileLogSource(path)
    if is_partition_root(path):  # a run's rollout/ of p%04d partitions
        return PartitionRootSource(path)
    if is_run_folder(path, allow_empty=allow_empty):
        inner = path / RUN_ROLLOUT_LOG
        if is_log_dir(inner):
            return FileLogSource(inner)
        return PartitionRootSource(inner) if is_partition_root(inner) else PendingDirectorySource(inner)
    _check_partition_root(path)
    _check_partition_root(path / RUN_ROLLOUT_LOG)
    strangers = sorted(n for n in os.listdir(path) if n not in (LOCK_NAME, INDEX_NAME) and not n.startswith("."))
    if allow_empty and not strangers:
        return PendingDirectorySource(path)
    held = f"; holds {', '.join(strangers[:3])}" if strangers else ""
    below = logs_below(path)
    hint = f"; did you mean {' or '.join(str(p) for p in below[:3])}{' (and more)' if len(below) > 3 else ''}?" if below else ""
    raise SourceError(f"{arg}: not an agentlog log directory (no segment files, no {DURABLE_NAME}{held}){hint}")


def _check_partition_root(path: Path) -> None:
    """When ``path`` holds a ``p%04d`` folder but is not a partition root, the
    error of :func:`~agentlog.events.log.partitions.list_partitions` naming the
    entries that are not partitions (a generic "not a log" would hide them)."""
    from .partitions import list_partitions, parse_partition_name

    if path.is_dir() and any(parse_partition_name(n) is not None for n in os.listdir(path)):
        try:
            list_partitions(path)
        except NotALog as exc:
            raise SourceError(str(exc)) from None


def logs_below(path: Path, *, depth: int = DID_YOU_MEAN_DEPTH, max_dirs: int = DID_YOU_MEAN_MAX_DIRS) -> list[Path]:
    """Log directories and run folders below ``path`` (not ``path`` itself), breadth first, at most
    ``depth`` levels down and through at most ``max_dirs`` folders; hidden and
    unreadable folders are passed over (this only suggests, it never decides)."""
    from .format import is_log_dir

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
                if is_log_dir(child) or is_run_folder(child, allow_empty=False):
                    found.append(child)  # a run folder is named itself: it stands for its rollout/ log
                else:
                    nxt.append(child)
        level = nxt
    return found
