"""The compiled frame codec (events/log/_framecodec.c) against the pure-Python
one: a differential fuzz of the scanner on random and mutated segments (every
record, the tail and the corruption verdict agree, at every buffer size), the
encoder byte for byte, the CRC32C backends (hardware instruction and the
google_crc32c fallback) against google_crc32c, and the codec switch."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import types
from pathlib import Path

import google_crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import LogCorruption, read_log, verify_log
from agentlog.events.log import framecodec
from agentlog.events.log.format import (
    DURABLE_NAME,
    FRAME_PREFIX,
    SEG_HDR_SIZE,
    encode_frame,
    pack_durable,
    pack_segment_header,
    segment_name,
)
from agentlog.events.log.scan import SegmentScanner
from log_helpers import with_pure_switch

pytestmark = pytest.mark.skipif(not framecodec.available(), reason="the compiled frame codec is not built")

if framecodec.available():
    from agentlog.events.log import _framecodec as fc

CAP = 4096
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["hardware", "hardware-streams", "hardware-fold256", "python"])
def crc_backend(request):
    """Every CRC32C backend of the compiled codec: the CPU's fastest (folding
    with VPCLMULQDQ where it has it), the CRC instruction alone (both skipped
    where the CPU has none), folding on 256-bit registers (what a CPU with AVX2
    and VPCLMULQDQ but no AVX-512 runs; skipped without them) and the call into
    google_crc32c."""
    if request.param.startswith("hardware") and not fc.HW_AVAILABLE:
        pytest.skip("this CPU has no CRC32C instruction")
    if request.param == "hardware-fold256" and not fc.FOLD256_AVAILABLE:
        pytest.skip("this CPU has no AVX2 with VPCLMULQDQ")
    saved = fc.crc_backend()
    fc.set_crc_backend(request.param)
    yield request.param
    fc.set_crc_backend(saved)


# ---------------------------------------------------------------- building segments

_sids = st.sampled_from(["s0", "s1", "ses-\u00e9", "x" * 40, ""])
_records = st.lists(
    st.tuples(_sids, st.integers(0, 2**64 - 1), st.integers(-(2**63), 2**63 - 1), st.integers(0, 255), st.binary(max_size=300)),
    max_size=12,
)


def _segment(recs, first: int = 0) -> bytes:
    out = [pack_segment_header(1, first)]
    for i, (sid, seq, ts, flags, payload) in enumerate(recs):
        out.append(encode_frame(first + i, seq, ts, flags, sid.encode(), payload))
    return b"".join(out)


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 7)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 20), st.just(0)),
    st.tuples(st.just("zero_tail"), st.integers(0, 1 << 20), st.integers(1, 200)),
    st.tuples(st.just("garbage"), st.integers(0, 1 << 20), st.integers(1, 40)),
    st.tuples(st.just("append_garbage"), st.integers(1, 80), st.just(0)),
)


def _mutate(data: bytes, muts, seed: int) -> bytes:
    buf = bytearray(data)
    r = random.Random(seed)
    for kind, at, arg in muts:
        body = len(buf) - SEG_HDR_SIZE
        if body <= 0 and kind != "append_garbage":
            continue
        pos = SEG_HDR_SIZE + at % max(body, 1)
        if kind == "flip":
            buf[pos] ^= 1 << arg
        elif kind == "cut":
            del buf[pos:]
        elif kind == "zero_tail":
            buf[pos:] = bytes(min(arg, len(buf) - pos)) + bytes(buf[pos + arg :])
        elif kind == "garbage":
            buf[pos : pos + arg] = r.randbytes(arg)
        else:
            buf += r.randbytes(at)
    return bytes(buf)


def _scan(path: Path, native: bool, chunk: int, limit: int | None, offset: int = SEG_HDR_SIZE, expected: int = 0):
    """Every frame (payload as bytes), the final offset/expected and the bad frame of one scan."""
    saved = framecodec.native
    framecodec.use_native(native)
    fd = os.open(path, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, path.name, offset, expected, CAP)
        sc.CHUNK = chunk
        frames = [(*fr[:7], bytes(fr.payload)) for fr in sc.frames(limit=limit)]
        return frames, sc.offset, sc.expected, sc.bad
    finally:
        os.close(fd)
        framecodec.native = saved


@pytest.fixture
def scratch():
    d = Path(tempfile.mkdtemp(prefix="agentlog-codec-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- the differential fuzz


@FUZZ
@given(
    recs=_records,
    muts=st.lists(_mutation, max_size=3),
    seed=st.integers(0, 1 << 30),
    chunk=st.sampled_from([16, 40, 97, 256, 1 << 18]),
    limit=st.one_of(st.none(), st.integers(0, 14)),
)
def test_compiled_and_python_scanners_agree_on_random_and_mutated_segments(scratch, crc_backend, recs, muts, seed, chunk, limit):
    """Every record, the stop position and the bad-frame verdict (offset and
    reason) are identical, whatever the read-chunk size (frames that straddle
    a chunk edge go through the Python step of the compiled path)."""
    data = _mutate(_segment(recs), muts, seed)
    path = scratch / segment_name(0)
    path.write_bytes(data)
    assert _scan(path, True, chunk, limit) == _scan(path, False, chunk, limit)


@FUZZ
@given(body=st.binary(max_size=600), valid_frames=st.integers(0, 3), chunk=st.sampled_from([9, 64, 1 << 18]))
def test_scanners_agree_on_random_bytes(scratch, crc_backend, body, valid_frames, chunk):
    """Random bytes after some valid frames: same records, same verdict."""
    data = _segment([("s", k, 0, 0, b"p" * k) for k in range(valid_frames)]) + body
    path = scratch / segment_name(0)
    path.write_bytes(data)
    assert _scan(path, True, chunk, None) == _scan(path, False, chunk, None)


@FUZZ
@given(recs=_records, muts=st.lists(_mutation, min_size=1, max_size=2), seed=st.integers(0, 1 << 30), watermark=st.booleans())
def test_readers_and_verify_agree_on_mutated_logs(scratch, recs, muts, seed, watermark):
    """Whole-log verdicts: read_log's records or its LogCorruption (message,
    segment, offset, last good LSN) and verify's report are the same under
    both codecs, with and without a durable watermark."""
    data = _mutate(_segment(recs), muts, seed)
    d = Path(tempfile.mkdtemp(dir=scratch))
    (d / segment_name(0)).write_bytes(data)
    if watermark:
        (d / DURABLE_NAME).write_bytes(pack_durable(len(recs), 1))

    def outcome(native: bool):
        saved = framecodec.native
        framecodec.use_native(native)
        try:
            try:
                got = [(r.lsn, r.session_id, r.session_seq, r.ts_ns, r.terminal, bytes(r.payload)) for r in read_log(d, raw=True, max_record_bytes=CAP)]
            except LogCorruption as exc:
                got = ("corrupt", str(exc), exc.segment, exc.offset, exc.last_good_lsn)
            rep = verify_log(d, max_record_bytes=CAP)
            return got, rep
        finally:
            framecodec.native = saved

    assert outcome(True) == outcome(False)


def test_every_truncation_and_bit_flip_of_a_small_segment_scans_alike(scratch):
    """Exhaustive on a three-frame segment: every cut and every single-bit flip."""
    data = _segment([("s0", 0, 5, 0, b"a" * 20), ("s1", 7, 6, 1, b"bb" * 9), ("s0", 1, 7, 0, b"")])
    path = scratch / segment_name(0)
    for cut in range(SEG_HDR_SIZE, len(data) + 1):
        path.write_bytes(data[:cut])
        assert _scan(path, True, 1 << 18, None) == _scan(path, False, 1 << 18, None), cut
    for bit in range(SEG_HDR_SIZE * 8, len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(flipped))
        a = _scan(path, True, 64, None)
        assert a == _scan(path, False, 64, None), bit
        assert a[3] is not None, f"bit {bit}: a flipped bit went unnoticed"


def test_zero_runs_of_every_length_get_the_same_verdict(scratch):
    """A zero-filled tail is told from a type-0 frame by the 64 bytes from the
    frame start (as far as the buffer reaches): runs of zeros of every length
    before a non-zero byte, at chunk sizes that cut the look-ahead short."""
    data = _segment([("s", 0, 1, 0, b"x")])
    path = scratch / segment_name(0)
    for zeros in range(0, 80):
        path.write_bytes(data + bytes(zeros) + b"\x05" + bytes(10))
        for chunk in (16, 48, 1 << 18):
            a = _scan(path, True, chunk, None)
            assert a == _scan(path, False, chunk, None), (zeros, chunk)


# ---------------------------------------------------------------- the encoder and the CRC


@FUZZ
@given(
    lsn=st.integers(0, 2**64 - 1),
    seq=st.integers(0, 2**64 - 1),
    ts=st.integers(-(2**63), 2**63 - 1),
    flags=st.integers(0, 255),
    sid=st.binary(max_size=70),
    payload=st.binary(max_size=5000),
)
def test_compiled_encoder_writes_the_reference_frame(crc_backend, lsn, seq, ts, flags, sid, payload):
    ref = encode_frame(lsn, seq, ts, flags, sid, payload)
    assert fc.encode_frame(lsn, seq, ts, flags, sid, payload) == ref
    assert fc.encode_frame(lsn, seq, ts, flags, sid, memoryview(payload), True) + payload == ref


def test_encode_batch_is_the_frames_back_to_back(crc_backend):
    recs = [(b"s%d" % i, i * 3, i & 1, os.urandom(i * 37)) for i in range(20)]
    buf, ends = fc.encode_batch(recs, 100, -5)
    ref = [encode_frame(100 + i, seq, -5, fl, sid, pl) for i, (sid, seq, fl, pl) in enumerate(recs)]
    assert buf == b"".join(ref)
    assert ends == [sum(len(f) for f in ref[: i + 1]) for i in range(len(ref))]


def test_encode_columns_is_encode_batch_over_columns(crc_backend):
    recs = [(b"s%d" % i, i * 3, i & 1, os.urandom(i * 37)) for i in range(20)]
    sids, seqs, flags, payloads = map(list, zip(*recs))
    assert fc.encode_columns(sids, seqs, flags, payloads, 100, -5) == fc.encode_batch(recs, 100, -5)
    assert fc.encode_columns([], [], [], [], 0, 0) == (b"", [])
    with pytest.raises(ValueError, match="columns of 2, 1, 2 and 2 records"):
        fc.encode_columns([b"s", b"t"], [0], [0, 0], [b"", b""], 0, 0)
    with pytest.raises(ValueError, match="record 1: flags 256"):
        fc.encode_columns([b"s", b"t"], [0, 0], [0, 256], [b"", b""], 0, 0)


def test_limits_beyond_the_lsn_range_behave_as_in_python(scratch):
    data = _segment([("s", 0, 1, 0, b"x"), ("s", 1, 2, 0, b"y")])
    path = scratch / segment_name(0)
    path.write_bytes(data)
    for limit in (-1, 0, 1, 2**64, 2**70):
        a = _scan(path, True, 1 << 18, limit)
        assert a == _scan(path, False, 1 << 18, limit), limit
    assert [len(_scan(path, True, 1 << 18, lim)[0]) for lim in (-1, 1, 2**70)] == [0, 1, 2]


def test_encoder_refuses_what_a_frame_cannot_hold():
    with pytest.raises(ValueError, match="session id of 65536 bytes"):
        fc.encode_frame(0, 0, 0, 0, b"x" * 65536, b"")
    with pytest.raises(ValueError, match="flags 256"):
        fc.encode_frame(0, 0, 0, 256, b"s", b"")
    with pytest.raises(TypeError, match="record 1"):
        fc.encode_batch([(b"s", 0, 0, b""), (b"s", 1)], 0, 0)
    with pytest.raises(ValueError, match="outside the 3-byte buffer"):
        fc.scan(b"abc", memoryview(b"abc"), tuple, 4, 0, 3, 0, None, CAP, 10)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=20000), crc=st.integers(0, 2**32 - 1), skip=st.integers(0, 7))
def test_crc32c_backends_equal_google_crc32c(crc_backend, data, crc, skip):
    """Any length and alignment (the three-stream path needs 768+ bytes)."""
    assert fc.crc32c(memoryview(data)[skip:], crc) == google_crc32c.extend(crc, data[skip:])


def test_crc32c_three_stream_block_edges(crc_backend):
    for n in (767, 768, 769, 1535, 1536, 12287, 12288, 12289, 13056, 3 * 4096 + 3 * 256 + 7):
        data = random.Random(n).randbytes(n)
        assert fc.crc32c(data) == google_crc32c.value(data), n


def test_crc32c_folding_edges(crc_backend):
    """The folding path's edges: its 512-byte minimum, its 256-byte steps, the
    64-byte (or, on 256-bit registers, 32-byte) steps after them and the tail
    the instruction finishes; from any register value, as a frame's CRC continues one."""
    for n in (511, 512, 513, 543, 544, 575, 576, 639, 767, 768, 799, 831, 1023, 1024, 1056, 1088, 24_000, 1 << 20):
        data = random.Random(n).randbytes(n + 3)
        for skip in range(4):
            for crc in (0, 1, 0xFFFFFFFF, 0x9E3779B9):
                view = memoryview(data)[skip : skip + n]
                assert fc.crc32c(view, crc) == google_crc32c.extend(crc, bytes(view)), (n, skip, crc)


def test_crc32c_backend_switch_names_the_kernel():
    """'hardware' is the CPU's fastest kernel, 'hardware-streams' the instruction
    alone, 'hardware-fold256' folding on 256-bit registers (refused, naming what
    is missing, on a CPU without them); crc_backend() reports the one chosen,
    and an unknown name is refused."""
    if not fc.HW_AVAILABLE:
        pytest.skip("this CPU has no CRC32C instruction")
    saved = fc.crc_backend()
    try:
        fc.set_crc_backend("hardware-streams")
        assert fc.crc_backend() == "hardware-streams"
        fc.set_crc_backend("hardware")
        assert fc.crc_backend() == "hardware"
        if fc.FOLD256_AVAILABLE:
            fc.set_crc_backend("hardware-fold256")
            assert fc.crc_backend() == "hardware-fold256"
        else:
            with pytest.raises(RuntimeError, match="no AVX2 with VPCLMULQDQ"):
                fc.set_crc_backend("hardware-fold256")
            assert fc.crc_backend() == "hardware"
        with pytest.raises(ValueError, match="expected 'hardware', 'hardware-streams', 'hardware-fold256' or 'python'"):
            fc.set_crc_backend("fold")
    finally:
        fc.set_crc_backend(saved)


# ---------------------------------------------------------------- the switch


def test_the_environment_variable_forces_the_pure_python_codec():
    code = "from agentlog.events.log import framecodec; print(framecodec.native is not None, framecodec.describe())"
    on = with_pure_switch(code, None)
    assert on.returncode == 0 and on.stdout.startswith("True compiled"), on.stderr
    off = with_pure_switch(code, "1")
    assert off.returncode == 0 and off.stdout.startswith("False pure Python"), off.stderr
    bad = with_pure_switch(code, "maybe")
    assert bad.returncode != 0 and "AGENTLOG_PURE_PYTHON='maybe'" in bad.stderr and "expected 1/true/yes" in bad.stderr


def test_a_stale_compiled_codec_is_named_and_not_used():
    # A build of an older _framecodec.c (a checkout updated without `pip install -e .`) lacks what this
    # version calls (MappedScan's batch argument, zstd_version): it must not be used, and must say why.
    assert framecodec.stale_reason(fc) == ""  # the one built here is current
    stale = types.SimpleNamespace(**{k: getattr(fc, k) for k in dir(fc) if not k.startswith("_") and k != "API"})
    reason = framecodec.stale_reason(stale)
    assert f"its API 1, this version needs {framecodec.API}" in reason and "pip install -e ." in reason
    assert f"API {framecodec.API + 1}" in framecodec.stale_reason(types.SimpleNamespace(API=framecodec.API + 1))


def test_a_frame_across_chunk_edges_is_read_by_both(scratch):
    """A record bigger than the read chunk: the compiled path hands it to the
    Python step, which refills the buffer to hold it."""
    data = _segment([("s", 0, 1, 0, b"x" * 1000), ("s", 1, 2, 0, b"y" * 10)])
    path = scratch / segment_name(0)
    path.write_bytes(data)
    a = _scan(path, True, FRAME_PREFIX, None)
    assert a == _scan(path, False, FRAME_PREFIX, None)
    assert [f[2] for f in a[0]] == [0, 1] and a[3] is None


# ---------------------------------------------------------------- batched readers


def test_frame_batches_are_the_records_of_read_log(tmp_path, codec):
    """read_frame_batches and follow_log(batches=True) give read_log's raw
    records (from any LSN, up to the durable watermark, across segments),
    under both codecs."""
    import asyncio

    from agentlog.events import FileLog, follow_log, read_frame_batches
    from event_samples import small_event

    d = tmp_path / "log"
    lg = FileLog.open(d, segment_bytes=4096)
    for k in range(30):
        lg.append_batch([(f"s{k}", i, small_event(i)) for i in range(7)])
    lg.close()

    def key(r):
        return (r.lsn, r.session_id, r.session_seq, r.ts_ns, bytes(r.payload))

    for start in (0, 1, 97, 209, 210, 500):
        want = [key(r) for r in read_log(d, start, raw=True)]
        got = [key(fr) for batch in read_frame_batches(d, start) for fr in batch]
        assert got == want, start

    async def follow(n: int) -> list:
        out = []
        async for batch in follow_log(d, 5, batches=True, poll_s=0.01):
            assert batch and isinstance(batch, list)
            out += [key(fr) for fr in batch]
            if len(out) >= n:
                return out

    assert asyncio.run(asyncio.wait_for(follow(205), 60)) == [key(r) for r in read_log(d, 5, raw=True)]
