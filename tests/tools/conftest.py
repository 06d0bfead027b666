"""Fixtures for the CLI tests: one engine-written run shared by the module's
tests (read-only; tests that damage a log work on a copy)."""

from __future__ import annotations

import asyncio
import gc
import shutil

import pytest

from cli_helpers import write_run


@pytest.fixture(autouse=True)
def _benchmarks_walk_only_their_own_heap(request):
    """A benchmark script collects garbage before each timed part (``gc.collect()``), and a collection
    walks every object the process holds. In a test worker that ran other files first, that is
    their leftovers too: bench_engine's tiny run took 25-31 s in the suite and 2 s alone. Frozen
    (``gc.freeze``), the objects held before the test are left out of every collection, as in the
    script's own process; they return to the collector after it."""
    if not request.path.name.startswith("test_bench_"):
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(scope="session")
def run_log(tmp_path_factory):
    """(path, facts): the engine-written run and what the online reducer saw."""
    path = tmp_path_factory.mktemp("cli") / "run.log"
    online: list[str] = []
    facts = asyncio.run(write_run(path, online))
    facts["online_digest"] = online[0]
    return path, facts


@pytest.fixture
def run_log_copy(run_log, tmp_path):
    """A private copy of the run's log directory (for tests that damage it)."""
    dst = tmp_path / "copy.log"
    shutil.copytree(run_log[0], dst, ignore=shutil.ignore_patterns("LOCK"))
    return dst
