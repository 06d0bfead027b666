"""`agentlog verify LOG [--repair]`: exit codes and one-line reports."""

from __future__ import annotations

import pytest

from agentlog.events import FileLog
from agentlog.events.log.format import DURABLE_NAME, INDEX_NAME, SEG_HDR_SIZE
from agentlog.events.schema.types import SessionOpened
from log_helpers import flip_bit, frame_offsets, records, seg_path, write_small_log
from agentlog.tools.cli import main


def run(capsys, *argv):
    capsys.readouterr()  # drop what building the log printed
    code = main(["verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_sound_log_exits_0_with_a_one_line_summary(tmp_path, capsys):
    write_small_log(tmp_path / "log", 9)
    code, out, err = run(capsys, tmp_path / "log")
    assert code == 0 and err == ""
    assert out.count("\n") == 0 and "ok, 9 records (lsn 0..8) in 1 segments" in out


def _torn(tmp_path):
    d = tmp_path / "log"
    write_small_log(d, 6)
    durable, index = (d / DURABLE_NAME).read_bytes(), (d / INDEX_NAME).read_bytes()
    lg = FileLog.open(d)
    lg.append_batch([("t", 0, SessionOpened(group_id="g", group_size=1))])
    lg.close()
    # The last append was never acknowledged (nor described by a checkpoint).
    (d / DURABLE_NAME).write_bytes(durable)
    (d / INDEX_NAME).write_bytes(index)
    seg = seg_path(d)
    start, end = frame_offsets(d)[-1]
    seg.write_bytes(seg.read_bytes()[: end - 5])
    return d, seg, start


def test_torn_tail_exits_1_naming_the_position_and_repair_cuts_it(tmp_path, capsys):
    d, seg, start = _torn(tmp_path)
    code, out, _ = run(capsys, d)
    assert code == 1 and f"torn tail at segment {seg.name} offset {start}" in out and "--repair" in out
    code, out, _ = run(capsys, d, "--repair")
    assert code == 0 and "repaired" in out
    assert not seg.exists() or seg.stat().st_size in (start, SEG_HDR_SIZE)
    code, out, _ = run(capsys, d)
    assert code == 0 and "ok, 6 records" in out
    assert len(records(d)) == 6


def test_mid_log_corruption_exits_1_and_repair_refuses_to_touch_it(tmp_path, capsys):
    d = tmp_path / "log"
    write_small_log(d, 6)
    (d / INDEX_NAME).unlink()
    seg = seg_path(d)
    start, _ = frame_offsets(d)[2]
    flip_bit(seg, (start + 12) * 8)
    before = seg.read_bytes()
    for extra in ([], ["--repair"]):
        code, out, _ = run(capsys, d, *extra)
        assert code == 1 and "CORRUPT" in out and f"offset {start}" in out and "last good lsn 1" in out
    assert seg.read_bytes() == before


@pytest.mark.parametrize("kind", ["missing", "not-a-log", "file"])
def test_missing_or_non_log_path_exits_2_with_one_line(tmp_path, capsys, kind):
    target = tmp_path / "nope"
    if kind == "not-a-log":
        target.mkdir()
        (target / "readme.txt").write_text("hi")
    elif kind == "file":
        target.write_text("hi")
    code, out, err = run(capsys, target)
    assert code == 2 and out == ""
    assert err.count("\n") == 0 and str(target) in err


def test_repair_refuses_while_a_writer_holds_the_log(tmp_path, capsys):
    d, seg, start = _torn(tmp_path)
    import fcntl
    import os

    fd = os.open(d / "LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        code, out, err = run(capsys, d, "--repair")
    finally:
        os.close(fd)
    assert code == 2 and "another writer" in err


def test_repair_never_cuts_records_a_writer_acknowledged_after_the_first_scan(tmp_path, monkeypatch):
    """A writer that opens, recovers and appends between verify's unlocked scan
    and its cut keeps every acknowledged record: the cut comes from a scan
    taken under the writer lock."""
    import agentlog.events.log.verify as log_module
    from agentlog.events import read_log, verify_log

    d, _seg, _start = _torn(tmp_path)
    real_lock = log_module.acquire_lock
    acked: list = []
    raced: list = []

    def writer_runs_first(directory):
        if not raced:  # once, at verify's lock: a whole writer session slips in
            raced.append(directory)
            lg = FileLog.open(directory)
            acked.extend(lg.append_batch([("late", 0, SessionOpened(group_id="g2", group_size=1))]))
            lg.close()
        return real_lock(directory)

    monkeypatch.setattr(log_module, "acquire_lock", writer_runs_first)
    rep = verify_log(d, repair=True)
    assert acked and rep.status == "ok"
    assert list(read_log(d))[-1] == acked[0]
    assert verify_log(d).status == "ok"
