"""Hypothesis fuzz of the reader: on random or mutated bytes it yields only
valid records or raises LogCorruption, in bounded time and memory."""

from __future__ import annotations

import shutil
import tempfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, LogCorruption, read_log
from agentlog.events.log.format import DURABLE_NAME, SEG_HDR_SIZE, pack_segment_header, segment_name
from log_helpers import write_small_log

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")

CAP = 4096
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def base_log():
    root = Path(tempfile.mkdtemp(prefix="agentlog-fuzz-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    envs = write_small_log(root / "base", 10)
    seg = (root / "base" / segment_name(0)).read_bytes()
    yield root, envs, seg
    shutil.rmtree(root, ignore_errors=True)


def _fresh(root: Path, data: bytes, durable: bytes | None = None) -> Path:
    d = Path(tempfile.mkdtemp(dir=root))
    (d / segment_name(0)).write_bytes(data)
    if durable is not None:
        (d / DURABLE_NAME).write_bytes(durable)
    return d


def _read_checked(d: Path, original: list | None):
    """Read everything; every record must be the original one at its LSN."""
    tracemalloc.start()
    try:
        try:
            got = list(read_log(d, durable_only=False, max_record_bytes=CAP))
        except LogCorruption as exc:
            assert exc.segment and exc.offset >= 0
            got = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < CAP + (2 << 20), f"reader allocated {peak} bytes"
    if got is not None:
        assert [e.lsn for e in got] == list(range(len(got)))
        if original is not None:
            assert got == original[: len(got)]
    return got


@FUZZ
@given(body=st.binary(max_size=3000), valid_header=st.booleans())
def test_reader_on_random_bytes_yields_valid_records_or_raises_corruption(base_log, body, valid_header):
    root, _envs, _seg = base_log
    data = (pack_segment_header(1, 0) if valid_header else b"") + body
    d = _fresh(root, data)
    try:
        got = _read_checked(d, None)
        if not valid_header and got:
            pytest.fail("records read from a segment without a valid header")
    except LogCorruption:
        pass
    finally:
        shutil.rmtree(d)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("zero"), st.integers(0, 10**6), st.integers(1, 200)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 50)),
)


def _mutate(seg: bytes, muts) -> bytes:
    b = bytearray(seg)
    for kind, pos, arg in muts:
        if not b:
            break
        i = SEG_HDR_SIZE + pos % max(1, len(b) - SEG_HDR_SIZE) if len(b) > SEG_HDR_SIZE else pos % len(b)
        if kind == "flip":
            b[i % len(b)] ^= 1 << arg
        elif kind == "set":
            b[i % len(b)] = arg
        elif kind == "cut":
            del b[i:]
        elif kind == "zero":
            b[i : i + arg] = bytes(len(b[i : i + arg]))
        elif kind == "insert":
            b.insert(i, arg)
        else:
            del b[i : i + arg]
    return bytes(b)


@FUZZ
@given(muts=st.lists(mutation, min_size=1, max_size=4), with_watermark=st.booleans())
def test_reader_and_recovery_on_mutated_logs_never_yield_a_damaged_record(base_log, muts, with_watermark):
    root, envs, seg = base_log
    durable = (root / "base" / DURABLE_NAME).read_bytes() if with_watermark else None
    d = _fresh(root, _mutate(seg, muts), durable)
    try:
        try:
            _read_checked(d, envs)
        except LogCorruption:
            pass
        # Recovery on the same bytes: it opens with a prefix of the original, or refuses.
        try:
            lg = FileLog.open(d, max_record_bytes=CAP, fsync="never")
        except LogCorruption:
            return
        try:
            got = list(lg.read())
            assert got == envs[: len(got)]
            if with_watermark:
                assert len(got) == len(envs), "recovery dropped acknowledged records without an error"
        finally:
            lg.close()
    finally:
        shutil.rmtree(d)
