"""Helpers for the CLI tests: a log written by the real SessionEngine on a
FileLog (finished, aborted, dropped, straggler-refused, forked and still
running sessions), reduced online while it is written, and a runner for
``agentlog`` as a subprocess.

Run as a script (``python cli_helpers.py DIR``) it writes that same run to
DIR: the writer process of the tail test.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentlog.tools.bench.synthetic_log import ABORT_REASONS, write_many_sessions  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[2]

SYSTEM = {"role": "system", "content": "You are a coding agent."}


def _user(i: int) -> dict:
    return {"role": "user", "content": f"Fix bug {i}."}


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


#: What the run holds, for the tests to check against (written by hand from
#: build_run below, not computed by the code under test).
EXPECTED = {
    "sessions": {
        "fin-0": {"group": "g-ok", "status": "finished", "reason": "", "turns": 2, "reward": 1.0},
        "fin-1": {"group": "g-ok", "status": "finished", "reason": "", "turns": 1, "reward": 0.0},
        "fork-2": {"group": "g-ok", "status": "finished", "reason": "", "turns": 2, "reward": 1.0},
        "abort-0": {"group": "g-bad", "status": "aborted", "reason": "wall_clock_timeout", "turns": 1, "reward": None},
        "exc-1": {"group": "g-bad", "status": "aborted", "reason": "exception:ValueError", "turns": 1, "reward": None},
        "drop-2": {"group": "g-bad", "status": "dropped", "reason": "cancelled", "turns": 0, "reward": None},
        "strag-3": {"group": "g-bad", "status": "finished", "reason": "", "turns": 1, "reward": 0.5},
        "live-0": {"group": "g-live", "status": "running", "reason": "", "turns": 1, "reward": None},
    },
    # fin-0: prompt 4 + out 3, then prompt 9 (clean) + out 2; fin-1: 4 + 3;
    # fork-2: 4 + 3, then a prompt that rewrites the first tokens (FORK) 6 + 2;
    # abort-0, exc-1, strag-3, live-0: 4 + 3 each.
    "tokens_prompt": 4 + 9 + 4 + 4 + 6 + 4 * 4,
    "tokens_output": 3 + 2 + 3 + 3 + 2 + 3 * 4,
    "groups": {"released": 2, "complete": 1, "skipped": 1, "pending": 1},
    "straggler_refused": "strag-3",
    "forked": "fork-2",
}


async def _turn(h: Any, messages: list, prompt: list[int], out: list[int]) -> None:
    await h.record_turn(
        messages=messages,
        prompt_ids=prompt,
        output_ids=out,
        output_log_probs=[-0.5] * len(out),
        response_message=_reply(f"reply {out[0]}"),
    )


async def write_run(path: str | os.PathLike, online: list | None = None) -> dict[str, Any]:
    """Write the run with SessionEngine on a FileLog at ``path``. If ``online``
    is a list, a concurrent follower reduces the log while it is written
    (the online path) and its digest is appended to it."""
    from agentlog.engine import SessionEngine, StragglerRefused
    from agentlog.events import FileLog, follow_log
    from agentlog.reducers.pipeline import Reducer

    log = FileLog.open(path, fsync="batch")
    reducer = Reducer()

    async def follow() -> None:
        async for env in follow_log(path, poll_s=0.01):
            reducer.feed(env)

    follower = asyncio.ensure_future(follow()) if online is not None else None
    eng = await SessionEngine.open(log, drain_s=0.1)
    base = [1, 2, 3, 4]
    # g-ok: two clean finishes and one with a forked second turn.
    h = await eng.open_session("fin-0", group_id="g-ok", group_size=3, sample_index=0, prompt=[SYSTEM, _user(0)])
    await h.start(harness="test")
    await _turn(h, [SYSTEM, _user(0)], base, [10, 11, 12])
    await h.record_command("pytest -x", 1, False, 0.25, "1 failed")
    await _turn(h, [SYSTEM, _user(0), _reply("reply 10"), {"role": "tool", "content": "1 failed"}], base + [10, 11, 12, 7, 8], [13, 14])
    await h.assign_reward(1.0, source="tests")
    await h.finish()

    h = await eng.open_session("fin-1", group_id="g-ok", group_size=3, sample_index=1)
    await h.start()
    await _turn(h, [SYSTEM, _user(1)], base, [20, 21, 22])
    await h.finish(reward=0.0)

    h = await eng.open_session("fork-2", group_id="g-ok", group_size=3, sample_index=2)
    await h.start()
    await _turn(h, [SYSTEM, _user(2)], base, [30, 31, 32])
    # The second prompt does not extend the held tokens: drift at token 0 -> FORK.
    await _turn(h, [SYSTEM, _user(2), _reply("reply 30"), {"role": "user", "content": "again"}], [9, 9, 30, 31, 32, 5], [33, 34])
    await h.finish(reward=1.0)

    # g-bad: a timeout abort, an exception abort, a drop, and a finish that then gets a straggler.
    h = await eng.open_session("abort-0", group_id="g-bad", group_size=4, sample_index=0)
    await h.start()
    await _turn(h, [SYSTEM, _user(3)], base, [40, 41, 42])
    await h.abort("wall_clock_timeout", error="budget of 1.0 s exhausted")

    try:
        async with eng.session("exc-1", group_id="g-bad", group_size=4, sample_index=1) as h:
            await h.start()
            await _turn(h, [SYSTEM, _user(4)], base, [50, 51, 52])
            raise ValueError("the agent crashed")
    except ValueError:
        pass

    h = await eng.open_session("drop-2", group_id="g-bad", group_size=4, sample_index=2)
    await h.drop("cancelled")

    h = await eng.open_session("strag-3", group_id="g-bad", group_size=4, sample_index=3)
    await h.start()
    await _turn(h, [SYSTEM, _user(5)], base, [60, 61, 62])
    await h.finish(reward=0.5)
    try:
        await _turn(h, [SYSTEM, _user(5)], base, [63, 64, 65])
        raise AssertionError("a straggler turn was accepted")
    except StragglerRefused:
        pass

    # g-live: one member still running when the writer stops.
    h = await eng.open_session("live-0", group_id="g-live", group_size=2, sample_index=0)
    await h.start()
    await _turn(h, [SYSTEM, _user(6)], base, [70, 71, 72])

    last = log.next_lsn - 1
    if follower is not None:
        for _ in range(3000):  # the follower sees every durable record; wait up to 30 s
            if reducer.last_lsn >= last or follower.done():
                break
            await asyncio.sleep(0.01)
        follower.cancel()
        try:
            await follower
        except asyncio.CancelledError:
            pass
        assert reducer.last_lsn == last, f"the online follower reached lsn {reducer.last_lsn}, expected {last}"
        online.append(reducer.digest.hexdigest())
    log.close()  # no engine.close(): live-0 stays running, as in a live log
    return {"last_lsn": last}


#: The metrics write_learner_log records per step (the names loop/trainer.py and learner/ use).
LEARNER_METRICS = ("rollout/reward_mean", "rollout/solve_rate", "loss/policy", "loss/kl", "stats/entropy", "stats/grad_norm", "stats/clip_frac")


def write_learner_log(path: str | os.PathLike, steps: int) -> None:
    """A learner log of ``steps`` PolicyUpdated records (versions 1..steps)
    carrying LEARNER_METRICS, appended as the loop's publish() does."""
    from agentlog.events import FileLog
    from agentlog.events.schema.types import PolicyUpdated
    from agentlog.loop.publish import LEARNER_STREAM

    log = FileLog.open(path, fsync="never")
    log.append_batch([
        (LEARNER_STREAM, k, PolicyUpdated(step=k, policy_version=k + 1,
                                          metrics={m: (k + 1) / (steps + i + 1) for i, m in enumerate(LEARNER_METRICS)}))
        for k in range(steps)
    ])
    log.close()


def agentlog(*args: str, timeout: float = 60, input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``agentlog ARGS`` in a subprocess (``python -m agentlog.tools.cli``)."""
    # The caller's environment as is: the subprocess imports the agentlog this test process imports
    # (the installed one, or a shim on PYTHONPATH), never the bare layer folders of the checkout.
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "agentlog.tools.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


def on_a_terminal(*args: str, stdout: bool = False, until=None, timeout: float = 120, columns: int = 120) -> tuple[int, str]:
    """Run ``agentlog ARGS`` with stderr (and, with ``stdout``, stdout too) on a
    pseudo-terminal; returns (exit code, what it wrote there). With ``until``,
    a predicate on the text so far, the command is interrupted (SIGINT) once
    it holds: for commands that run until interrupted, such as ``tail``."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    # A fresh pty is 0x0; a real terminal has a size (tqdm draws nothing in 0 columns).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    # The terminal's size is the pty's: $COLUMNS/$LINES (pytest-xdist's workers have them, 80x24) would override it.
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from agentlog.tools.cli import main; sys.exit(main())", *args],
        cwd=ROOT, env=env,
        stdout=slave if stdout else subprocess.DEVNULL, stderr=slave,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            # A hung child must fail the test, not hang it: wait for output with a deadline.
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"agentlog {' '.join(args)}: no end within {timeout} s; wrote {b''.join(chunks)[-2000:]!r}")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
            if until is not None and proc.poll() is None and until(b"".join(chunks).decode("utf-8", "replace")):
                proc.send_signal(signal.SIGINT)
                until = None  # read what it writes while stopping, up to EOF
        return proc.wait(timeout), b"".join(chunks).decode("utf-8", "replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


if __name__ == "__main__":
    import structlog

    # The writer process's log lines go to stderr, away from anything a test reads.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(write_run(sys.argv[1]))


def read_lines_until(proc: subprocess.Popen, done, timeout: float = 60) -> list[str]:
    """Lines of proc's stdout until done(lines) or timeout (then the command, a
    ``tail``, is interrupted with SIGINT, and killed if it does not stop)."""
    import signal
    import threading
    import time

    lines: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    try:
        while not done(list(lines)) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    return lines
