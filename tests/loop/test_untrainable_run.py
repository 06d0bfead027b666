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

from agentlog.events.schema.types import SessionAborted
from agentlog.events import read_log
from agentlog.loop.learner_records import STOPPED_UNTRAINABLE
from agentlog.loop.learner_records import read_learner_records

from custom_task_helpers import agentlog_exe, clean_env, train_cli
from test_custom_task_dir import CONFIG, TASK_MODULE as ECHO_TASK_MODULE

#: The echo task of the custom-task tests, as a user writes it, but with a verify() that divides by zero.
ECHO_VERIFY = """        ok = bool(outputs) and len(outputs[0]) > 0 and outputs[0][0] == episode.state["x"]
        return Verdict(reward=1.0 if ok else 0.0, success=ok)
"""
assert ECHO_VERIFY in ECHO_TASK_MODULE
TASK_MODULE = ECHO_TASK_MODULE.replace(ECHO_VERIFY, "        return Verdict(reward=1.0 / 0, success=False)\n")


def _user_dir(tmp_path: Path, extra: str = "") -> Path:
    tag = uuid.uuid4().hex[:8]
    module, name = f"crashing_verifier_{tag}", f"crashing-verifier-{tag}"
    user = tmp_path / "user"
    user.mkdir()
    (user / f"{module}.py").write_text(TASK_MODULE.format(name=name))
    # The run never makes a version, so its steps never end it: only the untrainable rule (or 150 s of time budget) can.
    (user / "run.toml").write_text(CONFIG.format(task=f'{extra}\n[task]\nname = "{name}"\nmodule = "{module}"\n'))
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
    aborted = sorted(e.session_id for e in read_log(run_dir / "rollout", 0) if isinstance(e.body, SessionAborted)
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
