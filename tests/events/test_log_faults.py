"""Fault injection into a real writer: write/fdatasync raising EIO or ENOSPC,
and short writes. The writer goes fatal, nothing acknowledged is lost, and
reopening recovers."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from agentlog.events import FileLog, LogClosed, OsOps, read_log
from agentlog.events.schema.types import CommandRan, SessionOpened
from event_samples import small_event

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")


class FaultyOps(OsOps):
    """Real OS calls, with faults armed per operation."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}  # op name -> errno to raise
        self.short_max: int | None = None  # cap on bytes per write()
        self.fail_after_bytes: int | None = None  # ENOSPC once this many more bytes were written
        self.calls: dict[str, int] = {}
        self.fail_at_call: dict[str, int] = {}  # op name -> the call number that raises EIO

    def _maybe_fail(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.fail_at_call.get(op) == self.calls[op]:
            raise OSError(errno.EIO, "injected Input/output error")
        code = self.fail.get(op)
        if code is not None:
            raise OSError(code, f"injected {os.strerror(code)}")

    def writev(self, fd, buffers):
        self._maybe_fail("write")
        if self.fail_after_bytes is None and self.short_max is None:
            return super().writev(fd, buffers)
        view = memoryview(b"".join(buffers))
        if self.fail_after_bytes is not None:
            if self.fail_after_bytes <= 0:
                raise OSError(errno.ENOSPC, "injected No space left on device")
            view = view[: self.fail_after_bytes]
            self.fail_after_bytes -= len(view)
        if self.short_max is not None:
            view = view[: self.short_max]
        return os.write(fd, view)

    def fdatasync(self, fd):
        self._maybe_fail("fdatasync")
        super().fdatasync(fd)

    def pwrite(self, fd, data, offset):
        self._maybe_fail("pwrite")
        return super().pwrite(fd, data, offset)


def opened(i=0):
    return SessionOpened(group_id="g", group_size=1)


def _fill(lg, start, n, compression="none"):
    """``n`` batches of two records; with ``compression`` "zstd" the second one's output
    compresses well, so each batch is stored as one compressed frame (small events alone
    would not save the 10% that compressing a batch must)."""
    envs = []
    for i in range(start, start + n):
        second = small_event(i) if compression == "none" else CommandRan(command=f"ls {i}", exit_code=0, output_tail=f"{i}\n" * 150)
        envs += lg.append_batch([(f"s{i}", 0, opened()), (f"s{i}", 1, second)])
    return envs


@pytest.fixture
def compressed_batches(monkeypatch):
    """The number of compressed batches the writers of this test packed (a list holding the
    count): a zstd case that never packed one would test the plain frames only."""
    from agentlog.events.log import batch_compression

    count = [0]
    pack = batch_compression.pack_batch

    def counted(*args):
        count[0] += 1
        return pack(*args)

    monkeypatch.setattr(batch_compression, "pack_batch", counted)
    return count


@pytest.mark.parametrize("op", ["write", "fdatasync"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_io_error_makes_the_writer_fatal_and_reopen_recovers(tmp_path, op, code, compression, compressed_batches):
    d = tmp_path / "log"
    ops = FaultyOps()
    lg = FileLog.open(d, os_ops=ops, compression=compression)
    acked = _fill(lg, 0, 5, compression)
    assert (compressed_batches[0] > 0) == (compression == "zstd")
    ops.fail[op] = code
    with pytest.raises(LogClosed, match=r"fatal.*reopen") as info:
        lg.append_batch([("x", 0, opened())])
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
    assert os.strerror(code) in str(info.value)
    # Never retried in place: with the fault gone the writer still refuses.
    del ops.fail[op]
    calls = dict(ops.calls)
    with pytest.raises(LogClosed):
        lg.append_batch([("y", 0, opened())])
    assert ops.calls == calls, "a fatal writer must not touch the file again"
    lg.close()
    lg = FileLog.open(d)
    got = list(lg.read())
    assert got[: len(acked)] == acked
    nxt = lg.append_batch([("z", 0, opened())])
    assert nxt[0].lsn == len(got)
    lg.close()


@pytest.mark.parametrize("op", ["write", "fdatasync", "pwrite"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_async_appenders_all_fail_and_none_hang_when_the_writer_dies(tmp_path, op, compression, compressed_batches):
    d = tmp_path / "log"
    ops = FaultyOps()
    lg = FileLog.open(d, os_ops=ops, compression=compression)
    acked = _fill(lg, 0, 3, compression)
    assert (compressed_batches[0] > 0) == (compression == "zstd")
    ops.fail[op] = errno.EIO

    async def main():
        tasks = [asyncio.ensure_future(lg.append(f"a{k}", 0, opened())) for k in range(50)]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    results = asyncio.run(main())
    assert all(isinstance(r, LogClosed) for r in results), results[:3]
    lg.close()
    ops.fail.clear()
    lg = FileLog.open(d)
    assert list(lg.read())[: len(acked)] == acked
    lg.close()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_short_writes_are_completed(tmp_path, compression, compressed_batches):
    """A short write is not an error: the writer writes the rest."""
    d = tmp_path / "log"
    ops = FaultyOps()
    ops.short_max = 7
    lg = FileLog.open(d, os_ops=ops, segment_bytes=2048, compression=compression)
    envs = _fill(lg, 0, 30, compression)
    assert (compressed_batches[0] > 0) == (compression == "zstd")
    assert ops.calls["write"] > 100
    lg.close()
    assert list(read_log(d)) == envs


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_short_write_then_enospc_leaves_a_torn_tail_that_reopen_cuts(tmp_path, compression, compressed_batches):
    """(Compressed, the torn frame is a batch of the flush's records: cut whole.)"""
    d = tmp_path / "log"
    ops = FaultyOps()
    lg = FileLog.open(d, os_ops=ops, compression=compression)
    acked = _fill(lg, 0, 4, compression)
    ops.fail_after_bytes = 50  # half a frame reaches the file, then the disk is full
    packed = compressed_batches[0]
    with pytest.raises(LogClosed, match="No space left"):
        _fill(lg, 100, 1, compression)
    assert (compressed_batches[0] > packed) == (compression == "zstd"), "the torn frame must be a compressed batch"
    lg.close()
    lg = FileLog.open(d)
    assert list(lg.read()) == acked
    assert lg.next_lsn == len(acked)
    lg.append_batch([("after", 0, opened())])
    lg.close()


def test_fault_while_sealing_a_segment_is_fatal_too(tmp_path):
    d = tmp_path / "log"
    ops = FaultyOps()
    lg = FileLog.open(d, os_ops=ops, segment_bytes=600)
    acked = _fill(lg, 0, 2)
    assert len(os.listdir(d)) and lg.next_lsn == 4
    # The next batch does not fit: its flush first seals the segment (an
    # fdatasync of the old file) and that fdatasync fails.
    ops.fail_at_call["fdatasync"] = ops.calls["fdatasync"] + 1
    big = [(f"t{i}", 0, SessionOpened(group_id="g", group_size=1, metadata={"pad": "x" * 100})) for i in range(3)]
    with pytest.raises(LogClosed, match="fatal"):
        lg.append_batch(big)
    assert not (d / "00000000000000000004.seg").exists(), "no new segment after a failed seal"
    lg.close()
    lg = FileLog.open(d, segment_bytes=600)
    assert list(lg.read())[: len(acked)] == acked
    lg.close()


def test_close_releases_the_lock_after_a_fatal_error(tmp_path):
    d = tmp_path / "log"
    ops = FaultyOps()
    lg = FileLog.open(d, os_ops=ops)
    ops.fail["write"] = errno.EIO
    with pytest.raises(LogClosed):
        lg.append_batch([("s", 0, opened())])
    lg.close()
    FileLog.open(d).close()


def test_an_unexpected_error_in_the_writer_thread_is_fatal_and_loud_not_silent(tmp_path):
    """Not only OSError: any exception in the writer thread makes the log fatal
    with a reason, fails every waiting appender (none hangs) and refuses more."""
    d = tmp_path / "log"
    lg = FileLog.open(d)
    acked = _fill(lg, 0, 3)

    def broken_bookkeeping():  # a bug in the writer thread, after a successful flush
        raise ZeroDivisionError("injected bug in the writer thread")

    lg._resolve_waiters = broken_bookkeeping

    async def main():
        tasks = [asyncio.ensure_future(lg.append(f"a{k}", 0, opened())) for k in range(20)]
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)

    results = asyncio.run(main())
    assert all(isinstance(r, LogClosed) for r in results), results[:3]
    assert "unexpected error" in str(results[0]) and "ZeroDivisionError" in str(results[0])
    assert lg.fatal_reason is not None and "ZeroDivisionError: injected bug" in lg.fatal_reason
    with pytest.raises(LogClosed, match="ZeroDivisionError"):
        lg.append_batch([("late", 0, opened())])
    lg.close()
    lg = FileLog.open(d)
    assert list(lg.read())[: len(acked)] == acked
    lg.close()


class PowerCutOps(OsOps):
    """Real OS calls that remember what every file the writer writes held at
    its last sync; ``power_cut`` rolls each back to that, as a power loss
    may. Unlike SIGKILL (the page cache survives) this loses unsynced writes.
    Files are known by inode: the writer names a segment file after opening it."""

    def __init__(self) -> None:
        self.synced: dict[int, bytes] = {}  # inode -> contents at its last sync
        self.dead = False

    @staticmethod
    def _contents(fd: int) -> bytes:
        with open(f"/proc/self/fd/{fd}", "rb") as f:  # the same file, readable
            return f.read()

    def _track(self, fd: int) -> int:
        if self.dead:
            raise OSError(errno.EIO, "injected: the power is off")
        ino = os.fstat(fd).st_ino
        if ino not in self.synced:  # what it held before this writer wrote to it
            self.synced[ino] = self._contents(fd)
        return ino

    def writev(self, fd, buffers):
        self._track(fd)
        return super().writev(fd, buffers)

    def pwrite(self, fd, data, offset):
        self._track(fd)
        return super().pwrite(fd, data, offset)

    def fdatasync(self, fd):
        ino = self._track(fd)
        super().fdatasync(fd)
        self.synced[ino] = self._contents(fd)

    def power_cut(self, directory, *, watermark_reached_disk: bool) -> None:
        """Drop every unsynced write. ``watermark_reached_disk``: the OS had
        happened to write DURABLE back (a 20-byte page) but not the data."""
        self.dead = True
        for entry in os.scandir(directory):
            data = self.synced.get(entry.inode())
            if data is None or (watermark_reached_disk and entry.name == "DURABLE"):
                continue
            with open(entry.path, "wb") as f:
                f.write(data)


@pytest.mark.parametrize("checkpoint_bytes", [None, 256], ids=["rotation-checkpoints", "periodic-checkpoints"])
@pytest.mark.parametrize("watermark_reached_disk", [False, True], ids=["all-unsynced-lost", "watermark-kept"])
@pytest.mark.parametrize("policy", ["always", "batch", "interval", "never"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_power_cut_loses_only_unsynced_records_and_the_log_reopens(tmp_path, policy, watermark_reached_disk, checkpoint_bytes,
                                                                     compression, compressed_batches, monkeypatch):
    from structlog.testing import capture_logs

    from agentlog.events.log import writer_checkpoint as log_writer

    from agentlog.events.log.format import SEG_HDR_SIZE, list_segments, load_checkpoint, read_watermark
    from agentlog.events.log.recovery import checkpoint_problem

    d = tmp_path / "log"
    ops = PowerCutOps()
    kw = {} if checkpoint_bytes is None else {"checkpoint_bytes": checkpoint_bytes}
    monkeypatch.setattr(log_writer, "_CKPT_SPACING", 0)  # an interval smaller than the INDEX spacing, as given
    lg = FileLog.open(d, fsync=policy, segment_bytes=2048, interval_s=3600, os_ops=ops, compression=compression, **kw)
    acked = _fill(lg, 0, 40, compression)
    assert (compressed_batches[0] > 0) == (compression == "zstd")
    segs = list_segments(d)
    assert len(segs) >= 3, "the test needs sealed (synced) segments and an open one"
    sealed = [e for e in acked if e.lsn < segs[-1]]  # sealing a segment syncs it
    ops.power_cut(d, watermark_reached_disk=watermark_reached_disk)
    with pytest.raises(LogClosed, match="power is off"):
        lg.close()
    on_disk = list(read_log(d, durable_only=False))  # every whole record the synced bytes hold
    assert on_disk == acked[: len(on_disk)]
    # Under "never" a flush that carries a periodic checkpoint syncs: a compressed log's small
    # flushes here carry one more often, and where the last one did, nothing unsynced is left.
    if policy == "never" and watermark_reached_disk and (compression == "none" or not read_watermark(d).synced):
        # Before a writer recovers it, a reader is told the watermark was only a hint.
        from agentlog.events import LogCorruption

        with pytest.raises(LogCorruption, match="never synced, so a power loss explains this"):
            list(read_log(d))
    ckpt, _ = load_checkpoint(d)
    if policy in ("always", "batch") or ckpt.offset > SEG_HDR_SIZE:
        # The INDEX never describes records the cut took. (A periodic INDEX
        # is not fsynced itself: a real power loss may also leave the previous
        # one or a torn one, which recovery rebuilds, as
        # test_bad_checkpoint_is_rebuilt_from_the_log shows.)
        # (A rotation's checkpoint under never/interval names the new
        # segment's header, which the cut may take: recovery then rebuilds.)
        assert checkpoint_problem(d, ckpt, list_segments(d), 1 << 20) == ""
    if policy in ("always", "batch"):
        assert checkpoint_bytes is None or ckpt.lsn >= len(acked) - 4, "periodic checkpoints keep up with the appends"
    with capture_logs() as logs:
        lg = FileLog.open(d)  # must open: what was synced is there, the rest was never promised
    line = [e for e in logs if e["event"] == "log.opened"][0]
    if policy in ("always", "batch") and checkpoint_bytes is not None:
        assert line["index"] == "checkpoint" and line["rescanned_bytes"] < checkpoint_bytes
    assert list(lg.read()) == on_disk
    assert len(on_disk) >= len(sealed)
    if policy in ("always", "batch"):
        assert on_disk == acked  # every acknowledgement waited for its sync
    elif checkpoint_bytes is None:
        assert len(on_disk) < len(acked), "the cut must have taken unsynced records, or this proves nothing"
    more = lg.append_batch([("after", 0, opened())])
    assert more[0].lsn == len(on_disk)
    lg.close()
    assert read_watermark(d).synced  # a clean close syncs, so its watermark is proof
    assert list(read_log(d)) == on_disk + more


def test_a_never_writer_marks_its_watermark_unsynced_until_close(tmp_path):
    from agentlog.events.log.format import read_watermark

    d = tmp_path / "log"
    lg = FileLog.open(d, fsync="never")
    _fill(lg, 0, 2)
    mark = read_watermark(d)
    assert mark.lsn == 4 and not mark.synced and mark.epoch == lg.epoch
    assert len(list(read_log(d))) == 4  # readers still follow it
    lg.close()
    assert read_watermark(d) == (4, 1, True)


_EMFILE_CHILD = r"""
import errno, json, os, resource, sys
sys.path.insert(0, sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # hard too: the writer may raise the soft one
from agentlog.events import FileLog, LogClosed, verify_log
from agentlog.events.log.api import LogError
from agentlog.events.schema.types import SessionOpened

d = sys.argv[1]
lg = FileLog.open(d, segment_bytes=1024)
opened = SessionOpened(group_id="g", group_size=1)
acked, report = [], {"refused": [], "rotations_while_exhausted": 0}

def append(i):
    acked.extend(lg.append_batch([(f"s{i}", 0, opened)]))

i = 0
for _ in range(5):
    append(i); i += 1
hog = []

def grab():  # take every free descriptor, as a burst of connections would
    while True:
        try:
            hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
            return

exhausted_at = lg.next_lsn
for _ in range(200):  # far more than a segment holds: rotations are forced
    grab()  # also the one a sealed segment gave back
    lsn_before = lg.next_lsn
    try:
        append(i)
    except LogClosed as exc:
        print(json.dumps({"fatal": str(exc)})); sys.exit(1)
    except LogError as exc:
        assert lg.next_lsn == lsn_before and lg.next_seq(f"s{i}") == 0, "a refused append changed state"
        report["refused"].append(str(exc))
        break
    i += 1
refused_at = lg.next_lsn
report["fatal_reason"] = lg.fatal_reason
for fd in hog:
    os.close(fd)
from agentlog.events.log.format import list_segments  # listing a directory takes a descriptor
from pathlib import Path
report["rotations_while_exhausted"] = sum(exhausted_at <= s < refused_at for s in list_segments(Path(d)))
for _ in range(100):  # the same append is taken now, and rotations go on
    append(i); i += 1
lg.close()
report["acked"] = len(acked)
lg = FileLog.open(d)
report["read_back"] = [e.lsn for e in lg.read()] == [e.lsn for e in acked]
lg.close()
report["verify"] = verify_log(d).status
print(json.dumps(report))
"""


def test_out_of_descriptors_a_rotation_refuses_the_append_cleanly_and_the_log_stays_healthy(tmp_path):
    """EMFILE when a new segment is needed: the append is refused with a clear
    LogError (nothing written, nothing changed), the log is not fatal, and
    appends succeed again once descriptors are freed. A segment file is
    opened ahead of need, so the first rotation after exhaustion still works."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    res = subprocess.run(
        [sys.executable, "-c", _EMFILE_CHILD, str(tmp_path / "log"), root],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(report["refused"]) == 1, report
    assert "append refused, nothing was written" in report["refused"][0]
    assert "EMFILE" in report["refused"][0] and "retry" in report["refused"][0]
    assert report["rotations_while_exhausted"] >= 1, "the segment opened ahead of need was not used"
    assert report["fatal_reason"] is None
    assert report["read_back"] and report["verify"] == "ok"


def test_opening_a_log_for_writing_raises_the_soft_descriptor_limit_to_the_hard_one(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import resource, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "want = hard if hard != resource.RLIM_INFINITY else int(open('/proc/sys/fs/nr_open').read())\n"
        "from agentlog.events import FileLog\n"
        "FileLog.open(sys.argv[1]).close()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], want)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "log"), root], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    soft, want = map(int, res.stdout.split()[-2:])
    if want <= 64:
        pytest.skip(f"the hard limit here is {want}: nothing to raise")
    assert soft == want
