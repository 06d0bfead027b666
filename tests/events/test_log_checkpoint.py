"""The writer's periodic INDEX checkpoint: it is taken at a consistent point of
the record stream, written only once the records it describes are synced, and
bounds what recovery after a crash rescans; recovering from it gives exactly
what a full rebuild scan gives ("incremental equals batch")."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from agentlog.events import FileLog, LogClosed
from agentlog.events.log import writer_checkpoint as log_writer  # the writer's checkpoints
from agentlog.events.log.format import INDEX_NAME, SEG_HDR_SIZE, list_segments, load_checkpoint, read_watermark
from agentlog.events.log.recovery import checkpoint_problem
from agentlog.events.schema.types import CommandRan, SessionFinished
from log_helpers import copy_log, seg_path

CHILD = """
import os, sys
from agentlog.events import FileLog
from agentlog.events.schema.types import CommandRan
path, n, batch, seg, ckpt = sys.argv[1], *map(int, sys.argv[2:])
lg = FileLog.open(path, segment_bytes=seg, checkpoint_bytes=ckpt)
for i in range(0, n, batch):
    lg.append_batch([(f"s{j % 7}", j // 7, CommandRan(command=str(j), exit_code=0, output_tail="x" * 200)) for j in range(i, i + batch)])
os.write(1, str(lg.next_lsn).encode())
os._exit(0)  # a crash: no close, no final checkpoint
"""


@pytest.fixture(autouse=True)
def exact_interval(monkeypatch):
    """These tests use intervals of a few hundred bytes, smaller than the
    spacing the writer keeps from the INDEX's own size: take them as given."""
    monkeypatch.setattr(log_writer, "_CKPT_SPACING", 0)


def _opened(logs: list) -> dict:
    return [e for e in logs if e["event"] == "log.opened"][0]


def test_a_crash_rescans_only_the_tail_after_the_periodic_checkpoint(tmp_path):
    d = tmp_path / "log"
    n, batch, seg, ckpt = 3070, 10, 4 << 20, 64 << 10  # not a multiple of the interval: a tail follows
    out = subprocess.run([sys.executable, "-c", CHILD, str(d), str(n), str(batch), str(seg), str(ckpt)], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert int(out.stdout) == n
    seg_size = seg_path(d).stat().st_size
    assert len(list_segments(d)) == 1 and seg_size > 4 * ckpt, "the child must have filled several intervals of one segment"
    mid, why = load_checkpoint(d)
    assert mid is not None, why
    # A mid-segment checkpoint passes recovery's checks as they are.
    assert SEG_HDR_SIZE < mid.offset < seg_size and 0 < mid.lsn < n
    assert checkpoint_problem(d, mid, list_segments(d), 1 << 20) == ""
    with capture_logs() as logs:
        lg = FileLog.open(d, segment_bytes=seg, checkpoint_bytes=ckpt)
    opened = _opened(logs)
    one_batch = seg_size // (n // batch) + 1
    assert opened["index"] == "checkpoint"
    assert opened["rescanned_bytes"] == seg_size - mid.offset
    assert 0 < opened["rescanned_bytes"] < ckpt + one_batch
    recs = list(lg.read())
    assert [(e.session_id, e.session_seq, e.body.command) for e in recs] == [(f"s{j % 7}", j // 7, str(j)) for j in range(n)]
    assert lg.open_sessions() == {f"s{k}": len(range(k, n, 7)) for k in range(7)}
    lg.close()


def test_a_full_rescan_without_periodic_checkpoints_for_contrast(tmp_path):
    """The same crash with the interval past the segment size rescans all of it."""
    d = tmp_path / "log"
    n, batch, seg = 1000, 10, 4 << 20
    out = subprocess.run([sys.executable, "-c", CHILD, str(d), str(n), str(batch), str(seg), str(seg)], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    with capture_logs() as logs:
        FileLog.open(d, segment_bytes=seg).close()
    assert _opened(logs)["rescanned_bytes"] == seg_path(d, 0).stat().st_size - SEG_HDR_SIZE


def test_interval_policy_writes_the_periodic_checkpoint_only_after_the_sync(tmp_path):
    d = tmp_path / "log"
    lg = FileLog.open(d, fsync="interval", interval_s=1.0, checkpoint_bytes=256)
    at_open = (d / INDEX_NAME).read_bytes() if (d / INDEX_NAME).exists() else None
    lg.append_batch([(f"s{i}", 0, CommandRan(command="x" * 100, exit_code=0)) for i in range(10)])
    # Written, not synced yet (the first sync is due a second after open).
    assert read_watermark(d) is None or read_watermark(d).lsn == 0
    assert ((d / INDEX_NAME).read_bytes() if (d / INDEX_NAME).exists() else None) == at_open
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (read_watermark(d) is None or read_watermark(d).lsn < 10):
        time.sleep(0.05)
    time.sleep(0.1)  # the sync publishes the watermark, then writes the checkpoint
    ckpt, why = load_checkpoint(d)
    assert ckpt is not None and ckpt.lsn == 10 and read_watermark(d).lsn >= ckpt.lsn, why
    lg.close()


def test_never_policy_syncs_the_flush_that_carries_a_periodic_checkpoint(tmp_path):
    from agentlog.events.log.writer import OsOps

    class CountingOps(OsOps):
        syncs = 0

        def fdatasync(self, fd):
            CountingOps.syncs += 1
            super().fdatasync(fd)

    d = tmp_path / "log"
    lg = FileLog.open(d, fsync="never", checkpoint_bytes=1024, os_ops=CountingOps())
    lg.append_batch([("s0", 0, CommandRan(command="x" * 100, exit_code=0))])
    assert CountingOps.syncs == 0 and not read_watermark(d).synced
    for i in range(1, 20):
        lg.append_batch([(f"s{i}", 0, CommandRan(command="x" * 100, exit_code=0))])
    ckpt, _ = load_checkpoint(d)
    # Each checkpoint's records were synced before it was written, and only then.
    assert 0 < CountingOps.syncs < 5 and ckpt.lsn <= read_watermark(d).lsn
    lg.close()


def test_a_periodic_checkpoint_out_of_descriptors_is_skipped_other_errors_are_fatal(tmp_path, monkeypatch):
    d = tmp_path / "log"
    lg = FileLog.open(d, checkpoint_bytes=256)
    errors = [errno.EMFILE]

    def failing_write_atomic(*_a, **_k):
        raise OSError(errors[0], os.strerror(errors[0]))

    monkeypatch.setattr(log_writer, "write_atomic", failing_write_atomic)
    with capture_logs() as logs:
        envs = lg.append_batch([(f"s{i}", 0, CommandRan(command="x" * 100, exit_code=0)) for i in range(10)])
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["log.checkpoint.skipped"]
    assert len(envs) == 10 and lg.fatal_reason is None
    errors[0] = errno.EIO
    with pytest.raises(LogClosed, match="Input/output error"):
        lg.append_batch([(f"t{i}", 0, CommandRan(command="x" * 100, exit_code=0)) for i in range(10)])
    lg.close()
    monkeypatch.undo()
    lg = FileLog.open(d)
    assert [e.session_id for e in lg.read()][:10] == [f"s{i}" for i in range(10)]
    lg.close()


def _crash_copy(d: Path, dst: Path, tail: bytes = b"") -> Path:
    """The directory as a crash right now leaves it (INDEX included), with ``tail`` torn bytes."""
    return copy_log(d, dst, cut=seg_path(d).stat().st_size, tail=tail, skip=())


def test_a_crash_right_after_a_rotation_recovers_from_the_rotations_checkpoint(tmp_path):
    """The rotation's checkpoint names the new segment's first entry as its own
    position; recovery used to take that for an entry past the checkpoint and
    rebuilt the whole index."""
    d = tmp_path / "log"
    lg = FileLog.open(d, segment_bytes=2048)
    while len(list_segments(d)) < 3:
        lg.append_batch([(f"s{lg.next_lsn}", 0, CommandRan(command="x" * 100, exit_code=0))])
    crashed = _crash_copy(d, tmp_path / "crashed")
    lg.close()
    ckpt, _ = load_checkpoint(crashed)
    assert (ckpt.segment, ckpt.offset) == (list_segments(crashed)[-1], SEG_HDR_SIZE)
    with capture_logs() as logs:
        FileLog.open(crashed).close()
    assert _opened(logs)["index"] == "checkpoint"
    assert _opened(logs)["rescanned_bytes"] == seg_path(crashed).stat().st_size - SEG_HDR_SIZE


@pytest.mark.parametrize("tail", [b"\x00" * 40, b"\x07garbage", b""], ids=["zeros", "garbage", "none"])
def test_a_torn_tail_at_the_checkpoints_offset_keeps_the_checkpoint(tmp_path, tail):
    """A crash while writing the batch after a checkpoint leaves torn bytes
    exactly at its offset: recovery still starts from it and cuts them."""
    d = tmp_path / "log"
    lg = FileLog.open(d, checkpoint_bytes=256)
    envs = lg.append_batch([(f"s{i}", 0, CommandRan(command="x" * 100, exit_code=0)) for i in range(5)])
    crashed = _crash_copy(d, tmp_path / "crashed", tail)
    lg.close()
    ckpt, _ = load_checkpoint(crashed)
    assert ckpt.lsn == 5 and ckpt.offset == seg_path(crashed).stat().st_size - len(tail)
    with capture_logs() as logs:
        lg = FileLog.open(crashed)
    assert _opened(logs)["index"] == "checkpoint" and _opened(logs)["rescanned_bytes"] == len(tail)
    assert list(lg.read()) == envs
    lg.close()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_checkpoint_whose_offset_is_not_a_frame_boundary_is_rebuilt(tmp_path, compression):
    """Compressed, the five records are one batch: a checkpoint at its end offset with the lsn of its
    last record lies inside it (the scan stops in the batch, past its bytes), and was trusted."""
    d = tmp_path / "log"
    lg = FileLog.open(d, checkpoint_bytes=256, compression=compression)
    lg.append_batch([(f"s{i}", 0, CommandRan(command="x" * 100, exit_code=0)) for i in range(5)])
    lg.close()
    good, _ = load_checkpoint(d)
    assert checkpoint_problem(d, good, list_segments(d), 1 << 20) == ""
    for lsn, offset in [(good.lsn, good.offset - 3), (good.lsn - 1, good.offset), (good.lsn + 1, good.offset)]:
        bad = msgspec.structs.replace(good, lsn=lsn, offset=offset)
        assert re.search(r"not at the checkpoint's|not a frame boundary", checkpoint_problem(d, bad, list_segments(d), 1 << 20))


def test_periodic_checkpoints_are_spaced_by_the_index_size(tmp_path, monkeypatch):
    """The INDEX holds the whole sparse index: the writer keeps periodic
    checkpoints _CKPT_SPACING times its size apart, so a long log's INDEX
    rewrites stay a small fraction of what is appended."""
    monkeypatch.setattr(log_writer, "_CKPT_SPACING", 8)
    d = tmp_path / "log"
    lg = FileLog.open(d, checkpoint_bytes=1)
    seen = []  # (offset, INDEX size) of each checkpoint written
    for i in range(200):
        lg.append_batch([(f"s{i}", 0, CommandRan(command="x" * 100, exit_code=0))])
        ckpt, _ = load_checkpoint(d)
        if ckpt is not None and (not seen or ckpt.offset != seen[-1][0]):
            seen.append((ckpt.offset, (d / INDEX_NAME).stat().st_size))
    assert lg._ckpt_every == 8 * seen[-1][1]
    lg.close()
    assert len(seen) >= 5
    for (off, size), (nxt, _) in zip(seen, seen[1:]):
        assert 8 * size <= nxt - off < 8 * size + 300, seen  # + about two records


# ---------------------------------------------------------------- incremental equals batch

#: Small segments and interval, so that a small log crosses both many times.
SEGMENT_BYTES = 8192
CKPT_BYTES = 1024

_record = st.tuples(st.integers(0, 4), st.integers(0, 600), st.booleans())  # session slot, size, terminal?
_batch = st.lists(_record, min_size=1, max_size=12)
_life = st.tuples(st.lists(_batch, min_size=0, max_size=25), st.binary(max_size=64))  # batches, then a torn tail


def _append(lg: FileLog, batch: list, gen: list[int], model: list) -> None:
    recs = []
    for slot, size, terminal in batch:
        sid = f"s{slot}.{gen[slot]}"
        seq = lg.next_seq(sid) + sum(1 for r in recs if r[0] == sid)
        if terminal:
            recs.append((sid, seq, SessionFinished(reward=size / 600)))
            gen[slot] += 1  # a finished session's id is never reused
        else:
            recs.append((sid, seq, CommandRan(command=f"{sid}:{seq}", exit_code=0, output_tail="y" * size)))
    model += [(sid, seq, body) for sid, seq, body in recs]
    lg.append_batch(recs)


def _state(d: Path) -> tuple:
    with capture_logs() as logs:
        lg = FileLog.open(d, segment_bytes=SEGMENT_BYTES, checkpoint_bytes=CKPT_BYTES)
    try:
        return lg.next_lsn, lg.open_sessions(), list(lg.read()), _opened(logs)
    finally:
        lg.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(policy=st.sampled_from(["always", "batch", "interval-0", "interval-long"]), lives=st.lists(_life, min_size=1, max_size=3))
def test_recovery_from_a_periodic_checkpoint_equals_a_full_rebuild(fast_tmp, policy, lives):
    """Random appends (terminal events included) and crash points, each
    crash followed by a torn tail: reopening from the INDEX gives the same
    next_lsn, open sessions and records as a rebuild scan without it."""
    root = fast_tmp / f"case-{time.monotonic_ns()}"
    fsync, interval_s = {"interval-0": ("interval", 0.0), "interval-long": ("interval", 3600.0)}.get(policy, (policy, 0.05))
    d = root / "life0"
    gen, model = [0] * 5, []
    for k, (batches, torn) in enumerate(lives):
        lg = FileLog.open(d, fsync=fsync, interval_s=interval_s, segment_bytes=SEGMENT_BYTES, checkpoint_bytes=CKPT_BYTES)
        for batch in batches or ([[(0, 10, False)]] if not list_segments(d) else []):
            _append(lg, batch, gen, model)
        # The crash: the files as they are now (the page cache survives a
        # SIGKILL), with a torn frame's bytes past the watermark. The copies
        # are the crashed directory; the writer is closed only afterwards.
        cut = seg_path(d).stat().st_size
        with_index = copy_log(d, root / f"index{k + 1}", cut=cut, tail=torn, skip=())
        rebuilt = copy_log(d, root / f"rebuild{k + 1}", cut=cut, tail=torn)
        crashed = copy_log(d, root / f"life{k + 1}", cut=cut, tail=torn, skip=())  # the next life recovers this
        lg.close()
        had_index = (with_index / INDEX_NAME).exists()
        nxt, open_sessions, recs, opened = _state(with_index)
        assert opened["index"] == ("checkpoint" if had_index else "rebuilt")
        if policy in ("always", "batch", "interval-0"):
            # Every submission that crossed the interval left a synced checkpoint behind it.
            assert opened["rescanned_bytes"] < CKPT_BYTES + len(torn)
        r_nxt, r_open, r_recs, r_opened = _state(rebuilt)
        assert r_opened["index"] == "rebuilt"
        assert (nxt, open_sessions, recs) == (r_nxt, r_open, r_recs)
        assert [(e.session_id, e.session_seq, e.body) for e in recs] == model
        expect_open: dict[str, int] = {}
        for sid, seq, body in model:
            if isinstance(body, SessionFinished):
                expect_open.pop(sid, None)
            else:
                expect_open[sid] = seq + 1
        assert open_sessions == expect_open
        d = crashed
