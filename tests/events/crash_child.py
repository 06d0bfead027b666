"""Child process of the crash test: appends forever and reports every
acknowledged record on stdout as ``lsn session seq`` lines, until SIGKILLed.

    python crash_child.py LOG_DIR SEED [COMPRESSION]

Sessions continue across crashes (their next seq comes from the reopened
log), every payload is derived from (session, seq), and both the asyncio and
the synchronous batch API are used, so the parent can check everything.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from agentlog.events import FileLog  # noqa: E402
from agentlog.events.schema.types import CommandRan  # noqa: E402

SESSIONS = 6


def body(sid: str, seq: int) -> CommandRan:
    """The payload the parent expects for (sid, seq)."""
    return CommandRan(command=f"{sid}:{seq}", exit_code=seq % 7, output_tail="x" * (seq * 37 % 300))


def report(envs) -> None:
    os.write(1, "".join(f"{e.lsn} {e.session_id} {e.session_seq}\n" for e in envs).encode())


def main() -> None:
    import structlog

    # stdout carries the acknowledgements only.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    path, seed = sys.argv[1], int(sys.argv[2])
    compression = sys.argv[3] if len(sys.argv) > 3 else "none"  # "zstd": every flush one compressed batch
    rnd = random.Random(seed)
    # Periodic INDEX checkpoints inside segments too.
    lg = FileLog.open(path, segment_bytes=8192, checkpoint_bytes=1024, compression=compression)
    os.write(1, b"ready\n")
    # Async appenders own the a* sessions, the batch thread the b* ones, so
    # each session's next seq is only ever read by the one that appends to it.

    async def appender(k: int) -> None:
        sid = f"a{k}"
        while True:
            seq = lg.next_seq(sid)
            report([await lg.append(sid, seq, body(sid, seq))])

    def batcher() -> None:
        while True:
            recs = []
            staged: dict[str, int] = {}
            for _ in range(rnd.randint(1, 20)):
                sid = f"b{rnd.randrange(SESSIONS)}"
                seq = staged.get(sid, lg.next_seq(sid))
                staged[sid] = seq + 1
                recs.append((sid, seq, body(sid, seq)))
            report(lg.append_batch(recs))

    async def run() -> None:
        threading.Thread(target=batcher, daemon=True).start()
        await asyncio.gather(*(appender(k) for k in range(SESSIONS)))

    asyncio.run(run())


if __name__ == "__main__":
    main()
