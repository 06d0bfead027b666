"""Import the fixture generator's event list without running it."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "make_golden", Path(__file__).resolve().parent.parent / "fixtures" / "make_golden.py"
)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
golden_envelopes = _mod.golden_envelopes
