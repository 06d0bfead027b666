"""A task whose verifier always crashes: every session is aborted and every
group skipped, so nothing is ever trainable. The run must not loop forever:
after ``max_untrainable_batches`` batches in a row with nothing to train,
`agentlog train` exits 1 naming the main abort reason and one session to
inspect, with ``agentlog show`` of that session saying the same."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from agentlog.events.types import SessionAborted
from agentlog.loop import logs
from agentlog.loop.publish import STOPPED_UNTRAINABLE, read_learner_records

from custom_task_helpers import agentlog_exe, clean_env, train_cli

#: A token-level task as a user writes it, whose verify() divides by zero.
TASK_MODULE = '''
import random

from agentlog.engine.tasks import Episode, Task, Verdict, register_task

BOS, EOS, A, B = 0, 1, 2, 3


@register_task("{name}")
class CrashingVerifierTask(Task):
    name = "{name}"
    vocab_size = 4
    eos_id = EOS
    max_new_tokens = 2
    max_turns = 1

    def new_episode(self, rng: random.Random) -> Episode:
        x = rng.choice((A, B))
        return Episode(prompt_ids=(BOS, x), messages=[{{"role": "user", "content": str(x)}}], state={{"x": x}}, label=x)

    def tool_step(self, episode, turn_index, output_ids):
        return None

    def verify(self, episode, outputs) -> Verdict:
        return Verdict(reward=1.0 / 0, success=False)
'''

#: Steps far beyond what the run reaches: only the untrainable rule can end it (no time budget, no reward stop).
CONFIG = '''
steps = 1000
groups_per_step = 2
group_size = 2
warmup_steps = 0
stop_reward = 0
time_budget_s = 0
d_model = 16
n_layer = 1
n_head = 2
fsync = "never"
{extra}
[task]
name = "{name}"
module = "{module}"

[faults]
exception_rate = 0.0
timeout_rate = 0.0
drop_rate = 0.0
straggler_rate = 0.0
empty_marker_rate = 0.0
'''


def _user_dir(tmp_path: Path, extra: str = "") -> Path:
    tag = uuid.uuid4().hex[:8]
    module, name = f"crashing_verifier_{tag}", f"crashing-verifier-{tag}"
    user = tmp_path / "user"
    user.mkdir()
    (user / f"{module}.py").write_text(TASK_MODULE.format(name=name))
    (user / "run.toml").write_text(CONFIG.format(name=name, module=module, extra=extra))
    return user


@pytest.mark.required
def test_a_verifier_that_always_crashes_stops_the_run_with_exit_1_naming_the_reason_and_a_session(tmp_path: Path) -> None:
    user = _user_dir(tmp_path, "max_untrainable_batches = 2")
    proc = train_cli(user, "--config", "run.toml")
    assert proc.returncode == 1, proc.stderr[-3000:] + proc.stdout[-2000:]
    run_dir = user / "run"
    records = [r for r in read_learner_records(run_dir / "learner") if r.step > 0]
    # Two empty batches, the second final and marked as the stop: not a timeout, not an endless loop.
    assert [(r.policy_version, len(r.groups), len(r.skipped)) for r in records] == [(0, 0, 2), (0, 0, 2)], records
    assert records[-1].metrics["loop/final"] == 1.0 and records[-1].metrics[STOPPED_UNTRAINABLE] == 1.0
    aborted = sorted(e.session_id for e in logs.read(run_dir / "rollout", 0) if isinstance(e.body, SessionAborted)
                     and e.body.reason == "verifier_failed:ZeroDivisionError")
    assert aborted, "every session aborts with the verifier's exception type"
    err = proc.stderr.strip().splitlines()[-1]
    expected = f"every session aborted: verifier_failed:ZeroDivisionError (agentlog show run {aborted[0]})"
    assert expected in err, err
    assert "max_untrainable_batches" in err and "Traceback" not in proc.stderr
    # The named session is there to inspect, with the verifier's error.
    show = subprocess.run([agentlog_exe(), "show", "run", aborted[0]], cwd=user, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert show.returncode == 0, show.stderr
    assert "verifier_failed:ZeroDivisionError" in show.stdout and "division by zero" in show.stdout


def test_max_untrainable_batches_is_validated_and_documented() -> None:
    from agentlog.loop.config import ConfigError, LoopConfig, field_help

    assert LoopConfig().max_untrainable_batches == 3
    assert "exit 1" in field_help(LoopConfig)["max_untrainable_batches"]
    with pytest.raises(ConfigError, match="max_untrainable_batches"):
        LoopConfig(max_untrainable_batches=-1)
