"""The connection to JetStream, shared by the writer and the readers.

nats-py is asyncio and the log interface is partly synchronous: a
:class:`Bridge` is a daemon thread running the event loop that holds the
connection, and sync callers (or other event loops) submit coroutines to
it. :func:`connect` reaches a list of servers and reconnects without limit;
:func:`retried` tries a request again while a leader election or a
reconnect makes it fail, up to a deadline named by the setting that bounds
it. :func:`require_nats` names the extra to install when nats-py is missing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from ..._logging import get_logger
from .api import LogError

log = get_logger(__name__)


def require_nats():
    """The nats package, or a LogError naming the extra to install."""
    try:
        import nats  # noqa: F401
    except ImportError as exc:  # a clear cure, not a bare ImportError
        raise LogError("the JetStream log needs nats-py: pip install 'agentlog[nats]'") from exc
    return nats


def retry_errors() -> tuple[type[BaseException], ...]:
    """Client-side failures of one request that a leader election or a
    reconnect causes (the connection itself stays open)."""
    import nats.errors
    import nats.js.errors

    return (
        nats.errors.TimeoutError,
        asyncio.TimeoutError,
        nats.errors.NoRespondersError,
        nats.js.errors.NoStreamResponseError,
        nats.errors.ConnectionReconnectingError,
        nats.errors.StaleConnectionError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.FlushTimeoutError,
    )


#: JetStream refusals that a node coming back makes for a moment: "no suitable peers for
#: placement, peer offline" (creating an R3 stream while a restarted node is not current yet).
TRANSIENT_API_ERRORS = (10005,)
#: Pause between tries of a request during an election.
RETRY_PAUSE_S = 0.05


async def retried(call, what: str, where: str, timeout_s: float, per_try_s: float, setting: str) -> Any:
    """``await call()``, tried again for up to ``timeout_s`` while it fails the
    way an election or a reconnect makes it fail (a client timeout, no
    responders, a 503 from the server, a peer still offline); any other error at once. Past the
    deadline a LogError names ``where``, ``what`` was asked and the
    ``setting`` that bounds it."""
    from nats.js.errors import APIError, ServiceUnavailableError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    retried_errors: tuple[type[BaseException], ...] = (APIError, *retry_errors())
    while True:
        try:
            return await asyncio.wait_for(call(), timeout=per_try_s)
        except retried_errors as exc:
            if isinstance(exc, ServiceUnavailableError) and exc.code is None:  # nats-py's "no responders" to $JS.API
                raise LogError(f"{where}: {what}: no JetStream API answered on the server (no responders); expected a "
                               f"nats-server with JetStream enabled (nats-server -js)") from exc
            if isinstance(exc, APIError) and exc.code != 503 and exc.err_code not in TRANSIENT_API_ERRORS:
                raise
            if loop.time() >= deadline:
                raise LogError(f"{where}: {what} not answered within {setting}={timeout_s:g} s: {exc!r}") from exc
            log.info("jetstream.retry", where=where, what=what, error=repr(exc))
            await asyncio.sleep(RETRY_PAUSE_S)


async def connect(url, connect_timeout_s: float, error_cb=None):
    """A nats-py connection to ``url`` (one nats:// URL, several joined by
    commas, or a list), reconnecting without limit and quickly: when the
    node a client is on dies, it must reach the survivors while the stream
    elects a leader; the callers' deadlines, not the connection, bound
    their requests."""
    require_nats()
    from nats.aio.client import Client

    servers = [url] if isinstance(url, str) else list(url)
    servers = [u.strip() for entry in servers for u in str(entry).split(",") if u.strip()]
    if not servers:
        raise ValueError(f"url: expected a nats:// URL or a list of them, found {url!r}")
    # nats-py never gives up on a first connection while reconnects are unlimited: bound it
    # (every server tried at least once), so a wrong URL is an error, not an open that hangs.
    nc = Client()
    give_up_s = (connect_timeout_s + 0.2) * len(servers) + 1.0
    try:
        # nats-py annotates both durations as int; it takes seconds as floats (asyncio timeouts).
        await asyncio.wait_for(nc.connect(servers=servers, connect_timeout=connect_timeout_s,  # type: ignore[arg-type]
                                          error_cb=error_cb, allow_reconnect=True, max_reconnect_attempts=-1,
                                          reconnect_time_wait=0.2),  # type: ignore[arg-type]
                               timeout=give_up_s)
    except asyncio.TimeoutError:
        last = nc.last_error
        await nc.close()
        raise LogError(f"cannot connect to a NATS server at {', '.join(servers)} within {give_up_s:g} s "
                       f"(last error: {last!r}); expected a running nats-server with JetStream") from None
    return nc


class Bridge:
    """A daemon thread running one asyncio loop: the NATS connection lives
    there, and sync callers (or other event loops) submit coroutines to it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro) -> concurrent.futures.Future:
        """Schedule ``coro`` on the bridge loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None = None) -> Any:
        """Run ``coro`` on the bridge loop and wait for its result."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Cancel what still runs on the loop (a client's heartbeat tasks), stop it and join the thread."""
        if self.loop.is_running():
            try:
                self.call(_cancel_others(), timeout=5)
            except concurrent.futures.TimeoutError:  # stopping anyway: the thread is a daemon
                log.warning("jetstream.bridge_stop_timeout", thread=self.thread.name)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_others() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
