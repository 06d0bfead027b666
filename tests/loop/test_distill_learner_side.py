"""The loop learner and on-policy distillation: a group a teacher did not fully
score is skipped whole with a "distill: ..." reason when distill_coef > 0, and
trains as usual when it is 0."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import torch

from agentlog.loop.trainer import LoopLearner, distill_refusal
from agentlog.loop.learner_records import step_digest
from agentlog.reducers.groups import Group
from agentlog.reducers.partitioned import ReleasedGroup

from loop_helpers import build_groups, small_config

GOOD = [("finish", 1.0, 0, -0.1), ("finish", 0.0, 0, -0.1), ("finish", 1.0, 0, -0.1), ("finish", 0.0, 0, -0.1)]


def scored(group: Group, *, unscored: tuple[str, int] | None = None, error: str | None = None) -> Group:
    """``group`` with every response token of its valid members scored by a
    teacher at log-prob -0.5 (aborted sessions are never scored), except response position ``unscored[1]`` of session ``unscored[0]``; ``error``
    marks the first session's rows as failed by a teacher."""
    members = []
    for m in group.members:
        if not m.valid:
            members.append(m)
            continue
        samples = []
        for s in m.samples:
            mask = np.ones(s.response_length, np.uint8)
            if unscored is not None and unscored[0] == s.session_id:
                mask[unscored[1]] = 0
            meta = dict(s.metadata)
            if error is not None and m is group.members[0]:
                meta["teacher_error"] = error
            samples.append(msgspec.structs.replace(
                s, teacher_log_probs=np.where(mask, -0.5, 0.0).astype("<f4").tobytes(),
                teacher_scored=mask.tobytes(), metadata=meta))
        members.append(msgspec.structs.replace(m, samples=tuple(samples)))
    return msgspec.structs.replace(group, members=tuple(members))


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_group_with_an_unscored_trained_token_is_skipped_when_distilling(tmp_path: Path) -> None:
    groups = build_groups({"holes": GOOD, "ok": GOOD})
    first_trained = int(np.flatnonzero(groups["holes"].members[1].samples[0].mask)[0])
    holes = scored(groups["holes"], unscored=("holes-s1", first_trained))
    ok = scored(groups["ok"])
    released = [ReleasedGroup(0, holes, ()), ReleasedGroup(0, ok, ())]

    ll = LoopLearner(tmp_path / "distill", small_config(learner={"distill_coef": 0.5}))
    rec = ll.train_step(1, released, 0, 10, {})
    assert rec.groups == ["ok"] and list(rec.skipped) == ["holes"]
    assert rec.skipped["holes"].startswith("distill: session holes-s1 row 0: ")
    assert "have no teacher score" in rec.skipped["holes"]
    assert rec.sample_digest == step_digest([ok]) and rec.policy_version == 1
    assert rec.metrics["distill/scored_frac"] == 1.0 and rec.metrics["rollout/distill_refused"] == 0.0
    # It trained exactly as the scored group alone would.
    alone = LoopLearner(tmp_path / "alone", small_config(learner={"distill_coef": 0.5}))
    alone.train_step(1, [ReleasedGroup(0, ok, ())], 0, 10, {})
    pa, pb = _params(ll.model), _params(alone.model)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)

    # Without distillation the same group trains, teacher holes or not.
    plain = LoopLearner(tmp_path / "plain", small_config())
    rec = plain.train_step(1, released, 0, 10, {})
    assert rec.groups == ["holes", "ok"] and rec.skipped == {}


def test_unscored_and_failed_groups_have_a_distill_reason() -> None:
    groups = build_groups({"bare": GOOD, "ok": GOOD, "dead": [("abort", 0.0, 0, 0.0)] * 2 + GOOD[:2]})
    assert distill_refusal(scored(groups["ok"])) == ""
    assert distill_refusal(groups["bare"]) == "distill: session bare-s0 row 0: no teacher scored its trained tokens"
    failed = distill_refusal(scored(groups["ok"], error="big@v1: timeout after 5 s"))
    assert failed.startswith("distill: session ok-s0 row 0: ") and "big@v1: timeout after 5 s" in failed
    # Aborted members carry no trained token: only the valid members need scores.
    assert distill_refusal(scored(groups["dead"])) == ""


async def _teacher(h, turn_index: int, output_ids: list[int]) -> None:
    """Scores every turn at rollout log-prob - 0.25 (so rollout - teacher = 0.25),
    with a top-2; fails on turn 1 of session ``bad-s2``."""
    if h.session_id == "bad-s2" and turn_index == 1:
        await h.record_teacher_failure(turn_index, teacher="big", teacher_version="v1", error="timeout after 5 s")
        return
    n = len(output_ids)
    ids = [[t, (t + 1) % 16] for t in output_ids]
    await h.record_teacher_scores(turn_index, teacher="big", teacher_version="v1", temperature=1.0,
                                  log_probs=[-0.35] * n, top_ids=ids, top_log_probs=[[-0.35, -1.5]] * n)


def test_teacher_scores_recorded_through_the_engine_train_and_a_failed_teacher_skips_its_group(tmp_path: Path) -> None:
    """End to end: the engine records teacher_scored events, the reducers align
    them, and the learner distills on them (reverse KL 0.25 on every trained
    token, all scored, top-K used); the group whose teacher timed out on one
    trained turn is skipped with the teacher's error as the reason."""
    groups = build_groups({"good": GOOD, "bad": GOOD}, teacher=_teacher)
    cfg = small_config(learner={"distill_coef": 0.5, "distill_topk_coef": 0.1})
    ll = LoopLearner(tmp_path, cfg)
    rec = ll.train_step(1, [ReleasedGroup(0, groups["good"], ()), ReleasedGroup(0, groups["bad"], ())], 0, 10, {})
    assert rec.groups == ["good"] and rec.policy_version == 1
    assert rec.skipped["bad"].startswith("distill: session bad-s2 row 0: ") and "timeout after 5 s" in rec.skipped["bad"]
    assert rec.metrics["distill/scored_frac"] == 1.0
    assert abs(rec.metrics["distill/reverse_kl"] - 0.25) < 1e-6
    assert rec.metrics["distill/topk_kl"] > 0.0
