"""The README a new user starts from: a quick start at the top (activate, demo,
where the results go, three commands to try), set-up that says how `agentlog`
gets on the PATH, and no benchmark tables (they live in docs/performance.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_quick_start_comes_first_and_says_activate_demo_results_and_three_commands():
    sections = re.findall(r"^## (.+)$", README, re.M)
    assert sections[0] == "Quick start", sections
    quick = _section("Quick start")
    assert "make demo" in quick and ". .venv/bin/activate" in quick
    assert "runs/demo" in quick and "report.html" in quick
    commands = [line for line in quick.splitlines() if line.startswith("agentlog ")]
    assert len(commands) >= 3 and all("runs/demo" in c for c in commands), commands


def test_set_up_says_how_agentlog_gets_on_the_path():
    setup = _section("Set-up")
    assert ". .venv/bin/activate" in setup and "PATH" in setup


def test_the_benchmark_tables_moved_to_docs_performance():
    assert not re.search(r"^GOAL \w+:", README, re.M) and "| seed |" not in README
    assert "docs/performance.md" in _section("Performance")
    perf = (ROOT / "docs" / "performance.md").read_text()
    for figure in ("GOAL durable_append_vs_raw_fdatasync", "GOAL opd_steps_to_0.9_vs_rl", "GOAL report_100k_size_mb",
                   "Measured on 2026-11-30 on the project's 2-core CI VM"):
        assert figure in perf, figure


# ---------------------------------------------------------------- the layout names every module

#: Library files that are not modules a reader looks for: package markers and the build script.
_NOT_LISTED = {"__init__.py", "setup.py"}


def _layout_block() -> str:
    """The code block of the README's Layout section."""
    return _section("Layout").split("```", 2)[1]


def layout_entries(block: str) -> dict[str, str]:
    """``{top-level entry: its text}``: an entry starts at column 0 (``events/``,
    ``_logging.py``) and runs over the indented lines after it."""
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            current = line.split()[0]
            entries[current] = line
        elif current is not None:
            entries[current] += "\n" + line
    return entries


def library_modules(root: Path) -> list[str]:
    """The repository's library modules (``events/log/writer.py``, ``_logging.py``, ...):
    every tracked Python or C source outside tests, examples, docs and the
    benchmark scripts (those are listed as a folder)."""
    import subprocess

    out = subprocess.run(["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "*.py", "*.c"],
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted(p for p in out if p.split("/")[0] not in ("tests", "examples", "docs") and not p.startswith("tools/bench/")
                  and Path(p).name not in _NOT_LISTED and (root / p).is_file())


def missing_from_layout(block: str, modules: list[str]) -> list[str]:
    """The modules the layout block does not name: ``layer/sub/mod.py`` must have its
    stem ``mod`` (as a word) and every folder ``sub/`` on the way in its layer's entry;
    a root module its own name anywhere in the block."""
    entries = layout_entries(block)
    missing = []
    for module in modules:
        parts = module.split("/")
        stem = Path(parts[-1]).stem
        if len(parts) == 1:
            if not re.search(rf"(?<![\w.]){re.escape(stem)}\b", block):
                missing.append(module)
            continue
        entry = entries.get(parts[0] + "/", "")
        folders_named = all(f"{folder}/" in entry for folder in parts[1:-1])
        if not folders_named or not re.search(rf"(?<![\w]){re.escape(stem)}(?![\w])", entry):
            missing.append(module)
    return missing


def test_the_layout_names_every_library_module():
    missing = missing_from_layout(_layout_block(), library_modules(ROOT))
    assert not missing, (
        "README.md's Layout does not name these modules (add each, with a few words, under its layer):\n"
        + "\n".join(missing)
    )


def test_the_layout_check_bites():
    block = ("events/    schema/ (types, lifecycle), log/ (writer, read)\n"
             "           fs, the atomic writes\n"
             "loop/      worker, demo/ (faults)\n")
    modules = ["events/fs.py", "events/schema/types.py", "events/log/writer.py", "events/log/scan.py",
               "loop/worker.py", "loop/demo/faults.py", "loop/demo/warmup.py", "loop/run.py", "_logging.py"]
    assert missing_from_layout(block, modules) == ["events/log/scan.py", "loop/demo/warmup.py", "loop/run.py", "_logging.py"]
