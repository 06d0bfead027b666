"""Every fold composes the one lifecycle step (``reducers.lifecycle_step.evolve``),
so on any stream, faults injected, they agree on which records are illegal:
the lifecycle reducer (replay), the run statistics (stats), the check behind
``agentlog verify`` and the engine's restart fold report the same set of
``(lsn, session, kind)``; the pipeline (reconstruct) raises the first of them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine import SessionEngine
from agentlog.events.schema.types import Envelope, RewardAssigned, event_tag
from agentlog.reducers.errors import ReduceError
from agentlog.reducers.lifecycle import LifecycleCheck, LifecycleReducer, Violation
from agentlog.reducers.lifecycle_step import ViolationKind
from agentlog.reducers.pipeline import Reducer
from agentlog.reducers.runstats import RunStats
from reduce_streams import RandomStream

FAULTS = ("drop", "duplicate", "bump_seq", "lower_seq", "after_terminal")


def inject(envs: list[Envelope], faults: list[tuple[str, int]]) -> list[Envelope]:
    """Apply ``(fault, position)`` to a valid stream, then renumber the LSNs 0..:
    drop a record (a gap, or a session never opened), duplicate one (a repeat,
    a reused id, or an event after the terminal one), move a record's
    ``session_seq`` up or down, or append an event after a session's terminal one."""
    out = list(envs)
    for fault, pos in faults:
        if not out:
            break
        i = pos % len(out)
        e = out[i]
        if fault == "drop":
            del out[i]
        elif fault == "duplicate":
            out.insert(i + 1, e)
        elif fault == "bump_seq":
            out[i] = Envelope(e.lsn, e.session_id, e.session_seq + 1 + pos % 3, e.ts_ns, e.body)
        elif fault == "lower_seq" and e.session_seq > 0:
            out[i] = Envelope(e.lsn, e.session_id, e.session_seq - 1, e.ts_ns, e.body)
        elif fault == "after_terminal":
            out.append(Envelope(e.lsn, e.session_id, e.session_seq + 1, e.ts_ns, RewardAssigned(reward=0.5)))
    return [Envelope(lsn, e.session_id, e.session_seq, e.ts_ns, e.body) for lsn, e in enumerate(out)]


def replay_violations(envs: list[Envelope]) -> list[tuple[int, str, str]]:
    reducer = LifecycleReducer()
    return [(o.lsn, o.session_id, o.kind.value) for env in envs for o in reducer.feed(env) if isinstance(o, Violation)]


def stats_violations(envs: list[Envelope]) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    stats = RunStats()
    stats.KEEP_VIOLATIONS = len(envs) + 1  # keep them all
    for env in envs:
        stats.feed(env)
    snap = stats.snapshot()["violations"]
    assert snap["count"] == sum(snap["by_kind"].values())
    return [(v["lsn"], v["session_id"], v["kind"]) for v in snap["first"]], snap["by_kind"]


def verify_violations(envs: list[Envelope]) -> list[tuple[int, str, str]]:
    check = LifecycleCheck()
    return [(v.lsn, v.session_id, v.kind.value) for e in envs for v in check.feed(e.lsn, e.session_id, e.session_seq, event_tag(e.body))]


class _RecordedLog:
    """Just what the engine's restart fold reads: the records, nothing open
    (so it appends nothing)."""

    def __init__(self, envs: list[Envelope]) -> None:
        self._envs = envs
        self.next_lsn = len(envs)

    def read(self, from_lsn: int = 0, *, raw: bool = False) -> Any:
        from agentlog.events.log.read import RawRecord

        return iter([RawRecord.of_envelope(e) if raw else e for e in self._envs[from_lsn:]])

    def open_sessions(self) -> dict[str, int]:
        return {}


def engine_violation_count(envs: list[Envelope]) -> int:
    engine = asyncio.run(SessionEngine.open(_RecordedLog(envs)))
    return engine.stats["violations"]


def pipeline_first_violation(envs: list[Envelope]) -> tuple[int, str, str] | None:
    reducer = Reducer()
    try:
        reducer.feed_many(envs)
    except ReduceError as exc:
        return exc.lsn, exc.session_id, exc.kind
    return None


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32 - 1),
    faults=st.lists(st.tuples(st.sampled_from(FAULTS), st.integers(min_value=0, max_value=10_000)), max_size=4),
)
def test_every_fold_finds_the_same_violations(seed, faults):
    envs = inject(list(RandomStream(seed, max_groups=3, max_turns=3).log().read(0)), faults)
    shown = replay_violations(envs)
    counted, by_kind = stats_violations(envs)
    assert counted == shown
    assert verify_violations(envs) == shown
    assert engine_violation_count(envs) == len(shown)
    assert by_kind == {k: sum(1 for v in shown if v[2] == k) for k in {v[2] for v in shown}}
    first = pipeline_first_violation(envs)
    if first is not None and first[2] is None:
        # A data error the lifecycle does not judge (a turn_index recorded twice, which a
        # duplicated event with a valid sequence number makes) may stop the pipeline first;
        # it is never later than the first lifecycle violation.
        assert not shown or first[0] <= shown[0][0], (first, shown[0])
    else:
        assert first == (shown[0] if shown else None)
    assert all(kind in {k.value for k in ViolationKind} for _, _, kind in shown)
    if not faults:
        assert shown == []


@pytest.mark.parametrize(
    "faults, kind",
    [
        ([("bump_seq", 3)], "seq_gap"),
        ([("lower_seq", 3)], "seq_repeat"),
        ([("after_terminal", 10**6 - 1)], "after_terminal"),
        ([("duplicate", 0)], "reused_id"),
        ([("drop", 0)], "never_opened"),
    ],
)
def test_each_fault_is_reported_as_its_kind(faults, kind):
    """A hand-made session of one turn: each fault yields exactly the kind it should."""
    from reduce_streams import Script, log_of

    valid = list(log_of(Script("s").turn([], [1, 2], [3]).finish(1.0)).read(0))
    envs = inject(valid, faults)
    shown = replay_violations(envs)
    assert shown and shown[0][1] == "s" and shown[0][2] == kind, shown
    assert verify_violations(envs) == shown == stats_violations(envs)[0]
    assert pipeline_first_violation(envs) == shown[0]
