"""Benchmark how groups spend rollouts: per-sample refill, dynamic sampling, counterfactual re-reduction.

Three measurements, each beside its anchor in the same run:

* **Wasted rollouts** (``wasted_rollouts_refill_at_5pct_aborts_n8``). Groups of 8 sessions
  through the real ``SessionEngine`` and reducers on an in-memory log; each session aborts
  with an infrastructure reason (``setup_failed``) with probability 5%, else finishes with a
  uniform random reward (so every full group has spread). A session is wasted when it adds no
  gradient: it is out of its group's baseline, or its group is skipped. Refill arm:
  infrastructure aborts refilled (``max_refills`` 8), the driver playing each replacement the
  engine owes, as the worker does. Anchor arm (``group_drop``): no refill, and a group with any
  abort is dropped whole (``min_valid`` = 8), as peers do; by the arithmetic, 1 - 0.95^8 = 0.34.
* **Steps to a reward of 0.9** (``demo_steps_to_0.9_dynamic_vs_plain``). The demo's loop (the
  lookup task, 300 warm-up steps, faults on) run twice with the same seed: plain, and with
  ``[groups] dynamic_sampling``. The reward a step reaches is the mean reward of the valid
  members of every group it consumed, trained or filtered (so dynamic sampling's filter does
  not flatter it); a run reaches 0.9 at the first step whose mean over the last 5 steps is
  >= 0.9. Printed beside: the sessions generated per step in each arm.
* **Counterfactual re-reduction of 100k sessions** (``counterfactual_rereduce_100k_sessions_s``).
  A run folder with 100,000 sessions (groups of 8, one 64-token turn each, 5% aborted) and the
  learner records of its steps (32 groups each, decided by the learner's own rule), then
  ``reconstruct --policy --diff``'s comparison (:func:`agentlog.loop.counterfactual.compare`)
  against ``min_valid`` 6. Anchor: one offline reduction of the same log (``reduce_log``).

    .venv/bin/python tools/bench/bench_groups.py [--quick] [--skip-demo] [--groups N] [--steps N] [--sessions N] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log
from agentlog.tools.bench.goals import goal, goal_line, meets

GROUP = 8
ABORT_P = 0.05


# ----------------------------------------------------------------- wasted rollouts

async def _play_groups(config: ReduceConfig, groups: int, seed: int) -> MemoryLog:
    """``groups`` groups of :data:`GROUP` through the engine, each session aborting with
    probability :data:`ABORT_P`, replacements played while the engine owes them."""
    rng = random.Random(seed)
    log = MemoryLog()
    eng = await SessionEngine.open(log, groups=config)
    for g in range(groups):
        gid = f"g{g:06d}"
        for i in range(GROUP):
            sid, replaces, index = f"{gid}-s{i}", "", i
            while True:
                h = await eng.open_session(sid, group_id=gid, group_size=GROUP, sample_index=index, replaces=replaces)
                await h.start()
                if rng.random() < ABORT_P:
                    await h.abort("setup_failed:OSError", error="the sandbox did not start")
                else:
                    await h.finish(reward=rng.random())
                if sid not in eng.owed_replacements(gid):
                    break
                index = eng.replacement_index(gid)
                sid, replaces = f"{gid}-s{index}", sid
    await eng.close()
    return log


def wasted_share(config: ReduceConfig, groups: int, seed: int) -> tuple[float, int]:
    """(share of generated sessions that add no gradient, sessions generated)."""
    log = asyncio.run(_play_groups(config, groups, seed))
    result = reduce_log(log, config)
    generated = sum(len(g.members) + len(g.dropped) for g in result.groups)
    useful = sum(1 for g in result.groups if not g.skipped for m in g.members if m.valid)
    return 1.0 - useful / generated, generated


# ----------------------------------------------------------------- steps to 0.9

def _step_rewards(run_dir: Path, cfg) -> list[tuple[float, int]]:
    """Per recorded RL step: (mean reward of the valid members of every group it consumed, sessions in them)."""
    from agentlog.loop.counterfactual import released_groups
    from agentlog.loop.learner_records import read_learner_records

    released = released_groups(run_dir, cfg)
    out = []
    for rec in read_learner_records(run_dir / "learner"):
        if rec.step == 0:
            continue
        groups = [released[ref.partition][ref.group_id].group for ref in rec.batch]
        rewards = [r for g in groups for r in g.valid_rewards]
        out.append((sum(rewards) / len(rewards) if rewards else math.nan, sum(len(g.members) + len(g.dropped) for g in groups)))
    return out


def steps_to(curve: list[tuple[float, int]], target: float, window: int = 5) -> int | None:
    """The first step (1-based) whose mean reward over the last ``window`` steps is >= ``target``."""
    for i in range(window, len(curve) + 1):
        rewards = [r for r, _ in curve[i - window : i] if not math.isnan(r)]
        if rewards and sum(rewards) / len(rewards) >= target:
            return i
    return None


def demo_arm(root: Path, dynamic: bool, steps: int, seed: int) -> list[tuple[float, int]]:
    """The demo's loop, plain or with dynamic sampling, for ``steps`` steps."""
    from agentlog.loop.config import LoopConfig
    from agentlog.loop.demo.faults import demo_groups
    from agentlog.loop.run import run_loop

    groups = demo_groups()
    groups["dynamic_sampling"] = dynamic
    cfg = LoopConfig(seed=seed, steps=steps, stop_reward=0, time_budget_s=0, max_untrainable_batches=0, groups=groups)
    run_dir = root / ("dynamic" if dynamic else "plain")
    run_loop(cfg, run_dir)
    return _step_rewards(run_dir, cfg)


# ----------------------------------------------------------------- counterfactual at 100k sessions

def build_run(run_dir: Path, sessions: int, seed: int) -> None:
    """A run folder of ``sessions`` one-turn sessions in groups of :data:`GROUP` (5% aborted),
    with the learner records of its steps of 32 groups."""
    from agentlog.events.log.writer import FileLog
    from agentlog.events.schema.types import PolicyUpdated, SessionAborted, SessionFinished, SessionOpened, SessionStarted
    from agentlog.events.schema.turn import TurnRecorded
    from agentlog.loop.config import LoopConfig
    from agentlog.loop.counterfactual import released_groups
    from agentlog.loop.learner_records import step_digest
    from agentlog.loop.publish import LEARNER_STREAM
    from agentlog.loop.run_folder import Run
    from agentlog.loop.trainer import decide_group
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    cfg = LoopConfig(seed=seed, groups_per_step=32, group_size=GROUP, warmup_steps=0)
    run_dir.mkdir(parents=True)
    Run.save_config(run_dir, cfg)
    prompt = np.arange(200, dtype="<i4").tobytes()
    records = []
    with FileLog.open(run_dir / "rollout", fsync="never") as log:
        for s in tqdm(range(sessions), desc="writing the run", unit=" sessions", mininterval=1.0, file=sys.stderr):
            gid, i = f"b{s // (GROUP * 32):05d}-g{(s // GROUP) % 32:02d}", s % GROUP
            sid = f"{gid}-s{i}"
            out = rng.integers(0, 1000, 64, dtype="<i4").tobytes()
            lps = (-rng.random(64, dtype="<f4")).astype("<f4").tobytes()
            records += [(sid, 0, SessionOpened(group_id=gid, group_size=GROUP, sample_index=i, prompt_ids=prompt)),
                        (sid, 1, SessionStarted()),
                        (sid, 2, TurnRecorded(turn_index=0, prompt_ids=prompt, output_ids=out, output_log_probs=lps))]
            end = SessionAborted(reason="setup_failed:OSError") if rng.random() < ABORT_P else SessionFinished(reward=float(rng.integers(0, 2)))
            records.append((sid, 3, end))
            if len(records) >= 8192:
                log.append_batch(records)
                records = []
        if records:
            log.append_batch(records)
    released = released_groups(run_dir, cfg)[0]
    order = sorted(released.values(), key=lambda r: r.group.release_index)
    with FileLog.open(run_dir / "learner") as llog:
        llog.append_batch([(LEARNER_STREAM, 0, PolicyUpdated(step=0, policy_version=0))])
        version = 0
        for step, start in enumerate(range(0, len(order), 32), start=1):
            batch = order[start : start + 32]
            decided = [(r, decide_group(r.group, version, cfg, distills=False)[0]) for r in batch]
            train = [r.group for r, why in decided if not why]
            version += 1 if train else 0
            rec = PolicyUpdated(step=step, policy_version=version, sample_digest=step_digest(train),
                                groups=[g.group_id for g in train], skipped={r.group.group_id: why for r, why in decided if why},
                                batch=[r.ref(why) for r, why in decided])
            llog.append_batch([(LEARNER_STREAM, step, rec)])


def counterfactual_seconds(root: Path, sessions: int, seed: int) -> tuple[float, float, int, int]:
    """(seconds for the counterfactual diff, seconds for one offline reduction, groups changed, steps equal)."""
    from agentlog.events.log.read import read_log
    from agentlog.loop.counterfactual import compare, policy_config
    from agentlog.loop.run_folder import Run

    run_dir = root / "cf"
    build_run(run_dir, sessions, seed)
    cfg = Run.load_config(run_dir)
    t0 = time.perf_counter()
    reduce_log(read_log(run_dir / "rollout", 0), cfg.reduce_config())
    t_reduce = time.perf_counter() - t0
    t0 = time.perf_counter()
    diff = compare(run_dir, cfg, policy_config(cfg, {"min_valid": 6}))
    t_cf = time.perf_counter() - t0
    return t_cf, t_reduce, len(diff.changes), diff.steps_equal_before


def main(argv: list[str] | None = None) -> int:
    """Run every measurement and print its GOAL line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run; the GOAL lines still print)")
    p.add_argument("--skip-demo", action="store_true", help="leave out the two demo runs (minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=None, help="groups played for the wasted rollouts (default 2,000; --quick 200)")
    p.add_argument("--steps", type=int, default=None, help="steps of each demo run (default 60; --quick 8)")
    p.add_argument("--sessions", type=int, default=None, help="sessions of the counterfactual's run (default 100,000; --quick 10,000)")
    p.add_argument("--dir", type=Path, default=None, help="where the runs go (a temp dir in it, removed after)")
    args = p.parse_args(argv)
    groups = args.groups or (200 if args.quick else 2000)
    sessions = args.sessions or (10_000 if args.quick else 100_000)
    steps = args.steps or (8 if args.quick else 60)
    lines = []

    refill = ReduceConfig(min_valid=2, abort_outcomes={"infrastructure": "refill"}, max_refills=GROUP)
    wasted, gen_refill = wasted_share(refill, groups, args.seed)
    dropped, gen_drop = wasted_share(ReduceConfig(min_valid=GROUP), groups, args.seed)
    print(f"wasted rollouts, {groups} groups of {GROUP}, {ABORT_P:.0%} infrastructure aborts: refill {wasted:.3f} "
          f"of {gen_refill} sessions; group_drop {dropped:.3f} of {gen_drop} sessions (arithmetic: {1 - (1 - ABORT_P) ** GROUP:.3f})")
    lines.append(goal_line("wasted_rollouts_refill_at_5pct_aborts_n8", f"{wasted:.3f}", "<=", "0.06", meets(wasted, "<=", 0.06))
                 + f"  [group_drop {dropped:.3f}]")

    with tempfile.TemporaryDirectory(prefix="bench-groups-", dir=args.dir) as tmp:
        root = Path(tmp)
        if not args.skip_demo:
            plain = demo_arm(root, False, steps, args.seed)
            dynamic = demo_arm(root, True, steps, args.seed)
            s_plain, s_dyn = steps_to(plain, 0.9), steps_to(dynamic, 0.9)
            per_step = [sum(n for _, n in arm) / len(arm) for arm in (plain, dynamic)]
            print(f"demo, seed {args.seed}, {steps} steps: reaches 0.9 at step plain {s_plain}, dynamic {s_dyn}; "
                  f"sessions per step plain {per_step[0]:.0f}, dynamic {per_step[1]:.0f}")
            if s_plain is None or s_dyn is None:
                lines.append(goal_line("demo_steps_to_0.9_dynamic_vs_plain", f"not reached (plain {s_plain}, dynamic {s_dyn})",
                                       "<=", "0.80x", False))
            else:
                lines.append(goal("demo_steps_to_0.9_dynamic_vs_plain", s_dyn / s_plain, "<=", 0.8)
                             + f"  [sessions/step plain {per_step[0]:.0f}, dynamic {per_step[1]:.0f}]")
        t_cf, t_reduce, changed, equal = counterfactual_seconds(root, sessions, args.seed)
        print(f"counterfactual over {sessions:,} sessions: {t_cf:.1f} s ({changed} groups change under min_valid 6, "
              f"{equal} steps equal to their records); one offline reduction: {t_reduce:.1f} s")
        # Two decimals: a small run's diff takes well under a second, which goal()'s whole seconds would print as 0.
        lines.append(goal_line("counterfactual_rereduce_100k_sessions_s" if sessions == 100_000 else f"counterfactual_rereduce_{sessions}_sessions_s",
                               f"{t_cf:.2f} s", "<=", "60 s", meets(t_cf, "<=", 60.0)) + f"  [one reduction {t_reduce:.1f} s]")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
