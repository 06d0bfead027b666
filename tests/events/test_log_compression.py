"""Compressed record batches of the file log (events/log/batch_compression.py):
what a compressed log stores, that every reader gives back what an
uncompressed log gives, that old logs stay readable and old readers refuse
a compressed one, and that recovery and verify treat a batch as one frame."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, read_log
from agentlog.events.log import format as log_format
from agentlog.events.log.api import LogCorruption, SequenceError
from agentlog.events.log.format import (
    BATCH_HDR,
    FRAME_PREFIX,
    SEG_HDR_SIZE,
    TYPE_BATCH,
    list_segments,
    load_checkpoint,
    parse_segment_header,
    segment_name,
)
from agentlog.events.log.read import follow_logs, read_frame_batches
from agentlog.events.log.verify import verify_log
from agentlog.events.schema.types import CommandRan, SessionOpened, SessionStarted
from log_helpers import copy_log, seg_path

pytestmark = pytest.mark.usefixtures("codec")


_VOCABULARY = ["".join(random.Random(i).choices(string.ascii_letters, k=1 + i % 8)) for i in range(512)]


def _records(sid: str, start: int, n: int, size: int = 200) -> list:
    """Records of session ``sid`` from seq ``start``; a negative ``size``: that many characters of
    random words (of 1-8 random letters, from a vocabulary of 512: compressed to about half), else a
    text that compresses well."""
    out = []
    for seq in range(start, start + n):
        text = " ".join(random.Random(seq).choices(_VOCABULARY, k=-size))[:-size] if size < 0 else ("F." * size)[:size]
        body = SessionOpened(group_id="g", group_size=1) if seq == 0 else SessionStarted() if seq == 1 else \
            CommandRan(command=f"pytest -k case{seq}", exit_code=seq % 3, output_tail=text)
        out.append((sid, seq, body))
    return out


def _write(d: Path, batches: list[int], compression: str | None, sizes: list[int] | None = None, **kw) -> list:
    lg = FileLog.open(d, compression=compression, clock=lambda: 7, **kw)
    envs, seq = [], 0
    for i, n in enumerate(batches):
        envs += lg.append_batch(_records("s", seq, n, sizes[i] if sizes else 200))
        seq += n
    lg.close()
    return envs


def _units(d: Path, k: int = -1) -> list[tuple[int, int, int]]:
    """(offset, type byte, first lsn) of each frame or batch stored in the k-th segment."""
    data = seg_path(d, k).read_bytes()
    off, out = SEG_HDR_SIZE, []
    while off < len(data):
        length, typ = data[off + 4 : off + 8], data[off + 8]
        out.append((off, typ, int.from_bytes(data[off + 9 : off + 17], "little")))
        off += FRAME_PREFIX + int.from_bytes(length, "little")
    return out


def test_an_append_call_is_stored_as_one_compressed_batch_and_reads_back(tmp_path):
    envs = _write(tmp_path / "z", [40, 1, 30], "zstd", sizes=[200, 0, 200])
    units = _units(tmp_path / "z")
    # One batch per call; the lone small record is not worth compressing: a plain frame.
    assert [(typ, lsn) for _, typ, lsn in units] == [(TYPE_BATCH, 0), (1, 40), (TYPE_BATCH, 41)]
    assert list(read_log(tmp_path / "z")) == envs
    plain = _write(tmp_path / "p", [40, 1, 30], None, sizes=[200, 0, 200])
    assert plain == envs
    assert seg_path(tmp_path / "z").stat().st_size < seg_path(tmp_path / "p").stat().st_size / 4


def test_the_choice_is_recorded_per_segment_and_kept_by_a_reopen(tmp_path):
    d = tmp_path / "log"
    _write(d, [10], "zstd")
    lg = FileLog.open(d)  # None: keep the log's choice
    lg.append_batch(_records("t", 0, 10))
    lg.close()
    lg = FileLog.open(d, compression="none")  # changed: recorded in the segments this writer starts
    lg.append_batch(_records("u", 0, 10))
    lg.close()
    heads = [parse_segment_header(seg_path(d, k).read_bytes()[:SEG_HDR_SIZE], segment_name(s), s) for k, s in enumerate(list_segments(d))]
    assert [(h.version, h.compression) for h in heads] == [(2, "zstd"), (2, "zstd"), (1, None)]
    assert [typ for _, typ, _ in _units(d, 1)] == [TYPE_BATCH]
    assert len(list(read_log(d))) == 30
    assert verify_log(d).status == "ok"
    with pytest.raises(ValueError, match="compression: expected one of zstd/none"):
        FileLog.open(tmp_path / "other", compression="lz4")


def test_an_old_reader_refuses_a_compressed_log_and_reads_an_uncompressed_one(tmp_path, monkeypatch):
    _write(tmp_path / "z", [10], "zstd")
    _write(tmp_path / "p", [10], None)
    # The reader before compression knew format version 1 only: its check is this one at FORMAT_VERSION 1.
    monkeypatch.setattr(log_format, "FORMAT_VERSION", 1)
    assert len(list(read_log(tmp_path / "p"))) == 10
    with pytest.raises(LogCorruption, match=r"format version 2 is newer than this reader \(1\); upgrade agentlog"):
        list(read_log(tmp_path / "z"))


def test_unknown_header_flags_are_refused(tmp_path):
    raw = bytearray(log_format.pack_segment_header(1, 0, "zstd"))
    raw[10] |= 2  # a flag this reader does not know
    body = bytes(raw[:28])
    raw[28:] = log_format.FRAME_CRC.pack(log_format.mask_crc(log_format.crc_value(body)))
    with pytest.raises(LogCorruption, match="header flags 0x0003 hold bits this reader does not know"):
        parse_segment_header(bytes(raw), segment_name(0), 0)


def test_a_torn_compressed_batch_at_the_tail_is_cut_whole(tmp_path):
    src = tmp_path / "src"
    envs = _write(src, [20, 20], "zstd")
    (_, _, _), (second, typ, first) = _units(src)
    assert (typ, first) == (TYPE_BATCH, 20)
    size = seg_path(src).stat().st_size
    for cut in (second + 3, second + FRAME_PREFIX + BATCH_HDR.size + 5, size - 1):
        d = copy_log(src, tmp_path / f"cut{cut}", cut=cut, skip=("INDEX", "DURABLE"))
        rep = verify_log(d)
        assert (rep.status, rep.offset, rep.last_good_lsn) == ("torn", second, 19), rep.summary()
        lg = FileLog.open(d, compression="zstd")
        assert lg.next_lsn == 20
        lg.append_batch(_records("s", 20, 5))
        lg.close()
        assert [e.lsn for e in read_log(d)] == list(range(25))
        assert list(read_log(d))[:20] == envs[:20]


@pytest.mark.parametrize("which", [0, 1])
def test_verify_and_recovery_find_a_flipped_byte_in_a_compressed_batch(tmp_path, which):
    src = tmp_path / "src"
    _write(src, [20, 20, 20], "zstd")
    off = _units(src)[which][0]
    d = copy_log(src, tmp_path / "d", skip=("INDEX", "DURABLE"))  # no watermark: only a later batch proves damage
    data = bytearray(seg_path(d).read_bytes())
    data[off + FRAME_PREFIX + BATCH_HDR.size + 3] ^= 0x40
    seg_path(d).write_bytes(bytes(data))
    rep = verify_log(d)
    assert (rep.status, rep.offset, rep.last_good_lsn) == ("corrupt", off, 20 * which - 1), rep.summary()
    assert "CRC mismatch" in rep.problem and "a valid frame follows" in rep.problem
    with pytest.raises(LogCorruption, match="CRC mismatch"):
        FileLog.open(d)
    with pytest.raises(LogCorruption, match="CRC mismatch"):
        list(read_log(d, durable_only=False))


def test_seek_and_follow_stop_and_resume_inside_a_batch(tmp_path):
    d = tmp_path / "log"
    # Batches big enough for several sparse-index entries (every 64 KiB), and small ones.
    envs = _write(d, [300, 7, 300, 1, 250], "zstd", sizes=[-900, -900, 200, 0, -900], segment_bytes=128 << 10)
    assert len(list_segments(d)) > 1
    assert any(len(entries) > 1 for entries in load_checkpoint(d)[0].index.values())  # seeks use the sparse index
    for k in (0, 1, 150, 299, 300, 306, 307, 500, 606, 607, 857):
        assert list(read_log(d, k)) == envs[k:]
    lg = FileLog.open(d)
    assert list(lg.read(451)) == envs[451:]
    lg.close()
    assert [fr.lsn for b in read_frame_batches(d, 133) for fr in b] == list(range(133, 858))

    async def follow() -> list:
        got = []
        async for _pid, env in follow_logs({0: d}, chunk=13, poll_s=0.01):
            got.append(env)
            if len(got) == len(envs):
                return got
        return got

    assert asyncio.run(asyncio.wait_for(follow(), 30)) == envs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(st.integers(1, 60), min_size=1, max_size=8),
    size=st.sampled_from([0, 40, 3000, 70_000, -50, -3000]),
    segment_kib=st.sampled_from([4, 64, 1024]),
)
def test_a_compressed_log_replays_equal_to_an_uncompressed_one(tmp_path_factory, batches, size, segment_kib):
    base = tmp_path_factory.mktemp("eq")
    logs = {}
    for comp in ("zstd", None):
        d = base / str(comp)
        lg = FileLog.open(d, compression=comp, clock=lambda: 5, segment_bytes=segment_kib << 10)
        seq = 0
        for n in batches:
            lg.append_batch(_records("s", seq, n, size))
            seq += n
        lg.close()
        logs[comp] = d
        assert verify_log(d).status == "ok"
    z, p = logs["zstd"], logs[None]
    assert list(read_log(z)) == list(read_log(p))
    raw = [[(fr.lsn, fr.session_id, fr.session_seq, fr.ts_ns, fr.flags, bytes(fr.payload)) for b in read_frame_batches(d) for fr in b] for d in (z, p)]
    assert raw[0] == raw[1]
    mid = sum(batches) // 2
    assert list(read_log(z, mid)) == list(read_log(p, mid))
    # A reopen recovers from the INDEX (or a rescan) to the same state.
    for d in (z, p):
        os.unlink(d / "INDEX")
    lz, lp = FileLog.open(z), FileLog.open(p)
    assert lz.next_lsn == lp.next_lsn == sum(batches)
    lz.close()
    lp.close()


def _rebatch(d: Path, which: int, damage, junk: bytes = b"") -> int:
    """Replace the ``which``-th unit (a batch) of the last segment by ``damage(raw)`` -> (raw, claimed raw)
    repacked with a valid outer CRC, ``junk`` stored after its zstd frame: what a writer or codec fault
    would store. Returns its offset."""
    import zstandard

    from agentlog.events.log.batch_compression import pack_batch

    units = _units(d)
    off, typ, first = units[which]
    end = units[which + 1][0]
    data = seg_path(d).read_bytes()
    _first, count, raw_len, _codec = BATCH_HDR.unpack_from(data, off + FRAME_PREFIX)
    assert typ == TYPE_BATCH
    raw = zstandard.ZstdDecompressor().decompress(data[off + FRAME_PREFIX + BATCH_HDR.size : end])
    raw, claimed = damage(bytearray(raw))
    stored = zstandard.ZstdCompressor(level=1).compress(bytes(raw)) + junk
    batch = pack_batch(first, count, bytes(claimed), stored)
    seg_path(d).write_bytes(data[:off] + batch + data[end:])
    return off


@pytest.mark.parametrize("fault", ["inner frame", "content size", "junk after the frame"])
def test_a_batch_whose_crc_holds_but_whose_frames_are_damaged_is_corruption(tmp_path, fault):
    # The outer CRC covers the stored bytes; the inner frames' own checks catch what the writer or the codec got wrong.
    d = tmp_path / "d"
    _write(d, [20, 20, 20], "zstd")

    def damage(raw: bytearray):
        if fault == "inner frame":
            raw[len(raw) // 2] ^= 0x10
            return raw, raw
        if fault == "junk after the frame":
            return raw, raw
        return raw, raw + b"?"  # the header claims one byte more than the zstd frame holds

    # Bytes after the zstd frame, inside the batch's CRC: its records decode, but the batch is not what the writer stores.
    off = _rebatch(d, 1, damage, junk=b"not a zstd frame" if fault == "junk after the frame" else b"")
    rep = verify_log(d)
    assert (rep.status, rep.offset, rep.last_good_lsn) == ("corrupt", off, 19), rep.summary()
    expected = {"inner frame": "of its frames: CRC mismatch", "content size": "its zstd frame says",
                "junk after the frame": "16 bytes of unused data"}[fault]
    assert expected in rep.problem
    with pytest.raises(LogCorruption, match=expected):
        list(read_log(d))


def test_records_written_by_one_flush_share_a_batch_and_checkpoints_hold_their_lsn_state(tmp_path):
    """Concurrent one-record async appends: a flush compresses every record it
    writes as one batch (so batches hold several append calls), and the
    checkpoints it takes (rotations, periodic) hold the sessions as of their
    own LSN, although appends staged meanwhile are ahead of it."""
    from agentlog.events.log.osops import OsOps

    d = tmp_path / "log"
    seen: list[bytes] = []

    class IndexWatch(OsOps):
        def fdatasync(self, fd: int) -> None:  # the INDEX a previous sync wrote, before the next one
            if (d / "INDEX").exists():
                seen.append((d / "INDEX").read_bytes())
            super().fdatasync(fd)

    n_sessions, n_turns = 12, 30

    async def go() -> list:
        lg = FileLog.open(d, compression="zstd", segment_bytes=24 << 10, checkpoint_bytes=2048, os_ops=IndexWatch())

        async def session(k: int) -> list:
            rng = random.Random(k)  # each session its own letters: batches do not compress across sessions
            bodies = [SessionOpened(group_id="g", group_size=1), SessionStarted()] + [
                CommandRan(command=f"step {seq}", exit_code=0, output_tail="".join(rng.choices(string.ascii_letters, k=300)))
                for seq in range(2, n_turns)]
            return [await lg.append(f"s{k}", seq, body) for seq, body in enumerate(bodies)]

        envs = [e for got in await asyncio.gather(*(session(k) for k in range(n_sessions))) for e in got]
        lg.close()
        return sorted(envs, key=lambda e: e.lsn)

    envs = asyncio.run(go())
    assert list(read_log(d)) == envs
    assert verify_log(d).status == "ok"
    counts = [BATCH_HDR.unpack_from(seg_path(d, k).read_bytes(), off + FRAME_PREFIX)[1]
              for k in range(len(list_segments(d))) for off, typ, _ in _units(d, k) if typ == TYPE_BATCH]
    assert len(list_segments(d)) > 2 and max(counts) > 1
    checked = 0
    for raw in seen:
        (tmp_path / "one").mkdir(exist_ok=True)
        (tmp_path / "one" / "INDEX").write_bytes(raw)
        ckpt = load_checkpoint(tmp_path / "one")[0]
        assert ckpt is not None
        expected = {e.session_id: e.session_seq + 1 for e in envs[: ckpt.lsn]}
        assert ckpt.open_sessions == expected, ckpt.lsn
        checked += 1
    assert checked > 5


def _clock_from(start: int):
    ticks = itertools.count(start)
    return lambda: next(ticks)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(st.integers(1, 30), min_size=1, max_size=10),
    size=st.sampled_from([0, 40, 3000, -50]),
    compression=st.sampled_from(["zstd", "none"]),
)
def test_append_batches_stores_what_append_batch_stores_batch_by_batch(tmp_path_factory, batches, size, compression):
    """``append_batches`` numbers and stamps each batch as ``append_batch`` does (one clock
    reading a batch), and the log reads back the same records, however it stores them."""
    base = tmp_path_factory.mktemp("batches")
    recs, seq = [], 0
    for n in batches:
        recs.append(_records("s", seq, n, size))
        seq += n
    one = FileLog.open(base / "one", compression=compression, clock=_clock_from(100))
    by_one = [one.append_batch(b) for b in recs]
    one.close()
    many = FileLog.open(base / "many", compression=compression, clock=_clock_from(100))
    together = many.append_batches(recs)
    many.close()
    assert together == by_one
    assert len({e.ts_ns for b in together for e in b}) == len(batches)
    assert list(read_log(base / "many")) == list(read_log(base / "one")) == [e for b in by_one for e in b]
    assert verify_log(base / "many").status == "ok"


def test_append_batches_writes_its_batches_in_one_flush_so_they_compress_together(tmp_path):
    """Batches of a record or two, each with its own timestamp (what ``agentlog export``
    copies from a stream): ``append_batch`` stores each on its own (a small batch, or plain
    frames where compressing so little saves too little); ``append_batches`` stores them all
    in one compressed batch."""
    recs = [_records("s", 2 * k, 2, size=-60) for k in range(40)]
    one = FileLog.open(tmp_path / "one", compression="zstd", clock=_clock_from(1))
    for b in recs:
        one.append_batch(b)
    one.close()
    many = FileLog.open(tmp_path / "many", compression="zstd", clock=_clock_from(1))
    many.append_batches(recs)
    many.close()
    assert [typ for _, typ, _ in _units(tmp_path / "many")] == [TYPE_BATCH]
    assert len(_units(tmp_path / "one")) >= len(recs)
    assert list(read_log(tmp_path / "many")) == list(read_log(tmp_path / "one"))
    assert seg_path(tmp_path / "many").stat().st_size < seg_path(tmp_path / "one").stat().st_size * 0.7


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_append_batches_makes_the_batches_before_a_refused_one_durable_and_nothing_after_it(tmp_path, compression):
    d = tmp_path / "log"
    lg = FileLog.open(d, compression=compression)
    first, gap, after = _records("s", 0, 5), _records("s", 7, 2), _records("s", 5, 2)
    with pytest.raises(SequenceError, match="'s'.*7"):
        lg.append_batches([first, _records("t", 0, 3), gap, after])
    assert lg.next_lsn == 8
    assert len(list(lg.read())) == 8  # durable when it raises, not only once close() flushes what is staged
    lg.close()
    assert [(e.session_id, e.session_seq) for e in read_log(d)] == [("s", i) for i in range(5)] + [("t", i) for i in range(3)]
    assert verify_log(d).status == "ok"
    lg = FileLog.open(d, compression=compression)  # the session goes on where the durable records left it
    lg.append_batch(after)
    lg.close()
    assert len(list(read_log(d))) == 10
