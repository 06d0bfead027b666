"""Whether the schema's hot loops run compiled: :mod:`agentlog.events.schema._speedups`,
built from ``events/schema/_speedups.c`` at ``pip install`` when a C compiler is present.

Every recorded turn packs its output token ids and log-probs, checks that every
log-prob is finite, and finds which of its messages are the very objects of the
session's previous turn. Each is a short loop over a few hundred Python objects;
in Python it costs a tenth of a captured turn (``tools/bench/capture_cpu.py``).
The compiled module runs the common case of each and hands anything else back to
the Python path, which stays the reference: :mod:`~.packing` and
:mod:`~.turn_delta` call ``native`` when it is set, and the differential tests
hold both paths to identical bytes, verdicts and refusals.

``native`` is the compiled module in use, or None: not built, stale (built from an
older source), or switched off with ``AGENTLOG_PURE_PYTHON=1``
(:mod:`agentlog._compiled`, the switch it shares with the file log's codec). Tests
switch at run time with :func:`use_native`.
"""

from __future__ import annotations

from types import ModuleType

from agentlog import _compiled as _switch

#: The compiled module's ``API`` this Python side calls (raised with every change to what it exports).
API = 1
_ACCELERATOR = _switch.Accelerator("agentlog.events.schema._speedups", API, "compiled schema speedups module", "pure-Python path")
_compiled = _ACCELERATOR.module  # the built module, in use or not (None: not built, or stale)

#: The compiled speedups module in use, or None (pure Python).
native: ModuleType | None = _ACCELERATOR.in_use()

stale_reason = _ACCELERATOR.stale_reason  # why a built module cannot serve this Python side ("" when it can)
unavailable_reason = _ACCELERATOR.unavailable_reason  # why it cannot be used ("" when it can)
available = _ACCELERATOR.available  # whether the compiled speedups were built and are current


def use_native(on: bool) -> None:
    """Switch the speedups for this process (tests, benchmarks). Raises
    RuntimeError when ``on`` and the compiled module was not built."""
    global native
    native = _ACCELERATOR.chosen(on)
