"""Log partitions: one rollout worker is one writer, and one writer owns one
log partition, a directory ``<root>/p0003/`` named by a stable partition id
(not by node), so that a restarted worker, on whatever node, reopens its own
partition (with a new writer epoch, which fences the stale incarnation: see
``FileLog._check_fence``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

from .api import LogError, NotALog

#: Partition ids are 0 .. MAX_PARTITIONS - 1, so that names sort as numbers.
MAX_PARTITIONS = 10_000
_NAME_RE = re.compile(r"p[0-9]{4}")


def check_partition_id(pid: Any) -> int:
    """``pid`` if it is a valid partition id (an int, 0 <= pid < 10000), else
    ValueError/TypeError naming the value and what was expected."""
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise TypeError(f"partition id: expected an int in [0, {MAX_PARTITIONS}), found {type(pid).__name__} {pid!r}")
    if not 0 <= pid < MAX_PARTITIONS:
        raise ValueError(f"partition id: expected an int in [0, {MAX_PARTITIONS}), found {pid}")
    return pid


def partition_name(pid: int) -> str:
    """The directory name of partition ``pid``: ``p%04d``."""
    return f"p{check_partition_id(pid):04d}"


def partition_dir(root: str | os.PathLike, pid: int) -> Path:
    """The log directory of partition ``pid`` under the run's partition root."""
    return Path(root) / partition_name(pid)


def parse_partition_name(name: str) -> int | None:
    """The id a partition directory name stands for, or None when ``name`` is not ``p`` and four ASCII digits."""
    return int(name[1:]) if _NAME_RE.fullmatch(name) else None


def list_partitions(root: str | os.PathLike) -> list[int]:
    """The partition ids under ``root``, ascending.

    Hidden entries (a leading dot: NFS's ``.nfsXXXX`` silly-rename files,
    editor or OS droppings) are ignored. Any other entry that is not a
    ``p%04d`` directory is an error naming it: a misnamed partition
    (``p3``, ``p00003``, a copy called ``p0003.bak``) would otherwise be
    silently left out of a merged read, and its events lost to the learner
    and to ``verify`` without a word. Raises NotALog when ``root`` is not a
    directory."""
    root = Path(root)
    if not root.is_dir():
        raise NotALog(f"{root}: expected a directory of log partitions (p0000, p0001, ...), found {'a file' if root.exists() else 'nothing'}")
    pids: list[int] = []
    strays: list[str] = []
    for entry in os.scandir(root):
        if entry.name.startswith("."):
            continue
        pid = parse_partition_name(entry.name)
        if pid is None or not entry.is_dir():
            strays.append(entry.name + ("" if pid is None else " (not a directory)"))
        else:
            pids.append(pid)
    if strays:
        strays.sort()
        raise NotALog(
            f"{root}: expected only partition directories named p and four digits (p0000 .. p9999), "
            f"found {', '.join(strays[:5])}{'...' if len(strays) > 5 else ''}; rename or move them out"
        )
    return sorted(pids)


def open_partition(root: str | os.PathLike, pid: int, **open_kw: Any):
    """Open partition ``pid`` under ``root`` as its one writer (creating it if
    needed), with a new writer epoch: ``FileLog.open`` on :func:`partition_dir`."""
    from .writer import FileLog

    return FileLog.open(partition_dir(root, pid), **open_kw)


def is_partition_root(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory holding at least one ``p%04d``
    partition directory (and nothing else that is not hidden)."""
    try:
        return bool(list_partitions(path))
    except NotALog:
        return False


def read_partitions(root: str | os.PathLike, *, raw: bool = False) -> Iterator[tuple[int, Any]]:
    """Every durable record of every partition under ``root``, each as
    ``(partition id, record)`` (an Envelope, or a RawRecord with ``raw``), in
    one merged order: by ``(ts_ns, partition id, lsn)``.

    Why this order: a merged view is read by people, who want time order,
    and within each partition records are already in LSN order (the merge
    takes them as they come, so a partition whose clock stepped back keeps
    its own order). Determinism comes from the key alone: it is a function
    of the files' contents, never of when each partition's records arrived,
    and ``(partition id, lsn)`` is unique, so equal timestamps tie-break the
    same way on every read. Streaming, with one open reader and one pending
    record per partition (``heapq.merge``), so memory does not grow with
    the log. An error while reading a partition (corruption, a missing
    segment) is re-raised as the same kind of error, its message prefixed
    by the partition's name and directory (the log layer's message names
    the segment, offset and LSN)."""
    root = Path(root)
    yield from merge_partitions({pid: (partition_dir(root, pid), _dir_reader(partition_dir(root, pid)))
                             for pid in list_partitions(root)}, raw=raw)


def _dir_reader(directory: Path):
    from .read import read_log

    return lambda raw: read_log(directory, raw=raw)


def merge_partitions(readers: dict[int, tuple[Any, Any]], *, raw: bool = False) -> Iterator[tuple[int, Any]]:
    """The merge of :func:`read_partitions` over any partitions: ``readers``
    maps a partition id to ``(where, read)``, ``read(raw)`` giving that
    partition's records in LSN order and ``where`` naming it in errors."""
    import heapq

    def one(pid: int) -> Iterator[tuple[int, int, int, Any]]:
        where, read = readers[pid]
        it = read(raw)
        try:
            for rec in it:
                yield rec.ts_ns, pid, rec.lsn, rec
        except LogError as exc:
            raise _prefixed(exc, f"partition {partition_name(pid)} ({where})") from exc
        except OSError as exc:
            raise type(exc)(exc.errno, f"partition {partition_name(pid)}: {exc.strerror or exc}", exc.filename) from exc
        finally:
            it.close()

    # The key (ts_ns, pid, lsn) is unique, so merge never compares records.
    for _ts, pid, _lsn, rec in heapq.merge(*(one(pid) for pid in sorted(readers)), key=lambda t: t[:3]):
        yield pid, rec


def _prefixed(exc: LogError, where: str) -> LogError:
    """``exc`` as the same LogError kind with ``where`` before its message."""
    new = LogError.__new__(type(exc))
    LogError.__init__(new, f"{where}: {exc}")
    new.__dict__.update(exc.__dict__)
    return new
