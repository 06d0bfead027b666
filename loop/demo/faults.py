"""Fault injection (demo-only): the rollout worker breaks some sessions on purpose.

The demo shows that a failure inside an agent is recorded and handled like
any real one, so each batch plans (reproducibly, from its own random stream)
which sessions get which fault, and :class:`agentlog.loop.worker.RolloutWorker`
plays it at a fixed point of the session:

* ``exception``: the agent raises :class:`InjectedFault` before turn 1
  (aborted, reason ``exception:InjectedFault``);
* ``timeout``: the agent hangs before turn 1 past the session's wall-clock
  budget ``FaultConfig.timeout_budget_s`` (aborted, ``wall_clock_timeout``);
* ``drop``: the session's task is cancelled before turn 1 (dropped, ``cancelled``);
* ``empty_marker``: the tool runs :data:`EMPTY_MARKER_CMD` in a LocalSandbox,
  which dies leaving an empty done marker (aborted, ``empty_done_marker``);
* ``straggler``: after the session finished, one more turn is tried, which the
  engine must refuse (never logged).

The rates are ``LoopConfig.faults`` (:class:`agentlog.loop.config.FaultConfig`);
``FaultConfig.none()`` plans no fault at all.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, NoReturn

from agentlog.events.errors import AgentlogError
from agentlog.engine import LocalSandbox, StragglerRefused

from ..config import FaultConfig

#: The command an ``empty_marker`` fault runs: it empties its own done marker
#: (the wrapper's last argument) and kills the wrapper before it can write the
#: exit code, so LocalSandbox finds an empty marker and no exit code.
EMPTY_MARKER_CMD = "m=$(tr '\\0' '\\n' < /proc/$PPID/cmdline | tail -n 1); : > \"$m\"; kill -9 $PPID"

# Why the demo has its own ``[groups]`` table (:func:`demo_groups`): its timeouts are injected hangs (``timeout_rate``), which
# the policy did not cause, so its ``wall_clock_timeout`` aborts are infrastructure
# (excluded), not the policy failures a real run counts them as: a correct first turn
# cut off by an injected hang must not be trained as a failure.
def demo_groups() -> dict:
    """The demo's ``[groups]`` table (a fresh copy)."""
    return {"reasons": {"wall_clock_timeout": "infrastructure"}}

#: Abort reason of a session whose tool left an empty done marker.
EMPTY_MARKER_REASON = "empty_done_marker"

#: Faults played inside the agent before turn :data:`MID_SESSION_TURN`.
MID_SESSION_FAULTS = ("exception", "drop", "timeout")
MID_SESSION_TURN = 1


class InjectedFault(AgentlogError, RuntimeError):
    """Raised inside a session on purpose (fault injection)."""


def plan_faults(faults: FaultConfig, rng: random.Random, groups: int, group_size: int) -> dict[tuple[int, int], str]:
    """Which member ``(g, i)`` of a batch of ``groups`` x ``group_size`` sessions gets
    which fault, drawn from ``rng`` (one stream per batch, so a restarted worker
    plans the same faults). Members without a fault are absent."""
    edges = [
        ("exception", faults.exception_rate),
        ("timeout", faults.timeout_rate),
        ("drop", faults.drop_rate),
        ("empty_marker", faults.empty_marker_rate),
    ]
    plan: dict[tuple[int, int], str] = {}
    for g in range(groups):
        for i in range(group_size):
            u = rng.random()
            acc = 0.0
            for kind, rate in edges:
                acc += rate
                if u < acc:
                    plan[(g, i)] = kind
                    break
            else:
                if rng.random() < faults.straggler_rate:
                    plan[(g, i)] = "straggler"
    return plan


async def play_mid_session_fault(fault: str, session_id: str, turn: int) -> NoReturn:
    """Break the running session: raise, cancel its task, or hang until the
    engine's wall-clock budget aborts it (``fault`` one of :data:`MID_SESSION_FAULTS`)."""
    if fault == "exception":
        raise InjectedFault(f"injected agent crash in session {session_id} before turn {turn}")
    if fault == "drop":
        asyncio.current_task().cancel()
        await asyncio.sleep(0)  # the cancellation lands here
    if fault not in MID_SESSION_FAULTS:
        raise ValueError(f"session {session_id}: fault {fault!r} is not played mid-session; expected one of {MID_SESSION_FAULTS}")
    # timeout: hang until the engine's wall-clock budget aborts us.
    await asyncio.sleep(3600)
    raise RuntimeError(f"session {session_id}: the injected hang outlived its wall-clock budget; the engine must abort it")


async def run_dying_tool(h: Any, sandbox: LocalSandbox) -> Any:
    """Run the ``empty_marker`` fault's tool command in ``sandbox``; its result
    has ``exit_code`` None when the wrapper died as planned."""
    return await h.run_command(sandbox, EMPTY_MARKER_CMD, 5.0)


def empty_marker_error(result: Any) -> str:
    """The abort error of a session whose tool left no exit code."""
    return f"tool command left no exit code (output {result.output_tail[-200:]!r})"


async def straggle(h: Any, context: list[int], eos_id: int) -> None:
    """A late turn on a finished session; returns once the engine refused it,
    raises RuntimeError if the engine accepted it."""
    try:
        await h.record_turn(messages=[], prompt_ids=context, output_ids=[eos_id], output_log_probs=[0.0])
    except StragglerRefused:
        return
    raise RuntimeError(f"session {h.session_id}: a straggler turn after the end was accepted; the engine must refuse it")
