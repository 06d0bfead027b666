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

import os
from types import ModuleType

ENV_VAR = "AGENTLOG_PURE_PYTHON"

#: The compiled module's ``API`` this Python side calls (raised with every change to what it exports).
API = 7


def stale_reason(module: object) -> str:
    """Why a compiled codec module cannot serve this version of the Python side
    (built from an older ``_framecodec.c`` and never rebuilt), or "" when it can."""
    found = getattr(module, "API", 1)
    if found == API:
        return ""
    return (f"the compiled codec is stale (its API {found}, this version needs {API}): rebuild it with "
            "`pip install -e .` (or `make .venv/.installed`); the pure-Python codec is used meanwhile")


def _forced_pure() -> bool:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"environment variable {ENV_VAR}={os.environ[ENV_VAR]!r}: expected 1/true/yes or 0/false/no (or unset)")


try:
    from . import _framecodec as _compiled
except ImportError as _exc:  # not built: no compiler at install time, or an unsupported platform
    _compiled: ModuleType | None = None
    _missing = f"the compiled codec is not built ({_exc})"
else:
    _missing = stale_reason(_compiled)
    if _missing:
        _compiled = None
        if not _forced_pure():  # the compiled codec was wanted
            import warnings

            warnings.warn(_missing, RuntimeWarning, stacklevel=2)


#: The compiled codec module in use, or None (pure Python).
native: ModuleType | None = None if _forced_pure() else _compiled


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
