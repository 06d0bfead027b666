"""The GOAL line's one owner (tools/bench/goals.py): its verdict under each operator, NaN, its
format, and that no benchmark script formats a GOAL line of its own."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from agentlog.tools.bench.goals import goal, goal_line, meets

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


@given(st.floats(allow_nan=False), st.floats(allow_nan=False))
def test_meets_judges_as_its_operator_reads(measured, target):
    assert meets(measured, ">=", target) == (measured >= target)
    assert meets(measured, "<=", target) == (measured <= target)
    assert meets(measured, "<", target) == (measured < target)
    assert meets(measured, ">", target) == (measured > target)
    assert meets(measured, "==", target) == (measured == target)


@pytest.mark.parametrize("op", [">=", "<=", "<", ">", "=="])
def test_a_measure_that_is_not_a_number_never_meets_its_goal(op):
    assert not meets(math.nan, op, 1.0)


def test_an_unknown_operator_is_refused_by_name():
    with pytest.raises(ValueError, match=r"goal operator: expected one of >= <= < > ==, found '=>'"):
        meets(1.0, "=>", 1.0)


def test_the_line_reads_name_measure_goal_and_verdict():
    assert goal_line("x_vs_y", "1.23x", "<=", "1.5x", True) == "GOAL x_vs_y: 1.23x (goal <= 1.5x) PASS"
    assert goal_line("x_vs_y", "1.73x", "<=", "1.5x", False) == "GOAL x_vs_y: 1.73x (goal <= 1.5x) MISS"
    assert goal("r", 0.795, ">=", 0.8) == "GOAL r: 0.80x (goal >= 0.80x) MISS"  # judged on the number, not its rounding
    assert goal("n", 512_345.6, ">=", 500_000, " ev/s") == "GOAL n: 512,346 ev/s (goal >= 500,000 ev/s) PASS"
    assert goal("n", math.nan, "<=", 1.0).endswith(" MISS")


#: A string literal that starts a GOAL line (an f-string, a plain one to concatenate or %-format)...
_WRITES_GOAL = re.compile(r"""(?<![\w.])[fFrR]?["']GOAL """)
#: ...except where a script reads such lines back.
_READS_GOAL = re.compile(r"""\.(replace|startswith|split|removeprefix)\(["']GOAL """)


def test_no_benchmark_script_formats_a_goal_line_of_its_own():
    # One owner: a script that wrote "GOAL ..." itself could drift from the format readers parse.
    own = [f"{p.name}:{i}" for p in sorted(BENCH.glob("*.py")) if p.name != "goals.py"
           for i, line in enumerate(p.read_text().splitlines(), 1) if _WRITES_GOAL.search(line) and not _READS_GOAL.search(line)]
    assert own == []


@pytest.mark.parametrize("line", ['print(f"GOAL x: {v} (goal <= 1) PASS")', 'out = "GOAL " + name', "s = 'GOAL %s: %s' % (n, v)"])
def test_the_ownership_check_sees_each_way_of_writing_a_line(line):
    assert _WRITES_GOAL.search(line) and not _READS_GOAL.search(line)


def test_the_ownership_check_lets_a_script_read_goal_lines():
    assert not _WRITES_GOAL.search('if line.startswith("GOAL "):') or _READS_GOAL.search('if line.startswith("GOAL "):')
    assert _READS_GOAL.search('print("   " + line.replace("GOAL ", "", 1))')
