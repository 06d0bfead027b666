"""A real rollout worker process whose model is scripted: what bench_resume and the worker-kill test kill.

``python -m agentlog.tools.bench.scripted_worker RUN_DIR`` runs
:class:`~agentlog.loop.worker.RolloutWorker` on ``RUN_DIR`` exactly as
``python -m agentlog.loop.worker`` does (its engine, log, gateway, built-in
Python agent, sandboxes and snapshots), with one difference: the gateway's
backend is :class:`~agentlog.tools.bench.resume_steps.ScriptedModel`, which answers every model call by a rule
of the conversation after a fixed generation time, instead of the tiny GPT,
whose random answers end nearly every session after one turn. The learner
(``python -m agentlog.loop.trainer``) trains on what it recorded as on any run.

The task, ``resume-steps``, and the model are :mod:`agentlog.tools.bench.resume_steps`.

The generation time per turn is ``AGENTLOG_STEPS_GEN_S`` (default 0.3 s).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path


def start(run_dir: Path, *args: str, **env: str) -> "subprocess.Popen[bytes]":
    """Start this worker on ``run_dir`` in its own process (``args``: its flags; ``env``: the task's
    ``AGENTLOG_STEPS_*`` settings), its output appended to ``logs/scripted-worker.stderr``."""
    err = open(Path(run_dir) / "logs" / "scripted-worker.stderr", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "agentlog.tools.bench.scripted_worker", str(run_dir), *args],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    finally:
        err.close()


def running_turns(run_dir: Path, *, version: int = 0) -> dict[str, int]:
    """The sessions of the run's rollout log that have not ended, and their durable turns, for those
    whose last turn a policy ``version`` or newer made (or with no turn, when ``version`` is 0)."""
    from agentlog.events import read_log
    from agentlog.events.log.format import DURABLE_NAME
    from agentlog.events.schema.types import TERMINAL_EVENT_TYPES, SessionOpened, TurnDelta, TurnRecorded

    log_dir = Path(run_dir) / "rollout"
    if not (log_dir / DURABLE_NAME).exists():  # not created yet
        return {}
    turns: dict[str, tuple[int, int]] = {}
    for env in read_log(log_dir, 0):
        if isinstance(env.body, SessionOpened):
            turns[env.session_id] = (0, 0)
        elif isinstance(env.body, (TurnRecorded, TurnDelta)):
            turns[env.session_id] = (env.body.turn_index + 1, env.body.policy_version)
        elif isinstance(env.body, TERMINAL_EVENT_TYPES):
            turns.pop(env.session_id, None)
    return {sid: n for sid, (n, v) in turns.items() if v >= version}


def main(argv: list[str] | None = None) -> int:
    """``python -m agentlog.tools.bench.scripted_worker RUN_DIR [--max-batches N]``."""
    import argparse

    import torch

    from agentlog.loop.run_folder import Run
    from agentlog.loop.runlog import configure_process_logging
    from agentlog.loop.worker import RolloutWorker

    p = argparse.ArgumentParser(prog="scripted-worker", description=main.__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--max-batches", type=int, default=None)
    args = p.parse_args(argv)
    cfg = Run.load_config(args.run_dir)
    configure_process_logging(args.run_dir, "worker-w0")
    torch.set_num_threads(cfg.torch_threads)
    worker = RolloutWorker(args.run_dir, cfg)
    from agentlog.tools.bench.resume_steps import ScriptedModel

    worker.backend = ScriptedModel(float(os.environ.get("AGENTLOG_STEPS_GEN_S", "0.3")))
    asyncio.run(worker.run(max_batches=args.max_batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
