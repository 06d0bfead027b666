"""Folding several log partitions at once, and rebuilding a learner's batches from them.

A partition is one rollout worker's log: its sessions, and so its groups,
never span partitions (:mod:`agentlog.events.log.partitions`). Each partition is
therefore folded by its own :class:`Reducer`; a group's samples depend only
on its partition's events, never on how the partitions interleave.

What does depend on the interleaving is which released groups a consumer
takes together, and in what order. Cross-partition arrival order is never
deterministic, so the consumer records its choice: each learner step names
its groups as :class:`GroupRef` (partition, group, members with their
terminal LSNs) together with the per-partition read frontier. Replaying
those records against the partitions (:func:`rebuild_batches`) gives back
exactly the batches that were consumed, whatever the timing was.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

from agentlog.events.schema.types import TERMINAL_EVENT_TYPES, Envelope, GroupRef, MemberRef, PolicyUpdated

from .config import DEFAULT_CONFIG, ReduceConfig
from .fold import ConfirmUsed
from .groups import Group
from .pipeline import InFlightWindow, Reducer


class ReleasedGroup(NamedTuple):
    """A group a partition's reducer released, with where its members ended."""

    partition: int
    group: Group
    members: tuple[MemberRef, ...]

    def ref(self, skip_reason: str = "") -> GroupRef:
        """The :class:`GroupRef` that names this group in a learner record."""
        return GroupRef(self.partition, self.group.group_id, list(self.members), skip_reason)


class PartitionFold:
    """One incremental :class:`Reducer` per partition, fed in any interleaving.

    ``feed(pid, env)`` takes the envelopes of each partition in that
    partition's LSN order (partitions may interleave arbitrarily) and returns
    the groups released, each as a :class:`ReleasedGroup`. It keeps, per
    partition, the read frontier (the next LSN not yet fed) and can say the
    low-water LSN a restart must read from. ``windows`` resume partitions at
    their low-water marks (:class:`InFlightWindow`): an envelope a window does
    not admit is counted in the frontier but not folded."""

    def __init__(self, config: ReduceConfig = DEFAULT_CONFIG, partitions: Iterable[int] = (),
                 windows: Mapping[int, InFlightWindow] | None = None,
                 start: Mapping[int, int] | None = None,
                 confirm_of: Callable[[int], ConfirmUsed] | None = None) -> None:
        """``confirm_of(pid)``: the ``confirm_used`` of partition ``pid``'s reducer (see
        :class:`Reducer`), for a fold that can read its partitions again."""
        self.config = config
        self.confirm_of = confirm_of
        self.reducers: dict[int, Reducer] = {}
        self.frontier: dict[int, int] = {}
        self.windows: dict[int, InFlightWindow] = dict(windows or {})
        self._terminal: dict[int, dict[str, int]] = {}
        for pid in partitions:
            self._add(pid, (start or {}).get(pid, 0))

    def _add(self, pid: int, start: int = 0) -> Reducer:
        reducer = self.reducers[pid] = Reducer(self.config, confirm_used=None if self.confirm_of is None else self.confirm_of(pid))
        self.frontier[pid] = start
        self._terminal[pid] = {}
        return reducer

    def reducer_of(self, pid: int) -> Reducer:
        """The reducer of partition ``pid`` (created on first use)."""
        reducer = self.reducers.get(pid)
        return reducer if reducer is not None else self._add(pid)

    def feed(self, pid: int, env: Envelope) -> list[ReleasedGroup]:
        """Fold ``env`` of partition ``pid``; the groups it released (usually none)."""
        reducer = self.reducers.get(pid)
        if reducer is None:
            reducer = self._add(pid, env.lsn)
        window = self.windows.get(pid)
        self.frontier[pid] = env.lsn + 1
        if window is not None and not window.admits(env):
            return []
        out = reducer.feed(env)  # raises ReduceError naming the LSN and session
        if isinstance(env.body, TERMINAL_EVENT_TYPES):
            self._terminal[pid][env.session_id] = env.lsn
        if not out.groups:
            return []
        ended = self._terminal[pid]
        released = []
        for g in out.groups:
            sids = [m.session_id for m in g.members] + list(g.dropped)
            members = tuple(MemberRef(sid, ended.pop(sid, -1)) for sid in sids)
            released.append(ReleasedGroup(pid, g, members))
        return released

    def low_water(self) -> dict[int, int]:
        """Per partition, the LSN a restart reads from: the oldest
        ``session_opened`` of a group still pending there, else the frontier."""
        out = {}
        for pid, reducer in self.reducers.items():
            oldest = reducer.oldest_in_flight_lsn()
            out[pid] = self.frontier[pid] if oldest is None else oldest
        return out

    def pending_groups(self) -> int:
        """Groups opened in any partition and not yet released."""
        return sum(len(r.pending_groups()) for r in self.reducers.values())


def reduce_partitions(sources: Mapping[int, Iterable[Envelope]], config: ReduceConfig = DEFAULT_CONFIG) -> dict[int, dict[str, ReleasedGroup]]:
    """Fold each partition's envelopes (``pid -> envelopes in LSN order``) on
    its own; per partition, the released groups by id."""
    out: dict[int, dict[str, ReleasedGroup]] = {}
    for pid, envelopes in sources.items():
        fold = PartitionFold(config, [pid])
        released: dict[str, ReleasedGroup] = {}
        for env in envelopes:
            for r in fold.feed(pid, env):
                released[r.group.group_id] = r
        out[pid] = released
    return out


class RebuiltStep(NamedTuple):
    """One learner step rebuilt from its record: the groups it trained, in order."""

    step: int
    trained: list[Group]
    problems: list[str]


def rebuild_batches(records: Iterable[PolicyUpdated], released: Mapping[int, Mapping[str, ReleasedGroup]]) -> Iterator[RebuiltStep]:
    """Replay learner ``records`` against the partitions' released groups
    (:func:`reduce_partitions`): per record, the groups it trained, in the
    order it trained them, each taken from the partition the record names.

    A record's problems say what does not match: a group not released in
    its partition, members or terminal LSNs other than recorded, trained
    groups other than ``groups`` lists, a group consumed twice."""
    seen: Counter = Counter()
    for rec in records:
        problems: list[str] = []
        trained: list[Group] = []
        for ref in rec.batch:
            key = (ref.partition, ref.group_id)
            seen[key] += 1
            if seen[key] > 1:
                problems.append(f"group p{ref.partition:04d}/{ref.group_id} consumed again by step {rec.step}")
            r = released.get(ref.partition, {}).get(ref.group_id)
            if r is None:
                problems.append(f"step {rec.step}: group {ref.group_id} is not released in partition p{ref.partition:04d}")
                continue
            if list(r.members) != list(ref.members):
                problems.append(f"step {rec.step}: group p{ref.partition:04d}/{ref.group_id}: members recorded "
                                f"{_describe(ref.members)}, the partition has {_describe(r.members)}")
            if not ref.skip_reason:
                trained.append(r.group)
        names = [g.group_id for g in trained]
        if names != list(rec.groups):
            problems.append(f"step {rec.step}: the batch trains {names}, the record lists {list(rec.groups)}")
        yield RebuiltStep(rec.step, trained, problems)


def _describe(members: Iterable[MemberRef]) -> str:
    return ", ".join(f"{m.session_id}@lsn {m.terminal_lsn}" for m in members)
