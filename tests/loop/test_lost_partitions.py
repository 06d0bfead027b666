"""A partition declared lost ([rollout] lost_after_s) is one that wrote nothing for that long *while
the learner waits for groups*: time spent training a step is no partition's silence. Once declared,
it stays lost across a learner restart, even once what a restart reads has moved past the record that
declared it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentlog.events.log.partitions import open_partition
from agentlog.events.log.writer import FileLog
from agentlog.learner.learner import Learner
from agentlog.loop.config import RolloutConfig
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.learner_restart import read_resume_records, resume_point
from agentlog.loop.trainer import LoopLearner

from loop_helpers import play_groups, small_config

GROUPS_PER_STEP = 4
STEP_S = 1.0  # a train step this long, longer than lost_after_s
LOST_AFTER_S = 0.4


def _specs(pid: int) -> dict:
    # Three batches of 4 groups, dealt as workers deal them (g % 2 == pid): 6 groups per partition.
    return {f"b{b:05d}-g{g:02d}": [("finish", float((b + g + i) % 2), 0, -0.7) for i in range(4)]
            for b in range(3) for g in range(GROUPS_PER_STEP) if g % 2 == pid}


def test_a_partition_with_unread_records_is_not_declared_lost_behind_a_long_train_step(tmp_path: Path, monkeypatch) -> None:
    cfg = small_config(steps=3, groups_per_step=GROUPS_PER_STEP, d_model=16, n_layer=1, n_head=2,
                       rollout=RolloutConfig(workers=2, lost_after_s=LOST_AFTER_S))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    # Both partitions are fully written (durable) before the learner starts.
    for pid in (0, 1):
        mem = play_groups(_specs(pid), seed=pid)
        log = open_partition(run / "rollout", pid)
        try:
            log.append_batch([(e.session_id, e.session_seq, e.body) for e in mem.read(0)])
        finally:
            log.close()
    step = Learner.step

    def slow_step(self, *args, **kwargs):  # a train step that takes a while (a real model's would)
        time.sleep(STEP_S)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "step", slow_step)
    learner = LoopLearner(run, cfg)
    asyncio.run(learner.run(max_steps=2))
    records = [r for r in read_learner_records(run / "learner") if r.step > 0]
    assert len(records) == 2
    lost = {pid: why for r in records for pid, why in r.lost_partitions.items()}
    assert not lost, f"a partition whose records were durable and unread was declared lost: {lost}"


def _play_p0(batches: range, seed: int):
    """Groups g0 and g2 of ``batches`` (partition 0's share of 2 workers), as the engine writes them."""
    specs = {f"b{b:05d}-g{g:02d}": [("finish", float((b + g + i) % 2), 0, -0.7) for i in range(4)]
             for b in batches for g in (0, 2)}
    return play_groups(specs, seed=seed)


def _write_p0(run: Path, mem) -> None:
    """Append ``mem``'s records durably to p0000."""
    log = open_partition(run / "rollout", 0)
    try:
        log.append_batch([(e.session_id, e.session_seq, e.body) for e in mem.read(0)])
    finally:
        log.close()


def test_a_lost_partition_is_still_lost_after_a_restart_once_its_record_is_no_longer_read(tmp_path: Path) -> None:
    cfg = small_config(steps=20, groups_per_step=GROUPS_PER_STEP, d_model=16, n_layer=1, n_head=2, stop_window=1,
                       rollout=RolloutConfig(workers=2, lost_after_s=0.5))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    later = _play_p0(range(3, 5), seed=1)
    _write_p0(run, _play_p0(range(0, 3), seed=0))  # 6 groups: one full step, 2 left waiting for p0001's share

    async def learn() -> None:
        learner = asyncio.ensure_future(LoopLearner(run, cfg).run(max_steps=4))
        while not any(r.lost_partitions for r in read_learner_records(run / "learner")):
            assert not learner.done(), learner.result()
            await asyncio.sleep(0.05)
        _write_p0(run, later)  # p0000 goes on: two more steps of its share
        await asyncio.wait_for(learner, 60)

    asyncio.run(learn())
    records = [r for r in read_learner_records(run / "learner") if r.step > 0]
    assert len(records) == 4 and {pid for r in records for pid in r.lost_partitions} == {1}
    llog = FileLog.open(run / "learner")  # what a restarted learner reads first
    try:
        needed = [r for _, r in read_resume_records(llog)]
    finally:
        llog.close()
    assert 1 in resume_point(needed).lost, (
        "a restarted learner forgets that p0001 was declared lost (the declaring record is before "
        "records_from_lsn): it reads p0001 again and cuts steps of the full groups_per_step")


def test_silence_is_what_a_partition_wrote_not_what_the_learner_has_read_of_it(tmp_path: Path) -> None:
    """A learner slow to reach a partition's durable records (a loaded machine, a long first read) does
    not declare it lost: the watch asks the log how far it is durable before it declares one. Read to its
    end and silent past ``lost_after_s``, a partition is declared lost, naming the last LSN read."""
    from agentlog.events.log.source import open_source
    from agentlog.loop.trainer import PartitionWatch

    root = tmp_path / "rollout"
    counts = {}
    for pid in (0, 1):
        log = open_partition(root, pid)
        try:
            counts[pid] = len(log.append_batch([(e.session_id, e.session_seq, e.body) for e in play_groups(_specs(pid), seed=pid).read(0)]))
        finally:
            log.close()
    parts = {pid: open_source(root).partition(pid) for pid in (0, 1)}
    watch = PartitionWatch.of_sources(0.2, parts)  # as the learner watches its partitions
    by_reads_alone = PartitionWatch(0.2, parts, lambda pid: 0)  # what the learner decided before it asked the log
    unread = {0: counts[0], 1: 0}  # all of p0000 read, none of p0001
    time.sleep(0.3)
    assert set(by_reads_alone.saw(0, unread)) == {1}
    assert watch.saw(0, unread) == {}, "a partition whose durable records were not read yet was declared lost"
    read = {0: counts[0], 1: counts[1]}
    assert watch.saw(1, read) == {}
    time.sleep(0.3)
    lost = watch.saw(0, read)
    assert set(lost) == {1} and f"after lsn {counts[1] - 1}" in lost[1], lost
