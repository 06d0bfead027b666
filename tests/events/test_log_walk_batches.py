"""Compressed batches decompressed by the mapped scanner's second thread
(``MappedScan`` with a ``batch_raw_cap``, libzstd loaded with dlopen by
_framecodec.c): a batch's frames must reach the reader checked, with the
batch's place and the same bytes as the pread path's ``read_batch`` gives,
and anything short of a plainly valid batch must go to that path, which then
stops with its own reason. So the two paths must agree on every segment,
valid, damaged, or holding batches whose inner frames are wrong in ways only
the inner checks see (an inner CRC, a session id that is not UTF-8)."""

from __future__ import annotations

import gc
import mmap
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, LogCorruption, read_log
from agentlog.events.log import framecodec, segmap
from agentlog.events.log.batch_compression import pack_batch
from agentlog.events.log.format import SEG_HDR_SIZE, batch_raw_cap, encode_frame, pack_segment_header, segment_name
from agentlog.events.log.scan import Frame, SegmentScanner
from agentlog.events.schema.types import CommandRan

from test_framecodec import _mutate, _mutation
from test_log_threaded_scan import threaded  # noqa: F401 - the fixture ``walking`` builds on

if framecodec.available():
    from agentlog.events.log import _framecodec as fc

pytestmark = pytest.mark.skipif(
    not framecodec.available() or not fc.HW_AVAILABLE, reason="the threaded scan needs the compiled codec and a CRC32C instruction"
)

CAP = 1 << 20


@pytest.fixture(params=["second thread", "caller's thread"])
def walking(request, monkeypatch):
    """The compiled walk on every segment, with libzstd: in ``MappedScan``'s thread (test_log_threaded_scan's
    ``threaded``), or in the reader's (``scan_mapped``: one CPU). Required where CI runs (its machines carry
    libzstd.so.1)."""
    request.getfixturevalue("threaded")
    if request.param == "caller's thread":
        monkeypatch.setattr(segmap, "CPUS", 1)
    if fc.zstd_version() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no libzstd for the compiled codec to load: the walk's batch path is untested")
        pytest.skip("no libzstd.so.1 on this machine")


@pytest.fixture
def scratch():
    d = Path(tempfile.mkdtemp(prefix="agentlog-walk-batches-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _frame(lsn: int, sid: bytes, payload: bytes) -> bytes:
    return encode_frame(lsn, lsn, 7, 0, sid, payload)


def _batch(first: int, frames: list[bytes]) -> bytes:
    raw = b"".join(frames)
    return pack_batch(first, len(frames), raw, zstandard.ZstdCompressor(level=-1).compress(raw))


def _compressed_segment(path: Path, units: list[list[tuple[bytes, bytes]]], single_batches: bool = False) -> int:
    """A zstd segment of ``units``: each a batch of (session id, payload) records, or, when it holds
    one record, a plain frame (a batch of one with ``single_batches``). Returns the records' count."""
    data, lsn = bytearray(pack_segment_header(1, 0, "zstd")), 0
    for unit in units:
        frames = [_frame(lsn + i, sid, payload) for i, (sid, payload) in enumerate(unit)]
        data += _batch(lsn, frames) if len(frames) > 1 or single_batches else frames[0]
        lsn += len(frames)
    path.write_bytes(bytes(data))
    return lsn


def _scan(path: Path, walk_batches: bool, limit: int | None = None, monkeypatch=None):
    """(frames as plain tuples, offset, expected, bad) of a full scan, and how many preads it made."""
    freads = [0]
    original = SegmentScanner._fill

    def counted(self, need_end, size):
        freads[0] += 1
        return original(self, need_end, size)

    monkeypatch.setattr(segmap, "WALK_BATCHES", walk_batches)
    monkeypatch.setattr(SegmentScanner, "_fill", counted)
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, path.name, SEG_HDR_SIZE, 0, CAP)
        frames = [(*fr[:7], bytes(fr.payload)) for fr in sc.frames(limit=limit)]
        bad = (sc.bad.offset, sc.bad.reason) if sc.bad is not None else None
        return (frames, sc.offset, sc.expected, bad), freads[0]
    finally:
        monkeypatch.setattr(SegmentScanner, "_fill", original)
        os.close(fd)


def _log(d: Path, rounds: int, per_round: int, size: int) -> list:
    lg = FileLog.open(d, compression="zstd", clock=lambda: 5)
    envs = []
    for r in range(rounds):
        envs += lg.append_batch([(f"s{k}", r, CommandRan(command=f"run {r}", exit_code=0, output_tail=("log line %d\n" % k) * size))
                                 for k in range(per_round)])
    lg.close()
    return envs


def test_the_walk_decompresses_a_logs_batches_and_the_pread_path_reads_none(scratch, walking, monkeypatch):
    d = scratch / "log"
    envs = _log(d, rounds=30, per_round=12, size=40)
    seg = d / segment_name(0)
    walked, preads = _scan(seg, True, monkeypatch=monkeypatch)
    pread, pread_reads = _scan(seg, False, monkeypatch=monkeypatch)
    assert walked == pread and len(walked[0]) == len(envs) and walked[3] is None
    assert preads == 0 and pread_reads > 0  # every batch came through the walk
    assert list(read_log(d)) == envs


def test_a_batch_frames_carry_its_place_and_outlive_the_scan(scratch, walking, monkeypatch):
    seg = scratch / segment_name(0)
    n = _compressed_segment(seg, [[(b"a", bytes([i]) * 300) for i in range(5)], [(b"b", b"x" * 50)], [(b"c", b"y" * 400)] * 3])
    fd = os.open(seg, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, seg.name, SEG_HDR_SIZE, 0, CAP)
        frames = list(sc.frames())
    finally:
        os.close(fd)
    assert [fr.lsn for fr in frames] == list(range(n))
    places = [(fr.offset, fr.end) for fr in frames]
    assert len(set(places[:5])) == 1 and len(set(places[6:])) == 1 and places[5][0] == places[0][1] == SEG_HDR_SIZE + len(
        _batch(0, [_frame(i, b"a", bytes([i]) * 300) for i in range(5)]))
    del sc
    gc.collect()
    # The payloads view the batches' decompressed bytes, which live as long as they do.
    assert [bytes(fr.payload) for fr in frames] == [bytes([i]) * 300 for i in range(5)] + [b"x" * 50] + [b"y" * 400] * 3
    with pytest.raises(TypeError):
        frames[0].payload[0] = 1  # read-only


def test_a_take_never_ends_inside_a_batch(scratch, walking):
    seg = scratch / segment_name(0)
    n = _compressed_segment(seg, [[(b"s", b"p" * 100)] * k for k in (7, 1, 12, 3, 30)])
    with open(seg, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mm)
    walk = fc.MappedScan(mm, view, Frame, SEG_HDR_SIZE, 0, len(mm), 0, None, CAP, batch_raw_cap(CAP))
    takes = []
    while True:
        frames, rel, expected, code, _reason = walk.take(2)
        if frames:
            assert (rel, expected) == (frames[-1].end, frames[-1].lsn + 1)
            takes.append(frames)
        if code != fc.MORE:
            break
    ends = {sum((7, 1, 12, 3, 30)[:k]) for k in range(1, 6)}
    taken = [sum(len(t) for t in takes[: k + 1]) for k in range(len(takes))]
    assert set(taken) <= ends and taken[-1] == n and code == fc.EOF and expected == n
    assert taken[:2] == [7, 20]  # two frames asked: a batch of 7, then the plain frame and the whole batch of 12 after it
    walk.close()
    del takes, frames, view
    mm.close()


def test_a_reader_that_stops_inside_the_batches_stops_the_thread_and_frees_them(scratch, walking):
    d = scratch / "log"
    _log(d, rounds=200, per_round=20, size=20)
    before = len(os.listdir("/proc/self/task"))
    for stop_at in (1, 25, 1000):
        for i, _env in enumerate(read_log(d)):
            if i == stop_at:
                break
        gc.collect()
        assert len(os.listdir("/proc/self/task")) <= before  # (never more: a thread of ours left running)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    units=st.lists(st.lists(st.tuples(st.sampled_from([b"s0", b"ses-\xc3\xa9", b"x" * 40]), st.binary(max_size=600)), min_size=1, max_size=9),
                   min_size=1, max_size=8),
    muts=st.lists(_mutation, max_size=2),
    seed=st.integers(0, 1 << 30),
    limit=st.one_of(st.none(), st.integers(0, 40)),
)
def test_the_walk_and_the_pread_path_agree_on_random_and_damaged_compressed_segments(scratch, walking, monkeypatch, units, muts,
                                                                                     seed, limit):
    seg = scratch / segment_name(0)
    _compressed_segment(seg, units)
    seg.write_bytes(_mutate(seg.read_bytes(), muts, seed))
    assert _scan(seg, True, limit, monkeypatch)[0] == _scan(seg, False, limit, monkeypatch)[0]


_SIDS = [b"ok", b"\xff\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xf0\x9f\x98\x80", b"\xe2\x82\xac",
         b"\xef\xbf\xbf", b"\xf4\x8f\xbf\xbf", b"\xe0\x9f\xbf", b"\xc2"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sids=st.lists(st.lists(st.sampled_from(_SIDS), min_size=2, max_size=6), min_size=1, max_size=5),
       inner_flip=st.one_of(st.none(), st.integers(0, 10_000)))
def test_inner_frames_only_the_inner_checks_catch_stop_both_paths_alike(scratch, walking, monkeypatch, sids, inner_flip):
    # Session ids that are not UTF-8 (overlong, surrogate, past U+10FFFF, cut short) and flipped inner
    # bytes under a valid outer CRC: the walk leaves the batch to the pread path, which names the fault.
    seg = scratch / segment_name(0)
    data, lsn = bytearray(pack_segment_header(1, 0, "zstd")), 0
    for batch in sids:
        raw = bytearray(b"".join(_frame(lsn + i, sid, b"payload %d" % i) for i, sid in enumerate(batch)))
        if inner_flip is not None and lsn == 0:
            raw[inner_flip % len(raw)] ^= 0x04
        data += pack_batch(lsn, len(batch), bytes(raw), zstandard.ZstdCompressor(level=-1).compress(bytes(raw)))
        lsn += len(batch)
    seg.write_bytes(bytes(data))
    walked, pread = _scan(seg, True, None, monkeypatch)[0], _scan(seg, False, None, monkeypatch)[0]
    assert walked == pread
    valid = all(_utf8(s) for batch in sids for s in batch) and inner_flip is None
    assert (walked[3] is None) == valid


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_a_damaged_batch_in_a_large_log_raises_the_same_error_walked_or_not(scratch, walking, monkeypatch):
    from test_log_compression import _rebatch

    d = scratch / "log"
    _log(d, rounds=40, per_round=10, size=30)

    def damage(raw: bytearray):
        raw[len(raw) // 3] ^= 0x10
        return raw, raw

    _rebatch(d, 17, damage)
    errors = []
    for walk_batches in (True, False):
        monkeypatch.setattr(segmap, "WALK_BATCHES", walk_batches)
        with pytest.raises(LogCorruption) as err:
            list(read_log(d))
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "of its frames: CRC mismatch" in errors[0]


def test_random_token_batches_that_do_not_compress_are_plain_frames_the_walk_reads_as_ever(scratch, walking, monkeypatch):
    r = random.Random(3)
    seg = scratch / segment_name(0)
    _compressed_segment(seg, [[(b"s", r.randbytes(900))] for _ in range(20)] + [[(b"t", b"z" * 900)] * 4])
    walked, preads = _scan(seg, True, monkeypatch=monkeypatch)
    assert walked == _scan(seg, False, monkeypatch=monkeypatch)[0] and len(walked[0]) == 24 and preads == 0


def test_a_legacy_zstd_frame_that_libzstd_would_decode_is_refused_as_the_pread_path_refuses_it(scratch, walking, monkeypatch):
    # The system libzstd may decode pre-1.0 frames (magic 0xFD2FB527: v0.7) that the zstandard package
    # refuses; the walk takes only zstd 1.0 frames, so both paths stop at the batch alike.
    seg = scratch / segment_name(0)
    raw = b"".join(_frame(i, b"s", b"payload %d" % i) for i in range(3))
    n = len(raw)
    legacy = ((0xFD2FB527).to_bytes(4, "little") + bytes([0xA0]) + n.to_bytes(4, "little")
              + bytes([0x40 | (n >> 16 & 7), (n >> 8) & 0xFF, n & 0xFF]) + raw + b"\xc0\x00\x00")
    seg.write_bytes(pack_segment_header(1, 0, "zstd") + pack_batch(0, 3, raw, legacy) + _frame(3, b"s", b"tail"))
    walked, pread = _scan(seg, True, None, monkeypatch)[0], _scan(seg, False, None, monkeypatch)[0]
    assert walked == pread and walked[0] == [] and "does not decompress" in walked[3][1]


@pytest.mark.parametrize("after", ["text", "skippable frame", "empty frame"])
def test_bytes_after_a_batchs_zstd_frame_stop_both_paths_at_the_batch(scratch, walking, monkeypatch, after):
    # The writer stores one zstd frame a batch. libzstd reads on through an empty or a skippable frame
    # after it, zstandard ignores anything after it unless told not to: both paths must refuse all three.
    seg = scratch / segment_name(0)
    raw = b"".join(_frame(i, b"s", b"payload %d" % i) for i in range(3))
    extra = {"text": b"not a zstd frame",
             "skippable frame": (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip",
             "empty frame": zstandard.ZstdCompressor(level=-1, write_content_size=True).compress(b"")}[after]
    stored = zstandard.ZstdCompressor(level=-1).compress(raw) + extra
    seg.write_bytes(pack_segment_header(1, 0, "zstd") + pack_batch(0, 3, raw, stored) + _frame(3, b"s", b"tail"))
    walked, pread = _scan(seg, True, None, monkeypatch)[0], _scan(seg, False, None, monkeypatch)[0]
    assert walked == pread and walked[0] == [] and "unused data" in walked[3][1]


def test_the_walk_holds_at_most_32_mib_of_batches_ahead_of_a_slow_reader(scratch, walking):
    # Records over 256 KiB are each a batch alone: a ring of 4,096 of them would hold gigabytes.
    seg = scratch / segment_name(0)
    r = random.Random(5)
    unit = [(b"s", r.randbytes(64) * 14_000)]  # 896 kB that compress, under the 1 MiB record cap
    n = _compressed_segment(seg, [unit] * 120, single_batches=True)
    with open(seg, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    view = memoryview(mm)
    walk = fc.MappedScan(mm, view, Frame, SEG_HDR_SIZE, 0, len(mm), 0, None, CAP, batch_raw_cap(CAP))
    got, peak = 0, 0
    while True:
        frames, _rel, _expected, code, _reason = walk.take(1)
        got += len(frames)
        time.sleep(0.002)  # a slow reader: the walk runs ahead as far as it may
        peak = max(peak, walk.held_bytes())
        if code != fc.MORE:
            break
    assert got == n and 16 << 20 <= peak <= (32 << 20) + (1 << 20) and walk.held_bytes() == 0
    walk.close()
    # A reader that stops early: closing frees what the walk held ahead, and says so.
    early = fc.MappedScan(mm, view, Frame, SEG_HDR_SIZE, 0, len(mm), 0, None, CAP, batch_raw_cap(CAP))
    frames = early.take(1)[0]
    time.sleep(0.05)
    assert early.held_bytes() > 0
    early.close()
    assert early.held_bytes() == 0
    del frames, view
    mm.close()


def test_a_reader_stopped_inside_a_batch_is_left_past_it_as_the_pread_path_leaves_it(scratch, walking, monkeypatch):
    seg = scratch / segment_name(0)
    _compressed_segment(seg, [[(b"s", b"a" * 300)] * 5, [(b"s", b"b" * 300)] * 5, [(b"s", b"c" * 300)]])
    states = []
    for walk_batches in (True, False):
        monkeypatch.setattr(segmap, "WALK_BATCHES", walk_batches)
        fd = os.open(seg, os.O_RDONLY)
        try:
            sc = SegmentScanner(fd, seg.name, SEG_HDR_SIZE, 0, CAP)
            for fr in sc.frames():
                if fr.lsn == 6:
                    break
            states.append((sc.offset, sc.expected))
        finally:
            os.close(fd)
    assert states[0] == states[1] and states[0][1] == 10


@pytest.mark.parametrize("walk_batches", [True, False])
def test_a_segment_cut_short_under_a_batch_read_says_the_file_shrank(scratch, walking, monkeypatch, walk_batches):
    # Recovery racing a reader cuts the file while its mapping still covers the old end: a batch read
    # there faults (SIGBUS) in the walk, which reports it as the pread path does, never crashing.
    monkeypatch.setattr(segmap, "WALK_BATCHES", walk_batches)
    seg = scratch / segment_name(0)
    r = random.Random(9)
    units = [[(b"s", r.randbytes(32) * 600)] * 8 for _ in range(40)]
    _compressed_segment(seg, units)
    size = seg.stat().st_size
    fd = os.open(seg, os.O_RDWR)
    try:
        sc = SegmentScanner(fd, seg.name, SEG_HDR_SIZE, 0, CAP)
        got = [fr.lsn for fr in sc.frames(limit=1, size=size)]  # maps the whole file
        os.ftruncate(fd, (size // 2 // mmap.PAGESIZE) * mmap.PAGESIZE)
        got += [fr.lsn for fr in sc.frames(size=size)]
    finally:
        os.close(fd)
    assert got == list(range(len(got))) and 0 < len(got) < 320
    assert sc.bad is not None and sc.bad.reason == "file shrank while reading" and sc.offset == sc.bad.offset


_CUT_CHILD = """
import os, sys
from agentlog.events.log import framecodec, segmap
from agentlog.events.log import _framecodec as fc
from agentlog.events.log.format import SEG_HDR_SIZE
from agentlog.events.log.scan import SegmentScanner
framecodec.use_native(True)
fc.set_crc_backend("hardware")
segmap.MIN_MAPPED_BYTES, segmap.MIN_THREADED_BYTES, segmap.CPUS = 0, 0, int(sys.argv[3])
path, cut = sys.argv[1], int(sys.argv[2])
size = os.path.getsize(path)
fd = os.open(path, os.O_RDWR)
sc = SegmentScanner(fd, os.path.basename(path), SEG_HDR_SIZE, 0, 1 << 20)
got = [f.lsn for f in sc.frames(limit=1, size=size)]  # maps the whole file
os.ftruncate(fd, cut)
got += [f.lsn for f in sc.frames(size=size)]
print(len(got), sc.offset, sc.bad.offset, sc.bad.reason)
"""


@pytest.mark.parametrize("cpus", [1, 2])
def test_a_cut_between_a_batchs_type_byte_and_the_rest_of_its_header_is_a_shrunk_file_not_a_crash(scratch, cpus):
    # The batch header's count and size lie past the bytes that name its type: a file cut (at a page boundary,
    # as the kernel truncates a mapping) between the two must read as "file shrank while reading", never SIGBUS.
    if fc.zstd_version() is None:
        pytest.skip("no libzstd.so.1 on this machine")
    import subprocess
    import sys

    page = mmap.PAGESIZE
    seg = scratch / segment_name(0)
    data, lsn = bytearray(pack_segment_header(1, 0, "zstd")), 0
    while len(data) < 2 * page - 12:  # plain frames up to 12 bytes before the second page's end
        room = 2 * page - 12 - len(data)
        fr = _frame(lsn, b"s", b"x" * 100)
        if room < 2 * len(fr):
            fr = _frame(lsn, b"s", b"x" * (100 + room - len(fr)))
        data += fr
        lsn += 1
    assert len(data) == 2 * page - 12
    data += _batch(lsn, [_frame(lsn + i, b"s", bytes([i]) * 300) for i in range(8)])
    seg.write_bytes(bytes(data))
    child = subprocess.run([sys.executable, "-c", _CUT_CHILD, str(seg), str(2 * page), str(cpus)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    frames, offset, bad_offset, reason = child.stdout.split(maxsplit=3)
    assert (int(frames), int(offset), int(bad_offset), reason.strip()) == (lsn, 2 * page - 12, 2 * page - 12, "file shrank while reading")
