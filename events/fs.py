"""Atomic file writes: the one home of "write a temp sibling, fsync, rename, fsync the directory".

A reader of a path written here sees the whole old content or the whole new
one, never a part: the new content is written to a temporary sibling and
renamed over the path. ``durable=True`` (the default) also fsyncs the file
before the rename and the directory after it, so the new content survives a
power loss once the call returns; ``durable=False`` skips both fsyncs (a crash
of the process still leaves the old or the new content, but a power loss may
leave either, or a truncated file: only for files that are rebuildable).

A write that fails removes its temporary file, so a partial file never holds
on to the space of a full disk, and re-raises the error.

It lives in the lowest layer that writes files (the log's INDEX and fence);
the engine's checkpoint, the learner's checkpoints, the run folder's
``config.json`` and marker, published model directories and the CLI's output
files all write through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import IO, Any, Callable, Iterator


def fsync_dir(directory: Path | str) -> None:
    """fsync a directory so that created, renamed or removed entries persist."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    """fsync the file at ``path`` (a read-only descriptor is enough on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path | str, *, durable: bool = True, tmp_name: str | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` for the caller to create (a file or a
    symlink); when the block ends normally, fsync it (``durable``), rename it over
    ``path`` and fsync the directory (``durable``). When the block or the rename
    fails, the temporary is removed and the error re-raised.

    ``tmp_name``: the temporary's name in the directory; default
    ``.<name>.<pid>.tmp``, so that two processes writing the same path never
    share one. A stale temporary of that name is removed first."""
    path = Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        if durable and not tmp.is_symlink():
            _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: Path | str, mode: str = "wb", *, durable: bool = True, encoding: str | None = None,
                tmp_name: str | None = None) -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing (``mode``: ``"wb"`` or
    ``"w"``) and yield the file; when the block ends normally it is closed and
    moved over ``path`` as :func:`atomic_path` does; when it fails, removed."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file: mode expected 'wb' or 'w', found {mode!r}")
    with atomic_path(path, durable=durable, tmp_name=tmp_name) as tmp:
        with open(tmp, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f


def write_atomic(directory: Path, name: str, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` as ``directory/name`` atomically (:func:`atomic_path`).

    The temporary is ``.<name>.tmp``, one fixed name: the files of a log
    directory written this way (INDEX, fence) have one writer, its lock's
    holder, and a crash leaves at most one stale temporary, replaced next time."""
    with atomic_file(Path(directory) / name, durable=durable, tmp_name=f".{name}.tmp") as f:
        f.write(data)


def write_dir_atomically(target: Path, write: Callable[[Path], Any], *, replace: bool) -> Path:
    """Build the directory ``target`` with ``write(tmp)`` in a temporary sibling, fsync
    its files and rename it into place, so a reader never sees half of it.
    ``replace``: an existing ``target`` is replaced (a rewrite of the same version);
    otherwise a ``target`` that another process finished meanwhile is kept, and ours
    removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        for f in tmp.iterdir():
            _fsync_path(f)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed build leaves nothing behind
        raise
    if replace:
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if replace or not target.exists():  # not a racing builder that won: a real failure
            raise
    fsync_dir(target.parent)
    return target


__all__ = ["atomic_file", "atomic_path", "fsync_dir", "write_atomic", "write_dir_atomically"]
