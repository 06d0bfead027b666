"""A restore that is stopped (a resume's restore timeout) leaves the workdir as it was, and nothing behind.

``asyncio.wait_for`` cancels the coroutine awaiting a thread, not the thread:
a restore thread left running would go on filling its staging directory and
swap it in after the session was aborted and its sandbox removed.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from agentlog.engine import LocalSandbox
from agentlog.engine.snapshots import SnapshotError, SnapshotStore


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _snapshot_of_many_files(tmp_path: Path, n: int) -> tuple[SnapshotStore, str]:
    src = tmp_path / "src"
    for d in range(n // 100):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(100):
            (src / f"d{d}" / f"f{i}").write_bytes(f"{d}/{i}\n".encode() * 8)
    store = SnapshotStore(tmp_path / "store")
    return store, store.snapshot(src, "s").digest


def test_a_cancelled_restore_stops_before_its_next_entry_and_leaves_the_workdir(tmp_path):
    store, digest = _snapshot_of_many_files(tmp_path, 200)
    work = tmp_path / "sb" / "s"
    work.mkdir(parents=True)
    (work / "mine").write_text("as it was\n")
    stop = threading.Event()
    stop.set()
    with pytest.raises(SnapshotError, match=r"restore of snapshot [0-9a-f]{64} stopped \(cancelled\) after 0 of \d+ entries"):
        store.restore(digest, work, cancel=stop)
    assert _tree(work) == {"mine": b"as it was\n"}
    assert sorted(p.name for p in work.parent.iterdir()) == ["s"]


def test_a_restore_timed_out_leaves_nothing_running_and_the_workdir_whole(tmp_path):
    store, digest = _snapshot_of_many_files(tmp_path, 2000)
    sandbox = LocalSandbox(tmp_path / "sb" / "s")
    (sandbox.workdir / "mine").write_text("as it was\n")

    async def go() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sandbox.restore(store, digest), 0.005)
        # The moment wait_for gave up, the restore's thread was over: nothing is filling a staging dir
        # or swapping it in, now or later.
        for _ in range(2):
            assert sorted(p.name for p in sandbox.workdir.parent.iterdir()) == ["s"]
            assert _tree(sandbox.workdir) == {"mine": b"as it was\n"}
            await asyncio.sleep(0.2)

    asyncio.run(go())
