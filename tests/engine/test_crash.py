"""Crash: a child process runs sessions on a FileLog and is SIGKILLed; a new
engine on the same log aborts the orphans with ``engine_restart``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agentlog.engine import DuplicateSession, SessionEngine
from engine_helpers import check_log_invariants
from agentlog.events import FileLog
from agentlog.events.schema.types import SessionAborted, SessionFinished, TurnDelta, TurnRecorded

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    from agentlog.events import FileLog
    from agentlog.engine import SessionEngine

    async def main(path, n):
        log = FileLog.open(path, fsync="batch")
        eng = await SessionEngine.open(log)

        async def one(i):
            h = await eng.open_session(f"s{i}", group_id=f"g{i // 4}", group_size=4)
            if i % 4 == 0:
                return  # left open
            await h.start()
            await h.record_turn(prompt_ids=[1, 2], output_ids=[3], output_log_probs=[-0.1])
            if i % 4 == 1:
                await h.finish(reward=1.0)
            elif i % 4 == 2:
                await h.abort("verifier_failed")
            # i % 4 == 3: left running

        await asyncio.gather(*(one(i) for i in range(n)))
        print("READY", log.next_lsn, flush=True)
        # Keep producing turns on the running sessions until killed.
        k = 0
        while True:
            for i in range(3, n, 4):
                await eng.get(f"s{i}").record_turn(output_ids=[k])
            k += 1

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


def _run_child_and_kill(path, n: int) -> int:
    err_path = path.with_name("child.stderr")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(n)],
            stdout=subprocess.PIPE, stderr=err, text=True, cwd=os.getcwd(),
        )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"child failed: {line!r}; stderr: {err_path.read_text()[-2000:]}"
        acked = int(line.split()[1])
        time.sleep(0.2)  # let it append more turns mid-flight
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    return acked


@pytest.mark.parametrize("n", [40, pytest.param(4000, marks=pytest.mark.slow)])
def test_restart_after_sigkill_aborts_orphans_with_engine_restart(arun, tmp_path, n):
    path = tmp_path / "log"
    acked = _run_child_and_kill(path, n)

    async def go():
        log = FileLog.open(path)
        try:
            assert log.next_lsn >= acked  # every acknowledged append survived
            eng = await SessionEngine.open(log)
            per = check_log_invariants(log)
            assert sorted(per) == sorted(f"s{i}" for i in range(n))
            for i in range(n):
                last = per[f"s{i}"][-1].body
                if i % 4 == 1:
                    assert isinstance(last, SessionFinished)
                elif i % 4 == 2:
                    assert isinstance(last, SessionAborted) and last.reason == "verifier_failed"
                else:
                    assert isinstance(last, SessionAborted) and last.reason == "engine_restart", (i, last)
            assert eng.stats["restart_aborted"] == n // 2
            running_turns = [sum(isinstance(e.body, (TurnRecorded, TurnDelta)) for e in per[f"s{i}"]) for i in range(3, n, 4)]
            assert all(t >= 1 for t in running_turns)
            with pytest.raises(DuplicateSession):
                await eng.open_session("s0", group_id="g", group_size=1)
            await eng.close()
        finally:
            log.close()
        # A second restart finds nothing to abort.
        log = FileLog.open(path)
        try:
            n_before = log.next_lsn
            eng = await SessionEngine.open(log)
            assert eng.stats["restart_aborted"] == 0 and log.next_lsn == n_before
        finally:
            log.close()

    arun(go())


def test_duplicate_id_confirmed_by_scanning_a_file_log(arun, tmp_path):
    """An id that left the status cache is still refused, via the filter and a raw scan of the file log."""

    async def go():
        log = FileLog.open(tmp_path / "log")
        try:
            eng = await SessionEngine.open(log, status_cache=1)
            for i in range(3):
                await (await eng.open_session(f"s{i}", group_id=f"g{i}", group_size=1)).drop("x")
            with pytest.raises(DuplicateSession, match="lsn 0"):
                await eng.open_session("s0", group_id="g0", group_size=1)
            assert eng.stats["id_scans"] == 1
        finally:
            log.close()

    arun(go())


def test_restart_aborts_an_orphan_whose_id_is_a_bloom_false_positive(arun, tmp_path):
    """The restart fold's Bloom filter can hold a fresh id by chance; the fold
    then skips that session as a 'reused id'. The orphan must still be aborted:
    the engine takes its orphans from the log's exact open-session map."""
    from agentlog.reducers.lifecycle import IdFilter

    # With a one-id filter, "open-26" hits the bits "done-0" set (found by search).
    probe = IdFilter(1)
    probe.add("done-0")
    assert probe.add("open-26"), "precondition: the crafted ids collide in a one-id filter"
    path = tmp_path / "log"

    async def crash():
        log = FileLog.open(path)
        eng = await SessionEngine.open(log, id_capacity=1)
        await (await eng.open_session("done-0", group_id="g0", group_size=1)).drop("done")
        await eng.open_session("open-26", group_id="g1", group_size=1)
        log.close()  # the engine is never closed: "open-26" is left open, as after a crash

    async def restart():
        log = FileLog.open(path)
        try:
            eng = await SessionEngine.open(log, id_capacity=1)
            last = check_log_invariants(log)["open-26"][-1].body
            assert isinstance(last, SessionAborted) and last.reason == "engine_restart", last
            assert eng.stats["restart_aborted"] == 1
            assert log.open_sessions() == {}
        finally:
            log.close()

    arun(crash())
    arun(restart())
