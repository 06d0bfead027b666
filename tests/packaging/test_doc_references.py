"""What the docs and docstrings tell a reader to run or open exists.

- Every ``python -m X`` written anywhere in the repository (Markdown, Python
  docstrings and comments, shell scripts) and every ``[..., "-m", "X", ...]``
  argument list names a module that imports: a layout change that moves a
  module must move the sentences that name it.
- The living docs (README.md, docs/design.md) name only files that exist
  (``events/log/writer.py``, ``tools/bench/bench_log.py``, ...) and only
  ``agentlog.<...>`` names that resolve to a module or an attribute of one.
  docs/performance.md is history (it names files as they were when measured),
  so it is not checked for paths.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from packaging_helpers import OLD_TOP_LEVEL, ROOT, tracked_files

#: Text files that may tell a reader to run something.
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".c", ".txt", ".cfg"}
TEXT_NAMES = {"Makefile", "run"}

_RUN_MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.|]*)")
_ARGV_MODULE = re.compile(r"""(?:sys\.executable|["']python3?["'])\s*,\s*["']-m["']\s*,\s*f?["']([A-Za-z_][\w.{}|]*)["']""")

LIVING_DOCS = ("README.md", "docs/design.md")
_LAYERS = ("events", "reducers", "learner", "engine", "gateway", "loop", "tools", "tests", "examples", "docs")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w/.-]*\.(?:py|c|md|toml|sh|png))" % "|".join(_LAYERS))
_DOTTED = re.compile(r"\bagentlog((?:\.[A-Za-z_]\w*)+)")
#: ``agentlog.`` names that are not modules: the entry point group task packages declare.
NOT_MODULES = {"tasks"}


def _module_names(text: str) -> list[tuple[int, str]]:
    """(line, module) for each ``python -m`` and ``"-m", "X"`` in ``text``; ``a.b.c|d``
    stands for ``a.b.c`` and ``a.b.d``. Elided names (``agentlog....``) and ones built
    at run time (``{kind}``) are left out."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern in (_RUN_MODULE, _ARGV_MODULE):
            for m in pattern.finditer(line):
                name = m.group(1)
                if name.endswith(".") or "{" in name or name.isupper():
                    continue  # elided, built at run time, or a placeholder (``python -m X``)
                first, *alternatives = name.split("|")
                found.append((lineno, first))
                stem = first.rpartition(".")[0]
                found += [(lineno, f"{stem}.{alt}" if stem else alt) for alt in alternatives]
    return found


def _importable(name: str) -> bool:
    """``name`` imports; a bare layer name (``loop.trainer``) never counts, even where a
    checkout on ``sys.path`` would resolve it."""
    if name.split(".")[0] in OLD_TOP_LEVEL:
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def unknown_run_modules(root: Path) -> list[str]:
    """'file:line: python -m NAME' for each module a doc or docstring runs that does not import."""
    problems = []
    me = Path(__file__).resolve()
    for rel in tracked_files(root):
        if (root / rel).resolve() == me:
            continue  # its own examples of stale names
        if rel.suffix not in TEXT_SUFFIXES and rel.name not in TEXT_NAMES:
            continue
        text = (root / rel).read_text(encoding="utf-8", errors="replace")
        for lineno, name in _module_names(text):
            if not _importable(name):
                problems.append(f"{rel.as_posix()}:{lineno}: python -m {name}")
    return problems


def test_every_python_dash_m_names_a_module_that_imports():
    problems = unknown_run_modules(ROOT)
    assert not problems, "`python -m` of modules that do not exist (name the module by its agentlog path):\n" + "\n".join(problems)


def test_the_check_sees_stale_and_current_module_names(tmp_path):
    """The scan catches a stale name in a docstring and an argv list, and accepts real ones."""
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text(
        '"""``python -m loop.trainer RUN_DIR``, ``python -m agentlog.loop.worker|trainer``."""\n'
        'subprocess.run([sys.executable, "-m", "agentlog.tools.nonesuch"])\n'
        'subprocess.run([sys.executable, "-m", f"agentlog.loop.{kind}"])  # built at run time\n'
    )
    (tmp_path / "b.md").write_text("Subprocesses run `python -m agentlog....`; `python -m agentlog.tools.cli` too.\n")
    assert unknown_run_modules(tmp_path) == ["a.py:1: python -m loop.trainer", "a.py:2: python -m agentlog.tools.nonesuch"]


def _resolves(dotted: str) -> bool:
    """``agentlog.<dotted>`` is a module, or an attribute (chain) of the longest module prefix."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        module_name = "agentlog." + ".".join(parts[:k])
        if not _importable(module_name):
            continue
        obj = importlib.import_module(module_name)
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def missing_doc_references(root: Path) -> list[str]:
    """'doc:line: what' for each file path or ``agentlog.`` name in the living docs that does not exist."""
    problems = []
    for doc in LIVING_DOCS:
        for lineno, line in enumerate((root / doc).read_text(encoding="utf-8").splitlines(), 1):
            for m in _PATH.finditer(line):
                path = m.group(1)
                if not (root / path).exists():
                    problems.append(f"{doc}:{lineno}: no file {path}")
            for m in _DOTTED.finditer(line):
                dotted = m.group(1).lstrip(".")
                if dotted not in NOT_MODULES and not _resolves(dotted):
                    problems.append(f"{doc}:{lineno}: agentlog.{dotted} is neither a module nor an attribute of one")
    return problems


def test_the_living_docs_name_files_and_modules_that_exist():
    problems = missing_doc_references(ROOT)
    assert not problems, "README.md / docs/design.md name things that do not exist:\n" + "\n".join(problems)
