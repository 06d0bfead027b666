"""The learner over several partitions: whatever order the partitions' events
arrive in, replaying the learner log against the partitions rebuilds exactly
the batches it trained (groups, tensors, digests); a restart consumes every
group once; a record that does not match its partitions is named."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events.schema.types import MemberRef
from agentlog.learner.batching import make_batches
from agentlog.loop.learner_restart import resume_point
from agentlog.loop.trainer import LoopLearner, StepCutter
from agentlog.loop.learner_records import step_digest
from agentlog.reducers.partitioned import PartitionFold, rebuild_batches, reduce_partitions

from loop_helpers import play_groups, small_config

GROUPS_PER_STEP = 3


def _partition_specs(pid: int, n_partitions: int, rng: random.Random) -> dict:
    """Groups dealt to partition ``pid`` as a worker deals them (g % n == pid),
    members finishing, aborting or dropping; some groups all aborted."""
    specs = {}
    for batch in range(2):
        for g in range(8):
            if g % n_partitions != pid:
                continue
            members = []
            for _ in range(4):
                roll = rng.random()
                outcome = "abort" if roll < 0.15 else "drop" if roll < 0.22 else "finish"
                members.append((outcome, float(rng.random() < 0.5), 0, -0.7))
            if rng.random() < 0.1:
                members = [("abort", 0.0, 0, 0.0)] * 4
            specs[f"b{batch:05d}-g{g:02d}"] = members
    return specs


@pytest.fixture(scope="module")
def partition_sets() -> dict[int, dict[int, list]]:
    """For 2..5 partitions, each partition's envelopes, written by the real engine."""
    out = {}
    for n in range(2, 6):
        rng = random.Random(n)
        out[n] = {pid: list(play_groups(_partition_specs(pid, n, rng), seed=pid).read(0)) for pid in range(n)}
    return out


def _arrival(parts: dict[int, list], order: list[int]) -> list[tuple[int, object]]:
    """Interleave the partitions: ``order`` names the partition of each next event."""
    cursors = {pid: iter(envs) for pid, envs in parts.items()}
    return [(pid, next(cursors[pid])) for pid in order]


def _tensors(groups) -> list[torch.Tensor]:
    samples = [s for g in groups for m in g.members if m.valid for s in m.samples if not s.remove_sample]
    out = []
    for b in make_batches(samples):
        out += [b.input_ids, b.targets, b.loss_mask, b.rollout_log_probs, b.predict_index]
    return out


def _learner_config():
    """Steps of GROUPS_PER_STEP groups, on a one-layer GPT of width 16: what these tests check (which
    groups each step trains, their tensors and digests) does not depend on the model, and its
    train_step costs a tenth of the default GPT's."""
    return small_config(groups_per_step=GROUPS_PER_STEP, d_model=16, n_layer=1, n_head=2)


def _draw_run(data, partition_sets, tmp_path_factory):
    """Draw 2..5 partitions and an arrival order of their events; a fresh learner."""
    parts = partition_sets[data.draw(st.integers(2, 5), label="partitions")]
    labels = [pid for pid, envs in parts.items() for _ in envs]
    order = data.draw(st.permutations(labels), label="arrival")
    return parts, LoopLearner(tmp_path_factory.mktemp("learner"), _learner_config()), order


def _online(learner: LoopLearner, arrival, consumed=None, fold=None, first_step: int = 1):
    """Drive the learner's own step cutting and ``train_step`` over ``arrival``;
    the records it would append, each with the groups it trained."""
    cfg = learner.cfg
    fold = fold or PartitionFold(cfg.reduce_config())
    cutter = StepCutter(fold, consumed if consumed is not None else set(), GROUPS_PER_STEP)
    out = []
    step = first_step
    for pid, env in arrival:
        batch = cutter.feed(pid, env)
        if batch is None:
            continue
        record = learner.train_step(step, batch, -1, -1, cutter.released_at)
        record = msgspec.structs.replace(record, frontier=dict(fold.frontier), low_water=fold.low_water())
        trained = [r.group for r in batch if r.group.group_id in record.groups]
        out.append((record, trained))
        cutter.consumed_batch(batch)
        step += 1
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_arrival_order_replays_to_the_batches_tensors_and_digests_trained(partition_sets, tmp_path_factory, data) -> None:
    """Hypothesis over shuffled arrival of 2..5 partitions: every record the
    learner writes, replayed against the partitions alone, gives the same
    groups in the same order, the same micro-batch tensors and the same digest."""
    parts, learner, order = _draw_run(data, partition_sets, tmp_path_factory)
    online = _online(learner, _arrival(parts, order))
    assert online, "no step was cut"
    released = reduce_partitions(parts, learner.cfg.reduce_config())
    rebuilt = list(rebuild_batches([rec for rec, _ in online], released))
    for (rec, trained), again in zip(online, rebuilt):
        assert again.problems == []
        assert [g.group_id for g in again.trained] == [g.group_id for g in trained] == rec.groups
        assert step_digest(again.trained) == rec.sample_digest == step_digest(trained)
        a, b = _tensors(trained), _tensors(again.trained)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    # Each consumed group is named once, with its partition, as the partition released it.
    consumed = [(ref.partition, ref.group_id) for rec, _ in online for ref in rec.batch]
    assert len(consumed) == len(set(consumed))
    for pid, gid in consumed:
        assert gid in released[pid]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_restart_from_the_per_partition_low_water_marks_consumes_every_group_once(partition_sets, tmp_path_factory, data) -> None:
    """Cut the learner after some steps, restart it from its records (per
    partition low-water marks and in-flight windows), feed each partition
    again from its mark in another arrival order: every released group is
    consumed exactly once over both lives, and every record replays."""
    parts, learner, order = _draw_run(data, partition_sets, tmp_path_factory)
    first = _online(learner, _arrival(parts, order))
    keep = data.draw(st.integers(1, len(first)), label="steps before the crash")
    records = [rec for rec, _ in first[:keep]]
    consumed, read_from, windows, _ = resume_point(records)
    fold = PartitionFold(learner.cfg.reduce_config(), parts, windows=windows, start=read_from)
    tail = {pid: [e for e in envs if e.lsn >= read_from.get(pid, 0)] for pid, envs in parts.items()}
    labels = [pid for pid, envs in tail.items() for _ in envs]
    order2 = data.draw(st.permutations(labels), label="arrival after the restart")
    second = _online(learner, _arrival(tail, order2), consumed=consumed, fold=fold, first_step=keep + 1)
    all_records = records + [rec for rec, _ in second]
    names = [(ref.partition, ref.group_id) for rec in all_records for ref in rec.batch]
    assert len(names) == len(set(names)), "a group was consumed twice"
    released = reduce_partitions(parts, learner.cfg.reduce_config())
    leftover = len({(pid, gid) for pid, groups in released.items() for gid in groups} - set(names))
    assert leftover < GROUPS_PER_STEP  # only the last, uncut step's groups remain
    for rec, again in zip(all_records, rebuild_batches(all_records, released)):
        assert again.problems == [] and step_digest(again.trained) == rec.sample_digest


def test_a_record_that_does_not_match_its_partitions_is_named(partition_sets, tmp_path: Path) -> None:
    """A member's terminal LSN, a group's partition and a group id that the
    partitions do not hold are each reported, naming the step and partition."""
    parts = partition_sets[2]
    learner = LoopLearner(tmp_path, _learner_config())
    rec, _ = _online(learner, _arrival(parts, [pid for pid, envs in parts.items() for _ in envs]))[0]
    released = reduce_partitions(parts, learner.cfg.reduce_config())
    ref = rec.batch[0]
    bad_member = msgspec.structs.replace(ref, members=[MemberRef(ref.members[0].session_id, ref.members[0].terminal_lsn + 1)] + ref.members[1:])
    other = 1 - ref.partition
    for bad, expect in [
        (bad_member, "members recorded"),
        (msgspec.structs.replace(ref, partition=other), f"not released in partition p{other:04d}"),
        (msgspec.structs.replace(ref, group_id="b09999-g00"), "b09999-g00 is not released"),
    ]:
        tampered = msgspec.structs.replace(rec, batch=[bad] + rec.batch[1:])
        problems = next(rebuild_batches([tampered], released)).problems
        assert any(expect in p and f"step {rec.step}" in p for p in problems), problems
