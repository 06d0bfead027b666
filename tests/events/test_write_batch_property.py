"""Validated on write, for whole batches and for async appends: the writer
checks a batch's bodies in one pass (``check_bodies``) and an async append on
its own path, and neither may take anything the per-record check refuses nor
refuse anything it takes. Any batch is accepted exactly when every body in it
decodes (each stored as ``encode_body`` gives it and read back equal), or
refused naming the session and seq of its first refused body, nothing written.
The ways the file writer stages frames (one codec call for a batch that fits
its segment, frame by frame otherwise, one record at a time for ``append``,
the pure-Python codec) write the same bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, read_log, verify_log
from agentlog.events.log import framecodec
from agentlog.events.log.api import MemoryLog
from agentlog.events.log.format import list_segments, segment_name
from agentlog.events.log.osops import OsOps
from agentlog.events.schema.types import CommandRan, EventValidationError, SessionFinished, SessionStarted, check_body, encode_body
from test_write_schema_property import bodies, plain, scratch_dir

#: Every test here runs under both frame codecs (compiled and pure Python; tests/events/conftest.py).
pytestmark = pytest.mark.usefixtures("codec")

PROPERTY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def first_refused(drawn: list) -> tuple[int, str] | None:
    """The reference: the index of the first body the one-record check refuses, with its error."""
    for i, body in enumerate(drawn):
        try:
            check_body(body)
        except EventValidationError as exc:
            return i, str(exc)
    return None


def stored_payloads(path: Path) -> list[bytes]:
    return [bytes(rec.payload) for rec in read_log(path, raw=True)]


@PROPERTY
@given(st.lists(bodies(), min_size=2, max_size=8))
def test_a_batch_is_taken_exactly_when_each_of_its_bodies_would_be(drawn):
    drawn = [body for _how, body in drawn if body is not None]
    recs = [(f"s{i}", 0, body) for i, body in enumerate(drawn)]
    refused = first_refused(drawn)
    with scratch_dir() as tmp:
        path = Path(tmp) / "log"
        file_log, memory_log = FileLog.open(path, fsync="never"), MemoryLog()
        try:
            for lg in (file_log, memory_log):
                if refused is None:
                    envs = lg.append_batch(recs)
                    assert [plain(encode_body(e.body)) for e in envs] == [plain(encode_body(check_body(b)[1])) for b in drawn]
                else:
                    i, why = refused
                    with pytest.raises(EventValidationError) as info:
                        lg.append_batch(recs)
                    assert str(info.value).startswith(f"session 's{i}' seq 0: {why} ")
                    assert "nothing was written" in str(info.value)
                    assert lg.next_lsn == 0 and lg.open_sessions() == {}
        finally:
            file_log.close()
        event("refused" if refused else "accepted")
        back = list(read_log(path))
        if refused is None:
            assert [(e.session_id, e.session_seq) for e in back] == [(sid, seq) for sid, seq, _ in recs]
            # Stored as the one-record check stores each body.
            assert stored_payloads(path) == [check_body(b)[0] for b in drawn]
            assert [plain(encode_body(e.body)) for e in back] == [plain(encode_body(e.body)) for e in memory_log.read()]
        else:
            assert back == []
        assert verify_log(path).status == "ok"


@PROPERTY
@given(st.lists(bodies(), min_size=1, max_size=8))
def test_an_async_append_is_taken_exactly_when_its_body_would_be(drawn):
    """Each session is open (its seq 0 appended), so every drawn body takes
    the async append's one-record path; all are appended concurrently."""
    drawn = [body for _how, body in drawn if body is not None]
    with scratch_dir() as tmp:
        path = Path(tmp) / "log"
        lg = FileLog.open(path, fsync="batch")
        try:
            lg.append_batch([(f"s{i}", 0, SessionStarted()) for i in range(len(drawn))])

            async def appends():
                return await asyncio.gather(*(lg.append(f"s{i}", 1, body) for i, body in enumerate(drawn)), return_exceptions=True)

            outcomes = asyncio.run(appends())
        finally:
            lg.close()
        expected = []
        for i, (body, outcome) in enumerate(zip(drawn, outcomes)):
            refused = first_refused([body])
            if refused is None:
                assert not isinstance(outcome, BaseException), outcome
                assert plain(encode_body(outcome.body)) == plain(encode_body(check_body(body)[1]))
                expected.append((f"s{i}", check_body(body)[0]))
            else:
                assert isinstance(outcome, EventValidationError)
                assert str(outcome).startswith(f"session 's{i}' seq 1: {refused[1]} ")
        back = [(rec.session_id, bytes(rec.payload)) for rec in read_log(path, raw=True) if rec.session_seq == 1]
        assert sorted(back) == sorted(expected)
        assert verify_log(path).status == "ok"


def _records(n: int) -> list[tuple[str, int, object]]:
    """n records over 40 sessions, some ended, payloads of many sizes (a few
    past the size written as its own iovec)."""
    recs, seqs = [], {}
    for i in range(n):
        sid = f"s{i % 40}.{i // 400}"
        seq = seqs.get(sid, 0)
        seqs[sid] = seq + 1
        if i % 400 >= 360:  # each session's last record in its block of 400
            recs.append((sid, seq, SessionFinished(reward=1.0)))
        else:
            recs.append((sid, seq, CommandRan(command=f"c{i}", output_tail="y" * ((i * 37) % 300 if i % 97 else 5000))))
    return recs


def _log_bytes(path: Path) -> dict[str, bytes]:
    names = [segment_name(s) for s in list_segments(path)] + ["INDEX", "DURABLE"]
    return {name: (path / name).read_bytes() for name in names}


def test_every_way_of_staging_writes_the_same_bytes(tmp_path):
    """Batches (framed in one call where they fit the segment, frame by frame
    across a rotation or a big payload), one record per batch, and async
    appends one at a time and many at once, under a fixed clock: byte for byte the same segments, index and
    watermark, with several segments and sparse-index entries in each."""
    recs = _records(2400)
    opts = dict(fsync="never", segment_bytes=200_000, checkpoint_bytes=50_000, clock=lambda: 7)

    def batches(path: Path, size: int) -> None:
        with FileLog.open(path, **opts) as lg:
            for i in range(0, len(recs), size):
                lg.append_batch(recs[i : i + size])

    def async_appends(path: Path) -> None:
        async def run(lg: FileLog) -> None:
            for sid, seq, body in recs:
                await lg.append(sid, seq, body)

        with FileLog.open(path, **opts) as lg:
            asyncio.run(run(lg))

    def concurrent_appends(path: Path) -> None:
        # 50 appends at a time, staged in call order: most join a submission still waiting for its flush,
        # big payloads (written where they lie, after their frame's prefix) among them.
        async def run(lg: FileLog) -> None:
            for i in range(0, len(recs), 50):
                await asyncio.gather(*(lg.append(sid, seq, body) for sid, seq, body in recs[i : i + 50]))

        with FileLog.open(path, **opts) as lg:
            asyncio.run(run(lg))

    batches(tmp_path / "big", 500)
    batches(tmp_path / "one", 1)
    async_appends(tmp_path / "async")
    reference = _log_bytes(tmp_path / "big")
    assert len(list_segments(tmp_path / "big")) >= 3
    assert _log_bytes(tmp_path / "one") == reference
    assert _log_bytes(tmp_path / "async") == reference
    concurrent_appends(tmp_path / "concurrent")
    assert _log_bytes(tmp_path / "concurrent") == reference
    saved = framecodec.native
    framecodec.use_native(False)
    try:
        batches(tmp_path / "pure", 500)
    finally:
        framecodec.native = saved
    assert _log_bytes(tmp_path / "pure") == reference
    assert [(e.session_id, e.session_seq) for e in read_log(tmp_path / "big")] == [(s, q) for s, q, _ in recs]


class _CountingOps(OsOps):
    """Counts the data syncs of a real writer."""

    def __init__(self) -> None:
        self.syncs = 0

    def fdatasync(self, fd: int) -> None:
        self.syncs += 1
        super().fdatasync(fd)


@pytest.mark.parametrize("fsync", ["always", "batch"])
def test_concurrent_async_appends_share_syncs_except_under_always(tmp_path, fsync):
    """Async appends from many sessions at once: each session's records land
    in its order and read back; under ``batch`` appends waiting for a flush
    share its write and sync, under ``always`` each append is synced on its own."""
    ops = _CountingOps()
    sessions, per = 50, 6

    async def session(lg: FileLog, k: int) -> None:
        for seq in range(per):
            await lg.append(f"s{k}", seq, CommandRan(command=f"{k}:{seq}"))

    async def run(lg: FileLog) -> None:
        await asyncio.gather(*(session(lg, k) for k in range(sessions)))

    with FileLog.open(tmp_path / "log", fsync=fsync, os_ops=ops) as lg:
        asyncio.run(run(lg))
        syncs = ops.syncs
    back = list(read_log(tmp_path / "log"))
    assert len(back) == sessions * per
    for k in range(sessions):
        assert [e.body.command for e in back if e.session_id == f"s{k}"] == [f"{k}:{seq}" for seq in range(per)]
    if fsync == "always":
        assert syncs == sessions * per
    else:
        assert syncs < sessions * per / 4
    assert verify_log(tmp_path / "log").status == "ok"
