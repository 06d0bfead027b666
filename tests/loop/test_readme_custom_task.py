"""The README's "Custom tasks" example trains as written (its own file: each loop run takes seconds)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from custom_task_helpers import REPO, agentlog_exe, check_trained, clean_env


def test_the_readmes_custom_task_example_trains_as_written(tmp_path: Path) -> None:
    """README "Custom tasks": its module (```python), its config (```toml with [task]) and its command
    (```console) train as written, from a directory outside the repository."""
    text = (REPO / "README.md").read_text()
    section = text.split("### Custom tasks", 1)[1].split("\n### ", 1)[0]
    (module,) = re.findall(r"```python\n(.*?)```", section, re.S)
    (config,) = [b for b in re.findall(r"```toml\n(.*?)```", section, re.S) if "[task]" in b]
    (command,) = [line[2:] for line in re.findall(r"```console\n(.*?)```", section, re.S)[0].splitlines() if line.startswith("$ ")]
    (tmp_path / "my_tasks.py").write_text(module)
    (tmp_path / "train.toml").write_text(config)
    args = shlex.split(command)
    assert args[:2] == ["agentlog", "train"], args
    proc = subprocess.run([agentlog_exe(), *args[1:], "--quiet", "--no-report", "--timeout", "120"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    out = args[args.index("--out") + 1]
    check_trained(tmp_path / out, "echo", "my_tasks")
