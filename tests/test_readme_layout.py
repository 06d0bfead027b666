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
