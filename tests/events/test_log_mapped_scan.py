"""The scanner's mapped fast path (events/log/segmap.py and scan_mapped in
_framecodec.c) against its pread path: the same frames, stops and reasons on
random and mutated segments and on compressed logs, a file cut short under
the mapping reported as "file shrank while reading" (never SIGBUS), and a
segment that grows while it is read (a tailing reader)."""

from __future__ import annotations

import asyncio
import mmap
import os
import resource
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, follow_log, read_log
from agentlog.events.log import framecodec, segmap
from agentlog.events.log.format import SEG_HDR_SIZE, encode_frame, list_segments, pack_segment_header, segment_name
from agentlog.events.log.scan import Frame, SegmentScanner
from agentlog.events.schema.types import CommandRan

from test_framecodec import _mutate, _mutation, _records, _segment

if framecodec.available():
    from agentlog.events.log import _framecodec as fc

pytestmark = pytest.mark.skipif(
    not framecodec.available() or not fc.HW_AVAILABLE, reason="the mapped path needs the compiled codec and a CRC32C instruction"
)

CAP = 1 << 20


@pytest.fixture
def scratch():
    d = Path(tempfile.mkdtemp(prefix="agentlog-mapped-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def native_hw():
    saved, backend = framecodec.native, fc.crc_backend()
    framecodec.use_native(True)
    fc.set_crc_backend("hardware")
    yield
    framecodec.native = saved
    fc.set_crc_backend(backend)


@pytest.fixture
def map_everything(monkeypatch):
    """Map every segment, however little of it is left to read."""
    monkeypatch.setattr(segmap, "MIN_MAPPED_BYTES", 0)


def _scan(path: Path, mapped: bool, limit: int | None = None, size: int | None = None):
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
        sc.mapped = mapped
        frames = [(*fr[:7], bytes(fr.payload)) for fr in sc.frames(limit=limit, size=size)]
        return frames, sc.offset, sc.expected, sc.bad, sc._map is not None
    finally:
        os.close(fd)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recs=_records, muts=st.lists(_mutation, max_size=3), seed=st.integers(0, 1 << 30), limit=st.one_of(st.none(), st.integers(0, 14)))
def test_mapped_and_pread_scans_agree_on_random_and_mutated_segments(scratch, native_hw, map_everything, recs, muts, seed, limit):
    path = scratch / segment_name(0)
    path.write_bytes(_mutate(_segment(recs), muts, seed))
    mapped, pread = _scan(path, True, limit), _scan(path, False, limit)
    assert mapped[:4] == pread[:4]
    assert not pread[4]
    assert mapped[4] or path.stat().st_size <= SEG_HDR_SIZE or not recs


def test_compressed_log_reads_alike_mapped_or_not(scratch, native_hw, map_everything, monkeypatch):
    lg = FileLog.open(scratch / "log", fsync="never", compression="zstd")
    for b in range(20):
        lg.append_batch([("s", b * 50 + i, CommandRan(command="ls " * (i % 40), exit_code=i % 3)) for i in range(50)])
        lg.append_batch([("solo", b, CommandRan(command="x", exit_code=0))])  # a plain frame between batches
    lg.close()
    mapped = [(e.lsn, e.session_id, e.session_seq, e.body) for e in read_log(scratch / "log")]
    monkeypatch.setattr(SegmentScanner, "mapped", False)
    assert mapped == [(e.lsn, e.session_id, e.session_seq, e.body) for e in read_log(scratch / "log")]
    assert len(mapped) == 20 * 51


def _frames_file(path: Path, n: int, payload: int = 4000, sids: dict[int, bytes] | None = None) -> list[int]:
    """A segment of n frames (frame i's session id ``sids[i]``, else b"s"); returns each frame's end offset."""
    ends, data = [], bytearray(pack_segment_header(1, 0))
    for i in range(n):
        data += encode_frame(i, i, 1, 0, (sids or {}).get(i, b"s"), bytes([i % 251]) * payload)
        ends.append(len(data))
    path.write_bytes(bytes(data))
    return ends


def scan_across_a_cut(path: Path, cut_page_aligned: bool) -> tuple[SegmentScanner, list, list[int]]:
    """Map a 200-frame segment whole, cut it after frame 99 (at the frame's end, or the page
    after it) as a recovery racing a reader does, and scan on: ``(scanner, frames, ends)``."""
    ends = _frames_file(path, 200)
    size = ends[-1]
    cut = ends[99] if not cut_page_aligned else (ends[99] // mmap.PAGESIZE + 1) * mmap.PAGESIZE
    fd = os.open(path, os.O_RDWR)
    try:
        sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
        got = list(sc.frames(limit=1, size=size))  # maps the whole file
        os.ftruncate(fd, cut)
        got += list(sc.frames(size=size))  # reads into the pages past the new end
    finally:
        os.close(fd)
    return sc, got, ends


@pytest.mark.parametrize("cut_page_aligned", [True, False])
def test_a_file_cut_short_under_the_mapping_stops_the_scan_instead_of_sigbus(scratch, native_hw, map_everything, cut_page_aligned):
    sc, got, ends = scan_across_a_cut(scratch / segment_name(0), cut_page_aligned)
    assert sc._map is not None
    assert [fr.lsn for fr in got] == list(range(len(got)))
    assert len(got) == 100 and got[-1].end == ends[99]
    assert sc.bad is not None and sc.bad.reason == "file shrank while reading", sc.bad


def test_scan_mapped_reports_a_fault_past_the_end_of_the_file(scratch, native_hw):
    """The guard itself: pages mapped past the end of the file fault; the
    scan says SHRANK and keeps the frames read before."""
    path = scratch / segment_name(0)
    ends = _frames_file(path, 50)
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, ends[-1], prot=mmap.PROT_READ)
        os.ftruncate(fd, (ends[9] // mmap.PAGESIZE + 1) * mmap.PAGESIZE)
        frames, rel, expected, code, reason = fc.scan_mapped(m, memoryview(m), Frame, SEG_HDR_SIZE, 0, ends[-1], 0, None, CAP, 4096)
        del frames
    finally:
        os.close(fd)
    assert code == fc.SHRANK and reason is None
    assert expected == 10 and rel == ends[9]


def test_a_segment_growing_while_read_is_mapped_again(scratch, native_hw, map_everything):
    path = scratch / segment_name(0)
    ends = _frames_file(path, 120)
    data = path.read_bytes()
    path.write_bytes(data[: ends[59]])
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
        first = [fr.lsn for fr in sc.frames()]
        with open(path, "ab") as f:  # the writer appends
            f.write(data[ends[59] :])
        second = [fr.lsn for fr in sc.frames()]
    finally:
        os.close(fd)
    assert first == list(range(60)) and second == list(range(60, 120)) and sc.bad is None


def test_read_log_maps_a_large_segment(scratch, native_hw):
    lg = FileLog.open(scratch / "log", fsync="never")
    lg.append_batch([("s", i, CommandRan(command="y" * 3000, exit_code=0)) for i in range(200)])
    lg.close()
    (seg,) = list_segments(scratch / "log")
    assert (scratch / "log" / segment_name(seg)).stat().st_size > segmap.MIN_MAPPED_BYTES
    fd = os.open(scratch / "log" / segment_name(seg), os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, "x", SEG_HDR_SIZE, seg, CAP)
        assert len(list(sc.frames())) == 200 and sc._map is not None and sc.bad is None
    finally:
        os.close(fd)
    assert [e.session_seq for e in read_log(scratch / "log")] == list(range(200))


def test_a_follower_reads_a_mapped_segment_while_the_writer_appends(scratch, native_hw, map_everything):
    """Tailing: the follower's cursor keeps its scanner (and mapping) across
    polls while the writer appends; every record arrives once, in order."""
    d = scratch / "log"
    lg = FileLog.open(d, fsync="batch")
    got: list = []

    async def run() -> None:
        async def follow() -> None:
            async for env in follow_log(d, poll_s=0.005):
                got.append((env.lsn, env.body))

        task = asyncio.create_task(follow())
        for b in range(10):
            await asyncio.to_thread(lg.append_batch, [("s", b * 20 + i, CommandRan(command="z" * 5000, exit_code=i)) for i in range(20)])
            await asyncio.sleep(0.02)
        for _ in range(200):
            if len(got) >= 200:
                break
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(run())
    lg.close()
    assert [lsn for lsn, _ in got] == list(range(200))
    assert [body.exit_code for _, body in got] == [i for _ in range(10) for i in range(20)]


HOLD_EVERY_SEGMENT = r"""
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))  # a reader's process that never opened a writer
from agentlog.events import read_log
from agentlog.events.log import framecodec
envs = list(read_log(sys.argv[1]))  # every segment's frames held: a mapping, and a descriptor, each
print(framecodec.native is not None, len(envs), envs[-1].body.command[-3:], resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 64)
"""


@pytest.mark.skipif(not framecodec.available(), reason="segments are mapped by the compiled codec only")
@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 200, reason="the hard RLIMIT_NOFILE leaves no room above the test's 64")
def test_holding_the_frames_of_more_mapped_segments_than_the_soft_fd_limit_reads_on(scratch):
    """Each mapped segment keeps a descriptor while its frames live (CPython's mmap holds a dup):
    a reader raises the soft RLIMIT_NOFILE to the hard one, as the writer does, before it maps
    (with a soft limit of 64, holding 100 segments' envelopes failed with EMFILE)."""
    lg = FileLog.open(scratch / "log", fsync="never", segment_bytes=300_000)
    lg.append_batch([("s", i, CommandRan(command="y" * 2900 + f"{i:03d}"[-3:])) for i in range(100 * 98)])
    lg.close()
    assert len(list_segments(scratch / "log")) >= 100
    res = subprocess.run([sys.executable, "-c", HOLD_EVERY_SEGMENT, str(scratch / "log")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    compiled, n, last, raised = res.stdout.split()
    assert (compiled, n, last, raised) == ("True", str(100 * 98), f"{100 * 98 - 1:03d}"[-3:], "True")
