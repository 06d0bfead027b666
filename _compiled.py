"""The optional compiled accelerators, and the one switch that turns them all off.

Two C extensions are built at ``pip install`` when a C compiler is present
(``setup.py``; without one the install warns and goes on):

* :mod:`agentlog.events.log._framecodec`, the file log's framing and CRC32C
  (selected by :mod:`agentlog.events.log.framecodec`);
* :mod:`agentlog.events.schema._speedups`, the schema's packing of token ids
  and log-probs, its finite check, and the turn encoding's identity
  comparison (selected by :mod:`agentlog.events.schema.speedups`).

Each is an accelerator of a pure-Python path that stays the reference: the
differential tests hold both to identical results. Each is used when it was
built and is current, unless the environment sets ``AGENTLOG_PURE_PYTHON=1``.
A module built from an older source (a checkout updated without reinstalling)
exports an older ``API`` number: it is then not used, and says why.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

#: Set to 1/true/yes to use the pure-Python path of every compiled accelerator.
ENV_VAR = "AGENTLOG_PURE_PYTHON"


def forced_pure() -> bool:
    """Whether :data:`ENV_VAR` asks for the pure-Python paths. Raises ValueError,
    naming the variable and its value, for a value that is neither yes nor no."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"environment variable {ENV_VAR}={os.environ[ENV_VAR]!r}: expected 1/true/yes or 0/false/no (or unset)")


def stale_reason(module: object, api: int, what: str, fallback: str) -> str:
    """Why the compiled ``module`` (``what``, in words) cannot serve the Python side that
    needs its ``api``: built from an older source and never rebuilt. "" when it can.
    ``fallback`` names the pure-Python path used meanwhile."""
    found = getattr(module, "API", 1)
    if found == api:
        return ""
    return (f"the {what} is stale (its API {found}, this version needs {api}): rebuild it with "
            f"`pip install -e .` (or `make .venv/.installed`); the {fallback} is used meanwhile")


class Accelerator:
    """One compiled accelerator as its Python side finds it: ``module`` (None when it cannot be
    used) and ``missing`` (why not: "" when it can). Importing ``name`` (absolute) happens here:
    a module not built (no C compiler at install time, an unsupported platform) or stale (see
    :func:`stale_reason`; a stale build also warns, unless the environment asks for the
    pure-Python paths anyway) is not used. The Python side keeps the module it calls as a
    global of its own (``native``, read on every call) and sets it with :meth:`chosen`."""

    def __init__(self, name: str, api: int, what: str, fallback: str) -> None:
        self.api, self.what, self.fallback = api, what, fallback
        self.module: ModuleType | None = None
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            self.missing = f"the {what} is not built ({exc})"
            return
        self.missing = self.stale_reason(module)
        if self.missing:
            if not forced_pure():  # the compiled module was wanted
                warnings.warn(self.missing, RuntimeWarning, stacklevel=3)
        else:
            self.module = module

    def stale_reason(self, module: object) -> str:
        """Why ``module`` cannot serve this version of the Python side, or "" when it can."""
        return stale_reason(module, self.api, self.what, self.fallback)

    def available(self) -> bool:
        """Whether the compiled module was built and is current (whether or not it is in use)."""
        return self.module is not None

    def unavailable_reason(self) -> str:
        """Why the compiled module cannot be used ("" when it can): not built (no C compiler at
        install time?), or built from an older source (stale)."""
        return self.missing

    def chosen(self, on: bool) -> ModuleType | None:
        """The module to call when switched ``on`` (tests, benchmarks), None when off. Raises
        RuntimeError, saying why, when ``on`` and the module cannot be used."""
        if on and self.module is None:
            raise RuntimeError(self.missing)
        return self.module if on else None

    def in_use(self) -> ModuleType | None:
        """The module to call at import: None when the environment asks for pure Python."""
        return None if forced_pure() else self.module
