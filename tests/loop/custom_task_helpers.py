"""Helpers of the custom-task tests: the real `agentlog train` command as a user runs it, and what a trained run holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted
from agentlog.events import read_log
from agentlog.loop.config import LoopConfig
from agentlog.loop.learner_records import read_learner_records

REPO = Path(__file__).resolve().parents[2]


def agentlog_exe() -> str:
    """The installed `agentlog` console script (what a user runs; it does not put the current directory on sys.path)."""
    exe = Path(sys.executable).with_name("agentlog")
    assert exe.exists(), f"the agentlog console script is not installed next to {sys.executable} (pip install -e .)"
    return str(exe)


def clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH and $AGENTLOG_AGENT."""
    # No PYTHONPATH: the module must be found the way a user's would be.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AGENTLOG_AGENT")}


def train_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`agentlog train ARGS --out run` (quiet, no report, 120 s timeout) run from ``cwd``."""
    return subprocess.run([agentlog_exe(), "train", *args, "--out", "run", "--quiet", "--no-report", "--timeout", "120"],
                          cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=180)


def check_trained(run_dir: Path, task_name: str, module: str) -> None:
    """The run recorded the module, trained at least version 1, and played sessions of the task that each ended once."""
    cfg = LoopConfig.load(run_dir / "config.json")
    assert module in cfg.task_modules and cfg.task == task_name
    assert all(Path(p).is_absolute() for p in cfg.task_path), cfg.task_path
    records = read_learner_records(run_dir / "learner")
    assert max(r.policy_version for r in records) >= 1, records
    opened: set[str] = set()
    harness: dict[str, str] = {}
    ended: dict[str, int] = {}
    for env in read_log(run_dir / "rollout", 0):
        b = env.body
        if isinstance(b, SessionOpened):
            opened.add(env.session_id)
        elif isinstance(b, SessionStarted):
            harness[env.session_id] = b.harness
        elif isinstance(b, (SessionFinished, SessionAborted, SessionDropped)):
            ended[env.session_id] = ended.get(env.session_id, 0) + 1
    assert opened, "no session in the rollout log"
    assert set(harness.values()) == {task_name}, set(harness.values())
    assert opened <= set(ended) and set(ended.values()) == {1}, "every session ends exactly once"
