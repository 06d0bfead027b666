"""The future-writer fixture (``tests/fixtures/future_log``) and its generator's functions."""

from make_golden_shim import FIXTURES, load_fixture_script

_mod = load_fixture_script("make_future_log")
future_records = _mod.future_records
write_frames = _mod.write_frames
FUTURE_LOG = FIXTURES / "future_log"
