"""Shared pieces of the packaging tests: where the repository is, which files
git tracks in it, and which top-level names the namespace replaced."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The repository root (the folder that holds pyproject.toml).
ROOT = Path(__file__).resolve().parents[2]

#: Top-level module names the repository used before the `agentlog` namespace (and the layer
#: folders added with it). Installed or imported bare, each of them collides with
#: another distribution or with a user's own package of that name.
OLD_TOP_LEVEL = ("engine", "events", "reducers", "learner", "tools", "gateway", "loop")


def tracked_files(root: Path, pattern: str | None = None) -> list[Path]:
    """Files of ``root`` that git knows (tracked, plus untracked ones not ignored),
    relative to ``root``; ``pattern`` is a git pathspec such as ``'*.py'``."""
    cmd = ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z"]
    if pattern:
        cmd += ["--", pattern]
    res = subprocess.run(cmd, capture_output=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(
            f"git ls-files failed in {root} (exit {res.returncode}): {res.stderr.decode(errors='replace').strip()}; "
            "the packaging tests need a git checkout of the repository"
        )
    return sorted(Path(p) for p in res.stdout.decode().split("\0") if p and (root / p).is_file())


def layer_folders(root: Path) -> list[str]:
    """The repository's layer folders: top-level folders that are Python packages
    (hold an ``__init__.py``), found on disk so a new layer cannot be overlooked."""
    return sorted(
        p.parent.as_posix() for p in tracked_files(root, "*/__init__.py") if len(p.parts) == 2 and p.parts[0] != "tests"
    )
