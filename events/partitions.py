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
from typing import Any

from .log_api import NotALog

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
    from .log_writer import FileLog

    return FileLog.open(partition_dir(root, pid), **open_kw)
