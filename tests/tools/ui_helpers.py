"""Shared pieces of the `agentlog ui` tests (API tests and browser tests).

``ui_run``: a module-scoped fixture giving the runs the UI is tested on,
reusing the suite's session-scoped runs (no new demo): the short demo's run
folder (rollout + learner log: groups, steps, reconstruct) and the CLI tests'
engine-written log (finished, aborted with a traceback, dropped, forked and
still-running sessions).

``start_ui(source, token=..., index_path=...) -> (url, stop)``: the real
server (:class:`agentlog.tools.ui.server.UiServer`) on 127.0.0.1 at a free
port, on its own event loop in a background thread, returned once its index
holds the whole log as it was at start. ``stop()`` shuts it down (idempotent).

Use from a test module::

    from ui_helpers import start_ui, ui_run  # noqa: F401  (ui_run is a fixture)
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest


@dataclass(frozen=True)
class UiRun:
    """The runs the UI tests read (read-only: copy before writing)."""

    demo: Path  # a run folder: config.json, rollout/, learner/
    log: Path  # a bare engine-written log (see tests/tools/cli_helpers.py EXPECTED)
    log_facts: dict


@pytest.fixture(scope="module")
def ui_run(short_demo_run, run_log) -> UiRun:
    """The short demo's run folder and the CLI tests' log (both made once per session)."""
    cwd, _ = short_demo_run
    path, facts = run_log
    return UiRun(demo=cwd / "runs" / "demo", log=Path(path), log_facts=facts)


def start_ui(source: Any, *, token: str | None = None, index_path: Any = None, host: str = "127.0.0.1",
             wait_indexed: bool = True, timeout_s: float = 60.0) -> tuple[str, Callable[[], None]]:
    """Start the real server on ``source`` in a background thread; returns (base URL, stop)."""
    from agentlog.tools.ui.server import UiServer

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="agentlog-ui-test", daemon=True)
    thread.start()
    ui = UiServer(str(source), token=token, index_path=None if index_path is None else str(index_path),
                  host=host, quiet=True)

    async def begin() -> str:
        url = await ui.start(port=0)
        if wait_indexed:
            await ui.caught_up(timeout_s)
        return url

    try:
        url = asyncio.run_coroutine_threadsafe(begin(), loop).result(timeout_s)
    except BaseException:
        _shutdown(loop, thread, ui)
        raise
    stopped = []

    def stop() -> None:
        if not stopped:
            stopped.append(True)
            _shutdown(loop, thread, ui)

    stop.server = ui  # type: ignore[attr-defined]  # tests may inspect the server (its index)
    return url, stop


def _shutdown(loop: asyncio.AbstractEventLoop, thread: threading.Thread, ui: Any) -> None:
    try:
        asyncio.run_coroutine_threadsafe(ui.stop(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
