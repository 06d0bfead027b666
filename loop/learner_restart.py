"""What a restarted learner reads of its own log, and where it picks the
rollout logs up: :func:`read_resume_records` (the records a restart needs,
from the newest record's ``records_from_lsn``), :func:`resume_point` (the
groups consumed, each partition's LSN to read from and in-flight window, the
partitions declared lost), and :class:`RecordsNeeded`, which the learner uses
to write ``records_from_lsn`` in each record. Split from :mod:`.trainer`."""

from __future__ import annotations

from typing import Iterable, NamedTuple

from agentlog.events.log.api import EventLog
from agentlog.events.schema.types import PolicyUpdated
from agentlog.reducers.pipeline import InFlightWindow

from .learner_records import record_consumed, record_frontier


class ResumePoint(NamedTuple):
    """Where a restarted learner picks the rollout logs up (:func:`resume_point`)."""

    consumed: set[tuple[int, str]]  # (partition, group) of every group trained or skipped by a recorded step
    read_from: dict[int, int]  # per partition, the LSN to read from (absent: 0)
    windows: dict[int, InFlightWindow]  # per partition, what of it to feed the fresh reducer
    lost: dict[int, str]  # partitions declared lost -> why


def resume_point(records: list[PolicyUpdated]) -> ResumePoint:
    """The resume point after the learner log's ``records`` (in order).

    Per partition, from the last record's low-water mark when recorded: the
    fold is rebuilt from the in-flight window (:class:`InFlightWindow`), not
    from a snapshot, so the groups it releases afterwards, and their
    samples, are those a fold from 0 releases. No record, or a last record
    written before the field (-1): from 0."""
    consumed: set[tuple[int, str]] = set()
    lost: dict[int, str] = {}
    for r in records:
        consumed.update(record_consumed(r))
        lost.update(r.lost_partitions)
    settled: dict[int, set[str]] = {}
    for pid, gid in consumed:
        settled.setdefault(pid, set()).add(gid)
    last = records[-1] if records else None
    if last is not None and last.low_water:
        read_from = dict(last.low_water)
    elif last is not None and last.lsn_low_water >= 0:
        read_from = {0: last.lsn_low_water}
    else:
        read_from = {}
    through = {pid: end - 1 for pid, end in record_frontier(last).items()} if read_from and last is not None else {}
    windows = {pid: InFlightWindow(through.get(pid, -1), settled.get(pid, set())) for pid in set(through) | set(settled)}
    return ResumePoint(consumed, read_from, windows, lost)


class RecordsNeeded:
    """Which learner-log records a restart after the newest one must read.

    It keeps (learner-log LSN, per-partition frontier, trained anything,
    declared a partition lost) of the records still needed, starting from
    those a restart read (``history``)."""

    def __init__(self, stop_window: int, history: Iterable[tuple[int, PolicyUpdated]] = ()) -> None:
        self.stop_window = stop_window
        self.entries: list[tuple[int, dict[int, int], bool, bool]] = [
            (lsn, record_frontier(r), bool(r.groups), bool(r.lost_partitions)) for lsn, r in history]

    def note(self, own_lsn: int, record: PolicyUpdated, low_water: dict[int, int]) -> int:
        """Remember ``record`` (about to be appended at learner-log LSN
        ``own_lsn``) and return its ``records_from_lsn``: the oldest record a
        restart after it must read. That is the first record whose frontier
        passes the low-water mark of some partition (records before it hold
        only groups released before the marks, whose sessions all opened
        before them, so the replay never meets them), or earlier where the
        stop rule's last ``stop_window`` trained records reach further back,
        or where a record declared a partition lost (a restart must know it:
        :func:`resume_point`). Older entries are forgotten: bounded by the
        window, except that a run which lost a partition keeps (and a restart
        rereads) its small records from that declaration on."""
        self.entries.append((own_lsn, record_frontier(record), bool(record.groups), bool(record.lost_partitions)))
        last = len(self.entries) - 1

        def reaches(frontier: dict[int, int]) -> bool:
            return any(frontier.get(pid, 0) > mark for pid, mark in low_water.items())

        window_first = next(i for i, (_, frontier, _, _) in enumerate(self.entries) if reaches(frontier) or i == last)
        trained = [i for i, (_, _, t, _) in enumerate(self.entries) if t]
        if self.stop_window <= 0:
            rewards_first = last  # no stop rule looks back
        else:
            rewards_first = trained[-self.stop_window] if len(trained) >= self.stop_window else 0
        lost_first = next((i for i, (_, _, _, declared) in enumerate(self.entries) if declared), last)
        del self.entries[: min(window_first, rewards_first, lost_first)]
        return self.entries[0][0]


def read_resume_records(llog: EventLog) -> list[tuple[int, PolicyUpdated]]:
    """The records of the learner log ``llog`` a restart needs, with their
    learner-log LSNs: from the last record's ``records_from_lsn`` on, or the
    whole log when the last record predates that field."""
    end = llog.next_lsn
    if end == 0:
        return []
    last = next(iter(llog.read(end - 1)))
    start = last.body.records_from_lsn if isinstance(last.body, PolicyUpdated) and last.body.records_from_lsn >= 0 else 0
    return [(env.lsn, env.body) for env in llog.read(start) if isinstance(env.body, PolicyUpdated)]
