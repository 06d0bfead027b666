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
_WHAT, _FALLBACK = "compiled codec", "pure-Python codec"


def stale_reason(module: object) -> str:
    """Why a compiled codec module cannot serve this version of the Python side
    (built from an older ``_framecodec.c`` and never rebuilt), or "" when it can."""
    return _switch.stale_reason(module, API, _WHAT, _FALLBACK)


_compiled, _missing = _switch.load("agentlog.events.log._framecodec", API, _WHAT, _FALLBACK)

#: The compiled codec module in use, or None (pure Python).
native: ModuleType | None = None if _switch.forced_pure() else _compiled


def available() -> bool:
    """True when the compiled codec was built (whether or not it is in use)."""
    return _compiled is not None


def unavailable_reason() -> str:
    """Why the compiled codec cannot be used ("" when it can): not built (no C
    compiler at install time?), or built from an older source (stale)."""
    return _missing


def use_native(on: bool) -> None:
    """Switch the codec for this process (tests, benchmarks). Raises
    RuntimeError when ``on`` and the compiled codec was not built."""
    global native
    if on and _compiled is None:
        raise RuntimeError(_missing)
    native = _compiled if on else None


def describe() -> str:
    """The codec in use, in words (for benchmarks and ``--version``-like output)."""
    if native is not None:
        return f"compiled (CRC32C: {native.crc_backend()})"
    if _compiled is not None:
        return f"pure Python ({ENV_VAR} set or switched off)"
    return f"pure Python ({_missing})"
