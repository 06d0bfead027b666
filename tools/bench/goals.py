"""The GOAL line every benchmark script ends with, in one place.

Each script prints one line per goal, last, in the form
``GOAL <name>: <measured> (goal <op> <target>) PASS|MISS``; text a script adds
after the verdict (an anchor, a breakdown) follows it on the same line. A MISS
is information: the scripts exit 0 on it. :func:`meets` decides the verdict, and
a measure that is not a number (NaN) never meets its goal.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

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


def goal_line(name: str, measured: str, op: str, target: str, ok: bool) -> str:
    """The GOAL line of ``name``: ``measured`` and ``target`` as they are shown, ``ok`` its verdict."""
    return f"GOAL {name}: {measured} (goal {op} {target}) {'PASS' if ok else 'MISS'}"


def goal(name: str, measured: float, op: str, target: float, unit: str = "x") -> str:
    """:func:`goal_line` of a number against its target, judged by :func:`meets`
    (``unit`` "x": a ratio shown to two decimals; another unit: a whole count with separators)."""
    fmt = (lambda v: f"{v:,.0f}{unit}") if unit != "x" else (lambda v: f"{v:.2f}x")
    return goal_line(name, fmt(measured), op, fmt(target), meets(measured, op, target))
