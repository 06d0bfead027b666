"""Benchmark on-policy distillation: steps to a reward of 0.9 with OPD against RL alone.

Each seed runs the demo twice with the same seed (the same warm-up, the same
student init, the same episodes and faults), through the real two-process
loop (``loop.run.run_loop``):

* RL alone: the demo's GRPO;
* OPD: the same, plus the demo's teacher (a bigger built-in GPT that solves
  the lookup task, :mod:`agentlog.loop.demo.teacher_model`) scoring every
  turn in the worker, and the learner's ``distill_coef`` lambda.

The figure is the policy version at which the mean reward of the last 10
trained steps first reaches 0.9 (the demo's stop rule); a run that never
gets there within ``--max-steps`` counts as ``max-steps + 1``. The goal
compares the medians over the seeds.

Usage: ``python tools/bench/bench_distill.py [--quick] [--seeds N] [--coef L]``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import structlog

from agentlog.engine.tasks import select_task
from agentlog.loop.config import LoopConfig
from agentlog.loop.demo.teacher_model import ensure_teacher, with_teacher
from agentlog.loop.publish import read_learner_records
from agentlog.loop.run import reward_curve, run_loop

#: The demo's stop rule: the mean reward of this many trained steps reaches TARGET.
WINDOW = 10
TARGET = 0.9
#: Default lambda (from the sweep quoted in the README).
DEFAULT_COEF = 1.0


def steps_to_target(records, window: int = WINDOW, target: float = TARGET) -> int | None:
    """The policy version at which the mean reward of the last ``window`` trained steps first
    reaches ``target``; None if it never does."""
    curve = reward_curve(records)
    rewards = [r for _, r, _ in curve]
    for i in range(window - 1, len(curve)):
        if sum(rewards[i - window + 1: i + 1]) / window >= target:
            return curve[i][0]
    return None


def one_run(base: Path, seed: int, *, opd: bool, coef: float, max_steps: int, topk: int = 0, topk_coef: float = 0.0) -> dict:
    """One run of the loop; returns its steps to the target, wall time and final reward."""
    run_dir = base / f"{'opd' if opd else 'rl'}-s{seed}"
    cfg = LoopConfig(seed=seed, steps=max_steps, stop_reward=TARGET, stop_window=WINDOW, time_budget_s=0)
    t_teacher = 0.0
    if opd:
        t0 = time.perf_counter()
        teacher, _ = ensure_teacher(run_dir, select_task(cfg.task), seed=seed)
        t_teacher = time.perf_counter() - t0
        cfg = with_teacher(cfg, teacher, coef, topk=topk, topk_coef=topk_coef)
    t0 = time.perf_counter()
    run_loop(cfg, run_dir, progress=False)
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
    p.add_argument("--coef", type=float, default=DEFAULT_COEF, help=f"distill_coef lambda of the OPD runs (default {DEFAULT_COEF})")
    p.add_argument("--topk", type=int, default=0, help="top-K tokens the teacher returns (0: none)")
    p.add_argument("--topk-coef", type=float, default=0.0, help="distill_topk_coef: weight of the top-K forward KL (needs --topk)")
    p.add_argument("--max-steps", type=int, default=None, help="most RL steps per run (default 80; --quick 40)")
    p.add_argument("--only", choices=("rl", "opd"), default=None, help="run one arm only (no GOAL line)")
    p.add_argument("--keep", type=Path, default=None, help="keep the run folders under this directory")
    args = p.parse_args(argv)
    seeds = args.seeds if args.seeds is not None else (2 if args.quick else 5)
    max_steps = args.max_steps if args.max_steps is not None else (40 if args.quick else 80)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    base = Path(tempfile.mkdtemp(prefix="bench_distill_")) if args.keep is None else args.keep
    base.mkdir(parents=True, exist_ok=True)
    arms = [a for a in ("rl", "opd") if args.only in (None, a)]
    results: dict[str, list[dict]] = {a: [] for a in arms}
    try:
        for seed in range(seeds):
            for arm in arms:
                r = one_run(base, seed, opd=arm == "opd", coef=args.coef, max_steps=max_steps, topk=args.topk,
                            topk_coef=args.topk_coef)
                results[arm].append(r)
                print(f"seed {seed} {arm:<3} steps to {TARGET}: {r['steps'] if r['steps'] is not None else f'>{max_steps}':>4}  "
                      f"trained {r['trained']:>3}  last reward {r['last_reward']:.2f}  wall {r['wall_s']:.0f} s"
                      + (f"  teacher build {r['teacher_s']:.1f} s  reverse KL {r['kl_first']:.2f} -> {r['kl_last']:.2f}"
                         if arm == "opd" else ""), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)

    print()
    print(f"lookup demo (32 prompts x 8 samples per step, warm-up 300 steps, faults on, 1 thread per process), "
          f"seeds 0..{seeds - 1}, OPD lambda {args.coef}; steps = policy versions to a {WINDOW}-step mean reward of {TARGET} "
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
        print(f"GOAL opd_steps_to_0.9_vs_rl: {ratio:.2f}x (goal <= 0.5x) {'PASS' if ratio <= 0.5 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
