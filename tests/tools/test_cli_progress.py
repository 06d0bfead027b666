"""Progress bars on reading more than a few MB (on a terminal); --quiet silences them."""

from __future__ import annotations

import sys

from cli_helpers import ROOT, on_a_terminal

sys.path.insert(0, str(ROOT / "tools" / "bench"))
from bench_cli import generate_log  # noqa: E402


def test_reading_a_big_log_shows_progress_and_quiet_silences_it(tmp_path):
    import logging

    import structlog

    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        generate_log(tmp_path / "big.log", 6 << 20, quiet=True)
    finally:
        structlog.configure(**saved)
    code, err = on_a_terminal("stats", str(tmp_path / "big.log"))
    assert code == 0, err
    assert "stats:" in err and "B/s" in err, err
    code, err = on_a_terminal("stats", str(tmp_path / "big.log"), "--quiet")
    assert code == 0 and err == "", err
