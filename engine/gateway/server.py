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
cap; 400 malformed JSON or a request we cannot read (the message names the
field); 413 a body over the size limit; 502 the backend failed. None of them
records anything.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import uuid
from collections import OrderedDict
from typing import Any

import msgspec
import structlog
from aiohttp import web

from engine.core import DuplicateSession
from events.lifecycle import TERMINAL_STATES, IllegalTransition, State
from events.types import EventValidationError
from reducers.groups import GroupError

from .admin import AdminFieldError, check_sampling, parse_end, parse_open

from .api import APIS, ResponsesAPI, TurnRequest, TurnResult, error_body, now_s
from .backends import Backend, BackendError, Generation, SamplingParams
from .chat import ByteChatTemplate, ChatTemplate, HermesToolParser, RequestError, ToolCallParser, assistant_message

_log = structlog.get_logger("agentlog.gateway")

#: How often (in requests) the per-session table is swept for ended sessions.
_SWEEP_EVERY = 1024

#: How many keys of ended sessions are remembered, so their agent's late
#: request is told the session ended (409) rather than that its key is unknown.
_RETIRED_KEYS = 4096

_TOOL_ID_PREFIX = {"chat": "call_", "responses": "call_", "messages": "toolu_"}
_RESPONSE_ID_PREFIX = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


class GatewayConfig(msgspec.Struct, frozen=True):
    """Gateway settings."""

    #: Turns one session may take; the next request is answered 429.
    max_turns: int = 256
    #: Largest request body accepted (bytes); larger ones are answered 413.
    max_body_bytes: int = 32 * 2**20
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


class _SessionCfg:
    __slots__ = ("sampling", "max_turns", "inflight", "api_key")

    def __init__(self) -> None:
        self.sampling: dict[str, Any] = {}
        self.max_turns: int | None = None
        self.inflight = 0
        #: The session's API key (issued by session_key), or None.
        self.api_key: str | None = None


class _Refused(Exception):
    """A request answered with an error before anything was recorded."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class Gateway:
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
        self._sessions: dict[str, _SessionCfg] = {}
        #: API key -> session id, for the sessions holding a _SessionCfg.
        self._keys: dict[str, str] = {}
        #: Keys of sessions forgotten lately -> their session id (bounded).
        self._retired: OrderedDict[str, str] = OrderedDict()
        self._requests = 0
        self._runner: web.AppRunner | None = None
        self.url = ""
        #: When a list, each turn appends (prepare_s, record_s, send_s): the
        #: gateway's own time split (benchmarks); None (default) records nothing.
        self.timings: list[tuple[float, float, float]] | None = None
        self.stats = {"turns": 0, "undelivered": 0, "cancelled": 0, "backend_errors": 0, "refused": 0}

    # ------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        """The aiohttp application (routes only; see :meth:`start`)."""
        app = web.Application(client_max_size=self.config.max_body_bytes)
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
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        bound = sock.getsockname()
        self.url = f"http://{host}:{bound[1]}"
        _log.info("gateway.listening", url=self.url, backend=self.backend.name, template=self.template.name)
        return self.url

    async def stop(self) -> None:
        """Stop listening (the engine and backend belong to the caller)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "Gateway":
        if not self.url:
            await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def configure_session(self, session_id: str, *, sampling: dict[str, Any] | None = None, max_turns: int | None = None) -> None:
        """Per-session sampling defaults and turn cap (forgotten when the session ends)."""
        if sampling:
            try:
                check_sampling(sampling, "sampling")
            except AdminFieldError as exc:
                raise ValueError(f"session {session_id!r}: {exc}") from None
        if max_turns is not None and (type(max_turns) is not int or max_turns < 1):
            raise ValueError(f"session {session_id!r}: max_turns: expected an int >= 1, found {max_turns!r}")
        cfg = self._sessions.setdefault(session_id, _SessionCfg())
        if sampling:
            cfg.sampling.update(sampling)
        if max_turns is not None:
            cfg.max_turns = max_turns

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

    def forget(self, session_id: str) -> None:
        """Drop the per-session configuration and key (harnesses call it when their session ends)."""
        cfg = self._sessions.get(session_id)
        if cfg is not None and cfg.inflight == 0:
            self._drop_cfg(session_id)

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

    def _error(self, style: str, status: int, kind: str, message: str) -> web.Response:
        return web.json_response(error_body(style, status, kind, message), status=status)

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
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _Refused(413, "request_too_large", f"request body over the limit of {self.config.max_body_bytes} bytes ({exc.text})") from None
        if len(raw) > self.config.max_body_bytes:  # chunked bodies are checked here
            raise _Refused(413, "request_too_large", f"request body of {len(raw)} bytes is over the limit of {self.config.max_body_bytes}")
        try:
            body = msgspec.json.decode(raw)
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
        base.update((k, v) for k, v in req.overrides.items() if k != "stop")
        try:
            check_sampling(base, "sampling")
        except AdminFieldError as exc:
            raise _Refused(400, "invalid_request_error", str(exc)) from None
        return base

    def _params(self, base: dict[str, Any], req: TurnRequest, room: int | None) -> SamplingParams:
        """The backend's parameters from the checked ``_sampling`` values (``base`` is consumed)."""
        c = self.config
        max_new = min(req.max_tokens or base.pop("max_new_tokens", c.default_max_tokens), c.max_tokens_cap)
        base.pop("max_new_tokens", None)
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
        return web.json_response({"status": "ok", "service": "agentlog-gateway", "backend": self.backend.name})

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
        try:
            key = self._api_key(request)
            self._session(key, self._session_id(key))
            req = APIS["messages"].parse(await self._body(request))
        except _Refused as exc:
            return self._error("anthropic", exc.status, exc.kind, str(exc))
        except RequestError as exc:
            return self._error("anthropic", 400, "invalid_request_error", str(exc))
        return web.json_response({"input_tokens": len(self.template.encode_prompt(req.messages, req.tools))})

    # ------------------------------------------------------------ one turn

    async def _turn(self, request: web.Request, api_name: str) -> web.StreamResponse:
        api = APIS[api_name]
        key = self._api_key(request)
        sid = self._session_id(key)
        log = _log.bind(session_id=sid, api=api_name)  # the id, never the key
        try:
            h = self._session(key, sid)
            body = await self._body(request)
            try:
                req = api.parse(body)
            except RequestError as exc:
                raise _Refused(400, "invalid_request_error", f"{api_name} request: {exc}") from None
            cfg = self._sessions.setdefault(h.session_id, _SessionCfg())
            merged = self._sampling(h.session_id, req)  # refuse unusable sampling values before anything runs
            cap = cfg.max_turns if cfg.max_turns is not None else self.config.max_turns
            if h.turns + cfg.inflight >= cap:
                raise _Refused(429, "rate_limit_error", f"session {h.session_id!r} reached its turn cap of {cap} turns")
        except _Refused as exc:
            self.stats["refused"] += 1
            log.info("gateway.request_refused", status=exc.status, reason=str(exc))
            self._forget_if_ended(sid)
            return self._error(api.error_style, exc.status, exc.kind, str(exc))
        cfg.inflight += 1
        try:
            return await self._generate_record_send(request, api, req, merged, h, cfg, log)
        except Exception as exc:  # a bug or a bad backend answer: logged in full and answered as JSON, never hidden
            log.exception("gateway.turn_failed", error=f"{type(exc).__name__}: {exc}")
            return self._error(api.error_style, 500, "api_error", f"turn failed: {type(exc).__name__}: {exc}")
        finally:
            cfg.inflight -= 1
            self._forget_if_ended(sid)

    async def _generate_record_send(
        self, request: web.Request, api: Any, req: TurnRequest, merged: dict[str, Any], h: Any, cfg: _SessionCfg, log: Any
    ) -> web.StreamResponse:
        t0 = time.perf_counter()
        prompt_ids = self.template.encode_prompt(req.messages, req.tools)
        ctx = self.backend.context_length
        room = None if ctx is None else ctx - len(prompt_ids)
        params = self._params(merged, req, room)
        if params.max_new_tokens <= 0:
            # Context exhausted before a single token: the turn ends "length" with no output.
            gen = Generation([], [], "length", self.backend.policy_version, 0.0)
            log.info("gateway.context_exhausted", prompt_tokens=len(prompt_ids), context=ctx)
        else:
            try:
                task = h.spawn(self.backend.generate(prompt_ids, params))
            except IllegalTransition as exc:
                return self._error(api.error_style, 409, "invalid_request_error", str(exc))
            try:
                gen = await task
            except asyncio.CancelledError:
                task.cancel()
                self.stats["cancelled"] += 1
                cur = asyncio.current_task()
                if cur is not None and cur.cancelling():
                    log.info("gateway.turn_cancelled", reason="client disconnected during generation; nothing recorded")
                    raise
                log.info("gateway.turn_cancelled", reason=f"session {h.state} during generation; nothing recorded")
                return self._error(api.error_style, 409, "invalid_request_error", f"session {h.session_id!r} ended ({h.state}) while generating")
            except BackendError as exc:
                self.stats["backend_errors"] += 1
                log.warning("gateway.backend_failed", error=str(exc), upstream_status=exc.status)
                return self._error(api.error_style, 502, "api_error", str(exc))
        text = self.template.decode(gen.output_ids)
        parsed = self.parser.parse(text, req.tools)
        if parsed.ill_formed:
            log.info("gateway.tool_call_ill_formed", error=parsed.error)
        prefix = _TOOL_ID_PREFIX[api.name]
        calls = [{"id": prefix + uuid.uuid4().hex[:24], **c} for c in parsed.tool_calls]
        response_message = assistant_message(parsed.content, calls)
        client = dict(req.overrides)
        if req.max_tokens is not None:
            client["max_tokens"] = req.max_tokens  # what was asked; max_new_tokens is what was allowed
        sampling = params.to_dict() | {"client": client, "api": api.name, "model": req.model}
        ignored = self.backend.ignored_sampling(params) + (["stop"] if "stop" in req.overrides else [])
        if ignored:
            sampling["ignored"] = ignored
        record = asyncio.ensure_future(
            h.record_turn(
                messages=req.messages,
                prompt_ids=prompt_ids,
                output_ids=gen.output_ids,
                output_log_probs=gen.log_probs,
                finish_reason=gen.finish_reason,
                response_message=response_message,
                policy_version=gen.policy_version,
                ill_formed=parsed.ill_formed,
                generate_s=gen.generate_s or (time.perf_counter() - t0),
                sampling=sampling,
            )
        )
        t_rec = time.perf_counter()
        try:
            env = await asyncio.shield(record)
        except asyncio.CancelledError:
            # The client left while the turn was being made durable: finish
            # recording it, then mark it undelivered so it is never trained.
            env = await self._settle_record(record, log)
            if env is not None:
                await self._undelivered(h, env.body.turn_index, "client disconnected before the response was sent", log)
            raise
        except IllegalTransition as exc:
            log.info("gateway.turn_refused", reason=str(exc))
            return self._error(api.error_style, 409, "invalid_request_error", str(exc))
        turn = env.body.turn_index
        self.stats["turns"] += 1
        res = TurnResult(
            id=f"{_RESPONSE_ID_PREFIX[api.name]}{uuid.uuid4().hex[:24]}",
            model=req.model or self.config.model_name,
            content=parsed.content,
            tool_calls=calls,
            finish_reason=gen.finish_reason,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(gen.output_ids),
            created=now_s(),
        )
        t_send = time.perf_counter()
        try:
            resp = await self._send(request, api, req, res)
            if self.timings is not None:
                self.timings.append((t_rec - t0 - gen.generate_s, t_send - t_rec, time.perf_counter() - t_send))
            return resp
        except (ConnectionError, asyncio.CancelledError) as exc:
            await self._undelivered(h, turn, f"client gone while sending: {type(exc).__name__}", log)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return web.Response(status=499)

    async def _settle_record(self, record: asyncio.Future, log: Any) -> Any:
        try:
            return await record
        except IllegalTransition as exc:
            log.info("gateway.turn_refused", reason=str(exc))
            return None

    async def _undelivered(self, h: Any, turn: int, reason: str, log: Any) -> None:
        self.stats["undelivered"] += 1
        log.info("gateway.turn_undelivered", turn_index=turn, reason=reason)
        try:
            await asyncio.shield(h.record_turn_undelivered(turn, reason))
        except IllegalTransition as exc:  # the session ended meanwhile: nothing more may be appended
            log.info("gateway.undelivered_not_recorded", turn_index=turn, reason=str(exc))

    async def _send(self, request: web.Request, api: Any, req: TurnRequest, res: TurnResult) -> web.StreamResponse:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client connection closed before the response")
        if req.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            events = api.render_stream(res, req)
            await resp.write(b"".join(events))
            await resp.write_eof()
            return resp
        payload = msgspec.json.encode(api.render(res, req))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(payload)
        await resp.prepare(request)
        await resp.write(payload)
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------ admin API (agentlog serve)

    def _admin_ok(self, request: web.Request) -> bool:
        if not self.admin_token:
            return False
        given = request.headers.get("X-Admin-Token", "")
        # Constant time: how long the compare takes says nothing about the token.
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.admin_token.encode("utf-8", "surrogateescape"))

    def _admin_refused(self, status: int, kind: str, what: str, exc: BaseException) -> web.Response:
        """An admin request refused before anything was appended (or by the engine, which appends nothing then)."""
        _log.info("gateway.admin_refused", status=status, what=what, reason=str(exc))
        return self._error("openai", status, kind, f"{what}: {exc}")

    def _admin_failed(self, what: str, exc: BaseException) -> web.Response:
        """An admin request that failed for a reason not its own (the log, a bug)."""
        _log.exception("gateway.admin_failed", what=what, error=f"{type(exc).__name__}: {exc}")
        return self._error("openai", 500, "api_error", f"{what} failed: {type(exc).__name__}: {exc}")

    async def _admin_open(self, request: web.Request) -> web.Response:
        """Open and start a session (fields: engine.gateway.admin.OpenRequest);
        answers its id, state, sample_index and ``api_key``: the key its agent
        must send (the session id is not one)."""
        if not self._admin_ok(request):
            return self._error("openai", 403, "permission_error", "admin API: missing or wrong X-Admin-Token")
        try:
            body = await self._body(request)
        except _Refused as exc:
            return self._error("openai", exc.status, exc.kind, str(exc))
        named = body.get("session_id")
        what = f"admin open of session {named!r}" if isinstance(named, str) else "admin open"
        # Every field is checked before the open: a refused request leaves nothing in the log.
        try:
            req = parse_open(body)
        except AdminFieldError as exc:
            return self._admin_refused(400, "invalid_request_error", what, exc)
        try:
            h = await self.engine.open_session(
                req.session_id,
                group_id=req.group_id,
                group_size=req.group_size,
                sample_index=req.sample_index,
                prompt=req.prompt,
                label=req.label,
                agent=req.agent,
                policy_version=self.backend.policy_version,
                metadata=req.metadata,
            )
        except (DuplicateSession, GroupError) as exc:
            return self._admin_refused(409, "invalid_request_error", what, exc)
        except (EventValidationError, ValueError, OverflowError) as exc:  # what the schema or the log refused: nothing was appended
            return self._admin_refused(400, "invalid_request_error", what, exc)
        except Exception as exc:  # the log failed: logged in full and answered as JSON, never hidden
            return self._admin_failed(what, exc)
        try:
            await h.start(harness=req.agent, sandbox="external", details={"gateway": self.url})
            self.configure_session(req.session_id, sampling=req.sampling, max_turns=req.max_turns)
            key = self.session_key(req.session_id)
        except Exception as exc:  # opened but not started: end it, so no session is left half-done
            await h.abort("admin_open_failed", error=f"{type(exc).__name__}: {exc}")
            self._forget_if_ended(req.session_id)
            return self._admin_failed(f"{what} (opened, then aborted: it could not start)", exc)
        opened = {"session_id": req.session_id, "state": str(h.state), "group_id": req.group_id, "sample_index": h.sample_index}
        return web.json_response(opened | {"api_key": key})

    async def _admin_end(self, request: web.Request) -> web.Response:
        """finish {"reward", "metadata"} / abort {"reason", "error"} / drop {"reason"} a session."""
        if not self._admin_ok(request):
            return self._error("openai", 403, "permission_error", "admin API: missing or wrong X-Admin-Token")
        sid, action = request.match_info["sid"], request.match_info["action"]
        if action not in ("finish", "abort", "drop"):
            return self._error("openai", 404, "not_found_error", f"unknown action {action!r}; expected finish, abort or drop")
        what = f"admin {action} of session {sid!r}"
        h = self.engine.get(sid)
        if h is None:
            return self._error("openai", 404, "not_found_error", f"{what}: session is not live (state {self.engine.status(sid)})")
        try:
            body = await self._body(request) if request.can_read_body else {}
            kwargs = parse_end(action, body)
        except _Refused as exc:
            return self._error("openai", exc.status, exc.kind, str(exc))
        except AdminFieldError as exc:
            return self._admin_refused(400, "invalid_request_error", what, exc)
        try:
            await getattr(h, action)(**kwargs)
        except (EventValidationError, ValueError, OverflowError) as exc:
            return self._admin_refused(400, "invalid_request_error", what, exc)
        except IllegalTransition as exc:  # it ended meanwhile: reported, not hidden
            return self._admin_refused(409, "invalid_request_error", what, exc)
        except Exception as exc:
            return self._admin_failed(what, exc)
        self._forget_if_ended(sid)
        return web.json_response({"session_id": sid, "state": str(h.state)})

    async def _admin_status(self, request: web.Request) -> web.Response:
        if not self._admin_ok(request):
            return self._error("openai", 403, "permission_error", "admin API: missing or wrong X-Admin-Token")
        sid = request.match_info["sid"]
        h = self.engine.get(sid)
        state = h.state if h is not None else self.engine.status(sid)
        return web.json_response({"session_id": sid, "state": None if state is None else str(state), "turns": h.turns if h else None})


__all__ = ["Gateway", "GatewayConfig", "ResponsesAPI"]
