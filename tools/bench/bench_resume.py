"""Benchmark resuming a killed worker's sessions against aborting them, side by side in one run.

Each arm runs the real rollout worker (``tools/bench/scripted_worker.py``:
RolloutWorker, engine, gateway, Python agent, LocalSandboxes, snapshots) on
one batch of ``--groups`` x ``--group-size`` sessions of the ``resume-steps``
task (``--steps`` + 2 turns each: 22, as agent sessions of minutes run;
``--gen-s`` seconds of generation per turn, ``--data-mb`` of files in every
sandbox), SIGKILLs it mid-session, once the sessions have ``--kill-after``
durable turns on average, and starts it again with
``--max-batches 0`` (it decides the orphans, plays the resumed ones to the
end, and exits). The learner process records its step 0 (which the
worker's first batch waits for) and is stopped once the restarted worker exits.

* ours: ``[resume] enabled = true``: orphans resume from their last durable turn;
* the anchor: ``[resume] enabled = false``: orphans are aborted ``engine_restart``,
  as every worker did before.

Figures (all read back from each arm's log):

* ``resumed_fraction_after_worker_kill``: orphans that resumed and finished
  with reward 1 (the task's verifier checks that the sandbox saw every step
  exactly once) over all orphans; goal >= 0.95.
* ``generation_seconds_lost_per_crash_resume_vs_abort``: generation seconds
  the crash threw away, resume over abort. An aborted orphan loses the
  generation of all its durable turns (their ``generate_s``) plus the turn in
  flight at the kill; a resumed one loses only the turn in flight (from the
  session's last record before the kill to the kill, at most ``--gen-s``, in
  both arms). Goal <= 0.1x.

The lost-generation ratio depends on where the kill falls: about one turn in
flight against the durable turns before it, so a kill halfway through a
22-turn session is the case measured.

Usage: ``python tools/bench/bench_resume.py [--groups 8] [--group-size 4] [--steps 20] [--kill-after 11] [--gen-s 0.4] [--data-mb 5]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentlog.events import read_log
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import SessionFinished, SessionResumed, TurnRecorded
from agentlog.loop import FaultConfig, LoopConfig
from agentlog.loop.run import start_process
from agentlog.tools.bench import scripted_worker
from agentlog.tools.bench.goals import goal_line, meets


def _worker(run: Path, args: argparse.Namespace, *extra: str) -> Any:
    return scripted_worker.start(run, *extra, AGENTLOG_STEPS_GEN_S=str(args.gen_s), AGENTLOG_STEPS_DATA_MB=str(args.data_mb))


def run_arm(root: Path, args: argparse.Namespace, *, resume: bool) -> dict:
    """One arm: start, kill, restart; returns its figures."""
    run = root / ("resume" if resume else "abort")
    (run / "logs").mkdir(parents=True)
    cfg = LoopConfig(task="resume-steps", task_modules=["agentlog.tools.bench.resume_steps"], steps=1,
                     groups_per_step=args.groups, group_size=args.group_size, warmup_steps=0, faults=FaultConfig.none(),
                     stop_reward=0, time_budget_s=0, max_lag=4, d_model=32, n_layer=1, n_head=2,
                     agent={"harness": "python-agent", "budget_s": 600, "max_tool_calls": 64}, inference={"context_length": 16384},
                     resume={"enabled": resume})
    cfg.save(run / "config.json")
    # The learner records step 0 (the worker's first batch waits for it) and trains the batch once it is released.
    learner = start_process("trainer", run)
    procs = [learner]
    try:
        proc = _worker(run, args, "--max-batches", "1")
        procs.append(proc)
        n = args.groups * args.group_size
        deadline = time.monotonic() + 600
        while True:
            live = scripted_worker.running_turns(run)
            if len(live) == n and sum(live.values()) >= args.kill_after * n:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench_resume: the worker exited ({proc.returncode}) or stalled before the kill; see {run}/logs")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        killed_ns = time.time_ns()
        proc.wait()
        t0 = time.perf_counter()
        again = _worker(run, args, "--max-batches", "0")
        procs.append(again)
        if again.wait(timeout=900) != 0:
            raise SystemExit(f"bench_resume: the restarted worker exited {again.returncode}; see {run}/logs")
        restart_s = time.perf_counter() - t0
    finally:
        # The learner was there for step 0; with every orphan aborted its step is skipped and it would wait on.
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    envs = list(full_turns(read_log(run / "rollout", 0)))
    orphans = {sid for sid, _ in live.items()}
    lost = 0.0
    last_snapshot_ns: dict[str, int] = {}
    durable_gen: dict[str, float] = {}
    resumed, finished = set(), {}
    for e in envs:
        if e.session_id not in orphans:
            continue
        if e.ts_ns <= killed_ns:
            last_snapshot_ns[e.session_id] = e.ts_ns  # its last record before the kill
        if isinstance(e.body, TurnRecorded) and e.ts_ns <= killed_ns:
            durable_gen[e.session_id] = durable_gen.get(e.session_id, 0.0) + e.body.generate_s
        elif isinstance(e.body, SessionResumed):
            resumed.add(e.session_id)
        elif isinstance(e.body, SessionFinished):
            finished[e.session_id] = e.body.reward
    for sid in orphans:
        # The turn in flight: from the session's last record before the kill (its tool result, or the
        # snapshot its request made) to the kill, at most one turn's generation; the same rule in both arms.
        in_flight = min(max(0.0, (killed_ns - last_snapshot_ns.get(sid, killed_ns)) / 1e9), args.gen_s)
        lost += in_flight if sid in resumed else in_flight + durable_gen.get(sid, 0.0)
    ok = sum(1 for sid in orphans if sid in resumed and finished.get(sid) == 1.0)
    return {"orphans": len(orphans), "resumed_ok": ok, "lost_s": lost, "restart_s": restart_s,
            "durable_turns": sum(live.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--gen-s", type=float, default=0.4, help="generation seconds per turn")
    p.add_argument("--data-mb", type=float, default=5.0, help="MB of files in every sandbox")
    p.add_argument("--steps", type=int, default=20, help="tool calls per session (turns: steps + 2)")
    p.add_argument("--kill-after", type=float, default=11.0, help="durable turns per session (mean) before the kill")
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ["AGENTLOG_STEPS_STEPS"] = str(args.steps)  # the worker's and the learner's task
    root = Path(tempfile.mkdtemp(prefix="bench-resume-", dir=args.dir))
    try:
        arms = {}
        for resume in (True, False):
            arms[resume] = run_arm(root, args, resume=resume)
            a = arms[resume]
            print(f"{'resume' if resume else 'abort '}: {a['orphans']} orphans with {a['durable_turns']} durable turns; "
                  f"{a['resumed_ok']} resumed and finished with reward 1; generation lost {a['lost_s']:.2f} s; "
                  f"restart to all ended {a['restart_s']:.1f} s")
        ours, anchor = arms[True], arms[False]
        fraction = ours["resumed_ok"] / max(1, ours["orphans"])
        ratio = ours["lost_s"] / anchor["lost_s"] if anchor["lost_s"] else float("inf")
        print(goal_line("resumed_fraction_after_worker_kill", f"{fraction:.3f}", ">=", "0.95", meets(fraction, ">=", 0.95)))
        print(goal_line("generation_seconds_lost_per_crash_resume_vs_abort", f"{ratio:.3f}x", "<=", "0.1x",
                        meets(ratio, "<=", 0.1)))
    except BaseException:
        print(f"bench_resume: the runs are kept in {root} for a look", file=sys.stderr)
        raise
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
