"""Connection limits of the gateway's HTTP listener: a header timeout and a connection cap.

aiohttp holds a connection whose request headers never finish for as long as
its keep-alive timeout (an hour by default), and accepts as many connections
as there are file descriptors. A few hundred slow or stuck clients (or a
slow-loris attacker) would then hold every descriptor the process has, and
the log's writer fails when it next opens a segment. Two guards sit between
the listening socket and aiohttp's request handler:

* **header timeout**: once the first byte of a request arrives, its headers
  must be complete within ``header_timeout_s``; otherwise the connection is
  closed. Trickling bytes does not extend it.
* **connection cap**: beyond ``max_connections`` open connections a new one
  is answered ``503`` (a JSON body naming the cap) and closed at once.

Idle keep-alive connections are bounded by aiohttp's own keep-alive timeout
(set by the gateway), and a slow request *body* by the gateway's body read
timeout (see ``Gateway._body``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import msgspec
from aiohttp import web

from agentlog._logging import get_logger

_log = get_logger("agentlog.gateway")


class ConnectionGuard(asyncio.Protocol):
    """Wraps one aiohttp request handler (an asyncio protocol) and enforces
    the header timeout; the :class:`GuardedSite` that made it enforces the cap."""

    def __init__(self, site: "GuardedSite", inner: asyncio.Protocol) -> None:
        self.site = site
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._bytes_while_busy = False
        self._refused = False

    # -- asyncio.Protocol, forwarded to aiohttp's handler ---------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        site = self.site
        if len(site.open) >= site.max_connections:
            self._refused = True
            site.refused += 1
            peer = transport.get_extra_info("peername")
            _log.warning("gateway.connection_refused", peer=str(peer), open=len(site.open), max_connections=site.max_connections)
            body = msgspec.json.encode(
                {"error": {"message": f"gateway busy: {len(site.open)} connections open, the cap is {site.max_connections}; retry later",
                           "type": "overloaded_error", "code": 503}}
            )
            head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            transport.write(head.encode() + body)  # type: ignore[attr-defined]
            transport.close()
            return
        site.open[transport] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_request:
            self._bytes_while_busy = True
        elif self._timer is None and data:
            self._arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        if not self._refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self.inner.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel()
        if self._refused:
            return
        self.site.open.pop(self.transport, None)
        self.inner.connection_lost(exc)

    # -- request boundaries (called by the site's middleware) ----------------

    def request_started(self) -> None:
        """The headers of a request are complete: its handler runs now."""
        self._cancel()
        self._in_request = True
        self._bytes_while_busy = False

    def request_finished(self) -> None:
        """The handler answered; bytes of a pipelined next request start its clock."""
        self._in_request = False
        if self._bytes_while_busy:
            self._arm()

    # -- the header clock ------------------------------------------------------

    def _arm(self) -> None:
        self._cancel()
        self._timer = asyncio.get_running_loop().call_later(self.site.header_timeout_s, self._headers_timed_out)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _headers_timed_out(self) -> None:
        self._timer = None
        if self._in_request or self.transport is None or self.transport.is_closing():
            return
        self.site.timed_out += 1
        peer = self.transport.get_extra_info("peername")
        _log.info("gateway.header_timeout", peer=str(peer), timeout_s=self.site.header_timeout_s)
        self.transport.close()


class GuardedSite(web.TCPSite):
    """A TCP site whose connections pass through a :class:`ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, header_timeout_s: float, max_connections: int, **kw: Any) -> None:
        if header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s: expected a number > 0, found {header_timeout_s!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections: expected an int >= 1, found {max_connections!r}")
        super().__init__(runner, host, port, **kw)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        #: Open connections (transport -> guard).
        self.open: dict[Any, ConnectionGuard] = {}
        #: Connections refused at the cap / closed for slow headers, since start.
        self.refused = 0
        self.timed_out = 0

    async def start(self) -> None:
        """Listen (as TCPSite.start does) with every connection guarded."""
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        factory: Callable[[], asyncio.Protocol] = lambda: ConnectionGuard(self, server())  # noqa: E731
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port

    def guard_of(self, request: web.BaseRequest) -> ConnectionGuard | None:
        """The guard of the connection ``request`` came on."""
        return self.open.get(request.transport)


def request_bounds_middleware(site_of: Callable[[], GuardedSite | None]) -> Callable[..., Any]:
    """An aiohttp middleware telling each connection's guard when a request's
    headers were complete (its handler starts) and when it was answered."""

    @web.middleware
    async def bounds(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        site = site_of()
        guard = site.guard_of(request) if site is not None else None
        if guard is not None:
            guard.request_started()
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_finished()

    return bounds
