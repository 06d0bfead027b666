"""Recovery: torn tails are truncated at every byte, corruption is never silent,
and reopening continues exactly where the log left off."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tracemalloc

import pytest
from structlog.testing import capture_logs

from agentlog.events import FileLog, LogCorruption, LogLocked, NotALog, read_log, verify_log
from agentlog.events.log.format import DURABLE_NAME, INDEX_NAME, SEG_HDR_SIZE, list_segments, segment_name
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from event_samples import small_event
from log_helpers import copy_log, drop_watermark, flip_bit, frame_offsets, records, rng, seg_path, write_small_log

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")

TAIL_FRAMES = 3


@pytest.fixture
def torn_source(fast_tmp):
    """A log whose last TAIL_FRAMES frames were written but whose watermark
    stayed before them, as after a crash between write and fdatasync."""
    d = fast_tmp / "src"
    envs = write_small_log(d, 12)
    durable = (d / DURABLE_NAME).read_bytes()
    lg = FileLog.open(d)
    for i in range(TAIL_FRAMES):
        envs += lg.append_batch([(f"t{i}", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    (d / DURABLE_NAME).write_bytes(durable)
    return d, envs


@pytest.mark.parametrize("variant", ["clean", "zeros", "garbage"])
def test_recovery_truncates_torn_tail_at_every_byte(torn_source, fast_tmp, variant):
    src, envs = torn_source
    offs = frame_offsets(src)
    full = seg_path(src).read_bytes()
    first_cut = 0  # the tail frames are alone in the new writer's segment, header included
    r = rng(len(full) + len(variant))
    n_before = len(envs) - TAIL_FRAMES
    for cut in range(first_cut, len(full)):
        pad = len(full) - cut
        tail = {"clean": b"", "zeros": bytes(pad), "garbage": bytes(r.getrandbits(8) for _ in range(pad))}[variant]
        d = copy_log(src, fast_tmp / f"{variant}{cut}", cut=cut, tail=tail)
        complete = sum(1 for _s, e in offs if e <= cut)
        lg = FileLog.open(d)
        assert lg.next_lsn == n_before + complete, f"cut at {cut} ({variant}, {r!r})"
        got = list(lg.read())
        assert got == envs[: n_before + complete]
        new = lg.append_batch([("after", 0, SessionOpened(group_id="g", group_size=1))])
        assert new[0].lsn == n_before + complete
        lg.close()
        assert records(d) == got + new
        shutil.rmtree(d)


def _bitflip_log(tmp_path):
    d = tmp_path / "flip"
    envs = write_small_log(d, 3)
    return d, envs, frame_offsets(d), seg_path(d)


def test_every_single_bit_flip_in_a_middle_frame_is_reported_as_corruption(fast_tmp):
    d, envs, offs, seg = _bitflip_log(fast_tmp)
    start, end = offs[1]
    clean = seg.read_bytes()
    for keep_watermark in (True, False):
        for bit in range(start * 8, end * 8):
            seg.write_bytes(clean)
            flip_bit(seg, bit)
            if not keep_watermark and (d / DURABLE_NAME).exists():
                drop_watermark(d)
            rep = verify_log(d)
            assert rep.status == "corrupt" and rep.offset == start and rep.last_good_lsn == 0, (bit, rep.summary())
            with pytest.raises(LogCorruption) as info:
                list(read_log(d))
            assert info.value.offset == start and info.value.segment == seg.name
        (d / DURABLE_NAME).unlink(missing_ok=True)
        seg.write_bytes(clean)
        write_small_log(d, 0)  # a writer open republishes the watermark


def test_every_single_bit_flip_in_the_last_frame_is_detected(fast_tmp):
    """With the watermark the damaged record was acknowledged: corruption. Without
    it the frame is indistinguishable from a torn write: it is never yielded."""
    d, envs, offs, seg = _bitflip_log(fast_tmp)
    start, end = offs[-1]
    clean = seg.read_bytes()
    durable = (d / DURABLE_NAME).read_bytes()
    for bit in range(start * 8, end * 8):
        seg.write_bytes(clean)
        flip_bit(seg, bit)
        (d / DURABLE_NAME).write_bytes(durable)
        assert verify_log(d).status == "corrupt"
        with pytest.raises(LogCorruption):
            list(read_log(d))
        drop_watermark(d)
        rep = verify_log(d)
        assert rep.status == "torn" and rep.offset == start, rep.summary()
        assert list(read_log(d)) == envs[:-1]


def test_acknowledged_records_cut_at_a_frame_boundary_are_reported_missing(tmp_path):
    """A clean cut between frames looks like a sound log; the watermark knows better."""
    d, envs, offs, seg = _bitflip_log(tmp_path)
    seg.write_bytes(seg.read_bytes()[: offs[1][0]])
    with pytest.raises(LogCorruption, match=r"lsn 1\.\.2 were acknowledged; they are missing"):
        FileLog.open(d)
    rep = verify_log(d)
    assert rep.status == "corrupt" and rep.last_good_lsn == 0
    with pytest.raises(LogCorruption):
        list(read_log(d))
    lg = FileLog.open(d, salvage=True)
    assert list(lg.read()) == envs[:1]
    lg.close()


def test_bit_flip_in_segment_header_is_corruption(tmp_path):
    d, envs, offs, seg = _bitflip_log(tmp_path)
    clean = seg.read_bytes()
    for bit in range(0, SEG_HDR_SIZE * 8, 7):
        seg.write_bytes(clean)
        flip_bit(seg, bit)
        assert verify_log(d).status == "corrupt"
        with pytest.raises(LogCorruption, match=seg.name):
            FileLog.open(d)


def test_mid_log_corruption_names_segment_offset_and_last_good_lsn(tmp_path):
    d = tmp_path / "log"
    write_small_log(d, 40, segment_bytes=1024)
    segs = list_segments(d)
    assert len(segs) >= 3
    mid = d / segment_name(segs[1])
    data = bytearray(mid.read_bytes())
    data[SEG_HDR_SIZE + 20] ^= 0xFF
    mid.write_bytes(bytes(data))
    (d / INDEX_NAME).unlink()  # force the full scan a stale checkpoint would trigger
    with pytest.raises(LogCorruption) as info:
        FileLog.open(d)
    err = info.value
    assert err.segment == mid.name and err.offset == SEG_HDR_SIZE and err.last_good_lsn == segs[1] - 1
    assert f"segment {mid.name}, offset {SEG_HDR_SIZE}, last good lsn {segs[1] - 1}" in str(err)
    rep = verify_log(d)
    assert rep.status == "corrupt" and rep.segment == mid.name
    assert verify_log(d, repair=True).status == "corrupt"  # repair never touches mid-log damage
    assert mid.read_bytes() == bytes(data)


def test_salvage_keeps_the_valid_prefix_and_moves_the_rest_aside(tmp_path):
    d = tmp_path / "log"
    envs = write_small_log(d, 40, segment_bytes=1024)
    segs = list_segments(d)
    mid = d / segment_name(segs[1])
    original_tail = mid.read_bytes()[SEG_HDR_SIZE:]
    flip_bit(mid, (SEG_HDR_SIZE + 20) * 8)
    (d / INDEX_NAME).unlink()
    lg = FileLog.open(d, salvage=True, segment_bytes=1024)
    assert lg.next_lsn == segs[1]
    assert list(lg.read()) == envs[: segs[1]]
    lg.append_batch([("new", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    moved = [p for p in d.iterdir() if p.name.startswith("salvage-")]
    assert len(moved) == 1
    kept = sorted(p.name for p in moved[0].iterdir())
    assert any(name.startswith(mid.name) for name in kept)
    assert all(segment_name(s) in kept for s in segs[2:])
    tail_file = next(p for p in moved[0].iterdir() if p.name.startswith(mid.name))
    assert len(tail_file.read_bytes()) == len(original_tail)  # nothing stored is lost
    assert verify_log(d).status == "ok"


def test_reopen_continues_session_numbering_from_the_checkpoint(tmp_path):
    d = tmp_path / "log"
    lg = FileLog.open(d, segment_bytes=2048)
    for i in range(60):
        lg.append_batch([(f"s{i}", 0, SessionOpened(group_id="g", group_size=1)), (f"s{i}", 1, small_event(i))])
    for i in range(0, 60, 2):
        lg.append_batch([(f"s{i}", 2, SessionFinished(reward=1.0))])
    expect = lg.open_sessions()
    lg.close()
    with capture_logs() as logs:
        lg = FileLog.open(d, segment_bytes=2048)
    opened = [e for e in logs if e["event"] == "log.opened"][0]
    assert opened["index"] == "checkpoint"
    assert lg.open_sessions() == expect and len(expect) == 30
    assert lg.next_seq("s1") == 2 and lg.next_seq("s0") == 0
    lg.append_batch([("s1", 2, small_event(0))])
    lg.close()


@pytest.mark.parametrize("damage", ["missing", "garbage", "stale"])
def test_bad_checkpoint_is_rebuilt_from_the_log(tmp_path, damage):
    d = tmp_path / "log"
    lg = FileLog.open(d, segment_bytes=1024)
    for i in range(30):
        lg.append_batch([(f"s{i}", 0, SessionOpened(group_id="g", group_size=1))])
    expect, nxt = lg.open_sessions(), lg.next_lsn
    lg.close()
    idx = d / INDEX_NAME
    if damage == "missing":
        idx.unlink()
    elif damage == "garbage":
        idx.write_bytes(idx.read_bytes()[:20] + b"\x00garbage" * 10)
    else:
        # A checkpoint from a different log state: another log's index, which
        # describes fewer records than this log holds (one that describes more
        # names records this log lacks: refused, see test_log_lost_data.py).
        other = tmp_path / "other"
        write_small_log(other, 20, segment_bytes=512)
        shutil.copy(other / INDEX_NAME, idx)
    with capture_logs() as logs:
        lg = FileLog.open(d, segment_bytes=1024)
    assert [e for e in logs if e["event"] == "log.opened"][0]["index"] == "rebuilt"
    assert lg.open_sessions() == expect and lg.next_lsn == nxt
    lg.close()
    with capture_logs() as logs:
        FileLog.open(d).close()
    assert [e for e in logs if e["event"] == "log.opened"][0]["index"] == "checkpoint"


def test_open_does_not_rescan_sealed_segments(tmp_path):
    """Damage inside an old sealed segment, away from any index entry, goes
    unnoticed by open (it reads only the checkpoint and the tail) but not by verify."""
    d = tmp_path / "log"
    write_small_log(d, 60, segment_bytes=1024)
    first = seg_path(d, 0)
    third_frame = frame_offsets(d, 0)[2][0]  # not where any index entry points
    flip_bit(first, (third_frame + 20) * 8)
    lg = FileLog.open(d)
    assert lg.next_lsn == 60
    lg.close()
    assert verify_log(d).status == "corrupt"


def test_read_seeks_with_the_sparse_index(tmp_path):
    """Reading from a late LSN never touches earlier frames (damage there is not hit)."""
    d = tmp_path / "log"
    lg = FileLog.open(d)
    big = "x" * 4000
    for i in range(60):  # ~240 KB in one segment: several sparse-index entries
        lg.append_batch([(f"s{i}", 0, SessionOpened(group_id="g", group_size=1, metadata={"pad": big}))])
    tail = list(lg.read(55))
    seg = seg_path(d)
    flip_bit(seg, (SEG_HDR_SIZE + 10) * 8)  # damage the very first frame
    assert list(lg.read(55)) == tail and [e.lsn for e in tail] == list(range(55, 60))
    with pytest.raises(LogCorruption):
        list(lg.read(0))
    lg.close()


def test_appends_one_at_a_time_index_as_batches_do(tmp_path):
    """The async append's fast path (one record, no batch) makes the sparse index entries the batch
    path makes for the same records, and a read from a late LSN seeks with them."""
    import asyncio

    prompt = bytes(4000)  # 1,000 tokens: ~4 KB a record, records of one open session (the fast path's case)
    bodies = [("s", 0, SessionOpened(group_id="g", group_size=1)), ("s", 1, SessionStarted(harness="h"))]
    bodies += [("s", 2 + t, TurnRecorded(turn_index=t, prompt_ids=prompt)) for t in range(58)]
    batched = FileLog.open(tmp_path / "batched")
    for record in bodies:
        batched.append_batch([record])
    single = FileLog.open(tmp_path / "single", clock=lambda: 0)

    async def one_by_one():
        for sid, seq, body in bodies:
            await single.append(sid, seq, body)

    asyncio.run(one_by_one())
    assert len(single._index[0]) > 2 and single._index == batched._index
    tail = list(single.read(55))
    flip_bit(seg_path(tmp_path / "single"), (SEG_HDR_SIZE + 10) * 8)  # damage the very first frame
    assert list(single.read(55)) == tail and [e.lsn for e in tail] == list(range(55, 60))
    batched.close()
    single.close()


def test_torn_segment_header_of_a_new_segment_is_removed(tmp_path):
    d = tmp_path / "log"
    envs = write_small_log(d, 8)
    nxt = d / segment_name(8)
    nxt.write_bytes(b"AGLOG")  # a crash right after creating the next segment
    lg = FileLog.open(d)
    assert lg.next_lsn == 8 and not nxt.exists()
    lg.append_batch([("x", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    assert records(d)[:8] == envs


def test_oversized_records_are_refused_and_corrupt_lengths_allocate_nothing(tmp_path):
    d = tmp_path / "log"
    lg = FileLog.open(d, max_record_bytes=4096)
    with pytest.raises(Exception, match=r"exceeds max_record_bytes 4096"):
        lg.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1, metadata={"x": "y" * 5000}))])
    assert lg.next_lsn == 0
    lg.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    seg = seg_path(d)
    data = bytearray(seg.read_bytes())
    data[SEG_HDR_SIZE + 4 : SEG_HDR_SIZE + 8] = (0xFFFFFFF0).to_bytes(4, "little")  # a 4 GiB length
    seg.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        with pytest.raises(LogCorruption, match="length"):
            list(read_log(d))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_a_rescan_holds_a_few_records_at_a_time_whatever_the_log_holds(tmp_path):
    """Recovery rescans every frame, but holds only a few records' bytes at once
    under either codec: the pure-Python one copies each frame's bytes, and a list
    of them (a read buffer's worth, up to thousands) held 12 MiB here."""
    d = tmp_path / "log"
    lg = FileLog.open(d)
    prompt = bytes(32 << 10)  # 8,192 tokens: 32 KiB a record
    for i in range(400):
        lg.append_batch([(f"s{i}", 0, SessionOpened(group_id="g", group_size=1, prompt_ids=prompt))])
    lg.close()
    (d / INDEX_NAME).unlink()  # no checkpoint: the whole log is rescanned
    tracemalloc.start()
    try:
        lg = FileLog.open(d)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert lg.next_lsn == 400
    lg.close()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held while rescanning 12.5 MiB of records"


def test_second_writer_is_refused_naming_the_directory(tmp_path):
    d = tmp_path / "log"
    lg = FileLog.open(d)
    with pytest.raises(LogLocked, match=str(d)):
        FileLog.open(d)
    lg.close()
    FileLog.open(d).close()


def test_deleting_the_lock_file_does_not_let_a_second_writer_in(tmp_path):
    """The lock cannot be swapped out from under a live writer: with LOCK
    deleted (or deleted and re-created) a second writer is still refused,
    naming the holder, and the first writer's records stay sound."""
    d = tmp_path / "log"
    lg = FileLog.open(d)
    lg.append_batch([("a", 0, SessionOpened(group_id="g", group_size=1))])
    (d / "LOCK").unlink()
    with pytest.raises(LogLocked, match=rf"{re.escape(str(d))}.*pid {os.getpid()}"):
        FileLog.open(d)
    (d / "LOCK").write_text("")  # re-created, empty: a lock on it would prove nothing
    with pytest.raises(LogLocked, match=rf"pid {os.getpid()}"):
        FileLog.open(d)
    lg.append_batch([("b", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    assert verify_log(d).status == "ok" and len(list(read_log(d))) == 2
    FileLog.open(d).close()


def test_a_directory_that_is_not_a_log_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotALog, match="not an agentlog log directory"):
        FileLog.open(tmp_path)
    with pytest.raises(NotALog):
        FileLog.open(tmp_path / "notes.txt")


def test_each_writer_open_gets_a_new_epoch_and_segment(tmp_path):
    from agentlog.events.log.format import parse_segment_header

    d = tmp_path / "log"
    epochs = []
    for k in range(3):
        lg = FileLog.open(d)
        epochs.append(lg.epoch)
        lg.append_batch([(f"s{k}", 0, SessionOpened(group_id="g", group_size=1))])
        lg.close()
    assert epochs == [1, 2, 3]
    segs = list_segments(d)
    assert segs == [0, 1, 2]
    hdrs = [parse_segment_header((d / segment_name(s)).read_bytes()[:SEG_HDR_SIZE], segment_name(s), s) for s in segs]
    assert [h.epoch for h in hdrs] == [1, 2, 3]


def test_raw_reads_give_undecoded_payload_views(tmp_path):
    d = tmp_path / "log"
    envs = write_small_log(d, 5)
    raws = list(read_log(d, raw=True))
    assert all(isinstance(r.payload, memoryview) for r in raws)
    assert [r.decode() for r in raws] == envs


SALVAGE_UNDER_A_READER = r"""
import subprocess, sys
from pathlib import Path
from agentlog.events import FileLog, read_log
from agentlog.events.log.format import INDEX_NAME, list_segments, segment_name
from agentlog.events.schema.types import CommandRan

d = Path(sys.argv[1])
lg = FileLog.open(d, fsync="batch")
lg.append_batch([("s", i, CommandRan(command="y" * 3000 + str(i), exit_code=0)) for i in range(2000)])
lg.close()
seg = d / segment_name(list_segments(d)[-1])
data = bytearray(seg.read_bytes())
data[200_000] ^= 0x10  # damage near lsn 65; valid records follow it
seg.write_bytes(bytes(data))
envs = list(read_log(d, from_lsn=1000))  # sought past the damage with the INDEX: mapped frames, bodies not built
(d / INDEX_NAME).unlink()  # the next writer scans in full, finds the damage and salvages
subprocess.run([sys.executable, "-c", f"from agentlog.events import FileLog; FileLog.open({str(d)!r}, salvage=True).close()"], check=True)
assert seg.stat().st_size < 200_000, seg.stat().st_size
print(len(envs), envs[0].lsn, envs[-1].body.command[-4:], sum(e.body.command.endswith(str(e.session_seq)) for e in envs))
"""


def test_a_salvage_never_cuts_a_segment_under_a_reader_that_holds_its_frames(tmp_path):
    """A reader in another process that sought past mid-log damage holds frames mapped from the
    segment; the next writer's salvage keeps the valid prefix as a new file instead of cutting
    this one, so the reader's bodies still build (cut in place, touching one killed it with SIGBUS)."""
    res = subprocess.run([sys.executable, "-c", SALVAGE_UNDER_A_READER, str(tmp_path / "log")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert res.stdout.split() == ["1000", "1000", "1999", "1000"]
