"""Helpers for the loop tests: small configs and waiting on run folders."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable

import pytest

from agentlog.loop.config import FaultConfig, LoopConfig
from agentlog.loop.learner_records import read_learner_records


def small_config(**overrides) -> LoopConfig:
    """A loop that runs in seconds: no warm-up, 8 groups of 4 per step."""
    values = dict(
        steps=12, groups_per_step=8, group_size=4, warmup_steps=0, min_valid=2,
        faults=FaultConfig(exception_rate=0.05, timeout_rate=0.05, drop_rate=0.05, straggler_rate=0.05, empty_marker_rate=0.0),
    )
    values.update(overrides)
    return LoopConfig(**values)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 60.0, procs=()) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` (and any dead process) on timeout."""
    t0 = time.monotonic()
    while not predicate():
        for p in procs:
            if p.poll() not in (None, 0):
                pytest.fail(f"while waiting for {what}: process {p.args} exited with {p.returncode}")
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def freeze_mid_batch(worker, open_sessions: Callable[[], set[str]], procs=(),
                     in_flight: Callable[[], bool] | None = None, looks: int = 200) -> set[str]:
    """Stop ``worker`` (SIGSTOP) at a moment its log shows sessions open, and return them
    (``open_sessions()``, read again while it is frozen).

    Reading the log while the worker is frozen makes what it says what a kill then leaves:
    seeing sessions open and stopping the worker are not a race. A look that finds the batch
    already over lets the worker go on (SIGCONT) instead of killing it, so a miss costs the run
    none of its steps, as a kill and restart between batches would. ``in_flight``: a cheaper
    test to poll between looks (a tail of the log), by default ``open_sessions`` itself."""
    poll = in_flight or (lambda: bool(open_sessions()))
    for _look in range(looks):
        wait_for("sessions in flight", poll, 60, procs)
        worker.send_signal(signal.SIGSTOP)
        found = open_sessions()
        if found:
            return found
        worker.send_signal(signal.SIGCONT)
    pytest.fail(f"the worker had no session open at any of {looks} looks while it was frozen")


def kill_live(*procs) -> None:
    """SIGKILL and reap every process of ``procs`` still running (a test's clean-up)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def learner_version(run_dir: Path) -> int:
    """Newest policy version in a run's learner log (-1 before any)."""
    recs = read_learner_records(Path(run_dir) / "learner")
    return recs[-1].policy_version if recs else -1


def build_groups(specs: dict[str, list[tuple[str, float, int, float]]], *, min_valid: int = 2,
                 sampling: dict[str, dict] | None = None, teacher=None):
    """Released groups made through the real engine and reducers on a MemoryLog.

    ``specs``: group id -> one (outcome, reward, policy_version, log_prob) per
    member, outcome ``finish``, ``abort`` or ``drop``. Finished members play
    the lookup task's two turns with every output token at ``log_prob``;
    ``sampling``: group id -> the sampling dict recorded with its turns;
    ``teacher``: ``async (handle, turn_index, output_ids)`` called after each
    recorded turn (to record teacher scores or failures).
    """
    from agentlog.reducers.config import ReduceConfig
    from agentlog.reducers.pipeline import reduce_log

    log = play_groups(specs, sampling=sampling, teacher=teacher)
    res = reduce_log(log, ReduceConfig(min_valid=min_valid))
    return {g.group_id: g for g in res.groups}


def play_groups(specs: dict[str, list[tuple[str, float, int, float]]], *, sampling: dict[str, dict] | None = None, seed: int = 0,
                teacher=None):
    """The MemoryLog the real engine writes when it plays ``specs`` (see :func:`build_groups`)."""
    import asyncio
    import random

    from agentlog.engine import SessionEngine
    from agentlog.engine.tasks.lookup import ANSWER, EOS, LOOKUP, LookupTask, key_token, value_token
    from agentlog.events.log.api import MemoryLog

    task = LookupTask()
    log = MemoryLog()

    async def play() -> None:
        engine = await SessionEngine.open(log)
        rng = random.Random(seed)
        for gid, members in specs.items():
            ep = task.new_episode(rng)
            key, value = ep.state["key"], ep.state["table"][ep.state["key"]]
            for i, (outcome, reward, version, lp) in enumerate(members):
                h = await engine.open_session(f"{gid}-s{i}", group_id=gid, group_size=len(members), sample_index=i,
                                              prompt=ep.messages, prompt_ids=list(ep.prompt_ids), policy_version=version)
                await h.start(harness="test")
                if outcome == "abort":
                    await h.abort("exception:Boom")
                    continue
                if outcome == "drop":
                    await h.drop("cancelled")
                    continue
                out0 = [LOOKUP, key_token(key), EOS]
                await h.record_turn(messages=ep.messages, prompt_ids=list(ep.prompt_ids), output_ids=out0,
                                    output_log_probs=[lp] * 3, response_message={"role": "assistant", "content": task.decode(out0)},
                                    policy_version=version, sampling=(sampling or {}).get(gid))
                if teacher is not None:
                    await teacher(h, 0, out0)
                tool = task.tool_step(ep, 0, out0)
                ctx = list(ep.prompt_ids) + out0 + list(tool.ids)
                out1 = [ANSWER, value_token(value if reward else (value + 1) % 16), EOS]
                msgs = ep.messages + [{"role": "assistant", "content": task.decode(out0)}, {"role": "tool", "content": tool.text}]
                await h.record_turn(messages=msgs, prompt_ids=ctx, output_ids=out1, output_log_probs=[lp] * 3,
                                    response_message={"role": "assistant", "content": task.decode(out1)}, policy_version=version,
                                    sampling=(sampling or {}).get(gid))
                if teacher is not None:
                    await teacher(h, 1, out1)
                await h.finish(reward=reward)
        await engine.close()

    asyncio.run(play())
    return log
