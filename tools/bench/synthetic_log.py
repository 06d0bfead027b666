"""A synthetic log of many small sessions, fast enough for 100k: the generator the report, CLI and UI
benchmarks and their tests share (a checkout's module, as every benchmark is)."""

from __future__ import annotations

import os
from typing import Any


#: What write_many_sessions appends per session, by fate (for tests that count).
ABORT_REASONS = ("wall_clock_timeout", "exception:ValueError", "sandbox_lost")


def write_many_sessions(path: str | os.PathLike, n_sessions: int, *, seed: int = 0, group_size: int = 4, turns: tuple[int, int] = (1, 4)) -> dict[str, Any]:
    """Append ``n_sessions`` small sessions (groups of ``group_size``, members
    interleaved) straight to a FileLog with ``append_batch``: fast enough for
    100k sessions. Each session: opened, started, 1-3 turns (random
    generation latency, policy version rising with the group), a command per
    turn, then finished with a reward (~80%), aborted (~15%, reasons from
    ABORT_REASONS) or dropped (~5%). Returns what it wrote: counts by outcome
    and reason, turns, commands, events."""
    import random

    from agentlog.events import FileLog
    from agentlog.events.schema.types import (
        CommandRan, SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted, TurnRecorded,
    )

    rng = random.Random(seed)
    log = FileLog.open(path, fsync="never")
    facts: dict[str, Any] = {"finished": 0, "aborted": 0, "dropped": 0, "turns": 0, "commands": 0, "events": 0,
                             "abort_reasons": {}, "drop_reasons": {}, "sessions": []}
    batch: list[tuple] = []
    n_groups = (n_sessions + group_size - 1) // group_size
    made = 0
    for g in range(n_groups):
        version = g * 8 // max(n_groups, 1)
        members = []
        for i in range(min(group_size, n_sessions - made)):
            sid = f"s{made:07d}"
            made += 1
            fate = rng.random()
            n_turns = rng.randint(turns[0], turns[1] - 1)
            bodies: list = [SessionOpened(group_id=f"g{g:06d}", group_size=group_size, sample_index=i, policy_version=version),
                            SessionStarted(harness="synthetic")]
            for t in range(n_turns):
                bodies.append(TurnRecorded(turn_index=t, prompt_ids=[1, 2, 3, 4 + t], output_ids=[10 + t, 11, 12],
                                           output_log_probs=[-0.5, -0.25, -0.125], policy_version=version,
                                           generate_s=rng.lognormvariate(0.0, 1.0)))
                bodies.append(CommandRan(command="pytest -x", exit_code=rng.choice((0, 1)), duration_s=rng.lognormvariate(-1.0, 1.5)))
            if fate < 0.80:
                bodies.append(SessionFinished(reward=rng.choice((0.0, 0.5, 1.0))))
                facts["finished"] += 1
            elif fate < 0.95:
                reason = rng.choice(ABORT_REASONS)
                bodies.append(SessionAborted(reason=reason, error="synthetic"))
                facts["aborted"] += 1
                facts["abort_reasons"][reason] = facts["abort_reasons"].get(reason, 0) + 1
            else:
                bodies = bodies[:2] + [SessionDropped(reason="cancelled")]
                n_turns = 0
                facts["dropped"] += 1
                facts["drop_reasons"]["cancelled"] = facts["drop_reasons"].get("cancelled", 0) + 1
            facts["turns"] += n_turns
            facts["commands"] += n_turns
            facts["sessions"].append(sid)
            members.append((sid, bodies))
        # Interleave the group's members event by event, as a live run does.
        for k in range(max(len(b) for _, b in members)):
            for sid, bodies in members:
                if k < len(bodies):
                    batch.append((sid, k, bodies[k]))
        if len(batch) >= 4096:
            log.append_batch(batch)
            facts["events"] += len(batch)
            batch = []
    if batch:
        log.append_batch(batch)
        facts["events"] += len(batch)
    log.close()
    return facts
