"""The GOAL line every benchmark script ends with, in one place: written and read back.

Each script prints one line per goal, last, in the form
``GOAL <name>: <measured> (goal <op> <target>) PASS|MISS``; text a script adds
after the verdict (an anchor, a breakdown) follows it on the same line. A MISS
is information: the scripts exit 0 on it. :func:`meets` decides the verdict, and
a measure that is not a number (NaN) never meets its goal.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Callable, NamedTuple

#: The comparisons a goal may state, by the operator its line shows.
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt, "==": operator.eq,
}


def meets(measured: float, op: str, target: float) -> bool:
    """Whether ``measured`` meets ``target`` under ``op`` (one of ``>= <= < > ==``); NaN never does."""
    try:
        compare = _OPS[op]
    except KeyError:
        raise ValueError(f"goal operator: expected one of {' '.join(_OPS)}, found {op!r}") from None
    return not math.isnan(measured) and compare(measured, target)


def verdict(ok: bool) -> str:
    """A goal's verdict as its line shows it."""
    return "PASS" if ok else "MISS"


def goal_line(name: str, measured: str, op: str, target: str, ok: bool) -> str:
    """The GOAL line of ``name``: ``measured`` and ``target`` as they are shown, ``ok`` its verdict."""
    return f"GOAL {name}: {measured} (goal {op} {target}) {verdict(ok)}"


def goal(name: str, measured: float, op: str, target: float, unit: str = "x") -> str:
    """:func:`goal_line` of a number against its target, judged by :func:`meets`
    (``unit`` "x": a ratio shown to two decimals; another unit: a whole count with separators)."""
    fmt = (lambda v: f"{v:,.0f}{unit}") if unit != "x" else (lambda v: f"{v:.2f}x")
    return goal_line(name, fmt(measured), op, fmt(target), meets(measured, op, target))


class GoalLine(NamedTuple):
    """One GOAL line read back (:func:`parse_goal_line`): each part as the line shows it."""

    name: str
    measured: str
    op: str
    target: str
    passed: bool
    #: What the script printed after the verdict (an anchor, a breakdown), or "".
    after: str


#: ``GOAL <name>: <measured> (goal <op> <target>) PASS|MISS[ <more>]``; the measured text may hold
#: parentheses of its own (an anchor beside the figure), so the last "(goal " opens the goal.
_LINE = re.compile(r"^GOAL (\S+): (.*) \(goal (" + "|".join(map(re.escape, _OPS)) + r") (.*?)\) (PASS|MISS)(.*)$")


def parse_goal_line(line: str) -> GoalLine | None:
    """The GOAL line ``line`` as its parts, or None when it is not one."""
    m = _LINE.match(line.rstrip("\n"))
    if m is None:
        return None
    name, measured, op, target, verdict, after = m.groups()
    return GoalLine(name, measured, op, target, verdict == "PASS", after.strip())
