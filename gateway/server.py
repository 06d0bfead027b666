"""The recording gateway: an OpenAI- and Anthropic-compatible HTTP endpoint.

A sandboxed agent CLI is pointed at the gateway with its API key set to its
session's key: a random token the gateway issues when the session is opened
(the admin API's answer, or :meth:`Gateway.session_key`). Session ids are
predictable and stay what logs name; only the key admits a request, and no
key is ever logged or recorded. Each request is one turn: the gateway finds the live session
(never creating one), renders the prompt through the chat template, calls
the backend, parses tool calls out of the text, records the turn through the
engine, and only then answers (JSON, or SSE for streaming clients). The turn
is durable before the agent sees a byte of the response, so the log never
misses a turn the agent acted on; if the answer cannot be delivered, a
``turn_undelivered`` event keeps that turn out of training.

Status codes: 401 no API key, or a key that is no session's; 409 a
session that is not running (ended, or not started); 429 the session's turn
cap; 400 malformed JSON, JSON nested deeper than ``json_depth.MAX_JSON_DEPTH``
levels, or a request we cannot read (the message names the field), or a prompt that leaves no room in the model's context
(``context_length_exceeded``); 408 a body that did not arrive in time; 413 a
body over the size limit; 405 a method the route does not take; 502 the
backend failed; 503 the gateway cannot record (its log or backend failed for
good, the reason is given; or it is shutting down; or too many large bodies
are in flight). None of them records anything.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from typing import Any

import msgspec
from aiohttp import web

from agentlog._logging import get_logger
from agentlog.events.schema.lifecycle import State
from agentlog.events.log.format import DEFAULT_MAX_RECORD_BYTES

from .admin import AdminRoutes
from .sampling import AdminFieldError, check_sampling
from .api import APIS, ResponsesAPI, TurnRequest, error_body
from .backends import Backend, SamplingParams
from .chat import ByteChatTemplate, ChatTemplate, HermesToolParser, RequestError, ToolCallParser
from .connections import GuardedSite, request_bounds_middleware
from .json_depth import JSONTooDeep, decode_json
from .turn import TurnPath, _Refused, _SessionCfg

_log = get_logger("agentlog.gateway")

#: How often (in requests) the per-session table is swept for ended sessions.
_SWEEP_EVERY = 1024

#: How many keys of ended sessions are remembered, so their agent's late
#: request is told the session ended (409) rather than that its key is unknown.
_RETIRED_KEYS = 4096


class GatewayConfig(msgspec.Struct, frozen=True):
    """Gateway settings."""

    #: Turns one session may take; the next request is answered 429.
    max_turns: int = 256
    #: Largest request body accepted (bytes); larger ones are answered 413.
    #: None: derived from the log's record cap (see :func:`body_cap_for`), so
    #: a body that passes always makes a record the log accepts.
    max_body_bytes: int | None = None
    #: Bodies of at least this many bytes count against ``large_bodies_bytes``.
    large_body_bytes: int = 2**20
    #: Bytes of large bodies in flight at once; a large body beyond it is
    #: answered 503 at once (a decoded body costs tens of times its size).
    large_bodies_bytes: int = 32 * 2**20
    #: Seconds a request's head (request line and headers) may take, from the
    #: connection's accept or, on a kept-alive connection, the request's first
    #: byte; slower connections (silent or trickling ones) are closed.
    header_timeout_s: float = 10.0
    #: Seconds a request's body may take to arrive; slower ones get 408.
    body_timeout_s: float = 60.0
    #: Seconds an idle keep-alive connection is kept open.
    idle_timeout_s: float = 75.0
    #: Open connections at most. At the cap a new one closes the connection
    #: that waited longest with no request in progress; when every one has a
    #: request in progress, the new one is answered 503 and closed.
    max_connections: int = 1024
    #: Connections of the cap kept for the admin API and /health: agent
    #: requests in progress at once stay below max_connections minus this, so
    #: an operator always gets in. None: an eighth of the cap, 1 to 8.
    admin_connections: int | None = None
    #: Output allowance when the client names none.
    default_max_tokens: int = 512
    #: Cap on any client's max_tokens (Claude Code asks for 64000).
    max_tokens_cap: int = 4096
    #: Sampling defaults of every session (per-session ones via configure_session).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    #: Name reported by GET /v1/models and echoed when the client names none.
    model_name: str = "agentlog"
    #: The routing key of a session's turns (a fleet routes on it, and an HTTP backend
    #: sends it upstream for the user's own router): "session", its session id, so
    #: each session keeps one server's prefix cache; "group", its group id, so a
    #: group's members share one server and the prompt prefix they have in common.
    route_by: str = "session"

    def __post_init__(self) -> None:
        if self.route_by not in ROUTE_BY:
            raise ValueError(f"GatewayConfig: route_by: expected one of {ROUTE_BY}, found {self.route_by!r}")


#: What a session's routing key is (GatewayConfig.route_by).
ROUTE_BY = ("session", "group")


#: Bytes a recorded turn may take beyond its messages and prompt ids: the
#: envelope, the sampling dict, the per-output-token costs below.
_RECORD_OVERHEAD = 64 * 2**10
#: Bytes one prompt token id takes in a record (int32).
_BYTES_PER_TOKEN_ID = 4
#: Bytes one output token takes in a record: its id, its log-prob, and up to
#: 16 bytes of decoded text in the response message.
_BYTES_PER_OUTPUT_TOKEN = 24


def body_cap_for(record_cap: int, context_length: int | None, max_output_tokens: int) -> int:
    """The largest request body whose turn still fits a log record of
    ``record_cap`` bytes. The recorded messages take at most the body's own
    size; the prompt ids take 4 bytes per token, at most ``context_length``
    of them (longer prompts are refused) or, the context unknown, one token
    per body byte (a byte-level tokenizer's worst case)."""
    room = record_cap - _RECORD_OVERHEAD - _BYTES_PER_OUTPUT_TOKEN * max_output_tokens
    if context_length is None:
        cap = room // (1 + _BYTES_PER_TOKEN_ID)
    else:
        cap = room - _BYTES_PER_TOKEN_ID * context_length
    if cap < 4096:
        raise ValueError(
            f"a log record cap of {record_cap} bytes leaves no room for request bodies "
            f"(context {context_length}, output cap {max_output_tokens} tokens)"
        )
    return cap


class Gateway(TurnPath, AdminRoutes):
    """Serves the three wire APIs over one engine and one backend.

    ``engine`` is a :class:`engine.SessionEngine`; sessions are opened and
    started by whoever runs the rollout (a harness, the admin API of
    ``agentlog serve``), never by the gateway on an agent's request.
    """

    def __init__(
        self,
        engine: Any,
        backend: Backend,
        *,
        template: ChatTemplate | None = None,
        parser: ToolCallParser | None = None,
        config: GatewayConfig | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.engine = engine
        self.backend = backend
        self.parser = parser or HermesToolParser()
        self.template = template or ByteChatTemplate(self.parser)
        self.config = config or GatewayConfig()
        self.admin_token = admin_token
        c = self.config
        try:
            check_sampling({"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k}, "GatewayConfig")
        except AdminFieldError as exc:
            raise ValueError(str(exc)) from None
        record_cap = getattr(engine.log, "max_record_bytes", DEFAULT_MAX_RECORD_BYTES)
        #: The body cap in force (the configured one, or derived from the log's record cap).
        self.max_body_bytes = self.config.max_body_bytes or body_cap_for(record_cap, backend.context_length, self.config.max_tokens_cap)
        self._large_bodies = 0  # bytes of large bodies in flight (see _body_budget)
        self._sessions: dict[str, _SessionCfg] = {}
        #: API key -> session id, for the sessions holding a _SessionCfg.
        self._keys: dict[str, str] = {}
        #: Keys of sessions forgotten lately -> their session id (bounded).
        self._retired: OrderedDict[str, str] = OrderedDict()
        self._requests = 0
        self._turns_inflight = 0
        self._turns_idle = asyncio.Event()  # set while no turn is in flight (drain)
        self._turns_idle.set()
        self._draining = False
        self._runner: web.AppRunner | None = None
        self._site: GuardedSite | None = None
        self.url = ""
        #: When a list, each turn appends (prepare_s, record_s, send_s): the
        #: gateway's own time split (benchmarks); None (default) records nothing.
        self.timings: list[tuple[float, float, float]] | None = None
        self.stats = {"turns": 0, "undelivered": 0, "cancelled": 0, "backend_errors": 0, "refused": 0}

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        """The aiohttp application (routes only; see :meth:`start`)."""
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[request_bounds_middleware(lambda: self._site, _is_operator_request), self._json_http_errors],
        )
        r = app.router
        r.add_route("HEAD", "/", self._health)
        r.add_get("/", self._health, allow_head=False)
        r.add_get("/health", self._health)
        r.add_get("/v1/models", self._models)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/responses", self._responses)
        r.add_post("/v1/messages", self._messages)
        r.add_post("/v1/messages/count_tokens", self._count_tokens)
        r.add_post("/admin/sessions", self._admin_open)
        r.add_post("/admin/sessions/{sid}/{action}", self._admin_end)
        r.add_get("/admin/sessions/{sid}", self._admin_status)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: any free port); returns the base URL.

        Handlers are cancelled when their client disconnects, which is how a
        backend call learns to abort and how an undeliverable turn is noticed.
        """
        c = self.config
        self._runner = web.AppRunner(
            self.app(), handler_cancellation=True, access_log=None, keepalive_timeout=c.idle_timeout_s, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = GuardedSite(self._runner, host, port, header_timeout_s=c.header_timeout_s, max_connections=c.max_connections,
                           admin_connections=c.admin_connections)
        await site.start()
        self._site = site
        # An IPv6 literal is bracketed in a URL (RFC 3986): http://::1:8000 names no port a client can use.
        self.url = f"http://[{host}]:{site.port}" if ":" in host else f"http://{host}:{site.port}"
        _log.info("gateway.listening", url=self.url, backend=self.backend.name, template=self.template.name,
                  max_body_bytes=self.max_body_bytes, max_connections=c.max_connections, admin_connections=site.admin_connections)
        return self.url

    async def drain(self, timeout_s: float) -> int:
        """Begin shutting down: refuse new turns (503) and wait up to
        ``timeout_s`` for the turns in flight to be answered. Returns how
        many are still in flight (the caller then ends their sessions, e.g.
        ``engine.close()`` drops them with reason ``shutdown``)."""
        self._draining = True
        if self._turns_inflight:
            _log.info("gateway.draining", inflight=self._turns_inflight, timeout_s=timeout_s)
            try:
                await asyncio.wait_for(self._turns_idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                _log.warning("gateway.drain_timed_out", inflight=self._turns_inflight, timeout_s=timeout_s)
        return self._turns_inflight

    async def stop(self) -> None:
        """Stop listening (the engine and backend belong to the caller).
        Handlers still running get a second to finish, then are cancelled."""
        self._draining = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None

    @property
    def fatal_reason(self) -> str | None:
        """None while the gateway can take turns; else why not, in one line:
        its log's writer failed for good, the backend's worker died, or an
        engine background task crashed. ``/health`` answers 503 with it and
        every turn is refused with it before any generation."""
        reason = self._log_unable()
        if reason is not None:
            return reason
        reason = self.backend.fatal_reason
        if reason is not None:
            return f"backend {self.backend.name}: {reason}"
        reason = getattr(self.engine, "background_failure", None)
        if reason is not None:
            return f"engine: {reason}"
        return None

    def _log_unable(self) -> str | None:
        """The log's fatal reason, as ``fatal_reason`` words it; None while it takes appends."""
        reason = self.engine.log.fatal_reason
        return None if reason is None else f"log: {reason}"

    async def __aenter__(self) -> "Gateway":
        if not self.url:
            await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def configure_session(self, session_id: str, *, sampling: dict[str, Any] | None = None, max_turns: int | None = None,
                          max_new_tokens: int | None = None, keep_turns: bool = False, before_turn: Any = None) -> None:
        """Per-session sampling defaults, turn cap and output cap (forgotten
        when the session ends). ``max_new_tokens`` caps every turn's output,
        whatever the client asks for (Claude Code asks for 64000): a task's
        output allowance holds for a CLI agent too. ``keep_turns``: keep each
        recorded turn's token ids for :meth:`session_turns` (a teacher scores
        them before the session ends). ``before_turn``: an async callable awaited with the
        turn index when each turn's request arrives, before it is generated (the rollout
        snapshots the sandbox there); what it raises fails that request with a 500."""
        if sampling:
            try:
                check_sampling(sampling, "sampling")
            except AdminFieldError as exc:
                raise ValueError(f"session {session_id!r}: {exc}") from None
        if max_turns is not None and (type(max_turns) is not int or max_turns < 1):
            raise ValueError(f"session {session_id!r}: max_turns: expected an int >= 1, found {max_turns!r}")
        if max_new_tokens is not None and (type(max_new_tokens) is not int or max_new_tokens < 1):
            raise ValueError(f"session {session_id!r}: max_new_tokens: expected an int >= 1, found {max_new_tokens!r}")
        cfg = self._sessions.setdefault(session_id, _SessionCfg())
        if max_new_tokens is not None:
            cfg.max_new_tokens = max_new_tokens
        if sampling:
            cfg.sampling.update(sampling)
        if max_turns is not None:
            cfg.max_turns = max_turns
        if keep_turns and cfg.turns is None:
            cfg.turns = []
        if before_turn is not None:
            cfg.before_turn = before_turn

    def session_key(self, session_id: str) -> str:
        """The API key of live session ``session_id``, issued on first call: a
        random token (``secrets.token_urlsafe``) that the session's agent sends
        as its API key. The id is no credential: ids are predictable. Raises
        KeyError for a session the engine does not hold live. Kept until the
        session's entry is forgotten; never logged or recorded."""
        if self.engine.get(session_id) is None:
            raise KeyError(f"session {session_id!r} is not live (state {self.engine.status(session_id)}); only a live session gets an API key")
        if len(self._sessions) > 2 * self.engine.live_count + _SWEEP_EVERY:
            self._sweep()  # sessions ended outside the gateway: amortised O(1) per key
        cfg = self._sessions.setdefault(session_id, _SessionCfg())
        if cfg.api_key is None:
            cfg.api_key = secrets.token_urlsafe(32)
            self._keys[cfg.api_key] = session_id
        return cfg.api_key

    def session_turns(self, session_id: str) -> list[tuple[int, list[int], list[int], float | None]]:
        """The turns recorded so far for live session ``session_id`` configured with
        ``keep_turns``: ``(turn index, prompt ids, output ids, sampling temperature as
        recorded, None when not a number)`` in order; empty otherwise."""
        cfg = self._sessions.get(session_id)
        return list(cfg.turns) if cfg is not None and cfg.turns is not None else []

    def session_calls(self, session_id: str) -> dict[str, int]:
        """``{"requests": n, "turns": m}``: the model calls live session
        ``session_id``'s agent made with its key, and how many of them were
        recorded as turns (the rest were refused or failed, each answered with
        an error). Zeros for a session the gateway holds nothing of."""
        cfg = self._sessions.get(session_id)
        return dict(cfg.calls) if cfg is not None else {"requests": 0, "turns": 0}

    @property
    def tracked_sessions(self) -> int:
        """Per-session entries the gateway holds (0 once all sessions ended;
        entries of ended sessions are swept first)."""
        self._sweep()
        return len(self._sessions)

    def _sweep(self) -> None:
        """Drop the entries (configuration, key) of sessions that ended."""
        for sid in [k for k, c in self._sessions.items() if c.inflight == 0 and self.engine.get(k) is None]:
            self._drop_cfg(sid)

    def _drop_cfg(self, sid: str) -> None:
        cfg = self._sessions.pop(sid)
        if cfg.api_key is not None:
            del self._keys[cfg.api_key]
            self._retired[cfg.api_key] = sid
            if len(self._retired) > _RETIRED_KEYS:
                self._retired.popitem(last=False)

    def _forget_if_ended(self, sid: str | None) -> None:
        # Entries exist only while a request is in flight or a session was
        # configured; configured ones go when their session is seen to have
        # ended, and a sweep every _SWEEP_EVERY requests catches the rest, so
        # the gateway's per-session state stays bounded by the live sessions.
        cfg = None if sid is None else self._sessions.get(sid)
        if cfg is not None and cfg.inflight == 0 and (
            self.engine.get(sid) is None or (not cfg.sampling and cfg.max_turns is None and cfg.api_key is None)
        ):
            self._drop_cfg(sid)
        self._requests += 1
        if self._requests % _SWEEP_EVERY == 0:
            self._sweep()

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _api_key(request: web.Request) -> str:
        key = request.headers.get("x-api-key", "")
        if not key:
            auth = request.headers.get("Authorization", "")
            if auth[:7].lower() == "bearer ":
                key = auth[7:].strip()
        return key

    def _error(self, style: str, status: int, kind: str, message: str, code: str | None = None) -> web.Response:
        return web.json_response(error_body(style, status, kind, message, code), status=status)

    @web.middleware
    async def _json_http_errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """aiohttp's own refusals (no such route, wrong method) as JSON in
        the dialect of the route, never as plain text."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            style = "anthropic" if request.path.startswith("/v1/messages") else "openai"
            if exc.status == 405:
                allowed = sorted(exc.headers.get("Allow", "").split(",")) if "Allow" in exc.headers else []
                message = f"{request.method} {request.path}: method not allowed; expected {' or '.join(a for a in allowed if a) or 'another method'}"
                resp = self._error(style, 405, "invalid_request_error", message)
                if "Allow" in exc.headers:
                    resp.headers["Allow"] = exc.headers["Allow"]
                return resp
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            return self._error(style, exc.status, kind, f"{request.method} {request.path}: {exc.reason}")

    def _session_id(self, key: str) -> str | None:
        """The session whose API key is ``key`` (live or lately ended), else None."""
        return self._keys.get(key) or self._retired.get(key)

    def _session(self, key: str, sid: str | None) -> Any:
        """The running session of API key ``key`` (``sid``: its id, from
        _session_id). Messages name the session id, never the key."""
        if not key:
            raise _Refused(401, "authentication_error", "no API key: set it to the session's key issued at open (Authorization: Bearer <key> or x-api-key)")
        if sid is None:
            raise _Refused(401, "authentication_error", "API key is no session's key: use the key issued when the session was opened (a session id is not a key)")
        h = self.engine.get(sid)
        if h is None:
            state = self.engine.status(sid)
            raise _Refused(409, "invalid_request_error", f"session {sid!r} has ended ({state or 'long ago'}); it takes no more turns")
        if h.state is not State.RUNNING:
            raise _Refused(409, "invalid_request_error", f"session {sid!r} is {h.state}, expected running (the rollout starts it before the agent runs)")
        return h

    async def _body(self, request: web.Request) -> dict[str, Any]:
        cap = self.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > cap:
            raise _Refused(413, "request_too_large", f"request body of {declared} bytes (Content-Length) is over the limit of {cap}")
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _Refused(413, "request_too_large", f"request body over the limit of {cap} bytes ({exc.text})") from None
        except TimeoutError:
            raise _Refused(408, "request_timeout", f"request body did not arrive within {self.config.body_timeout_s} s") from None
        except web.RequestPayloadError as exc:  # aiohttp could not decode the body: its Content-Encoding, its chunks
            encoding = request.headers.get("Content-Encoding", "none")
            raise _Refused(400, "invalid_request_error",
                           f"request body could not be read (Content-Encoding: {encoding}): {exc}") from None
        if len(raw) > cap:  # chunked bodies are checked here
            raise _Refused(413, "request_too_large", f"request body of {len(raw)} bytes is over the limit of {cap}")
        try:
            body = decode_json(raw, "request body")
        except JSONTooDeep as exc:
            raise _Refused(400, "invalid_request_error", str(exc)) from None
        except msgspec.DecodeError as exc:
            raise _Refused(400, "invalid_request_error", f"malformed JSON in the request body: {exc}") from None
        if not isinstance(body, dict):
            raise _Refused(400, "invalid_request_error", f"request body: expected a JSON object, found {type(body).__name__}")
        return body

    def _sampling(self, sid: str, req: TurnRequest) -> dict[str, Any]:
        """Server defaults, then the session's, then the client's overrides;
        refused with a 400 naming the field when a value cannot drive a
        sampler whose log-probs we train on."""
        c = self.config
        base: dict[str, Any] = {"temperature": c.temperature, "top_p": c.top_p, "top_k": c.top_k}
        cfg = self._sessions.get(sid)
        if cfg is not None:
            base.update(cfg.sampling)
        base.update((k, v) for k, v in req.overrides.items() if k != "stop")  # each checked as the request was parsed
        try:
            check_sampling(base, "sampling")
        except AdminFieldError as exc:
            raise _Refused(400, "invalid_request_error", str(exc)) from None
        return base

    def _params(self, base: dict[str, Any], req: TurnRequest, room: int | None, session_cap: int | None = None) -> SamplingParams:
        """The backend's parameters from the checked ``_sampling`` values (``base`` is consumed)."""
        c = self.config
        max_new = min(req.max_tokens or base.pop("max_new_tokens", c.default_max_tokens), c.max_tokens_cap)
        base.pop("max_new_tokens", None)
        if session_cap is not None:
            max_new = min(max_new, session_cap)
        if room is not None:
            max_new = min(max_new, room)
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=float(base["temperature"]),
            top_p=float(base["top_p"]),
            top_k=int(base["top_k"]),
            seed=base.get("seed"),
            stop_ids=tuple(self.template.stop_ids),
        )

    # ------------------------------------------------------------ routes

    async def _health(self, request: web.Request) -> web.Response:
        reason = self.fatal_reason
        body: dict[str, Any] = {"status": "ok", "service": "agentlog-gateway", "backend": self.backend.name}
        servers = getattr(self.backend, "describe", None)  # a fleet: each server, in routing or out and why
        if servers is not None:
            body["servers"] = servers()
        if reason is not None:
            return web.json_response(body | {"status": "failing", "reason": reason}, status=503)
        return web.json_response(body)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "agentlog", "type": "model", "display_name": self.config.model_name}]}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "responses")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "messages")

    async def _count_tokens(self, request: web.Request) -> web.Response:
        reserved = 0
        try:
            try:
                key = self._api_key(request)
                self._session(key, self._session_id(key))
                reserved = self._reserve_body(request)  # a large body counts against the budget, as a turn's does
                req = APIS["messages"].parse(await self._body(request))
            except _Refused as exc:
                return self._error("anthropic", exc.status, exc.kind, str(exc))
            except RequestError as exc:
                return self._error("anthropic", 400, "invalid_request_error", str(exc))
            return web.json_response({"input_tokens": len(self.template.encode_prompt(req.messages, req.tools))})
        finally:
            self._large_bodies -= reserved


def _is_operator_request(request: web.Request) -> bool:
    """The admin API and the health checks: they may use the connections kept for operators."""
    path = request.path
    return path.startswith("/admin/") or path in ("/", "/health")


__all__ = ["Gateway", "GatewayConfig", "ResponsesAPI", "body_cap_for"]
