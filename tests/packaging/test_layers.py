"""The layers' dependencies point one way (docs/design.md, "Layers").

    tools ──▶ loop ──▶ engine ──▶ reducers ──▶ events
      │        ├─────▶ learner ───┘
      │        └─────▶ gateway ─▶ engine
      └─────▶ gateway

A layer may import the layers below it, never one above it or beside it: the
log knows no folds, the reducers no torch, the engine and the learner not
each other; the loop may use the gateway (text tasks' rollouts go through
it), never the reverse. Every import of every
Python file of a layer folder is checked, function-level imports included,
whether written ``agentlog.<layer>`` or relative.
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

from packaging_helpers import ROOT, layer_folders, tracked_files

#: layer -> the layers it may import (besides itself and the root package).
ALLOWED: dict[str, frozenset[str]] = {
    "events": frozenset(),
    "reducers": frozenset({"events"}),
    "learner": frozenset({"reducers", "events"}),
    "engine": frozenset({"reducers", "events"}),
    "gateway": frozenset({"engine", "reducers", "events"}),
    "loop": frozenset({"gateway", "engine", "learner", "reducers", "events"}),
    "tools": frozenset({"loop", "gateway", "engine", "learner", "reducers", "events"}),
}


def imported_layers(rel: PurePosixPath, tree: ast.AST, layers: set[str]) -> list[tuple[int, str]]:
    """(line, layer) for each import in ``tree`` (the module at ``rel``) of a layer of the namespace."""
    package = list(rel.parent.parts)  # the package the module is in (an __init__.py: its own)
    found = []
    for node in ast.walk(tree):
        targets: list[list[str]] = []
        if isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                targets = [node.module.split(".")] if node.module else []
            else:
                base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else None
                if base is None:
                    raise AssertionError(f"{rel}:{node.lineno}: relative import above the agentlog package")
                mod = base + (node.module.split(".") if node.module else [])
                # `from . import x` / `from .. import tools`: the names may be modules themselves.
                targets = [mod + [a.name] for a in node.names] if not node.module else [mod]
                targets = [["agentlog", *t] for t in targets]
        for parts in targets:
            if len(parts) >= 2 and parts[0] == "agentlog" and parts[1] in layers:
                found.append((node.lineno, parts[1]))
    return found


def layer_violations(root: Path) -> list[str]:
    """'path:line: layer imports layer' for each import that points up or sideways."""
    layers = set(layer_folders(root))
    unknown = sorted(layers - set(ALLOWED))
    assert not unknown, f"layer folder(s) {unknown} have no place in ALLOWED: add them, with docs/design.md's picture"
    problems = []
    for rel in tracked_files(root, "*.py"):
        posix = PurePosixPath(rel.as_posix())
        layer = posix.parts[0]
        if layer not in layers:
            continue
        tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=str(rel))
        for line, target in imported_layers(posix, tree, layers):
            if target != layer and target not in ALLOWED[layer]:
                problems.append(f"{posix}:{line}: {layer} imports {target}")
    return sorted(problems)


def test_dependencies_point_one_way():
    problems = layer_violations(ROOT)
    assert not problems, "imports against the layers' direction (docs/design.md):\n" + "\n".join(problems)


def test_relative_imports_resolve_to_their_layer():
    tree = ast.parse("from ..tools import cli\nfrom . import worker\nfrom .. import events\nimport agentlog.learner.loss\n")
    layers = {"tools", "loop", "events", "learner"}
    assert imported_layers(PurePosixPath("loop/run.py"), tree, layers) == [(1, "tools"), (2, "loop"), (3, "events"), (4, "learner")]
