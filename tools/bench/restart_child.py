"""The restarted engine process of ``bench_restart.py``: it imports what a
worker that restarts imports to open its log and its engine, and nothing of
the benchmark (the learner's, the reducers' pipeline and the loop's modules
would make its heap, and so the collector's work, larger than a restart's)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import time

import msgspec

from agentlog.engine import SessionEngine
from agentlog.events import FileLog


def restart_engine_here(path: str, from_zero: bool) -> None:
    """Open the log and the engine (it aborts the orphans); print, as JSON, the
    seconds that took, the records it folded, and what it appended (a digest)
    and counted."""
    logging.getLogger("agentlog").setLevel(logging.ERROR)  # one warning per orphan aborted: expected
    # The imports leave objects waiting for the collector's first full
    # collection, which comes after a fixed number of allocations: without
    # this it fell inside whichever restore happened to allocate past that
    # point (the long log's, as a rule), and the goal compared where that one
    # collection fell, not the logs.
    gc.collect()

    async def go() -> dict:
        t0 = time.perf_counter()
        log = FileLog.open(path, fsync="never")
        try:
            t1 = time.perf_counter()
            before = log.next_lsn
            eng = await SessionEngine.open(log, **({"checkpoint_every": 0} if from_zero else {}))
            took = time.perf_counter() - t1
            appended = [(e.session_id, e.session_seq, e.body) for e in log.read(before)]
            return {"took": took, "log_open": t1 - t0, "total": took + t1 - t0, "rescanned": log.rescanned_bytes,
                    "folded": eng.stats["restart_folded"], "violations": eng.stats["violations"],
                    "aborted": len(appended), "digest": hashlib.sha256(msgspec.msgpack.encode(appended)).hexdigest()}
        finally:
            log.close()

    print(json.dumps(asyncio.run(go())), flush=True)
