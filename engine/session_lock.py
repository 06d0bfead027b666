"""The per-session FIFO lock of the session engine (:mod:`engine.core`).

Operations of one session are serialised by a FIFO lock kept in two slots of
its handle (``_busy``, ``_waiters``). The uncontended path is one attribute
test and set, with no allocation, written inline by each operation::

    if h._busy:
        await acquire_contended(h)
    else:
        h._busy = True
    try:
        ...
    finally:
        release(h)

An asyncio.Lock per session costs two GC-tracked objects per session and
three coroutine objects per operation, and with 10,000 live sessions the extra
garbage-collector work made the engine ~1.6x slower than plain appends
(tools/bench/bench_engine.py); so does a helper coroutine awaited on every
operation, which is why the uncontended test is not behind a call. Release
hands the lock straight to the oldest waiter, so nobody can barge.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


async def acquire_contended(h: Any) -> None:
    """Wait for ``h``'s lock (held by someone else, ``h._busy`` is True); returns owning it."""
    await handed_over(h, queue_for(h))


def queue_for(h: Any) -> asyncio.Future:
    """Join ``h``'s queue for its lock (held by someone else) now: the place is taken at
    this call, in call order, whenever the caller then waits (:func:`handed_over`)."""
    if h._waiters is None:
        h._waiters = deque()
    fut = asyncio.get_running_loop().create_future()
    h._waiters.append(fut)
    return fut


async def handed_over(h: Any, fut: asyncio.Future) -> None:
    """Wait until ``h``'s lock is handed over through ``fut`` (:func:`queue_for`); returns owning it."""
    try:
        await fut
    except asyncio.CancelledError:
        if fut.done() and not fut.cancelled():
            release(h)  # it was handed to us as we were cancelled: pass it on
        raise


def release(h: Any) -> None:
    """Release ``h``'s lock: hand it to the oldest live waiter, or free it."""
    waiters = h._waiters
    while waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(None)  # ownership passes on; _busy stays True
            return
    h._waiters = None
    h._busy = False
