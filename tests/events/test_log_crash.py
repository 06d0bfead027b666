"""Crash test: a child appends with fsync and reports what was acknowledged;
SIGKILL at random moments must never lose an acknowledged record."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentlog.events import FileLog, read_log, verify_log
from crash_child import body
from log_helpers import rng

CHILD = Path(__file__).with_name("crash_child.py")


def _run_and_kill(log_dir: Path, seed: int, delay_s: float, compression: str) -> list[tuple[int, str, int]]:
    """Start a child writing with ``compression``, let it append for ``delay_s`` after it is
    ready, SIGKILL it; returns every (lsn, session, seq) it reported as acknowledged."""
    err_path = log_dir.parent / f"child-{seed}.err"
    err = open(err_path, "wb")
    proc = subprocess.Popen([sys.executable, str(CHILD), str(log_dir), str(seed), compression], stdout=subprocess.PIPE,
                            stderr=err)
    buf = b""
    fd = proc.stdout.fileno()
    deadline = None
    try:
        while True:
            timeout = 10.0 if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], timeout)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buf += chunk
                if deadline is None and b"ready\n" in buf:
                    deadline = time.monotonic() + delay_s
            if deadline is None and not ready:
                raise AssertionError(f"child never became ready: {err_path.read_text()[-2000:]}")
            if deadline is not None and time.monotonic() >= deadline:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(10)
        # Whatever the child wrote before dying is still in the pipe.
        rest = proc.stdout.read()
        buf += rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        err.close()
    assert proc.returncode == -signal.SIGKILL, f"child exited by itself ({proc.returncode}): {err_path.read_text()[-2000:]}"
    acked = []
    for line in buf.split(b"\n")[:-1]:  # the last piece may be a torn line
        if line == b"ready":
            continue
        lsn, sid, seq = line.split()
        acked.append((int(lsn), sid.decode(), int(seq)))
    return acked


def _check(log_dir: Path, acked_all: dict[int, tuple[str, int]], verified: list[tuple[str, int, bytes]]) -> int:
    """The log after a crash: a gapless prefix holding every acknowledged record, each
    session's seqs gapless, every body the one its (session, seq) implies. ``verified``:
    (session, seq, payload) of the LSNs a previous check decoded and compared, which
    must still hold those very bytes (compared as bytes: the check stays linear in what
    is new); it is extended with the new records."""
    lg = FileLog.open(log_dir)
    try:
        recs = [(r.lsn, r.session_id, r.session_seq, bytes(r.payload)) for r in lg.read(raw=True)]
        fresh = {e.lsn: e for e in lg.read(len(verified))}
    finally:
        lg.close()
    assert [lsn for lsn, *_ in recs] == list(range(len(recs))), "the log is not a gapless prefix"
    assert len(recs) >= len(verified), f"the log holds {len(recs)} records; {len(verified)} were read back before"
    for lsn, (sid, seq, payload) in enumerate(verified):
        assert recs[lsn][1:] == (sid, seq, payload), f"lsn {lsn} changed since it was read back"
    for lsn, sid, seq, payload in recs[len(verified):]:
        env = fresh[lsn]
        assert (env.session_id, env.session_seq, env.body) == (sid, seq, body(sid, seq)), f"lsn {lsn}"
        verified.append((sid, seq, payload))
    for lsn, (sid, seq) in acked_all.items():
        assert lsn < len(recs), f"acknowledged lsn {lsn} ({sid}, {seq}) lost; log has {len(recs)} records"
        assert recs[lsn][1:3] == (sid, seq), f"acknowledged lsn {lsn} holds {recs[lsn][1:3]}, expected ({sid}, {seq})"
    nxt: dict[str, int] = {}
    for lsn, sid, seq, _payload in recs:
        assert seq == nxt.get(sid, 0), f"lsn {lsn}: session {sid} seq gap"
        nxt[sid] = seq + 1
    return len(recs)


def _crash_loop(log_dir: Path, kills: int, seed: int, compression: str = "none") -> None:
    r = rng(seed)
    acked_all: dict[int, tuple[str, int]] = {}
    verified: list[tuple[str, int, bytes]] = []
    total_acked = 0
    for k in range(kills):
        acked = _run_and_kill(log_dir, r.randrange(1 << 30), r.uniform(0.0, 0.25), compression)
        total_acked += len(acked)
        for lsn, sid, seq in acked:
            assert acked_all.setdefault(lsn, (sid, seq)) == (sid, seq), f"lsn {lsn} acknowledged twice"
        n = _check(log_dir, acked_all, verified)
        assert n >= len(acked_all), (k, r)
    assert total_acked > 0, "the child never acknowledged anything: the test tested nothing"
    assert verify_log(log_dir).status == "ok"
    assert len(list(read_log(log_dir))) >= len(acked_all)


def test_acknowledged_appends_survive_sigkill_at_random_moments(tmp_path, codec):
    """At least 20 kills on the real disk (10 with the pure-Python codec in
    the child and the checks: the same test, at half the cost); every
    acknowledged record survives."""
    _crash_loop(tmp_path / "log", kills=20 if codec == "compiled" else 10, seed=20261130)


def test_acknowledged_compressed_batches_survive_sigkill_at_random_moments(tmp_path):
    """The same with ``compression="zstd"``: a kill can land mid-way through a compressed
    batch (one frame holding a flush's records), and recovery cuts a torn one whole; every
    acknowledged record survives, and the reopened log is still compressed."""
    from agentlog.events.log.batch_compression import segment_compression
    from agentlog.events.log.format import list_segments

    log_dir = tmp_path / "log"
    kills = 10
    _crash_loop(log_dir, kills=kills, seed=20261207, compression="zstd")
    segments = list_segments(log_dir)
    # Each reopened writer starts a segment of its own; more than the kills give means it rotated too.
    assert len(segments) > kills + 1, "the kills must land across rotations, or rotation was never under test"
    assert {first: segment_compression(log_dir, first) for first in segments} == dict.fromkeys(segments, "zstd")


@pytest.mark.slow
def test_acknowledged_appends_survive_many_sigkills(tmp_path):
    _crash_loop(tmp_path / "log", kills=300, seed=7)
