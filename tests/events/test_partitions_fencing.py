"""Log partitions (naming, listing, validation) and the epoch fence: a stale
writer (an older epoch, e.g. on another node of a shared filesystem whose
flock this node does not see) is refused once a newer writer has opened
the log. The second node is simulated with FileLog.open's private
``_flock=False`` seam: the flock is the one thing another node would not
share; everything else (files, fence, recovery) is the real writer."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, LogClosed, LogCorruption, LogFenced, NotALog, OsOps, read_log, verify_log
from agentlog.events.log.format import FENCE_NAME, read_durable, read_fence
from agentlog.events.log.partitions import list_partitions, open_partition, parse_partition_name, partition_dir
from agentlog.events.schema.types import SessionOpened

# ---------------------------------------------------------------- partitions


def test_partition_dir_is_named_by_a_four_digit_id(tmp_path):
    assert partition_dir(tmp_path, 3) == tmp_path / "p0003"
    assert partition_dir(str(tmp_path), 0).name == "p0000"
    assert partition_dir(tmp_path, 9999).name == "p9999"


@pytest.mark.parametrize(
    ("pid", "exc", "says"),
    [
        (-1, ValueError, "found -1"),
        (10_000, ValueError, "found 10000"),
        (True, TypeError, "bool True"),
        ("3", TypeError, "str '3'"),
        (3.0, TypeError, "float 3.0"),
    ],
)
def test_a_bad_partition_id_is_refused_naming_it(tmp_path, pid, exc, says):
    with pytest.raises(exc, match="partition id: expected an int in \\[0, 10000\\)") as info:
        partition_dir(tmp_path, pid)
    assert says in str(info.value)


def test_list_partitions_sorts_ids_and_ignores_hidden_entries(tmp_path):
    for pid in (12, 0, 3):
        open_partition(tmp_path, pid).close()
    (tmp_path / ".nfs0000000001").write_bytes(b"x")  # NFS silly rename
    assert list_partitions(tmp_path) == [0, 3, 12]
    assert parse_partition_name("p\u0660\u0660\u0660\u0661") is None  # Arabic-Indic digits are not a partition


@pytest.mark.parametrize("stray", ["p3", "p00003", "p0003.bak", "learner"])
def test_list_partitions_names_a_stray_entry(tmp_path, stray):
    partition_dir(tmp_path, 1).mkdir()
    (tmp_path / stray).mkdir()
    with pytest.raises(NotALog, match=f"found {stray.replace('.', '[.]')}"):
        list_partitions(tmp_path)


def test_list_partitions_refuses_a_file_named_like_a_partition_and_a_missing_root(tmp_path):
    (tmp_path / "p0005").write_bytes(b"")
    with pytest.raises(NotALog, match="p0005 \\(not a directory\\)"):
        list_partitions(tmp_path)
    with pytest.raises(NotALog, match="found nothing"):
        list_partitions(tmp_path / "absent")


# ---------------------------------------------------------------- fencing


def _rec(sid: str):
    return (sid, 0, SessionOpened(group_id="g", group_size=1))


def _sids(d: Path) -> list[str]:
    return [e.session_id for e in read_log(d)]


def test_a_stale_writer_is_refused_once_a_newer_one_opens(tmp_path):
    d = tmp_path / "p0000"
    a = open_partition(tmp_path, 0)
    assert read_fence(d) == a.epoch
    acked = [e.session_id for e in a.append_batch([_rec("a0"), _rec("a1")])]
    b = FileLog.open(d, _flock=False)  # "another node": its flock does not exclude A
    assert b.epoch == a.epoch + 1 and read_fence(d) == b.epoch
    with pytest.raises(LogFenced, match=f"a newer writer \\(epoch {b.epoch}\\) opened this log; this writer \\(epoch {a.epoch}\\) is stale") as info:
        a.append_batch([_rec("a2")])
    assert (info.value.epoch, info.value.newer_epoch) == (a.epoch, b.epoch)
    assert str(d) in str(info.value)
    assert "is stale" in a.fatal_reason
    with pytest.raises(LogFenced):  # fatal: every later append is refused
        a.append_batch([_rec("a3")])
    b.append_batch([_rec("b0")])
    a.close()  # fatal: touches nothing
    b.close()
    assert _sids(d) == acked + ["b0"]
    assert verify_log(d).ok


def test_a_stale_writers_close_does_not_overwrite_the_newer_watermark(tmp_path):
    a = FileLog.open(tmp_path, fsync="never")
    a.append_batch([_rec("a0")])
    b = FileLog.open(tmp_path, _flock=False)
    b.append_batch([_rec("b0"), _rec("b1")])
    with pytest.raises(LogFenced):
        a.close()
    assert read_durable(tmp_path) == (3, b.epoch)
    b.close()
    assert _sids(tmp_path) == ["a0", "b0", "b1"] and verify_log(tmp_path).ok


def test_async_appends_of_a_stale_writer_fail_with_log_fenced(tmp_path):
    async def main():
        a = FileLog.open(tmp_path)
        await a.append("a0", 0, SessionOpened(group_id="g", group_size=1))
        b = FileLog.open(tmp_path, _flock=False)
        results = await asyncio.gather(*(a.append(f"a{i}", 0, SessionOpened(group_id="g", group_size=1)) for i in (1, 2, 3)), return_exceptions=True)
        assert all(isinstance(r, LogFenced) for r in results), results
        a.close()
        b.close()

    asyncio.run(main())
    assert _sids(tmp_path) == ["a0"] and verify_log(tmp_path).ok


class _OpenBAfterWrite(OsOps):
    """Opens the newer writer right after the stale one's batch is written,
    before it is synced and acknowledged."""

    def __init__(self, d: Path) -> None:
        self.d, self.armed, self.b = d, False, None

    def writev(self, fd, buffers):
        n = os.writev(fd, buffers)
        if self.armed:
            self.armed = False
            self.b = FileLog.open(self.d, _flock=False)
        return n


def test_a_batch_written_before_the_newer_writer_opens_is_not_acknowledged(tmp_path):
    ops = _OpenBAfterWrite(tmp_path)
    a = FileLog.open(tmp_path, os_ops=ops)
    a.append_batch([_rec("a0")])
    ops.armed = True
    with pytest.raises(LogFenced):
        a.append_batch([_rec("a1")])
    b = ops.b
    # Written before B's recovery: B keeps it, as it keeps any crashed
    # writer's unacknowledged records (A's caller got an outcome-unknown error).
    assert b.next_lsn == 2
    b.append_batch([_rec("b0")])
    a.close()
    b.close()
    assert _sids(tmp_path) == ["a0", "a1", "b0"] and verify_log(tmp_path).ok


def test_without_the_fence_check_a_stale_writer_would_still_acknowledge(tmp_path):
    """What the check prevents (fence=False skips it): A acknowledges after B opened."""
    a = FileLog.open(tmp_path, fence=False)
    b = FileLog.open(tmp_path, _flock=False)
    assert a.append_batch([_rec("a0")])[0].lsn == 0  # acknowledged by a stale writer
    assert read_fence(tmp_path) == b.epoch
    a.close()
    b.close()


def test_the_epoch_continues_from_durable_when_fence_is_missing(tmp_path):
    lg = FileLog.open(tmp_path)
    lg.append_batch([_rec("a0")])
    lg.close()
    lg = FileLog.open(tmp_path)
    epoch = lg.epoch
    lg.close()
    os.unlink(tmp_path / FENCE_NAME)  # a log written before fences existed
    lg = FileLog.open(tmp_path)
    assert lg.epoch == epoch + 1 and read_fence(tmp_path) == lg.epoch
    lg.close()


def test_a_fence_lowered_under_a_writer_makes_it_fatal(tmp_path):
    a = FileLog.open(tmp_path)
    os.unlink(tmp_path / FENCE_NAME)
    with pytest.raises(LogClosed, match="FENCE file names epoch 0 \\(0: missing\\)"):
        a.append_batch([_rec("a0")])
    a.close()


# ---------------------------------------------------------------- interleavings


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.integers(0, 4),
    ops=st.lists(st.tuples(st.sampled_from("AB"), st.integers(1, 3)), max_size=12),
    fsync=st.sampled_from(["always", "batch", "interval", "never"]),
    segment_bytes=st.sampled_from([256, 1 << 20]),
)
def test_interleaved_appends_never_acknowledge_a_stale_record(before, ops, fsync, segment_bytes):
    kw = dict(fsync=fsync, segment_bytes=segment_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "p0007"
        a = FileLog.open(d, **kw)
        acked: list[str] = []
        for i in range(before):
            acked += [e.session_id for e in a.append_batch([_rec(f"a{i}.{j}") for j in range(i % 2 + 1)])]
        b = FileLog.open(d, _flock=False, **kw)
        for k, (who, n) in enumerate(ops):
            batch = [_rec(f"{who}{k}.{j}") for j in range(n)]
            if who == "A":
                with pytest.raises(LogFenced):
                    a.append_batch(batch)
                assert a.fatal_reason is not None
            else:
                acked += [e.session_id for e in b.append_batch(batch)]
        if a.fatal_reason is None:  # a stale writer's close publishes nothing
            with pytest.raises(LogFenced):
                a.close()
        a.close()
        b.close()
        assert _sids(d) == acked
        rep = verify_log(d)
        assert rep.ok and rep.records == len(acked), rep
        c = FileLog.open(d, **kw)
        assert c.next_lsn == len(acked) and c.epoch == b.epoch + 1
        c.close()


class _OpenBBeforeWrite(OsOps):
    """Opens the newer writer between the stale one's pre-write fence read and
    its write: the race window the fence cannot close without storage-side
    enforcement."""

    def __init__(self, d: Path) -> None:
        self.d, self.armed, self.b = d, False, None

    def writev(self, fd, buffers):
        if self.armed:
            self.armed = False
            self.b = FileLog.open(self.d, _flock=False)
        return os.writev(fd, buffers)


def test_the_race_window_is_never_acknowledged_and_verify_reports_its_bytes(tmp_path):
    ops = _OpenBBeforeWrite(tmp_path)
    a = FileLog.open(tmp_path, os_ops=ops)
    a.append_batch([_rec("a0")])
    ops.armed = True
    with pytest.raises(LogFenced):
        a.append_batch([_rec("a1")])  # written after B's recovery, never acknowledged
    b = ops.b
    assert b.next_lsn == 1
    b.append_batch([_rec("b0")])
    a.close()
    b.close()
    # The stale bytes sit past B's recovery point in A's (now sealed)
    # segment: verify and readers report the damage, never read A's record.
    rep = verify_log(tmp_path)
    assert rep.status == "corrupt" and "starts at lsn 1, expected 2" in rep.problem, rep
    with pytest.raises(LogCorruption, match="segment 00000000000000000001.seg starts at lsn 1"):
        list(read_log(tmp_path))
    c = FileLog.open(tmp_path)  # trusts B's INDEX checkpoint; its reads refuse too
    with pytest.raises(LogCorruption, match="written by a stale writer"):
        list(c.read())
    c.close()
