"""Followers in other processes see exactly the appended sequence, across
segment rotation and writer restarts, and never a record before it is durable."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentlog.events import FileLog, LogLocked, OsOps, follow_log, read_log
from agentlog.events.log.format import list_segments
from agentlog.events.schema.types import SessionOpened, event_tag
from event_samples import small_event

CHILD = Path(__file__).with_name("follow_child.py")
N = 400


def _append_everything(d: Path) -> None:
    lg = FileLog.open(d, segment_bytes=2048)

    async def session(k: int, lo: int, hi: int):
        for seq in range(lo, hi):
            await lg.append(f"a{k}", seq, SessionOpened(group_id="g", group_size=1) if seq == 0 else small_event(seq))

    asyncio.run(_gather(session, 0, 25))
    for i in range(50):
        lg.append_batch([(f"b{i}", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()  # a writer restart in the middle: new epoch, new segment
    lg = FileLog.open(d, segment_bytes=2048)
    asyncio.run(_gather(session, 25, 50))
    lg.append_batch([(f"b{i}", 1, small_event(i)) for i in range(N - 350)])
    lg.close()


async def _gather(session, lo, hi):
    await asyncio.gather(*(session(k, lo, hi) for k in range(6)))


def test_two_followers_in_other_processes_see_exactly_the_appended_sequence(tmp_path):
    d = tmp_path / "log"
    FileLog.open(d).close()  # the log exists before the followers start
    procs = [
        subprocess.Popen([sys.executable, str(CHILD), str(d), str(N)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline() == b"ready\n", p.stderr.read()
        _append_everything(d)
        outs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    expect = [f"{e.lsn} {e.session_id} {e.session_seq} {event_tag(e.body)}" for e in read_log(d)]
    assert len(expect) == N
    assert len(list_segments(d)) > 4, "the followers must have crossed segment rotations"
    for out, err in outs:
        assert out.decode().splitlines() == expect, err.decode()[-2000:]


class BlockingSync(OsOps):
    """fdatasync waits for ``release`` once armed: records sit written but not durable."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def fdatasync(self, fd):
        if self.armed:
            self.entered.set()
            self.release.wait(10)
        super().fdatasync(fd)


def test_followers_never_see_records_that_are_written_but_not_yet_durable(tmp_path):
    d = tmp_path / "log"
    ops = BlockingSync()
    lg = FileLog.open(d, os_ops=ops)
    first = lg.append_batch([(f"s{i}", 0, SessionOpened(group_id="g", group_size=1)) for i in range(5)])
    ops.armed = True
    done = []
    t = threading.Thread(target=lambda: done.append(lg.append_batch([("late", 0, SessionOpened(group_id="g", group_size=1))])))
    t.start()
    assert ops.entered.wait(5)
    # The late record's bytes are in the file now, but not durable.
    assert len(list(read_log(d, durable_only=False))) == 6
    assert list(read_log(d)) == first

    async def follow_for(seconds):
        got = []

        async def run():
            async for env in follow_log(d, poll_s=0.01):
                got.append(env)

        try:
            await asyncio.wait_for(run(), seconds)
        except asyncio.TimeoutError:
            pass
        return got

    assert asyncio.run(follow_for(0.3)) == first
    ops.release.set()
    t.join(5)
    assert done and done[0][0].lsn == 5
    assert asyncio.run(follow_for(0.3)) == first + done[0]
    lg.close()


def test_second_writer_in_another_process_is_refused(tmp_path):
    d = tmp_path / "log"
    lg = FileLog.open(d)
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from agentlog.events import FileLog, LogLocked\n"
        "try:\n    FileLog.open(%r)\nexcept LogLocked as e:\n    print(e); sys.exit(3)\n"
    ) % (str(Path(__file__).resolve().parents[2]), str(d))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert res.returncode == 3, res.stderr.decode()[-2000:]
    msg = res.stdout.decode()
    assert str(d) in msg and "another writer" in msg
    lg.close()
    with pytest.raises(LogLocked):
        with FileLog.open(d):
            FileLog.open(d)


@pytest.mark.parametrize("policy", ["interval", "never", "batch", "always"])
def test_watermark_reaches_every_acknowledged_record_under_each_policy(tmp_path, policy):
    """Under ``interval`` the sync (and so the watermark) follows within the
    interval even when no further append comes to trigger it."""
    from agentlog.events.log.format import read_durable

    d = tmp_path / "log"
    lg = FileLog.open(d, fsync=policy, interval_s=0.05)
    lg.append_batch([("a", 0, SessionOpened(group_id="g", group_size=1))])
    time.sleep(0.06)
    lg.append_batch([("a", 1, small_event(1))])  # inside the interval: written, not yet synced
    deadline = time.monotonic() + 2
    while read_durable(d)[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert read_durable(d)[0] == 2
    assert [e.lsn for e in read_log(d)] == [0, 1]
    lg.close()


def test_a_read_across_many_segments_lists_the_directory_about_once(tmp_path, monkeypatch):
    """Each segment switch used to list the directory again (O(segments) each): a log
    reopened 300 times (a segment per writer open) took seconds to read."""
    import agentlog.events.log.read as read_mod

    d = tmp_path / "log"
    for k in range(60):
        with FileLog.open(d) as lg:
            lg.append_batch([(f"s{k}", 0, SessionOpened(group_id=f"g{k}", group_size=1))])
    listings = []
    real = read_mod.list_segments
    monkeypatch.setattr(read_mod, "list_segments", lambda directory: listings.append(1) or real(directory))
    got = [e.session_id for e in read_log(d)]
    assert got == [f"s{k}" for k in range(60)]
    assert len(list_segments(d)) == 60 and len(listings) <= 3, len(listings)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_segment_listed_before_the_limit_was_read_never_lets_a_stale_writers_frames_through(tmp_path, compression):
    """A cursor lists the directory again for each read (after its limit), not once for good: a newer
    writer's segment that appeared since (here 10, while a stale writer's segment 5 runs past lsn 10
    and its segment 15 was listed before) makes the stale frames refused, never read. Compressed, the
    stale records past lsn 10 are inside a batch the scan stopped in (they read as the log before)."""
    import shutil

    from agentlog.events.log.api import LogCorruption
    from agentlog.events.log.format import segment_name
    from agentlog.events.log.read import Cursor

    def write(d: Path, runs: list[int], tag: str) -> None:
        lsn = 0
        for n in runs:
            with FileLog.open(d, compression=compression) as lg:
                lg.append_batch([(f"{tag}{lsn + i}", 0, SessionOpened(group_id="g", group_size=1)) for i in range(n)])
            lsn += n

    stale, newer, d = tmp_path / "stale", tmp_path / "newer", tmp_path / "log"
    write(stale, [5, 10, 5], "A")  # segments 0 (0..4), 5 (5..14), 15 (15..19)
    write(newer, [5, 5, 3], "B")  # segments 0, 5 (5..9), 10 (10..12)
    shutil.copytree(stale, d, ignore=shutil.ignore_patterns("INDEX*", "DURABLE*", "LOCK*", "FENCE*"))
    cur = Cursor(d, 0, 1 << 20, None, True)
    try:
        assert [r.session_id for r in cur.records(5)] == [f"A{i}" for i in range(5)]
        shutil.copy(newer / segment_name(10), d / segment_name(10))
        with pytest.raises(LogCorruption, match=f"segment {segment_name(10)} starts at lsn 10"):
            list(cur.records(13))
    finally:
        cur.close()
