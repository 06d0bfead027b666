"""A custom task from another directory: a task module written in a
temporary directory outside the repository trains through the real
``agentlog train`` command, run from that directory with no PYTHONPATH, in
every process of the loop: once through ``--import MODULE``, once through
the config's ``[task] module`` (with ``path``). And a module that cannot be
imported stops the command before any run, naming it and why."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

from agentlog.loop.config import LoopConfig

from custom_task_helpers import REPO, check_trained, train_cli

#: A token-level task as a user writes it: prompt ``BOS x``, one turn, reward 1 when the turn repeats x.
TASK_MODULE = '''
import random

from agentlog.engine.tasks import Episode, Task, Verdict, register_task

BOS, EOS, A, B = 0, 1, 2, 3


@register_task("{name}")
class EchoTask(Task):
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
        ok = bool(outputs) and len(outputs[0]) > 0 and outputs[0][0] == episode.state["x"]
        return Verdict(reward=1.0 if ok else 0.0, success=ok)
'''

#: A loop that runs in seconds: tiny model, 2 RL steps of 2 groups x 2, no warm-up, no faults.
CONFIG = '''
steps = 2
groups_per_step = 2
group_size = 2
min_valid = 1
warmup_steps = 0
stop_reward = 0
d_model = 16
n_layer = 1
n_head = 2
fsync = "never"
{task}
[faults]
exception_rate = 0.0
timeout_rate = 0.0
drop_rate = 0.0
straggler_rate = 0.0
empty_marker_rate = 0.0
'''


def _write_task(where: Path) -> tuple[str, str]:
    """(module name, task name), both unique, written to ``where``."""
    tag = uuid.uuid4().hex[:8]
    module, name = f"user_echo_{tag}", f"echo-{tag}"
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{module}.py").write_text(TASK_MODULE.format(name=name))
    return module, name


@pytest.mark.required
def test_a_task_module_in_another_directory_trains_through_import(tmp_path: Path) -> None:
    user = tmp_path / "user"
    module, name = _write_task(user)
    assert not str(user).startswith(str(REPO))
    (user / "run.toml").write_text(CONFIG.format(task=f'task = "{name}"'))
    proc = train_cli(user, "--config", "run.toml", "--import", module)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    check_trained(user / "run", name, module)
    assert str(user) in LoopConfig.load(user / "run" / "config.json").task_path


@pytest.mark.required
def test_a_task_module_in_another_directory_trains_through_the_config_entry(tmp_path: Path) -> None:
    # The module lives in a folder of its own, found through [task] path (relative to the config
    # file); the command runs from a third directory.
    module, name = _write_task(tmp_path / "tasks")
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "run.toml").write_text(CONFIG.format(task=f'[task]\nname = "{name}"\nmodule = "{module}"\npath = ["../tasks"]\n'))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = train_cli(elsewhere, "--config", str(conf_dir / "run.toml"))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    check_trained(elsewhere / "run", name, module)
    assert str(tmp_path / "tasks") in LoopConfig.load(elsewhere / "run" / "config.json").task_path


def test_train_with_a_missing_task_module_exits_2_naming_it_before_any_run(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(CONFIG.format(task='task = "lookup"'))
    proc = train_cli(tmp_path, "--config", "run.toml", "--import", "no_such_task_module_xyz")
    assert proc.returncode == 2, proc.stderr
    assert "task module 'no_such_task_module_xyz' not found" in proc.stderr and "sys.path" in proc.stderr
    assert str(tmp_path) in proc.stderr  # the current directory was searched
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_train_with_a_task_module_that_raises_exits_2_with_its_traceback_tail(tmp_path: Path) -> None:
    (tmp_path / "broken_task_mod.py").write_text(textwrap.dedent('''
        def _setup():
            raise RuntimeError("the dataset is missing")

        _setup()
    '''))
    (tmp_path / "run.toml").write_text(CONFIG.format(task='[task]\nname = "lookup"\nmodule = "broken_task_mod"\n'))
    proc = train_cli(tmp_path, "--config", "run.toml")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "task module 'broken_task_mod' raised RuntimeError: the dataset is missing" in err, err
    assert "broken_task_mod.py" in err and "_setup" in err, err
    assert not (tmp_path / "run").exists()

