"""Connection limits of the gateway's HTTP listener: a request-head timeout,
a connection cap that makes room by closing idle connections, and a share of
the cap kept for the admin API.

aiohttp (the server the gateway runs on) accepts as many connections as
there are file descriptors and holds one that sends nothing, or trickles its
request head a byte at a time, for its whole keep-alive timeout. A few
hundred such sockets (a slow-loris attacker) would hold every descriptor, or
every slot of a cap, and lock out agents and operators alike. The guards sit
between the listening socket and aiohttp's request handler:

* **request-head timeout**: a request's head (request line and headers) must
  be complete within ``header_timeout_s`` of the connection's accept, or, on
  a kept-alive connection, of the next request's first byte; otherwise the
  connection is closed. The clock bounds the whole head, not the gap between
  bytes: trickling does not extend it, and a socket that sends nothing is
  closed just the same.
* **connection cap**: at ``max_connections`` open connections a new one
  closes the connection that has waited longest without a request in
  progress: first one that never completed a request head (silent or
  trickling), then the longest-idle kept-alive one. Only when every
  connection has a request in progress is the new one answered ``503`` (a
  JSON body naming the cap) and closed.
* **admin share**: ``admin_connections`` of the cap are kept for the admin
  API and ``/health``: agent requests in progress at once are capped at
  ``max_connections - admin_connections``; one more is answered ``503``. An
  operator can then always connect (closing an idle connection if need be)
  and be served.

Idle kept-alive connections are further bounded by aiohttp's own keep-alive
timeout (set by the gateway), and a slow request *body* by the gateway's body
read timeout (see ``Gateway._body``; a body is read only once the request's
key was checked).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Callable

import msgspec
from aiohttp import web

from agentlog._logging import get_logger

_log = get_logger("agentlog.gateway")


class ConnectionGuard(asyncio.Protocol):
    """Wraps one aiohttp request handler (an asyncio protocol) and enforces
    the request-head timeout; the :class:`GuardedSite` that made it enforces
    the cap and the admin share."""

    def __init__(self, site: "GuardedSite", inner: asyncio.Protocol) -> None:
        self.site = site
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._agent_request = False  # the request in progress counts against the agents' share
        self._bytes_while_busy = False
        self._refused = False
        self._closed = False

    # -- asyncio.Protocol, forwarded to aiohttp's handler ---------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        site = self.site
        if len(site.open) >= site.max_connections and not site.make_room():
            self._refuse(transport)
            return
        site.open[transport] = self
        site.fresh[self] = None
        self._arm()  # the head clock runs from accept: a socket that sends nothing is closed too
        self.inner.connection_made(transport)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        site = self.site
        self._refused = True
        site.refused += 1
        peer = transport.get_extra_info("peername")
        _log.warning("gateway.connection_refused", peer=str(peer), open=len(site.open), max_connections=site.max_connections)
        body = msgspec.json.encode(
            {"error": {"message": f"gateway busy: {len(site.open)} connections open, each with a request in progress; "
                                  f"the cap is {site.max_connections}; retry later",
                       "type": "overloaded_error", "code": 503}}
        )
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        transport.write(head.encode() + body)  # type: ignore[attr-defined]
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_request:
            self._bytes_while_busy = True
        elif self._timer is None and data:
            self._arm()  # the first byte of a kept-alive connection's next request
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
        self._forget()
        self.inner.connection_lost(exc)

    def _forget(self) -> None:
        """Leave the site's tables (at close, or at once when evicted)."""
        self._closed = True
        site = self.site
        site.open.pop(self.transport, None)
        site.fresh.pop(self, None)
        site.idle.pop(self, None)

    def evict(self, why: str) -> None:
        """Close this connection (it has no request in progress) to make room."""
        self._cancel()
        self._forget()
        self.site.evicted += 1
        assert self.transport is not None
        _log.info("gateway.connection_evicted", peer=str(self.transport.get_extra_info("peername")), reason=why)
        self.transport.close()

    # -- request boundaries (called by the site's middleware) ----------------

    def request_started(self, agent: bool) -> bool:
        """The head of a request is complete: its handler runs now. Returns
        False when it is an ``agent`` request (not admin) and the agents'
        share of the cap is in use: the caller answers 503."""
        self._cancel()
        self._in_request = True
        self._bytes_while_busy = False
        site = self.site
        site.fresh.pop(self, None)
        site.idle.pop(self, None)
        if agent:
            if site.agent_requests >= site.agent_share:
                site.refused_for_admin += 1
                return False
            site.agent_requests += 1
            self._agent_request = True
        return True

    def request_finished(self) -> None:
        """The handler answered; bytes of a pipelined next request start its clock."""
        self._in_request = False
        if self._agent_request:
            self._agent_request = False
            self.site.agent_requests -= 1
        if self._closed:
            return
        self.site.idle[self] = None  # newest idle last: the oldest is closed first to make room
        if self._bytes_while_busy:
            self._arm()

    # -- the head clock ------------------------------------------------------

    def _arm(self) -> None:
        self._cancel()
        self._timer = asyncio.get_running_loop().call_later(self.site.header_timeout_s, self._head_timed_out)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._in_request or self.transport is None or self.transport.is_closing():
            return
        self.site.timed_out += 1
        peer = self.transport.get_extra_info("peername")
        _log.info("gateway.header_timeout", peer=str(peer), timeout_s=self.site.header_timeout_s)
        self.transport.close()


def default_admin_connections(max_connections: int) -> int:
    """The admin share of a cap when none is configured: an eighth, 1 to 8."""
    return max(1, min(8, max_connections // 8))


class GuardedSite(web.TCPSite):
    """A TCP site whose connections pass through a :class:`ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, header_timeout_s: float, max_connections: int,
                 admin_connections: int | None = None, **kw: Any) -> None:
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s: expected a number > 0, found {header_timeout_s!r}")
        if max_connections < 2:
            raise ValueError(f"max_connections: expected an int >= 2 (one at least is kept for the admin API), found {max_connections!r}")
        if admin_connections is None:
            admin_connections = default_admin_connections(max_connections)
        if not 1 <= admin_connections < max_connections:
            raise ValueError(f"admin_connections: expected an int in [1, max_connections - 1] = [1, {max_connections - 1}], found {admin_connections!r}")
        super().__init__(runner, host, port, **kw)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.admin_connections = admin_connections
        #: Agent (non-admin) requests that may be in progress at once.
        self.agent_share = max_connections - admin_connections
        #: Open connections (transport -> guard).
        self.open: dict[Any, ConnectionGuard] = {}
        #: Connections that never completed a request head, oldest first.
        self.fresh: OrderedDict[ConnectionGuard, None] = OrderedDict()
        #: Kept-alive connections between requests, longest idle first.
        self.idle: OrderedDict[ConnectionGuard, None] = OrderedDict()
        #: Agent requests in progress.
        self.agent_requests = 0
        #: Since start: connections refused at the cap, closed for a slow head,
        #: closed to make room; agent requests refused to keep the admin share.
        self.refused = 0
        self.timed_out = 0
        self.evicted = 0
        self.refused_for_admin = 0

    def make_room(self) -> bool:
        """Close the connection that waited longest with no request in
        progress (a never-used one before an idle kept-alive one); False when
        every open connection has a request in progress."""
        for waiting, why in ((self.fresh, "at the connection cap: no request head yet"),
                             (self.idle, "at the connection cap: idle keep-alive")):
            if waiting:
                victim = next(iter(waiting))
                victim.evict(why)
                return True
        return False

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


def request_bounds_middleware(site_of: Callable[[], GuardedSite | None], is_admin: Callable[[web.Request], bool]) -> Callable[..., Any]:
    """An aiohttp middleware telling each connection's guard when a request's
    head was complete (its handler starts) and when it was answered; an agent
    request (``is_admin`` false) beyond the agents' share is answered 503."""

    @web.middleware
    async def bounds(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        site = site_of()
        guard = site.guard_of(request) if site is not None else None
        if guard is not None and not guard.request_started(agent=not is_admin(request)):
            guard.request_finished()
            assert site is not None
            message = (f"gateway busy: {site.agent_requests} requests in progress, the most at once; "
                       f"{site.admin_connections} of the {site.max_connections} connections are kept for the admin API; retry later")
            return web.json_response({"error": {"message": message, "type": "overloaded_error", "code": 503}}, status=503,
                                     headers={"Connection": "close"})
        try:
            return await handler(request)
        finally:
            if guard is not None:
                guard.request_finished()

    return bounds
