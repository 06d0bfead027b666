"""The demo's teacher (loop/demo/teacher_model.py): a bigger built-in GPT that solves lookup.

Built once per module (a few seconds on one thread); the checks read it back
the way the loop's processes do, from ``<run>/teacher/policy.pt``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentlog.engine.tasks import select_task
from agentlog.learner.learner import read_policy
from agentlog.learner.model import GPT
from agentlog.loop.config import ConfigError, LoopConfig
from agentlog.loop.demo.teacher_model import (
    TEACHER_META,
    TeacherRecipe,
    ensure_teacher,
    rollout_solve_rate,
    teacher_path,
)
from agentlog.loop.teacher import TorchTeacher, state_dict_digest


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, dict]:
    run = tmp_path_factory.mktemp("run")
    path, meta = ensure_teacher(run, select_task("lookup"), seed=0)
    return run, path, meta


def load(path: Path) -> GPT:
    state, config = read_policy(path)
    return GPT.from_state_dict(state, config).eval()


@pytest.mark.required
def test_teacher_is_bigger_and_solves_lookup_with_the_tasks_verifier(built) -> None:
    """Read back from the run folder, the teacher solves >= 95% of 1000 fresh lookup episodes
    sampled at temperature 1 (the task's tool between turns, its verifier at the end), and it
    is bigger than the student the demo trains."""
    run, path, meta = built
    assert path == teacher_path(run) and path.is_file()
    model = load(path)
    student = LoopConfig()
    assert model.config.d_model > student.d_model and model.config.n_layer > student.n_layer
    assert model.config.n_head == TeacherRecipe().n_head  # recorded with the weights, not guessed
    rate = rollout_solve_rate(model, select_task("lookup"), episodes=1000, seed=12345, temperature=1.0)
    assert rate >= 0.95, f"teacher solve rate {rate}"
    assert meta["solve_rate"] >= 0.95 and meta["steps"] <= TeacherRecipe().max_steps


def test_the_student_after_the_demos_warmup_does_not_solve_lookup() -> None:
    """The measurement can fail: the student's own warm-up (85% wrong answers) leaves it far below 0.95."""
    from agentlog.loop.demo.warmup import supervised_warmup
    from agentlog.loop.policy import build_model

    task = select_task("lookup")
    cfg = LoopConfig(warmup_steps=40, warmup_batch=64, warmup_threads=1)
    model = build_model(cfg, task)
    supervised_warmup(model, task, cfg)
    assert rollout_solve_rate(model, task, episodes=500, seed=12345) < 0.5


def test_teacher_is_deterministic_from_its_seed_and_cached_in_the_run(built, tmp_path: Path) -> None:
    """Built again in another folder from the same seed: the same weights digest. The run's copy
    is reused (not rebuilt) and its file has the recorded digest; a file changed after the build,
    or a different seed on the same folder, is refused with the reason."""
    run, path, meta = built
    assert meta["digest"].startswith("sha256:")
    assert state_dict_digest(load(path)) == meta["digest"] == TorchTeacher.from_checkpoint(path).version
    task = select_task("lookup")
    _, again = ensure_teacher(tmp_path / "other", task, seed=0)
    assert again["digest"] == meta["digest"]

    mtime = path.stat().st_mtime_ns
    _, cached = ensure_teacher(run, task, seed=0)
    assert cached == meta and path.stat().st_mtime_ns == mtime

    with pytest.raises(ConfigError, match="built for"):
        ensure_teacher(run, task, seed=1)

    # Change one weight of the other folder's copy: its digest no longer matches teacher.json.
    other = teacher_path(tmp_path / "other")
    state = torch.load(other, weights_only=True)
    state["model"]["ln_f.weight"][0] += 1.0
    torch.save(state, other)
    with pytest.raises(ConfigError, match="digest"):
        ensure_teacher(tmp_path / "other", task, seed=0)
    assert json.loads((other.parent / TEACHER_META).read_text())["digest"] == meta["digest"]


@pytest.mark.required
def test_demo_distill_scores_every_turn_with_the_runs_teacher_and_checks_equal(tmp_path: Path, capsys) -> None:
    """`agentlog demo --distill` (2 short RL steps, faults on): the teacher is built into the run
    folder, every finished session's turns carry its scores recorded under its weights digest, the
    learner trains with lambda and reports the reverse KL, and the offline check is EQUAL."""
    from agentlog.events.schema.types import SessionFinished, TeacherScored, TurnDelta, TurnRecorded
    from agentlog.events import read_log
    from agentlog.loop.check import check_run
    from agentlog.loop.demo import DEMO_DISTILL_COEF, DEMO_TOPK, DEMO_TOPK_COEF, TEACHER_NAME
    from agentlog.loop.learner_records import read_learner_records
    from agentlog.tools.cli import main as cli_main
    from short_demo import SHORT_DEMO_ARGS

    out = tmp_path / "run"
    rc = cli_main([*SHORT_DEMO_ARGS, "--distill", "--no-report", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "EQUAL (2/2 steps equal" in printed, printed
    assert check_run(out).ok
    meta = json.loads((out / "teacher" / TEACHER_META).read_text())
    cfg = LoopConfig.load(out / "config.json")
    lcfg = cfg.learner_config()
    assert (lcfg.distill_coef, lcfg.distill_topk_coef, cfg.distill.topk) == (DEMO_DISTILL_COEF, DEMO_TOPK_COEF, DEMO_TOPK)
    assert [t.checkpoint for t in cfg.distill.teachers] == [str(teacher_path(out).resolve())]

    turns: dict[str, int] = {}
    scored: dict[str, set[int]] = {}
    finished = set()
    for env in read_log(out / "rollout", 0):
        body = env.body
        if isinstance(body, (TurnRecorded, TurnDelta)):  # a turn is recorded whole or as a delta
            turns[env.session_id] = turns.get(env.session_id, 0) + 1
        elif isinstance(body, TeacherScored):
            assert (body.teacher, body.teacher_version, body.error, body.top_k) == (TEACHER_NAME, meta["digest"], "", DEMO_TOPK)
            scored.setdefault(env.session_id, set()).add(body.turn_index)
        elif isinstance(body, SessionFinished):
            finished.add(env.session_id)
    assert finished
    for sid in finished:
        assert scored.get(sid) == set(range(turns[sid])), sid

    records = read_learner_records(out / "learner")
    trained = [r for r in records if r.step > 0 and r.groups]
    assert trained and all(r.metrics["distill/scored_frac"] == 1.0 for r in trained)
    assert all(r.metrics["distill/reverse_kl"] > 0 and r.metrics["distill/topk_kl"] > 0 for r in trained)  # far from the teacher


def test_demo_distill_coef_needs_distill(tmp_path: Path, capsys) -> None:
    """--distill-coef without --distill, or lambda <= 0, is refused before any run folder exists."""
    from agentlog.tools.cli import main as cli_main

    assert cli_main(["demo", "--distill-coef", "0.5", "--out", str(tmp_path / "a")]) == 2
    assert cli_main(["demo", "--distill", "--distill-coef", "0", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--distill-coef: only with --distill" in err and "expected a number > 0" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
