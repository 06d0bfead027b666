"""Import the fixture generators' functions without running them."""

import importlib.util
from pathlib import Path
from types import ModuleType

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def load_fixture_script(name: str) -> ModuleType:
    """The module ``tests/fixtures/<name>.py``, loaded (its ``__main__`` part does not run)."""
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


golden_envelopes = load_fixture_script("make_golden").golden_envelopes
