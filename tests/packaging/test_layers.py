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

Third-party imports too (:data:`BANNED_PACKAGES`): the event schema and the
reducers are data and pure folds, so they import no torch, aiohttp, tqdm or
nats, at module level, inside a function or through ``importlib``; and only
``tools/`` draws progress bars (tqdm). A run in a fresh interpreter also checks
that importing them loads none of those packages through another module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
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


#: The event schema: its types, the lifecycle grammar and the turn encoding, not
#: the log or its JetStream backend.
SCHEMA_MODULES = ("events/schema",)

#: Torch, the HTTP stack, progress bars and the NATS client.
HEAVY = frozenset({"torch", "aiohttp", "tqdm", "nats"})

#: (which files, which third-party packages they may not import, why).
BANNED_PACKAGES: list[tuple[tuple[str, ...], frozenset[str], str]] = [
    (("reducers",), HEAVY, "the reducers are pure folds"),
    (SCHEMA_MODULES, HEAVY, "the event schema is data"),
    # Every layer but tools (the library stays quiet; tools/progress.py draws the bars).
    (("__init__.py", "_logging.py", "events", "reducers", "learner", "engine", "gateway", "loop"), frozenset({"tqdm"}),
     "only tools/ draws progress bars"),
]


def _covers(where: tuple[str, ...], posix: PurePosixPath) -> bool:
    """Whether the file ``posix`` is one of ``where`` (files) or inside one of them (folders)."""
    return any(str(posix) == w or str(posix).startswith(w + "/") for w in where)


def imported_packages(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of each absolute import in ``tree``: ``import x.y``,
    ``from x.y import z`` and ``importlib.import_module("x")`` / ``__import__("x")``
    with a literal name, wherever they are written (functions included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value.split(".")[0]))
    return found


def banned_imports(root: Path) -> list[str]:
    """'path:line: imports pkg (why)' for each import :data:`BANNED_PACKAGES` forbids there."""
    problems = []
    for rel in tracked_files(root, "*.py"):
        posix = PurePosixPath(rel.as_posix())
        rules = [(banned, why) for where, banned, why in BANNED_PACKAGES if _covers(where, posix)]
        if not rules:
            continue
        tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=str(rel))
        for line, package in imported_packages(tree):
            for banned, why in rules:
                if package in banned:
                    problems.append(f"{posix}:{line}: imports {package} ({why})")
    return sorted(problems)


def test_schema_and_reducers_import_no_torch_aiohttp_tqdm_or_nats_and_only_tools_draws_bars():
    problems = banned_imports(ROOT)
    assert not problems, "third-party imports where the layers forbid them (docs/design.md):\n" + "\n".join(problems)


def test_the_banned_import_check_bites(tmp_path):
    """A function-level torch import in a reducer, an importlib tqdm in the engine and an
    aiohttp import in the schema are each found; the same imports in the learner or
    tools are not."""
    files = {
        "reducers/fold.py": "import numpy as np\ndef f():\n    import torch.nn\n",
        "engine/core.py": "import importlib\nbar = importlib.import_module('tqdm')\n",
        "events/schema/types.py": "from aiohttp import web\n",
        "events/schema/turn.py": "import nats.js\n",
        "learner/model.py": "import torch\n",
        "tools/progress.py": "from tqdm import tqdm\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert banned_imports(tmp_path) == [
        "engine/core.py:2: imports tqdm (only tools/ draws progress bars)",
        "events/schema/turn.py:1: imports nats (the event schema is data)",
        "events/schema/types.py:1: imports aiohttp (the event schema is data)",
        "reducers/fold.py:3: imports torch (the reducers are pure folds)",
    ]


def test_importing_the_schema_and_the_reducers_loads_none_of_them():
    """Through other modules too: a fresh interpreter imports every reducer and schema module."""
    modules = ["agentlog.reducers." + p.stem for p in sorted((ROOT / "reducers").glob("*.py")) if p.stem != "__init__"]
    for rel in tracked_files(ROOT, "*.py"):
        posix = PurePosixPath(rel.as_posix())
        if _covers(SCHEMA_MODULES, posix):
            parts = posix.with_suffix("").parts
            modules.append(".".join(("agentlog", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        print(",".join(sorted(p for p in {sorted(HEAVY)!r} if p in sys.modules)))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"importing {modules} loaded {res.stdout.strip()}"


def schema_imports_of_the_log(root: Path) -> list[str]:
    """'path:line: ...' for each import of ``agentlog.events.log`` (absolute, or
    relative as ``..log``) in ``events/schema/``: the schema is the lower
    sublayer of ``events``, and the log builds on it, never the reverse."""
    problems = []
    for rel in tracked_files(root, "*.py"):
        posix = PurePosixPath(rel.as_posix())
        if not _covers(SCHEMA_MODULES, posix):
            continue
        tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=str(rel))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ("agentlog.events." if node.level == 2 else "") + (node.module or "")
                if node.level == 2 and not node.module:  # from .. import log
                    base = "agentlog.events." + ",".join(a.name for a in node.names)
                names = [base]
            if any(n == "agentlog.events.log" or n.startswith("agentlog.events.log.") for n in names):
                problems.append(f"{posix}:{node.lineno}: imports the log (events/schema/ is data the log builds on)")
    return sorted(problems)


def test_the_schema_does_not_import_the_log():
    problems = schema_imports_of_the_log(ROOT)
    assert not problems, "\n".join(problems)


def test_the_schema_to_log_check_bites(tmp_path):
    files = {
        "events/schema/types.py": "from ..log.api import LogError\n",
        "events/schema/turn.py": "import agentlog.events.log.format\nfrom ..errors import AgentlogError\n",
        "events/log/api.py": "from ..schema.types import Envelope\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert schema_imports_of_the_log(tmp_path) == [
        "events/schema/turn.py:1: imports the log (events/schema/ is data the log builds on)",
        "events/schema/types.py:1: imports the log (events/schema/ is data the log builds on)",
    ]


def test_checking_a_run_folder_imports_no_torch():
    """`agentlog reconstruct` and `check` run loop.check over a run folder: a
    pure reading of logs, so importing it must not pay torch's import (it did,
    through the trainer and the publisher, ~3 s a command)."""
    code = "import sys, agentlog.loop.check, agentlog.loop.learner_records; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
