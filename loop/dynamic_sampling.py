"""Dynamic sampling: a group that teaches nothing is filtered, and a new prompt is drawn in its place.

A group teaches nothing when the reducer skipped it (fewer than ``min_valid`` valid members)
or when its valid rewards have no spread (every advantage is 0). With ``[groups]
dynamic_sampling`` on, such a group is recorded as skipped, and the worker that played it
plays a *redraw*: a group of ``group_size`` sessions for a new prompt, named after the group
it follows (``b00012-g07`` -> ``b00012-g07-r1`` -> ``b00012-g07-r2``), up to ``max_redraws``
per base group. Each base group so starts one *chain*, which ends at its first group worth
training, or at its last redraw.

The learner cuts a step once ``groups_per_step`` chains have ended (:func:`ends_chain`): every
group of the step is recorded, trained or skipped with its reason, and the step trains what
it has. Its shortfall (chains that ended without a trainable group) is a metric. Worker and
learner apply the same pure rule (:func:`wants_redraw`) to the same released group (both
fold it with the run's reduce settings), so they agree on every chain without talking: a
batch still makes one step, and the pacing by steps (``max_lag``) holds.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from agentlog.reducers.groups import Group
from agentlog.reducers.runstats import RunStats, decode_projection

from .config_sections import GroupsConfig
from .naming import redraw_of


def zero_spread(group: Group, tolerance: float) -> str:
    """Why ``group`` teaches nothing because its valid rewards differ by at most ``tolerance``
    (so every advantage is 0), or "" when they spread."""
    rewards = group.valid_rewards
    if rewards and max(rewards) - min(rewards) <= tolerance:
        return (f"zero spread: {len(rewards)} valid reward(s) within {tolerance:g} of each other "
                f"({min(rewards):g}..{max(rewards):g}; dynamic sampling)")
    return ""


def uninformative(group: Group, groups: GroupsConfig) -> bool:
    """Whether dynamic sampling filters ``group``: skipped by the reducer, or no spread."""
    return groups.dynamic_sampling and (group.skipped or bool(zero_spread(group, groups.spread_tolerance)))


def wants_redraw(group: Group, groups: GroupsConfig) -> bool:
    """Whether a new prompt is drawn after ``group``: it teaches nothing and its chain has a redraw left."""
    return uninformative(group, groups) and redraw_of(group.group_id) < groups.max_redraws


def ends_chain(group: Group, groups: GroupsConfig) -> bool:
    """Whether ``group`` is the last of its chain and counts toward a step: no redraw follows
    it, and it is no over-sampled leftover."""
    return not wants_redraw(group, groups) and not oversampled(group)


#: The drop reason of an over-sampled leftover's sessions.
OVERSAMPLED = "oversampled"


def oversampled(group: Group) -> str:
    """Why ``group`` is an over-sampled leftover (cancelled once its batch had its groups), or ""."""
    n = sum(1 for r in group.drop_reasons if r == OVERSAMPLED)
    return f"oversampled: {n} member(s) cancelled once the batch's first groups completed" if n else ""


async def run_chain(play: Callable[[int], Awaitable[Group]], groups: GroupsConfig,
                    stop: Callable[[], bool] = lambda: False) -> list[Group]:
    """Play redraw 0, 1, ... of one chain (``play(k)``: the released group of redraw ``k``)
    until one ends it, or ``stop()`` says the chain was cancelled; the groups played, in
    order. At most ``max_redraws + 1``."""
    played: list[Group] = []
    while True:
        group = await play(len(played))
        played.append(group)
        if not wants_redraw(group, groups) or stop():
            return played


class ReleasedGroups:
    """The groups a worker's own log has released, folded with the run's reduce settings
    (the statistics fold: bodies projected, with their stored bytes for the health flags), read on demand."""

    def __init__(self, log: Any, config: Any) -> None:
        self._log = log
        self._released: dict[str, Group] = {}
        self._stats = RunStats.of(config)
        self._stats.on_group = self._keep
        self._lock = asyncio.Lock()  # one catch-up at a time (it runs in a thread)

    def _keep(self, group: Group) -> None:
        self._released[group.group_id] = group

    def catch_up(self) -> None:
        """Fold what the log holds past what was folded."""
        feed = self._stats.feed_record
        for rec in self._log.read(self._stats.last_lsn + 1, raw=True):
            feed(rec.lsn, rec.session_id, rec.session_seq, rec.ts_ns, decode_projection(rec.payload), rec.payload)

    async def take(self, group_id: str) -> Group | None:
        """``group_id`` once released (forgotten here then), or None while it is in flight.
        The log is read in a thread, so the sessions in flight go on meanwhile."""
        async with self._lock:
            group = self._released.pop(group_id, None)
            if group is None:
                await asyncio.to_thread(self.catch_up)
                group = self._released.pop(group_id, None)
        return group

    def retain(self, prefix: str) -> None:
        """Forget the released groups whose id does not start with ``prefix`` (earlier batches')."""
        self._released = {gid: g for gid, g in self._released.items() if gid.startswith(prefix)}
