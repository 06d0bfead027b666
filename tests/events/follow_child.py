"""Child process of the follower test: tails a log with follow_log and prints
``lsn session seq tag`` for each of the first N records, then exits.

    python follow_child.py LOG_DIR N
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from agentlog.events import follow_log  # noqa: E402
from agentlog.events.schema.types import event_tag  # noqa: E402


async def main(path: str, n: int) -> None:
    os.write(1, b"ready\n")
    seen = 0
    out = []
    async for env in follow_log(path, poll_s=0.01):
        out.append(f"{env.lsn} {env.session_id} {env.session_seq} {event_tag(env.body)}\n")
        seen += 1
        if seen == n:
            break
    os.write(1, "".join(out).encode())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
