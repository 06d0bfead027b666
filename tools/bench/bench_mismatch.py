"""Benchmark the training–inference mismatch in-process: the learner's log-probs against the rollout's.

A short real training of the demo's lookup task (the worker and the learner
in this process, the built-in GPT sampled by the worker's batcher, faults
on) with the worker never ahead of the learner (``max_lag = 0``), so every
trained token was generated at the learner's own version and each step's
``stats/train_rollout_logprob_abs_diff_max`` covers all of them. Two arms,
interleaved, the same config and seed:

* ours: ``GPT.batch_invariant`` (the default), sampling and training on one
  numeric path (:mod:`agentlog.learner.batch_invariant`);
* the anchor: ``GPT.batch_invariant = False``, torch's attention and one
  product per linear layer, as before the path was unified.

Both start from the same policy, warmed up once beforehand with the demo's
supervised warm-up. It prints each arm's largest and mean difference and KL
estimate over every trained token of the run, and the CPU seconds of the
run (``time.process_time``; the fastest of the rounds): what the one numeric
path costs where the rollout and the learner share a core.

    python tools/bench/bench_mismatch.py [--quick] [--rounds R] [--steps S] [--groups G] [--group-size N]
        [--warmup-steps W] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import tempfile
import time
from pathlib import Path

import structlog
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentlog.learner.model import GPT  # noqa: E402
from agentlog.loop.config import LoopConfig  # noqa: E402
from agentlog.loop.learner_records import mismatch_summary, read_learner_records  # noqa: E402
from agentlog.loop.trainer import LoopLearner  # noqa: E402
from agentlog.loop.worker import RolloutWorker  # noqa: E402
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402


def warmed_weights(cfg: LoopConfig) -> dict[str, torch.Tensor]:
    """The policy after the demo's supervised warm-up (``cfg.warmup_steps``, torch's kernels), once for both arms."""
    from agentlog.engine.tasks import select_task
    from agentlog.loop.demo.warmup import supervised_warmup
    from agentlog.loop.policy import build_model

    task = select_task(cfg.task)
    model = build_model(cfg, task)
    supervised_warmup(model, task, cfg)
    return model.state_dict()


def train(run_dir: Path, cfg: LoopConfig, invariant: bool, weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """RL from ``weights`` on ``invariant``'s numeric path, in this process; the run's mismatch and CPU seconds."""
    before = GPT.batch_invariant
    GPT.batch_invariant = invariant
    try:
        learner = LoopLearner(run_dir, cfg)  # warmup_steps 0: version 0 is the model as loaded here
        learner.model.load_state_dict(weights)

        async def run() -> None:
            await asyncio.gather(learner.run(), RolloutWorker(run_dir, cfg).run())

        t0 = time.process_time()
        asyncio.run(run())
        cpu = time.process_time() - t0
    finally:
        GPT.batch_invariant = before
    records = read_learner_records(run_dir / "learner")[1:]
    summary = mismatch_summary(records)
    if summary is None:
        raise SystemExit(f"bench_mismatch: no step of {run_dir} measured a token at the learner's version")
    return {"max": summary.abs_diff_max, "mean": summary.abs_diff_mean, "tokens": summary.tokens, "steps": summary.steps,
            "kl": max(r.metrics["stats/train_rollout_kl"] for r in records if r.metrics.get("stats/train_rollout_tokens", 0) > 0),
            "trained": sum(r.metrics.get("perf/trained_tokens", 0.0) for r in records), "rl_cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run (CI smoke)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds of both arms, alternating which goes first (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default 8; 3 with --quick)")
    ap.add_argument("--groups", type=int, default=None, help="groups per step (default 32; 8 with --quick)")
    ap.add_argument("--group-size", type=int, default=None, help="rollouts per group (default 8; 4 with --quick)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="supervised warm-up steps, once for both arms (default 50; 20 with --quick)")
    ap.add_argument("--dir", default=None, help="where the runs' temporary folder goes (default: the system's; removed after)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    sizes = (3, 8, 4, 20) if args.quick else (8, 32, 8, 50)
    given = (args.steps, args.groups, args.group_size, args.warmup_steps)
    steps, groups, group_size, warmup = (default if value is None else value for value, default in zip(given, sizes))
    cfg = LoopConfig(seed=0, steps=steps, groups_per_step=groups, group_size=group_size, max_lag=0,
                     warmup_steps=0, stop_reward=0, time_budget_s=0)
    weights = warmed_weights(dataclasses.replace(cfg, warmup_steps=warmup, warmup_threads=1))
    arms: dict[str, list[dict[str, float]]] = {"ours": [], "torch kernels": []}
    with tempfile.TemporaryDirectory(prefix="bench-mismatch-", dir=args.dir) as tmp:
        order = [("ours", True), ("torch kernels", False)]
        for r in range(args.rounds or 2):
            for name, invariant in order if r % 2 else order[::-1]:  # the anchor first in even rounds
                arms[name].append(train(Path(tmp) / f"{name.replace(' ', '-')}-{r}", cfg, invariant, weights))
    print(f"lookup task in-process: {steps} RL steps of {groups} groups x {cfg.group_size} after {warmup} warm-up steps, "
          f"max_lag 0, faults on; every trained token at the learner's version")
    print(f"{'arm':<24} {'tokens':>8} {'max |diff|':>12} {'mean |diff|':>12} {'max KL':>10} {'RL CPU s':>9}")
    for name, runs in arms.items():
        worst = max(runs, key=lambda x: x["max"])
        cpu = min(x["rl_cpu_s"] for x in runs)
        print(f"{name + (' (anchor)' if name != 'ours' else ''):<24} {int(worst['tokens']):>8} {worst['max']:>12.3g} "
              f"{worst['mean']:>12.3g} {worst['kl']:>10.3g} {cpu:>9.2f}")
        if any(x["tokens"] != x["trained"] for x in runs):
            raise SystemExit(f"bench_mismatch: arm {name!r} left trained tokens unmeasured: {runs}")
    ours = max(x["max"] for x in arms["ours"])
    anchor = max(x["max"] for x in arms["torch kernels"])
    cost = min(x["rl_cpu_s"] for x in arms["ours"]) / min(x["rl_cpu_s"] for x in arms["torch kernels"])
    print()
    print(goal_line("train_rollout_logprob_abs_diff_max_in_process", f"{ours:g}", "==", "0", meets(ours, "==", 0))
          + f"    anchor, torch kernels: {anchor:.3g}")
    print(goal_line("in_process_rl_cpu_vs_torch_kernels", f"{cost:.2f}x", "<=", "1.1x", meets(cost, "<=", 1.1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
