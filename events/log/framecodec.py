"""Which frame codec the file log uses: the compiled one
(:mod:`agentlog.events.log._framecodec`, built from ``events/log/_framecodec.c`` at
``pip install`` when a C compiler is present) or the pure-Python one in
:mod:`~agentlog.events.log.scan` and :mod:`~agentlog.events.log.writer`.
Both give identical results (the differential tests hold them to it); the
compiled one stops paying Python per frame for framing and CRC32C.

The compiled codec is used when it was built, unless the environment sets
``AGENTLOG_PURE_PYTHON=1``. Tests switch at run time with :func:`use_native`.
``native`` is the compiled module in use, or None.
"""

from __future__ import annotations

from types import ModuleType

from agentlog import _compiled as _switch
from agentlog._compiled import ENV_VAR

#: The compiled module's ``API`` this Python side calls (raised with every change to what it exports).
API = 7
_ACCELERATOR = _switch.Accelerator("agentlog.events.log._framecodec", API, "compiled codec", "pure-Python codec")
_compiled = _ACCELERATOR.module  # the built module, in use or not (None: not built, or stale)

#: The compiled codec module in use, or None (pure Python).
native: ModuleType | None = _ACCELERATOR.in_use()

stale_reason = _ACCELERATOR.stale_reason  # why a built module cannot serve this Python side ("" when it can)
unavailable_reason = _ACCELERATOR.unavailable_reason  # why it cannot be used ("" when it can)
available = _ACCELERATOR.available  # whether the compiled codec was built and is current


def use_native(on: bool) -> None:
    """Switch the codec for this process (tests, benchmarks). Raises
    RuntimeError when ``on`` and the compiled codec was not built."""
    global native
    native = _ACCELERATOR.chosen(on)


def describe() -> str:
    """The codec in use, in words (for benchmarks and ``--version``-like output)."""
    if native is not None:
        return f"compiled (CRC32C: {native.crc_backend()})"
    if _compiled is not None:
        return f"pure Python ({ENV_VAR} set or switched off)"
    return f"pure Python ({_ACCELERATOR.missing})"
