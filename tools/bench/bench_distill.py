"""Benchmark on-policy distillation: steps to a reward of 0.9 with OPD against RL alone.

Each seed runs the demo twice with the same seed (the same warm-up, the same
student init, the same episodes and faults), through the real two-process
loop (``loop.run.run_loop``):

* RL alone: the demo's GRPO;
* OPD: the same, plus the demo's teacher (a bigger built-in GPT that solves
  the lookup task, :mod:`agentlog.loop.demo.teacher_model`) scoring every
  turn in the worker, and the learner's ``distill_coef`` lambda.

Both arms of a seed start from the same version 0: the bench runs the
demo's supervised warm-up once per seed, in its own process on one thread
(what the learner would do at the start of each run; the warm-up is
deterministic given the seed and the thread count), and hands it to each
run's learner as its published version 0, from which the learner resumes.
Halving the warm-ups leaves the comparison unchanged.

The figure is the policy version at which the mean reward of the last 10
trained steps first reaches 0.9 (the demo's stop rule); a run that never
gets there within ``--max-steps`` counts as ``max-steps + 1``. The goal
compares the medians over the seeds.

Usage: ``python tools/bench/bench_distill.py [--quick] [--seeds N] [--coef L] [--topk K --topk-coef C]``;
a lambda sweep runs one arm: ``--only opd --seeds 1 --coef 1.0 --topk 0 --topk-coef 0``, and
``--warmups DIR`` keeps the warm-ups between invocations. ``--warmup-steps``, ``--groups-per-step``
and ``--group-size`` shrink the demo's shape (a smoke run; the defaults are the demo's).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

from agentlog.engine.tasks import select_task
from agentlog.events.schema.types import PolicyUpdated
from agentlog.learner.learner import Learner
from agentlog.events import FileLog
from agentlog.loop.config import LoopConfig
from agentlog.loop.demo import DEMO_DISTILL_COEF, DEMO_TOPK, DEMO_TOPK_COEF
from agentlog.loop.demo.teacher_model import ensure_teacher, with_teacher
from agentlog.loop.demo.warmup import supervised_warmup
from agentlog.loop.policy import build_model
from agentlog.loop.publish import checkpoint_path, publish
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.run import reward_curve, run_loop
from agentlog.tools.bench.goals import goal_line, meets

#: The demo's stop rule: the mean reward of this many trained steps reaches TARGET.
WINDOW = 10
TARGET = 0.9


def steps_to_target(records, window: int = WINDOW, target: float = TARGET) -> int | None:
    """The policy version at which the mean reward of the last ``window`` trained steps first
    reaches ``target``; None if it never does."""
    curve = reward_curve(records)
    rewards = [r for _, r, _ in curve]
    for i in range(window - 1, len(curve)):
        if sum(rewards[i - window + 1: i + 1]) / window >= target:
            return curve[i][0]
    return None


def warmed_up(base: Path, cfg: LoopConfig) -> Path:
    """The seed's version 0 (the demo's warm-up of ``cfg``), as a learner checkpoint under
    ``base``: built once, then reused by every run of the seed (and by a later bench on the
    same ``--keep`` folder)."""
    shape = "" if cfg.warmup_steps == LoopConfig.warmup_steps else f"-w{cfg.warmup_steps}"
    path = base / f"warmup-s{cfg.seed}-t{cfg.warmup_threads}{shape}.pt"
    if not path.exists():
        task = select_task(cfg.task)
        model = build_model(cfg, task)
        metrics = supervised_warmup(model, task, cfg)
        # As the learner does: the RL optimiser starts fresh after the warm-up.
        Learner(model, cfg.learner_config()).save_checkpoint(path)
        print(f"seed {cfg.seed} warm-up: {metrics['warmup/steps']:.0f} steps, loss {metrics['warmup/loss']:.3f}, "
              f"{metrics['warmup/seconds']:.0f} s", flush=True)
    return path


def start_from(run_dir: Path, cfg: LoopConfig, checkpoint: Path) -> None:
    """Publish ``checkpoint`` as the run's version 0 (step 0), so its learner resumes from it."""
    ckpt = checkpoint_path(run_dir / "checkpoints", 0)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(checkpoint, ckpt)
    llog = FileLog.open(run_dir / "learner", fsync=cfg.fsync)
    try:
        publish(llog, PolicyUpdated(step=0, policy_version=0, checkpoint=str(ckpt), metrics={"loop/final": 0.0}))
    finally:
        llog.close()


def one_run(base: Path, seed: int, *, opd: bool, coef: float, max_steps: int, topk: int = DEMO_TOPK, topk_coef: float = DEMO_TOPK_COEF,
            warmups: Path | None = None, learner: dict | None = None, shape: dict | None = None) -> dict:
    """One run of the loop from the seed's shared warm-up; returns its steps to the target,
    wall time and final reward. ``shape``: LoopConfig fields that change the demo's size
    (warmup_steps, groups_per_step, group_size; none: the demo's)."""
    run_dir = base / f"{'opd' if opd else 'rl'}-s{seed}"
    cfg = LoopConfig(seed=seed, steps=max_steps, stop_reward=TARGET, stop_window=WINDOW, time_budget_s=0, warmup_threads=1,
                     **(shape or {}))
    if learner:
        cfg = LoopConfig.from_dict({**cfg.to_dict(), "learner": {**cfg.learner, **learner}})
    start_from(run_dir, cfg, warmed_up(warmups or base, cfg))
    t_teacher = 0.0
    if opd:
        t0 = time.perf_counter()
        teacher, _ = ensure_teacher(run_dir, select_task(cfg.task), seed=seed)
        t_teacher = time.perf_counter() - t0
        cfg = with_teacher(cfg, teacher, coef, topk=topk, topk_coef=topk_coef)
    t0 = time.perf_counter()
    run_loop(cfg, run_dir)
    wall = time.perf_counter() - t0
    records = read_learner_records(run_dir / "learner")
    curve = reward_curve(records)
    kl = [r.metrics.get("distill/reverse_kl") for r in records if r.step > 0 and "distill/reverse_kl" in r.metrics]
    return {"steps": steps_to_target(records), "wall_s": wall, "teacher_s": t_teacher, "trained": len(curve),
            "last_reward": curve[-1][1] if curve else float("nan"), "kl_first": kl[0] if kl else float("nan"),
            "kl_last": kl[-1] if kl else float("nan")}


def main(argv: list[str] | None = None) -> int:
    """Run RL and OPD on every seed, print a table and the GOAL line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 seeds, at most 40 steps")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 5; --quick 2)")
    p.add_argument("--coef", type=float, default=DEMO_DISTILL_COEF,
                   help=f"distill_coef lambda of the OPD runs (default: the demo's, {DEMO_DISTILL_COEF})")
    p.add_argument("--topk", type=int, default=DEMO_TOPK, help=f"top-K tokens the teacher returns (0: none; default {DEMO_TOPK})")
    p.add_argument("--topk-coef", type=float, default=DEMO_TOPK_COEF,
                   help=f"distill_topk_coef: weight of the top-K forward KL (default {DEMO_TOPK_COEF})")
    p.add_argument("--max-steps", type=int, default=None, help="most RL steps per run (default 80; --quick 40)")
    demo = LoopConfig()
    p.add_argument("--warmup-steps", type=int, default=demo.warmup_steps, help=f"supervised warm-up steps (default {demo.warmup_steps})")
    p.add_argument("--groups-per-step", type=int, default=demo.groups_per_step, help=f"prompts per RL step (default {demo.groups_per_step})")
    p.add_argument("--group-size", type=int, default=demo.group_size, help=f"samples per prompt (default {demo.group_size})")
    p.add_argument("--only", choices=("rl", "opd"), default=None, help="run one arm only (no GOAL line)")
    p.add_argument("--learner", action="append", default=[], metavar="KEY=VALUE",
                   help="override a LearnerConfig field in both arms (repeatable; JSON values)")
    p.add_argument("--warmups", type=Path, default=None, help="keep (and reuse) the seeds' warm-ups in this directory")
    p.add_argument("--keep", type=Path, default=None, help="keep the run folders under this directory")
    args = p.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 5)
    max_steps = args.max_steps if args.max_steps is not None else (40 if args.quick else 80)
    if seeds < 1 or max_steps < WINDOW:
        p.error(f"--seeds {seeds} --max-steps {max_steps}: expected at least 1 seed and {WINDOW} steps")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    base = Path(tempfile.mkdtemp(prefix="bench_distill_")) if args.keep is None else args.keep
    base.mkdir(parents=True, exist_ok=True)
    if args.warmups is not None:
        args.warmups.mkdir(parents=True, exist_ok=True)
    learner = {}
    for item in args.learner:
        key, sep, raw = item.partition("=")
        try:
            learner[key.strip()] = json.loads(raw)
        except ValueError:
            p.error(f"--learner {item!r}: expected KEY=VALUE with a JSON value")
        if not sep or not key.strip():
            p.error(f"--learner {item!r}: expected KEY=VALUE")
    shape = {"warmup_steps": args.warmup_steps, "groups_per_step": args.groups_per_step, "group_size": args.group_size}
    arms = [a for a in ("rl", "opd") if args.only in (None, a)]
    results: dict[str, list[dict]] = {a: [] for a in arms}
    try:
        for seed in range(seeds):
            for arm in arms:
                r = one_run(base, seed, opd=arm == "opd", coef=args.coef, max_steps=max_steps, topk=args.topk,
                            topk_coef=args.topk_coef, warmups=args.warmups, learner=learner, shape=shape)
                results[arm].append(r)
                print(f"seed {seed} {arm:<3} steps to {TARGET}: {r['steps'] if r['steps'] is not None else f'>{max_steps}':>4}  "
                      f"trained {r['trained']:>3}  last reward {r['last_reward']:.2f}  wall {r['wall_s']:.0f} s"
                      + (f"  teacher build {r['teacher_s']:.1f} s  reverse KL {r['kl_first']:.2f} -> {r['kl_last']:.2f}"
                         if arm == "opd" else ""), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)

    print()
    print(f"lookup demo ({args.groups_per_step} prompts x {args.group_size} samples per step, "
          f"one shared warm-up of {args.warmup_steps} steps per seed, faults on, "
          f"1 thread per process), "
          f"seeds 0..{seeds - 1}, OPD lambda {args.coef}, top-{args.topk} forward KL x {args.topk_coef}; steps = policy versions to a {WINDOW}-step mean reward of {TARGET} "
          f"(never: {max_steps + 1})")
    print(f"{'arm':<5} {'median':>7} {'min':>5} {'max':>5} {'reached':>8} {'wall s/run':>11}")
    med: dict[str, float] = {}
    for arm, rs in results.items():
        steps = [r["steps"] if r["steps"] is not None else max_steps + 1 for r in rs]
        med[arm] = statistics.median(steps)
        reached = sum(r["steps"] is not None for r in rs)
        print(f"{arm:<5} {med[arm]:>7.1f} {min(steps):>5} {max(steps):>5} {reached:>5}/{len(rs):<2} "
              f"{statistics.mean(r['wall_s'] for r in rs):>11.1f}")
    if len(arms) == 2:
        ratio = med["opd"] / med["rl"]
        print(goal_line("opd_steps_to_0.9_vs_rl", f"{ratio:.2f}x", "<=", "0.5x", meets(ratio, "<=", 0.5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
