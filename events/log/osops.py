"""The file log writer's seam to the OS: the data and sync calls it makes
(:class:`OsOps`, which tests subclass to inject faults into a real writer)
and its file-descriptor budget (the errnos of running out of descriptors, and
raising the soft RLIMIT_NOFILE once per process)."""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

from agentlog._logging import get_logger

# The writer's logger: these are the writer's events, whichever module emits them.
log = get_logger("agentlog.events.log.writer")


class OsOps:
    """The OS calls the writer makes for data and syncs. Tests substitute a
    subclass to inject faults (EIO, ENOSPC, short writes) into a real writer."""

    def writev(self, fd: int, buffers: list) -> int:
        """``os.writev``: may write fewer bytes than given (the writer completes it)."""
        return os.writev(fd, buffers)

    def fdatasync(self, fd: int) -> None:
        """``os.fdatasync``: makes a batch of frames durable."""
        os.fdatasync(fd)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        """``os.pwrite``: writes at an offset without moving the file position."""
        return os.pwrite(fd, data, offset)


_NOFILE_RAISED = False
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def raise_nofile_limit() -> None:
    """Once per process: raise the soft RLIMIT_NOFILE to the hard limit, so a
    burst of connections does not starve the writer of descriptors, and a
    reader that holds the frames of many mapped segments (a descriptor each,
    :mod:`~agentlog.events.log.segmap`) does not run out."""
    global _NOFILE_RAISED
    if _NOFILE_RAISED:
        return
    _NOFILE_RAISED = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:  # Linux caps the descriptor table at fs.nr_open; "infinity" is refused
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = soft
    if soft == resource.RLIM_INFINITY or target <= soft:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.debug("log.nofile_limit.unchanged", soft=soft, hard=hard, error=repr(exc))
        return
    log.debug("log.nofile_limit.raised", soft_was=soft, soft=target, hard=hard)
