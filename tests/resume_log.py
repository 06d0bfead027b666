"""A crashed-and-resumed session, written by the real SessionEngine, for the readers' tests.

``write_session(path, turns, crashes)`` plays one scripted session ``"s"`` of
``turns`` turns (group ``"g"`` of 1), each turn as a worker records it: the
sandbox snapshot its request found, the turn, then its tool call's command.
At each crash ``n`` (durable turns at the crash, non-decreasing) the worker
dies after turn ``n - 1``: by default with turn ``n - 1``'s command run and
turn ``n``'s request arrived (its snapshot recorded) and generating; ``(n,
RECORDED)`` or ``(n, COMMANDED)`` die earlier. The engine is abandoned (on a
FileLog the log is closed under it, as a killed process leaves it), a new
engine opens the log with ``adopt_orphans=True`` and resumes the session from
the snapshot before turn ``n - 1`` (before turn 0 when ``n`` is 0), runs turn
``n - 1``'s command again, and the session continues. With ``crashes=()`` it
is the same session uninterrupted: the reference a resumed one must train as.

Snapshot digests name their turn and incarnation (:func:`digest`), so a
reader's output says whose snapshot it shows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

PROMPT = [{"role": "user", "content": "fix it"}]
SESSION, GROUP = "s", "g"


def digest(turn: int, incarnation: int) -> str:
    """The snapshot digest of ``turn`` taken by ``incarnation`` (0: the first): 64 hex digits."""
    return hashlib.blake2b(f"snapshot of turn {turn} by incarnation {incarnation}".encode(), digest_size=32).hexdigest()


def turn_kwargs(k: int) -> dict[str, Any]:
    """Turn k of the scripted session: each prompt extends the last context by a tool answer."""
    prompt = list(range(1, 4))
    for j in range(k):
        prompt += [100 + 10 * j, 101 + 10 * j, 50 + j]  # output of turn j, then its tool result
    messages = PROMPT + [m for j in range(k) for m in ({"role": "assistant", "content": f"a{j}"}, {"role": "tool", "content": f"t{j}"})]
    return dict(messages=messages, prompt_ids=prompt, output_ids=[100 + 10 * k, 101 + 10 * k],
                output_log_probs=[-0.25 - k, -0.5 - k], response_message={"role": "assistant", "content": f"a{k}"})


#: How far the dying incarnation got past its last durable turn ``n - 1``: the turn recorded only,
#: its command run too, or turn ``n``'s request arrived (its snapshot recorded) and was generating.
RECORDED, COMMANDED, IN_FLIGHT = 0, 1, 2


def _steps(turns: int) -> list[tuple[str, int]]:
    """The worker's script: per turn its snapshot, the turn, its command."""
    return [(kind, k) for k in range(turns) for kind in ("snapshot", "turn", "command")]


async def _step(h: Any, kind: str, k: int, incarnation: int) -> None:
    if kind == "snapshot":
        await h.record_snapshot(k, digest(k, incarnation), files=3 + k, bytes=300 + k, new_bytes=10 * k, seconds=0.25)
    elif kind == "turn":
        await h.record_turn(**turn_kwargs(k))
    else:
        await h.record_command(f"echo {k}", 0, False, 0.01, f"t{k}")


async def write_session(path: str | Path | None, turns: int, crashes: Sequence[int | tuple[int, int]] = (), *,
                        reward: float = 1.0):
    """Write the session (see the module docstring) to a FileLog at ``path`` (closed at the end),
    or to a MemoryLog when ``path`` is None (returned). Each crash is ``n`` (durable turns) or
    ``(n, how far)``: :data:`RECORDED`, :data:`COMMANDED` or :data:`IN_FLIGHT` (the default)."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.events.log.api import MemoryLog

    points = [c if isinstance(c, tuple) else (c, IN_FLIGHT) for c in crashes]
    if [n for n, _ in points] != sorted(n for n, _ in points) or any(not 0 <= n <= turns or how not in (0, 1, 2) for n, how in points):
        raise ValueError(f"crashes: expected non-decreasing durable-turn counts in [0, {turns}], each with how far 0..2, "
                         f"found {list(crashes)!r}")
    steps = _steps(turns)
    memory = MemoryLog() if path is None else None
    log = memory if memory is not None else FileLog.open(path)
    eng = await SessionEngine.open(log)
    h = await eng.open_session(SESSION, group_id=GROUP, group_size=1, sample_index=0, prompt=PROMPT)
    await h.start(harness="python-agent")
    pos = 0  # the next step of the script
    for incarnation, (n, how) in enumerate(points):
        # The last step the dying incarnation made: turn n - 1 and as far past it as `how` says (turn 0's snapshot
        # before any durable turn: without it the session could not resume).
        last = min(3 * (n - 1) + 1 + how, len(steps) - 1) if n else 0
        for kind, k in steps[pos:last + 1]:
            await _step(h, kind, k, incarnation)
        if memory is None:
            log.close()  # killed: nothing of the engine is closed
            log = FileLog.open(path)
        eng = await SessionEngine.open(log, adopt_orphans=True)
        point = eng.orphans[SESSION]
        h = await eng.resume(SESSION, point.snapshot_to_resume(), worker=f"w{incarnation + 1}")
        # The new incarnation runs the last durable turn's command again in the restored sandbox, then goes on.
        pos = 3 * (n - 1) + 2 if n else 0
    for kind, k in steps[pos:]:
        await _step(h, kind, k, len(points))
    await h.finish(reward=reward)
    await eng.close()
    if memory is None:
        log.close()
    return memory
