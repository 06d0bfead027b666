"""The one-writer lock of a log directory: flocks on the directory itself
and on its LOCK file (which names the holder's pid). The writer holds it for
its lifetime; ``verify --repair`` holds it while it cuts a torn tail."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import NamedTuple

from .api import LogLocked
from .format import LOCK_NAME


class WriterLock(NamedTuple):
    """The writer's hold on a log directory: flocks on the directory itself and on its LOCK file."""

    dir_fd: int
    file_fd: int


def acquire_lock(directory: Path, *, flock: bool = True) -> WriterLock:
    """Become the one writer of ``directory`` or raise LogLocked naming the holder.

    The lock is an flock on the directory itself, which nobody can delete or
    swap out from under a live writer (a LOCK file can be deleted and
    re-created, and a lock on the new file would let a second writer in). The
    LOCK file is still locked too (writers of earlier versions lock only it)
    and holds the writer's pid for humans and for the error message.

    ``flock=False`` opens both descriptors without locking them: the test
    seam that simulates a writer on another node of a shared filesystem,
    whose flock this node does not see (see FileLog.open's ``_flock``)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    file_fd = -1
    try:
        try:
            if flock:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            file_fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            if flock:
                fcntl.flock(file_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LogLocked(
                f"log {directory}: another writer holds it ({_lock_holder(directory, dir_fd)}); "
                f"one writer per log directory — readers use read_log/follow_log, which need no lock"
            ) from None
        os.ftruncate(file_fd, 0)
        os.pwrite(file_fd, str(os.getpid()).encode(), 0)
    except BaseException:
        if file_fd >= 0:
            os.close(file_fd)
        os.close(dir_fd)
        raise
    return WriterLock(dir_fd, file_fd)


def release_lock(lock: WriterLock) -> None:
    """Unlock and close both descriptors of ``lock``."""
    for fd in (lock.file_fd, lock.dir_fd):
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _lock_holder(directory: Path, dir_fd: int) -> str:
    """Who holds the writer lock: the pid in LOCK, else the flock's owner per
    /proc/locks (the LOCK file may have been removed under the writer)."""
    try:
        with open(directory / LOCK_NAME, "rb") as f:
            pid = f.read(64).decode("ascii", "replace").strip()
        if pid:
            return f"pid {pid}, per {directory / LOCK_NAME}"
    except FileNotFoundError:
        pass
    st = os.fstat(dir_fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
                    return f"pid {fields[4]}, per /proc/locks; its {LOCK_NAME} file is missing"
    except OSError:
        pass
    return f"holder unknown: no pid in {directory / LOCK_NAME}"
