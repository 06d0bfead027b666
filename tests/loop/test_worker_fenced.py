"""A rollout worker whose log was fenced by a newer incarnation never ends a
batch as if nothing happened: even when every append of the batch failed at
once and the batch itself ended "normally" (its sessions' errors collected),
the worker stops with WorkerLogFatal instead of going on (or exiting 0 when
the learner's final version is already out)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("nats", reason="the JetStream log needs the nats extra: pip install 'agentlog[nats]'")

from agentlog.events.log.api import LogFenced
from agentlog.events.schema.types import SessionOpened
from agentlog.loop.config import LogConfig, RolloutConfig
from agentlog.loop.worker import RolloutWorker, WorkerLogFatal
from loop_helpers import small_config


def test_a_batch_that_ends_after_its_log_was_fenced_stops_the_worker(tmp_path: Path, nats_server) -> None:
    """On JetStream, where two incarnations can be alive at once (a file
    partition's flock keeps a second writer out of one process)."""
    cfg = small_config(rollout=RolloutConfig(workers=2),
                       log=LogConfig(backend="nats", url=nats_server.url, stream="fenced-worker"))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    worker = RolloutWorker(run, cfg, partition=1)
    stale = worker.run_folder.open_rollout(1, fence=True)
    newer = worker.run_folder.open_rollout(1, fence=True)  # a restarted incarnation takes a higher epoch
    try:
        async def batch_whose_appends_all_fail() -> str:
            try:
                await stale.append("s0", 0, SessionOpened(group_id="g", group_size=1))
            except LogFenced:
                return "errors collected, batch over"  # as run_batch gathers its sessions' errors
            raise AssertionError("the stale incarnation's append was not refused")

        with pytest.raises(WorkerLogFatal, match="went fatal"):
            asyncio.run(worker.watch_log(stale, batch_whose_appends_all_fail()))
    finally:
        stale.close()
        newer.close()
        worker.run_folder.close()
