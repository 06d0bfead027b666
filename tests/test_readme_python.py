"""The README's Python examples run as written: every ```python block, in
order, in one empty directory (later examples read what earlier ones wrote),
each as its own process so one example cannot lean on another's imports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 5, "the README's Usage section lost its Python examples"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs_as_written(index: int, workdir: Path) -> None:
    script = workdir / f"example_{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=workdir, capture_output=True, text=True, timeout=240,
        env={k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"},
    )
    assert proc.returncode == 0, f"README example {index} failed:\n{BLOCKS[index]}\n--- stderr ---\n{proc.stderr[-3000:]}"
