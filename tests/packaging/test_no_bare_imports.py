"""No code, test or README example imports a bare ``events``, ``engine``, ``tools`` ...

Everything is ``agentlog.<layer>``. A bare name would resolve to whatever
``events`` or ``tools`` comes first on ``sys.path`` (a user's own package in
the current directory, another distribution), or work only from a checkout.
The check covers every Python file git knows, the ```python blocks of the
Markdown docs, and module paths given as strings: ``python -m X``,
``importlib.import_module("X")``, ``monkeypatch.setattr("X.attr", ...)``,
``mock.patch("X.attr")``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from packaging_helpers import OLD_TOP_LEVEL, ROOT, tracked_files

#: Calls whose first argument is a module path (or a "module.attribute" target).
MODULE_PATH_CALLS = {"import_module", "__import__", "find_spec", "setattr", "delattr", "patch", "run_module"}

_OLD = re.compile(rf"^({'|'.join(OLD_TOP_LEVEL)})(\.|$)")


def _leading_text(node: ast.AST) -> str | None:
    """The literal text a string argument starts with (an f-string's leading literal part), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def _call_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def bare_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every import of an old top-level name, and every such module path given as a string."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _OLD.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _OLD.match(node.module):
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and _call_name(node.func) in MODULE_PATH_CALLS and node.args:
            text = _leading_text(node.args[0])
            # setattr/delattr(obj, "name", ...) take an object first: only a string first argument is a path.
            if text is not None and _OLD.match(text):
                found.append((node.lineno, f"{_call_name(node.func)}({text!r}, ...)"))
        elif isinstance(node, (ast.List, ast.Tuple)):
            for flag, arg in zip(node.elts, node.elts[1:]):
                if _leading_text(flag) == "-m" and (text := _leading_text(arg)) is not None and _OLD.match(text):
                    found.append((node.lineno, f"-m {text}"))
    return found


def markdown_python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, source) of each ```python block of a Markdown text."""
    return [
        (text[: m.start(1)].count("\n") + 1, m.group(1))
        for m in re.finditer(r"^```python[ \t]*\n(.*?)^```", text, re.M | re.S)
    ]


def scan_repository(root: Path) -> list[str]:
    """'path:line: what' for every bare import in the repository at ``root``."""
    problems = []
    for rel in tracked_files(root, "*.py"):
        tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=str(rel))
        problems += [f"{rel}:{line}: {what}" for line, what in bare_imports(tree)]
    for rel in tracked_files(root, "*.md"):
        for first, source in markdown_python_blocks((root / rel).read_text(encoding="utf-8")):
            # README examples use top-level await, as in an asyncio REPL.
            tree = compile(source, f"{rel}:{first}", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            problems += [f"{rel}:{first + line}: {what}" for line, what in bare_imports(tree)]
    return problems


def test_no_bare_import_of_an_old_top_level_name():
    problems = scan_repository(ROOT)
    assert not problems, (
        f"{len(problems)} import(s) of bare {'/'.join(OLD_TOP_LEVEL)} (use agentlog.<layer>):\n" + "\n".join(problems)
    )


def test_the_scan_sees_every_form():
    source = (
        "import events\nimport tools.loop.run as r\nfrom engine import SessionEngine\nfrom learner.loss import x\n"
        "import agentlog.events\nfrom agentlog.tools import cli\nfrom . import loop\nimport eventsource\n"
        "importlib.import_module('reducers.pipeline')\nmonkeypatch.setattr('gateway.server.X', 1)\n"
        "monkeypatch.setattr(mod, 'events', 1)\nmock.patch(f'loop.run.{name}')\n"
        "subprocess.run([sys.executable, '-m', f'loop.{kind}'])\nsubprocess.run(['python', '-m', 'agentlog.loop.run'])\n"
    )
    found = [line for line, _ in bare_imports(ast.parse(source))]
    assert found == [1, 2, 3, 4, 9, 10, 12, 13], bare_imports(ast.parse(source))
