"""The mapped scanner's second thread (``MappedScan`` in _framecodec.c, used by
events/log/segmap.py): the walk that checks bounds, CRC32C and LSNs runs in a
thread of its own while the reader builds the frames it has checked. It must
give the same frames, stops and reasons as the pread path on random and
mutated segments, report a file cut short under it as "file shrank while
reading" (never SIGBUS), keep going when its ring of noted frames fills, and
stop its thread when the reader stops early."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, LogCorruption, read_log
from agentlog.events.log import framecodec, segmap
from agentlog.events.log.format import SEG_HDR_SIZE, list_segments, segment_name
from agentlog.events.log.scan import Frame, SegmentScanner
from agentlog.events.schema.types import CommandRan

from test_framecodec import _mutate, _mutation, _records, _segment
from test_log_mapped_scan import _frames_file, scan_across_a_cut

if framecodec.available():
    from agentlog.events.log import _framecodec as fc

pytestmark = pytest.mark.skipif(
    not framecodec.available() or not fc.HW_AVAILABLE, reason="the threaded scan needs the compiled codec and a CRC32C instruction"
)

CAP = 1 << 20
RING = 4096  # RING_FRAMES in _framecodec.c: frames the walk notes ahead at most


@pytest.fixture
def scratch():
    d = Path(tempfile.mkdtemp(prefix="agentlog-threaded-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def threaded(monkeypatch):
    """The compiled codec with its hardware CRC, every segment mapped and walked
    by the second thread however little is left to read, on any machine."""
    saved, backend = framecodec.native, fc.crc_backend()
    framecodec.use_native(True)
    fc.set_crc_backend("hardware")
    monkeypatch.setattr(segmap, "MIN_MAPPED_BYTES", 0)
    monkeypatch.setattr(segmap, "MIN_THREADED_BYTES", 0)
    monkeypatch.setattr(segmap, "CPUS", 2)
    yield
    framecodec.native = saved
    fc.set_crc_backend(backend)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _scan(path: Path, mapped: bool, limit: int | None = None):
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
        sc.mapped = mapped
        frames = [(*fr[:7], bytes(fr.payload)) for fr in sc.frames(limit=limit)]
        return frames, sc.offset, sc.expected, sc.bad
    finally:
        os.close(fd)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=_records, muts=st.lists(_mutation, max_size=3), seed=st.integers(0, 1 << 30), limit=st.one_of(st.none(), st.integers(0, 14)))
def test_threaded_and_pread_scans_agree_on_random_and_mutated_segments(scratch, threaded, recs, muts, seed, limit):
    path = scratch / segment_name(0)
    path.write_bytes(_mutate(_segment(recs), muts, seed))
    assert _scan(path, True, limit) == _scan(path, False, limit)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=_records, muts=st.lists(_mutation, max_size=3), seed=st.integers(0, 1 << 30),
       limit=st.one_of(st.none(), st.integers(0, 14)), walk=st.sampled_from(["pread", "mapped", "threaded"]))
def test_a_scan_without_payloads_gives_the_same_frames_and_stop_each_frame_without_its_payload(
        scratch, threaded, recs, muts, seed, limit, walk):
    """``payloads`` off (recovery's walk): every compiled path (pread, mapped, mapped
    with the second thread) gives the frames, offsets and stop it gives with them, and
    builds no payload view."""
    path = scratch / segment_name(0)
    path.write_bytes(_mutate(_segment(recs), muts, seed))
    cpus = segmap.CPUS
    segmap.CPUS = 1 if walk == "mapped" else 2  # one CPU: the mapped walk runs in the reader's thread
    try:
        scans = []
        for payloads in (True, False):
            fd = os.open(path, os.O_RDONLY)
            try:
                sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
                sc.mapped, sc.payloads = walk != "pread", payloads
                frames = list(sc.frames(limit=limit))
                scans.append(([fr[:7] for fr in frames], [fr.payload for fr in frames], sc.offset, sc.expected, sc.bad))
            finally:
                os.close(fd)
    finally:
        segmap.CPUS = cpus
    (heads, views, *stop), (heads_only, nones, *stop_only) = scans
    assert heads_only == heads and stop_only == stop
    assert all(type(v) is memoryview for v in views) and nones == [None] * len(heads)


def test_more_frames_than_the_ring_holds_arrive_in_order_in_small_takes(scratch, threaded):
    path = scratch / segment_name(0)
    n = 3 * RING + 17
    ends = _frames_file(path, n, payload=20)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mm)
    walk = fc.MappedScan(mm, view, Frame, SEG_HDR_SIZE, 0, len(mm), 0, None, CAP)
    got: list[int] = []
    while True:
        frames, rel, expected, code, reason = walk.take(1000)
        assert len(frames) <= 1000
        got += [fr.lsn for fr in frames]
        if frames:
            assert (rel, expected) == (frames[-1].end, frames[-1].lsn + 1)
        if code != fc.MORE:
            break
    assert got == list(range(n)) and code == fc.EOF and reason is None and rel == ends[-1]
    assert walk.take(10)[1:] == (rel, expected, code, None)  # the stop again, with no frames
    walk.close()
    del frames, view
    mm.close()


def test_a_limit_stops_the_walk_at_that_lsn(scratch, threaded):
    path = scratch / segment_name(0)
    ends = _frames_file(path, 50)
    assert [fr[2] for fr in _scan(path, True, limit=23)[0]] == list(range(23))
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
        assert len(list(sc.frames(limit=23))) == 23 and sc.offset == ends[22] and sc.expected == 23 and sc.bad is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("cut_page_aligned", [True, False])
def test_a_file_cut_short_under_the_walk_stops_it_instead_of_sigbus(scratch, threaded, cut_page_aligned):
    sc, got, ends = scan_across_a_cut(scratch / segment_name(0), cut_page_aligned)  # the thread walks past the new end
    assert [fr.lsn for fr in got] == list(range(100)) and got[-1].end == ends[99]
    assert sc.bad is not None and sc.bad.reason == "file shrank while reading" and sc.bad.offset == ends[99]


def test_the_walk_reports_a_fault_in_its_own_thread(scratch, threaded):
    path = scratch / segment_name(0)
    ends = _frames_file(path, 50)
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, ends[-1], prot=mmap.PROT_READ)
        os.ftruncate(fd, (ends[9] // mmap.PAGESIZE + 1) * mmap.PAGESIZE)
        walk = fc.MappedScan(m, memoryview(m), Frame, SEG_HDR_SIZE, 0, ends[-1], 0, None, CAP)
        lsns: list[int] = []
        while True:
            frames, rel, expected, code, reason = walk.take(4096)
            lsns += [fr.lsn for fr in frames]
            if code != fc.MORE:
                break
        del frames
    finally:
        os.close(fd)
    assert code == fc.SHRANK and reason is None and lsns == list(range(10)) and (rel, expected) == (ends[9], 10)


def test_a_session_id_that_is_not_utf8_stops_the_scan_as_the_pread_path_does(scratch, threaded):
    path = scratch / segment_name(0)
    _frames_file(path, 300, sids={157: b"\xff\xfe"})
    mapped, pread = _scan(path, True), _scan(path, False)
    assert mapped == pread
    assert len(mapped[0]) == 157 and mapped[3] is not None and mapped[3].reason == "session id is not UTF-8"


def test_a_reader_that_stops_early_stops_the_thread(scratch, threaded):
    path = scratch / segment_name(0)
    _frames_file(path, 2000, payload=2000)
    before = _threads()
    fd = os.open(path, os.O_RDONLY)
    try:
        for stop_at in (0, 1, 700):
            sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
            it = sc.frames()
            lsns = []
            for fr in it:
                lsns.append(fr.lsn)
                if len(lsns) > stop_at:
                    break
            assert lsns == list(range(stop_at + 1))
            it.close()
            assert _threads() == before
        del fr, it, sc
    finally:
        os.close(fd)


def _small_walk(scratch: Path) -> tuple[Any, mmap.mmap]:
    """A MappedScan over a mapped segment of ten frames, its thread started, and the mapping."""
    path = scratch / segment_name(0)
    _frames_file(path, 10)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    return fc.MappedScan(m, memoryview(m), Frame, SEG_HDR_SIZE, 0, len(m), 0, None, CAP), m


def test_take_after_close_says_so(scratch, threaded):
    walk, m = _small_walk(scratch)
    walk.close()
    walk.close()
    with pytest.raises(ValueError, match="closed"):
        walk.take(1)
    m.close()  # no export left: the walk let go of the mapping


def _big_log(d: Path) -> None:
    lg = FileLog.open(d, fsync="never")
    lg.append_batch([("s%d" % (i % 7), i // 7, CommandRan(command="y" * 3000, exit_code=i % 5)) for i in range(1500)])
    lg.close()


def test_read_log_reads_a_large_segment_alike_threaded_or_not(scratch, threaded, monkeypatch):
    _big_log(scratch / "log")
    threaded_read = [(e.lsn, e.session_id, e.session_seq, e.body) for e in read_log(scratch / "log")]
    monkeypatch.setattr(segmap, "CPUS", 1)
    assert threaded_read == [(e.lsn, e.session_id, e.session_seq, e.body) for e in read_log(scratch / "log")]
    assert [x[0] for x in threaded_read] == list(range(1500))


def test_a_damaged_frame_in_a_large_segment_raises_the_same_error_threaded_or_not(scratch, threaded, monkeypatch):
    _big_log(scratch / "log")
    (seg,) = list_segments(scratch / "log")
    path = scratch / "log" / segment_name(seg)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # a payload byte near the middle: a CRC mismatch
    path.write_bytes(bytes(data))

    def failure():
        n = 0
        with pytest.raises(LogCorruption) as err:
            for _ in read_log(scratch / "log"):
                n += 1
        return n, str(err.value), err.value.segment, err.value.offset, err.value.last_good_lsn

    threaded_failure = failure()
    monkeypatch.setattr(segmap, "CPUS", 1)
    assert threaded_failure == failure()
    assert "CRC mismatch" in threaded_failure[1] and 0 < threaded_failure[0] < 1500


def _in_a_fork(child) -> tuple[int, str]:
    """Run ``child()`` (returning a short str) in a forked child with a 20 s alarm; its exit
    status and what it returned. The child never returns into pytest."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)  # a child that hangs is killed, and the test fails instead of hanging
            os.write(w, child().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return status, f.read()


def test_a_forked_child_reads_on_without_its_parents_walk_thread(scratch, threaded):
    """A reader whose walk thread runs, iterated on in a forked child (which has no such thread):
    the child reads the rest on its own (it waited forever for the parent's thread before), and
    the parent's reader goes on as if nothing happened."""
    _big_log(scratch / "log")
    it = read_log(scratch / "log")
    assert next(it).lsn == 0
    status, out = _in_a_fork(lambda: " ".join(str(e.lsn) for e in it))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert out.split() == [str(i) for i in range(1, 1500)]
    assert [e.lsn for e in it] == list(range(1, 1500))


def test_a_take_of_a_walk_started_by_another_process_refuses(scratch, threaded):
    walk, m = _small_walk(scratch)

    def child() -> str:
        try:
            walk.take(1)
        except RuntimeError as exc:
            return str(exc)
        return "took"

    status, out = _in_a_fork(child)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert f"runs in process {os.getpid()}, not in this one" in out
    assert len(walk.take(10)[0]) == 10  # the parent's own walk is untouched
    walk.close()
    m.close()
