"""How a rollout worker plays one group: its members concurrently, each followed by the
replacements the engine owes for it (per-sample refill, :mod:`agentlog.reducers.abort_classes`)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from agentlog._logging import get_logger
from agentlog.engine import SessionEngine, SessionTimeout

from .demo.faults import InjectedFault
from .naming import member_id

log = get_logger("agentlog.loop.group_play")

#: How a session may end that is the session's outcome, not the worker's failure.
SESSION_ENDINGS = (asyncio.CancelledError, InjectedFault, SessionTimeout)

#: ``play(index, slot, fault=..., replaces=...)``: play member ``index`` for the prompt of ``slot``.
Play = Callable[..., Awaitable[Any]]


async def play_group(engine: SessionEngine, gid: str, size: int, play: Play, faults: dict[int, str],
                     on_refill: Callable[[str, str, int], None], cancelled: Callable[[], bool] = lambda: False,
                     unplayed: Callable[..., Awaitable[None]] | None = None) -> None:
    """Play members ``0 .. size-1`` of group ``gid`` concurrently, each with its refills
    (:func:`with_refills`), until every one is terminal. A session that ended (an
    injected fault, a timeout, a drop) is its outcome; any other failure is raised.
    Once ``cancelled()``, a member or replacement not yet opened is handed to
    ``unplayed(index, replaces=...)`` (which opens and drops it) instead of played."""
    tasks = [asyncio.ensure_future(with_refills(engine, gid, i, play, faults.get(i), on_refill, cancelled, unplayed))
             for i in range(size)]
    failures = [(i, r) for i, r in enumerate(await asyncio.gather(*tasks, return_exceptions=True))
                if isinstance(r, BaseException) and not isinstance(r, SESSION_ENDINGS)]
    for i, exc in failures[1:]:  # the first is raised; the others are never dropped unseen
        log.error("group.member_failed", group_id=gid, member=i, error=f"{type(exc).__name__}: {exc}", exc_info=exc,
                  effect=f"raised with the group's first failure (member {failures[0][0]})")
    if failures:
        raise failures[0][1]


async def end_unplayed(engine: SessionEngine, gid: str, size: int, opened: set[str], **open_kw: Any) -> int:
    """After a killed worker: open and abort (``engine_restart``) the members of group ``gid``
    it never opened (not in ``opened``), then each replacement still owed (and those these
    aborts owe, up to ``max_refills``), so the group completes. Returns how many."""
    n = 0
    for i in range(size):
        if member_id(gid, i) not in opened:
            h = await engine.open_session(member_id(gid, i), group_id=gid, group_size=size, sample_index=i, **open_kw)
            await h.abort("engine_restart", error="never started: the worker was killed while opening its batch")
            n += 1
    while engine.owed_replacements(gid):
        h = await engine.open_session(member_id(gid, engine.replacement_index(gid)), group_id=gid, group_size=size,
                                      replaces=engine.owed_replacements(gid)[0], **open_kw)
        await h.abort("engine_restart", error="never started: the worker was killed before this replacement opened")
        n += 1
    return n


async def with_refills(engine: SessionEngine, gid: str, i: int, play: Play, fault: str | None,
                       on_refill: Callable[[str, str, int], None], cancelled: Callable[[], bool] = lambda: False,
                       unplayed: Callable[..., Awaitable[None]] | None = None) -> None:
    """Play member ``i`` of group ``gid``, then, while the engine owes the group a replacement
    for the member just played (its abort class is "refill" and the group is under
    ``max_refills``), play a replacement for the same prompt (the same slot): the next
    replacement index, ``replaces`` naming the member it replaces (``on_refill(replaced,
    replacement, slot)`` is told first). Raises what the first play raised, after its
    replacements ran."""
    first: BaseException | None = None
    sid, replaces, slot = member_id(gid, i), "", i
    while True:
        try:
            if cancelled() and unplayed is not None:
                await unplayed(i, replaces=replaces)
            else:
                await play(i, slot, fault=fault, replaces=replaces)
        except SESSION_ENDINGS as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the batch itself is being cancelled: no replacement starts
            # The session ended aborted or dropped; a replacement may be owed for it.
            first = first or exc
        if sid not in engine.owed_replacements(gid):
            break
        i = engine.replacement_index(gid)
        sid, replaces, fault = member_id(gid, i), sid, None
        on_refill(replaces, sid, slot)
    if first is not None:
        raise first
