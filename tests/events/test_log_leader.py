"""The group commit's leader: an ``append_batch`` caller writes and syncs its
own batch. The writer thread (there for async appends) never takes a batch
that no async appender awaits from under its caller, which would then wait
for that thread to flush and wake it (two thread switches per batch, each up
to a scheduler quantum on a busy machine)."""

from __future__ import annotations

import threading
import time

from agentlog.events import FileLog, OsOps
from agentlog.events.schema.types import CommandRan


class SyncingThreads(OsOps):
    """Records the thread of every fdatasync."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def fdatasync(self, fd: int) -> None:
        self.threads.append(threading.current_thread())
        super().fdatasync(fd)


def test_the_writer_thread_leaves_a_staged_batch_to_its_caller(tmp_path):
    ops = SyncingThreads()
    lg = FileLog.open(tmp_path / "log", fsync="batch", os_ops=ops)
    body = CommandRan(command="ls", exit_code=0, duration_s=0.1)
    try:
        lg.append_batch([("s", 0, body)])
        # What append_batch does, with the writer thread woken (as the end of
        # every flush wakes it) and queued on the lock while the batch is staged.
        with lg._cv:
            lg._cv.notify_all()
            time.sleep(0.05)
            _envs, end = lg._submit([("s", 1, body), ("t", 0, body)])
        time.sleep(0.05)  # the writer thread has the lock and sees the staged batch
        lg._commit(end)
        assert [e.lsn for e in lg.read()] == [0, 1, 2]
    finally:
        lg.close()
    caller = threading.current_thread()
    assert [t is caller for t in ops.threads[:2]] == [True, True]
