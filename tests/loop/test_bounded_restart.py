"""A restart from the learner's low-water LSN equals a restart from LSN 0.

The learner records, with each step, the oldest ``session_opened`` of any
member of a group still pending in its reducer; a restart replays the
rollout log from there through :class:`InFlightWindow`. These tests check
that it releases the same groups, in the same order, with the same samples,
as a fold from 0, on logs whose groups straddle each other."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import PolicyUpdated
from agentlog.events import FileLog
from agentlog.loop.publish import publish
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.learner_restart import read_resume_records, resume_point
from agentlog.loop.trainer import LoopLearner
from agentlog.reducers.errors import ReduceError
from agentlog.reducers.pipeline import InFlightWindow, Reducer
from agentlog.reducers.samples import digest_samples

from interleaved import record_interleaved
from loop_helpers import small_config

_LOGS: dict[int, list] = {}


def _envelopes(seed: int) -> list:
    if seed not in _LOGS:
        log = MemoryLog()
        record_interleaved(log, seed=seed, groups=24, in_flight=14)
        _LOGS[seed] = list(log.read(0))
    return _LOGS[seed]


def _released(reducer: Reducer, envelopes, window: InFlightWindow | None = None):
    """(lsn, group id, digest of its samples) for every group released."""
    out = []
    for env in envelopes:
        if window is not None and not window.admits(env):
            continue
        for g in reducer.feed(env).groups:
            out.append((env.lsn, g.group_id, digest_samples(list(g.samples))))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 3), cut=st.floats(0.0, 1.0))
def test_a_fold_resumed_at_the_low_water_mark_releases_what_a_fold_from_zero_releases(seed: int, cut: float) -> None:
    """Cut a fold from 0 after any envelope: the groups released so far are
    settled and the reducer's oldest in-flight LSN is the mark. A fresh
    reducer fed the window from the mark releases exactly the groups the
    fold from 0 releases after the cut, in the same order, same samples."""
    envs = _envelopes(seed)
    c = min(int(cut * len(envs)), len(envs) - 1)
    full = Reducer()
    before = _released(full, envs[: c + 1])
    through = envs[c].lsn
    oldest = full.oldest_in_flight_lsn()
    low = through + 1 if oldest is None else oldest
    after = _released(full, envs[c + 1:])
    settled = {gid for _, gid, _ in before}
    resumed = _released(Reducer(), [e for e in envs if e.lsn >= low], InFlightWindow(through, settled))
    assert resumed == after
    assert {gid for _, gid, _ in after}.isdisjoint(settled)


def test_the_window_leaves_out_members_of_settled_groups_and_sessions_opened_before_the_mark() -> None:
    """Where groups straddle the mark the window must filter: fed whole from the
    mark, a fresh reducer meets events of sessions it never saw open."""
    envs = _envelopes(0)
    full = Reducer()
    settled: set[str] = set()
    for c, env in enumerate(envs):
        settled |= {g.group_id for g in full.feed(env).groups}
        oldest = full.oldest_in_flight_lsn()
        if settled and oldest is not None and oldest > envs[0].lsn:
            straddle = [e for e in envs[oldest: c + 1] if e.session_id and not isinstance(e.body, PolicyUpdated)]
            opened_in = {e.session_id for e in envs[oldest: c + 1] if e.body.__struct_config__.tag == "session_opened"}
            if any(e.session_id not in opened_in for e in straddle):
                break
    else:
        raise AssertionError("the recorded log has no cut where a session straddles the mark")
    with pytest.raises(ReduceError):  # the reducer refuses a session it never saw open
        Reducer().feed_many(envs[oldest:])
    # Through the window, the same records fold cleanly.
    window = InFlightWindow(envs[c].lsn, settled)
    Reducer().feed_many(e for e in envs[oldest:] if window.admits(e))


def _run_learner(run: Path, cfg, max_steps: int) -> None:
    asyncio.run(asyncio.wait_for(LoopLearner(run, cfg).run(max_steps=max_steps), timeout=120))


def _without_low_water(run: Path, src: Path) -> None:
    """Rewrite ``run``'s learner log as a learner from before the fields wrote it
    (no ``lsn_low_water`` nor ``records_from_lsn``), its checkpoints pointing into ``run``."""
    records = read_learner_records(src / "learner")
    shutil.rmtree(run / "learner")
    llog = FileLog.open(run / "learner", fsync="batch")
    try:
        for r in records:
            ckpt = r.checkpoint.replace(str(src), str(run))
            publish(llog, msgspec.structs.replace(r, lsn_low_water=-1, records_from_lsn=-1, checkpoint=ckpt))
    finally:
        llog.close()


def test_a_learner_restarted_from_its_low_water_mark_trains_what_a_restart_from_zero_trains(tmp_path: Path) -> None:
    """Drive the loop's learner on a recorded rollout log of straddling groups:
    train eight steps of one group each (so groups in flight at the cut were
    opened several steps back), stop, copy the run. Restart one copy as is (from the
    recorded low-water mark) and the other with the mark removed (from LSN 0):
    the next steps train the same groups, skip the same, and give the same
    sample digests and policy versions."""
    cfg = small_config(steps=30, groups_per_step=1, stop_window=1, stop_reward=0.0)
    a = tmp_path / "a"
    a.mkdir()
    cfg.save(a / "config.json")
    rollout = FileLog.open(a / "rollout", fsync="batch")
    try:
        record_interleaved(rollout, seed=5, groups=40, in_flight=16)
    finally:
        rollout.close()
    _run_learner(a, cfg, 8)
    first = read_learner_records(a / "learner")
    assert len(first) == 9
    assert 0 < first[-1].lsn_low_water <= first[-1].lsn_end, first[-1]
    # The restart reads the learner log's tail only, but more than its last record.
    assert 0 < first[-1].records_from_lsn < len(first) - 1, first[-1]
    b = tmp_path / "b"
    shutil.copytree(a, b)
    _without_low_water(b, a)
    _run_learner(a, cfg, 8)
    _run_learner(b, cfg, 8)
    ra, rb = read_learner_records(a / "learner")[9:], read_learner_records(b / "learner")[9:]
    assert len(ra) == len(rb) == 8
    for x, y in zip(ra, rb):
        assert (x.step, x.policy_version, x.groups, x.skipped, x.sample_digest, x.lsn_start, x.lsn_end, x.lsn_low_water) == (
            y.step, y.policy_version, y.groups, y.skipped, y.sample_digest, y.lsn_start, y.lsn_end, y.lsn_low_water)
    consumed = [g for r in read_learner_records(a / "learner") for g in [*r.groups, *r.skipped]]
    assert len(consumed) == len(set(consumed)), "a group was consumed twice"
    assert any(r.groups for r in ra)


class _PolicyUpdatedBeforeLowWater(msgspec.Struct, frozen=True, tag="policy_updated"):
    """``policy_updated`` as a learner wrote it before the low-water fields."""

    step: int
    policy_version: int
    checkpoint: str = ""
    metrics: dict[str, float] = {}
    sample_digest: str = ""
    lsn_start: int = -1
    lsn_end: int = -1
    groups: list[str] = []
    skipped: dict[str, str] = {}


def test_a_learner_log_from_before_the_low_water_fields_resumes_from_zero() -> None:
    """Old records decode with both fields at -1; the learner then reads its whole
    log and replays the rollout log from LSN 0 with nothing filtered."""
    old = [_PolicyUpdatedBeforeLowWater(step=i, policy_version=i, lsn_start=10 * i - 9 if i else -1,
                                        lsn_end=10 * i if i else -1, groups=[f"g{i}"] if i else []) for i in range(4)]
    records = [msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=PolicyUpdated) for r in old]
    assert all(r.lsn_low_water == -1 and r.records_from_lsn == -1 for r in records)
    llog = MemoryLog()
    for r in records:
        publish(llog, r)
    read = read_resume_records(llog)
    assert [lsn for lsn, _ in read] == [0, 1, 2, 3] and [r for _, r in read] == records
    consumed, read_from, windows, lost = resume_point(records)
    assert consumed == {(0, "g1"), (0, "g2"), (0, "g3")} and read_from == {} and not lost
    window = windows[0]
    assert window.through_lsn == -1
    assert all(window.admits(env) for env in _envelopes(0)[:200])
