"""GRPO groups: released exactly once, in completion order.

A group is released when all ``group_size`` sessions that declared it are
terminal, and so is every replacement it is owed: a member aborted with
``refill`` (per-sample refill, :mod:`agentlog.reducers.abort_classes`) is
excluded and owes the group one more member, a session that ``replaces`` it. Finished members with a usable reward are valid. Aborted members
stay as their zero-masked placeholder and are invalid (out of the baseline).
Dropped members are absent: counted towards completion, carrying no sample.
A group with fewer than ``min_valid`` valid members is released as skipped,
with its reason. Released groups are forgotten, so memory stays bounded by
the groups still in flight.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Sequence

import msgspec

from agentlog.events.errors import AgentlogError
from .abort_classes import FAIL
from .config import ReduceConfig
from .health import UNTRAINABLE
from .samples import Sample

FINISHED = "finished"
ABORTED = "aborted"
DROPPED = "dropped"


class GroupError(AgentlogError, ValueError):
    """Sessions of one group contradict each other (group_size, sample_index,
    too many members)."""


def row_removed(member_valid: bool, row: Sample) -> bool:
    """The zero-contribution rule, its one owner: a row contributes exactly zero
    gradient when its member is out of the group's baseline (aborted, or finished
    without a usable reward: ``member_valid`` False) or the reducers removed the
    row itself (``remove_sample``: the aborted placeholder, no usable reward,
    sampling that cannot be reproduced). The learner drops such rows, and the
    baseline counts only valid members (:attr:`Group.valid_rewards`)."""
    return not member_valid or row.remove_sample


def aborted_as_failure(body: Any, config: ReduceConfig) -> bool:
    """Whether an aborted member (its ``session_aborted`` ``body``) counts as a
    failure in its group's baseline, with ``config.fail_reward``: its reason's
    abort class says "fail", and no replacement was owed for it (a refilled
    member is always excluded). Otherwise it is excluded: zero contribution."""
    return body.refill is not True and config.outcome_of(body.reason) == FAIL


def row_trains(member_valid: bool, row: Sample) -> bool:
    """Whether a row contributes gradient: not removed (:func:`row_removed`) and
    with at least one trained token."""
    return not row_removed(member_valid, row) and bool(row.mask.any())


def reward_mean(rewards: Sequence[float]) -> float:
    """The mean of ``rewards``, NaN for none: the group baseline's one
    definition. Added left to right in float64, from 0.0, then divided by the
    count, so every user gets the same bits: :attr:`Group.baseline`, the
    learner's per-group baseline (:func:`group_means`, which
    ``learner.advantages`` centres the rewards on) and the reward means the
    loop and the learner report. (Not ``sum``: from Python 3.12 it adds
    floats with compensation, which would change the bits by version.)"""
    total = 0.0
    for r in rewards:
        total += r
    return total / len(rewards) if rewards else math.nan


def group_means(rewards: Sequence[float], groups: Sequence[int]) -> list[float]:
    """Per group ``0 .. max(groups)``: :func:`reward_mean` of its ``rewards``
    (``groups[i]``: the group of ``rewards[i]``), in the order they are given."""
    members: list[list[float]] = [[] for _ in range(max(groups) + 1 if groups else 0)]
    for r, g in zip(rewards, groups):
        members[g].append(r)
    return [reward_mean(m) for m in members]


class GroupMember(msgspec.Struct, frozen=True):
    """One terminal, non-dropped member of a group and its samples."""

    session_id: str
    sample_index: int
    status: str  # finished / aborted
    valid: bool  # in the baseline: finished with a usable reward
    reward: float | None  # None when invalid
    reason: str = ""  # abort reason, or why a finished member is invalid
    samples: tuple[Sample, ...] = ()
    replaces: str = ""  # the aborted member this one replaces (per-sample refill)


class Group(msgspec.Struct, frozen=True):
    """A released GRPO group."""

    group_id: str
    group_size: int
    members: tuple[GroupMember, ...]  # by sample_index, dropped members absent
    dropped: tuple[str, ...]  # session ids of dropped members
    skipped: bool
    skip_reason: str
    release_index: int  # 0, 1, 2... in completion order
    lsn_released: int  # LSN of the terminal event that completed the group
    #: (replacement, the member it replaces) for each per-sample refill, in opening order.
    replaced: tuple[tuple[str, str], ...] = ()
    #: Why each member of :attr:`dropped` was dropped, in the same order ("" where not known).
    drop_reasons: tuple[str, ...] = ()

    @property
    def samples(self) -> list[Sample]:
        """Every member's samples, in member order."""
        return [s for m in self.members for s in m.samples]

    @property
    def valid(self) -> list[bool]:
        """Per sample of :attr:`samples`: whether it is in the baseline."""
        return [m.valid for m in self.members for _ in m.samples]

    @property
    def n_valid(self) -> int:
        """Valid members."""
        return sum(1 for m in self.members if m.valid)

    @property
    def valid_rewards(self) -> list[float]:
        """Rewards of the valid members, one per member (not per row)."""
        return [m.reward for m in self.members if m.valid and m.reward is not None]

    @property
    def baseline(self) -> float:
        """The group's baseline: :func:`reward_mean` of :attr:`valid_rewards` (NaN without any)."""
        return reward_mean(self.valid_rewards)

    def solve_rate(self, threshold: float = 1.0) -> float:
        """Fraction of valid members with reward >= threshold (NaN without any)."""
        rewards = self.valid_rewards
        if not rewards:
            return math.nan
        return sum(1 for r in rewards if r >= threshold) / len(rewards)


class _Pending:
    __slots__ = ("group_size", "opened", "done", "dropped", "owed", "refills", "drop_reasons")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.opened: dict[str, tuple[int, int]] = {}  # session -> (sample_index, lsn)
        self.done: list[GroupMember] = []
        self.dropped: list[str] = []
        #: Members aborted with ``refill`` whose replacement has not opened yet.
        self.owed: list[str] = []
        #: replacement -> the member it replaces, in opening order.
        self.refills: dict[str, str] = {}
        #: dropped member -> why it was dropped.
        self.drop_reasons: dict[str, str] = {}

    def expected(self) -> int:
        """Terminal members that complete the group: its size, plus one per refill owed or opened."""
        return self.group_size + len(self.owed) + len(self.refills)


#: How many recently released group ids are remembered to refuse a late
#: member (a reused group id would otherwise release the group twice).
#: Bounded so memory does not grow with the length of the run.
RELEASED_WINDOW = 1024


def _at(lsn: int) -> str:
    """' (lsn N)' for a member from the log; '' for one not appended yet (lsn -1)."""
    return "" if lsn < 0 else f" (lsn {lsn})"


def _at_lsn(lsn: int) -> str:
    """' at lsn N' for a member from the log; '' for one not appended yet (lsn -1)."""
    return "" if lsn < 0 else f" at lsn {lsn}"


class PendingGroupSnapshot(msgspec.Struct, frozen=True):
    """One group in flight as plain data (see :class:`GroupTracker`)."""

    group_id: str
    group_size: int
    opened: list[tuple[str, int, int]]  # (session_id, sample_index, lsn), in joining order
    done: list[GroupMember]
    dropped: list[str]
    owed: list[str] = []
    refills: list[tuple[str, str]] = []  # (replacement, replaced)
    drop_reasons: dict[str, str] = {}


class GroupTrackerSnapshot(msgspec.Struct, frozen=True):
    """:class:`GroupTracker` as plain data: the groups in flight, the window
    of recently released group ids ``(group_id, lsn)`` and the release count."""

    min_valid: int
    pending: list[PendingGroupSnapshot]
    recent: list[tuple[str, int]]
    released: int


class GroupTracker:
    """Incremental group state: ``open`` members, ``close`` them, get groups back."""

    def __init__(self, min_valid: int = 2) -> None:
        self.min_valid = min_valid
        self._pending: dict[str, _Pending] = {}
        self._recent: OrderedDict[str, int] = OrderedDict()  # group_id -> lsn released
        self.released = 0

    def __len__(self) -> int:
        return len(self._pending)

    def pending(self) -> dict[str, tuple[int, int, int]]:
        """Groups in flight: ``group_id -> (group_size, opened, terminal)``."""
        return {
            gid: (p.group_size, len(p.opened), len(p.done) + len(p.dropped)) for gid, p in self._pending.items()
        }

    def oldest_open_lsn(self) -> int | None:
        """The smallest LSN at which a member of a group still in flight opened
        (ended members included), or None when no group is in flight: a fold
        resumed from there sees every event of every pending group."""
        lsns = [lsn for p in self._pending.values() for _, lsn in p.opened.values()]
        return min(lsns) if lsns else None

    def to_snapshot(self, *, placed_only: bool = False) -> GroupTrackerSnapshot:
        """The tracker's whole state as plain data, for a checkpoint. ``placed_only``: as a
        fold of the log would hold it, leaving out each member whose opening is not in the
        log yet (joined with lsn None and not :meth:`placed`), as :meth:`withdraw` would."""
        pending = []
        for gid, p in self._pending.items():
            opened, refills, owed = list(p.opened.items()), list(p.refills.items()), list(p.owed)
            if placed_only:
                # A fold joins members in LSN order; the engine joins them as it decides.
                opened = sorted(((s, m) for s, m in opened if m[1] >= 0), key=lambda sm: sm[1][1])
                placed = {s for s, _ in opened}
                refills = sorted(((r, m) for r, m in refills if r in placed), key=lambda rm: p.opened[rm[0]][1])
                # Owed in the order the members ended (a fold appends each at its abort); ``dropped`` holds that order.
                owed += [m for r, m in p.refills.items() if r not in placed]
                ended_at = {s: i for i, s in enumerate(p.dropped)}
                owed.sort(key=ended_at.__getitem__)
                if not opened and not p.done and not p.dropped:
                    continue  # every member's opening is still on its way to the log
            pending.append(PendingGroupSnapshot(gid, p.group_size, [(sid, idx, lsn) for sid, (idx, lsn) in opened],
                                                list(p.done), list(p.dropped), owed, refills, dict(p.drop_reasons)))
        if placed_only:
            # A fold creates a group at its first member's opening in the log; the engine, as it decides.
            pending.sort(key=lambda g: g.opened[0][2] if g.opened else -1)
        return GroupTrackerSnapshot(min_valid=self.min_valid, pending=pending, recent=list(self._recent.items()),
                                    released=self.released)

    @classmethod
    def from_snapshot(cls, snap: GroupTrackerSnapshot) -> "GroupTracker":
        """The tracker :meth:`to_snapshot` saw."""
        t = cls(snap.min_valid)
        for g in snap.pending:
            p = t._pending[g.group_id] = _Pending(g.group_size)
            p.opened = {sid: (idx, lsn) for sid, idx, lsn in g.opened}
            p.done, p.dropped = list(g.done), list(g.dropped)
            p.owed, p.refills, p.drop_reasons = list(g.owed), dict(g.refills), dict(g.drop_reasons)
        t._recent = OrderedDict(snap.recent)
        t.released = snap.released
        return t

    def check_open(self, group_id: str, session_id: str, group_size: int, sample_index: int, lsn: int | None = None,
                   replaces: str = "") -> None:
        """The membership rule: raise GroupError naming the conflict if
        ``session_id`` may not join ``group_id`` as declared; change nothing.
        A replacement (``replaces``: the member it replaces) joins only a group
        in flight that owes a replacement for that member, and only once.

        One rule for both sides: the reducers apply it to what the log holds
        and the engine (:class:`engine.core.SessionEngine`) to what it is
        asked to open (``lsn`` None: not in the log yet), so the engine never
        accepts a member the reducers would then refuse."""
        at = _at_lsn(-1 if lsn is None else lsn)
        p = self._pending.get(group_id)
        if replaces and (p is None or replaces not in p.owed):
            owed = "none" if p is None or not p.owed else ", ".join(repr(s) for s in p.owed)
            where = "a group not in flight" if p is None else f"a group that owes replacements for: {owed}"
            raise GroupError(
                f"group {group_id!r}: session {session_id!r}{at} replaces {replaces!r}, but {where}"
                " (a replacement follows its member's session_aborted with refill, once)"
            )
        if p is None:
            released_at = self._recent.get(group_id)
            if released_at is not None:
                raise GroupError(
                    f"group {group_id!r}: session {session_id!r}{at} joins a group already released{_at_lsn(released_at)}"
                    " (group ids are never reused)"
                )
            return
        if session_id in p.opened:
            # A reused id would otherwise count as a second member of its group.
            raise GroupError(
                f"group {group_id!r}: session {session_id!r}{at} joins again (first joined{_at_lsn(p.opened[session_id][1])});"
                " session ids are never reused"
            )
        if group_size != p.group_size:
            others = ", ".join(f"{s!r}{_at(lsn)}" for s, (_, lsn) in list(p.opened.items())[:8])
            raise GroupError(
                f"group {group_id!r}: session {session_id!r}{at} declares group_size {group_size},"
                f" but sessions {others} declared group_size {p.group_size}"
            )
        if not replaces and len(p.opened) - len(p.refills) >= group_size:
            raise GroupError(
                f"group {group_id!r}: session {session_id!r}{at} would be member {len(p.opened) - len(p.refills) + 1}"
                f" of a group of group_size {group_size} (members: {', '.join(repr(s) for s in p.opened if s not in p.refills)})"
            )
        for other, (idx, other_lsn) in p.opened.items():
            if idx == sample_index:
                raise GroupError(
                    f"group {group_id!r}: session {session_id!r}{at} repeats sample_index {sample_index}"
                    f" of session {other!r}{_at(other_lsn)}"
                )

    def open(self, group_id: str, session_id: str, group_size: int, sample_index: int, lsn: int | None,
             replaces: str = "") -> None:
        """A session declared membership of ``group_id`` (refused by :meth:`check_open`'s rule)."""
        self.check_open(group_id, session_id, group_size, sample_index, lsn, replaces)
        p = self._pending.get(group_id)
        if p is None:
            p = self._pending[group_id] = _Pending(group_size)
        p.opened[session_id] = (sample_index, -1 if lsn is None else lsn)
        if replaces:
            p.owed.remove(replaces)
            p.refills[session_id] = replaces

    def placed(self, group_id: str, session_id: str, lsn: int) -> None:
        """The opening of ``session_id``, which joined ``group_id`` with lsn None, reached the log at ``lsn``."""
        p = self._pending[group_id]
        p.opened[session_id] = (p.opened[session_id][0], lsn)

    def owed(self, group_id: str) -> list[str]:
        """The members of ``group_id`` (in flight) owed a replacement that has not opened yet."""
        p = self._pending.get(group_id)
        return list(p.owed) if p is not None else []

    def refills(self, group_id: str) -> int:
        """Replacements ``group_id`` (in flight) was owed so far, opened or not."""
        p = self._pending.get(group_id)
        return len(p.owed) + len(p.refills) if p is not None else 0

    def is_member(self, group_id: str, session_id: str) -> bool:
        """Whether ``session_id`` joined ``group_id``, which is still in flight."""
        p = self._pending.get(group_id)
        return p is not None and session_id in p.opened

    def next_sample_index(self, group_id: str) -> int:
        """The smallest sample_index no member of ``group_id`` holds (0 for a new group)."""
        p = self._pending.get(group_id)
        if p is None:
            return 0
        taken = {idx for idx, _ in p.opened.values()}
        return next(i for i in range(len(taken) + 1) if i not in taken)

    def replacement_index(self, group_id: str) -> int:
        """The sample_index of ``group_id``'s next replacement: the smallest one at or past
        its group_size that no member holds (never an original member's slot)."""
        p = self._pending.get(group_id)
        if p is None:
            raise GroupError(f"group {group_id!r}: not in flight, so it owes no replacement")
        taken = {idx for idx, _ in p.opened.values()}
        return next(i for i in range(p.group_size, p.group_size + len(taken) + 1) if i not in taken)

    def withdraw(self, group_id: str, session_id: str) -> None:
        """Undo :meth:`open` of a member whose opening never reached the log."""
        p = self._pending.get(group_id)
        if p is None or session_id not in p.opened:
            return
        del p.opened[session_id]
        replaced = p.refills.pop(session_id, None)
        if replaced is not None:
            p.owed.append(replaced)  # still owed: its replacement never reached the log
        if not p.opened and not p.done and not p.dropped:
            del self._pending[group_id]

    def close(self, group_id: str, member: GroupMember | None, session_id: str, lsn: int | None,
              refill: bool = False, drop_reason: str = "") -> Group | None:
        """A member reached its terminal state (``member`` None: dropped, for
        ``drop_reason``; ``refill``: aborted owing the group a replacement).
        Returns the group when this completes it, else None."""
        p = self._pending[group_id]
        if member is None:
            p.dropped.append(session_id)
            if drop_reason:
                p.drop_reasons[session_id] = drop_reason
        else:
            if session_id in p.refills:
                member = msgspec.structs.replace(member, replaces=p.refills[session_id])
            p.done.append(member)
        if refill:
            p.owed.append(session_id)
        if len(p.done) + len(p.dropped) < p.expected():
            return None
        del self._pending[group_id]
        members = tuple(sorted(p.done, key=lambda m: (m.sample_index, m.session_id)))
        n_valid = sum(1 for m in members if m.valid)
        skip_reason = ""
        if n_valid < self.min_valid:
            aborted = sum(1 for m in members if m.status == ABORTED)
            invalid = [m for m in members if m.status == FINISHED and not m.valid]
            flagged = sum(1 for m in invalid if m.reason.startswith(UNTRAINABLE + ":"))
            skip_reason = (
                f"{n_valid} valid member(s) < min_valid {self.min_valid}"
                f" ({aborted} aborted, {len(p.dropped)} dropped, {len(invalid) - flagged} finished without a usable reward"
                + (f", {flagged} untrainable by health flags)" if flagged else ")")
            )
        group = Group(
            group_id=group_id,
            group_size=p.group_size,
            members=members,
            dropped=tuple(sorted(p.dropped)),
            drop_reasons=tuple(p.drop_reasons.get(s, "") for s in sorted(p.dropped)),
            skipped=bool(skip_reason),
            skip_reason=skip_reason,
            release_index=self.released,
            lsn_released=lsn,
            replaced=tuple(p.refills.items()),
        )
        self.released += 1
        self._recent[group_id] = -1 if lsn is None else lsn
        if len(self._recent) > RELEASED_WINDOW:
            self._recent.popitem(last=False)
        return group
