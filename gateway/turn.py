"""One agent request, one turn: the gateway's turn path.

Refuse what cannot be recorded before anything runs, generate through the
backend, record the turn through the engine (durable before the agent sees a
byte), then answer; a turn whose answer cannot be delivered is marked
``turn_undelivered``. Mixed into :class:`~agentlog.gateway.server.Gateway`
(:class:`TurnPath` holds no state of its own: it uses the gateway's engine,
backend, template, parser, config, per-session table and counters).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence, cast

import msgspec
from aiohttp import web

from agentlog._logging import get_logger
from agentlog.events.errors import AgentlogError
from agentlog.events.schema.lifecycle import IllegalTransition
from agentlog.events.log.api import LogClosed
from agentlog.engine.lineages import Declared, LineageError
from agentlog.engine.staged import PendingTurn
from agentlog.events.schema.turn import SERVER_KEY, SERVER_MOVED_FROM_KEY
from agentlog.events.schema.types import turn_temperature

from .api import APIS, TurnRequest, TurnResult, now_s
from .backends import ROUTING_KEY, BackendError
from .chat import RequestError, assistant_message, unrecordable
from .prompt_cache import LineagePrompts

if TYPE_CHECKING:
    from .backends import Backend, SamplingParams
    from .chat import ChatTemplate, ToolCallParser
    from .server import GatewayConfig

_log = get_logger("agentlog.gateway")

_TOOL_ID_PREFIX = {"chat": "call_", "responses": "call_", "messages": "toolu_"}
_RESPONSE_ID_PREFIX = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


class _SessionCfg:
    __slots__ = ("sampling", "max_turns", "max_new_tokens", "inflight", "api_key", "calls", "turns", "prompts", "server",
                 "before_turn")

    def __init__(self) -> None:
        self.sampling: dict[str, Any] = {}
        self.max_turns: int | None = None
        #: Cap on every turn's output tokens, the client's max_tokens included (None: the server's cap).
        self.max_new_tokens: int | None = None
        self.inflight = 0
        #: Model calls of this session: "requests" (each one made with its key), "turns" (those recorded).
        self.calls = {"requests": 0, "turns": 0}
        #: The session's API key (issued by session_key), or None.
        self.api_key: str | None = None
        #: The recorded turns' (turn index, prompt ids, output ids, sampling temperature), kept only
        #: when asked (configure_session(keep_turns=True): a teacher scores them); else None.
        self.turns: list[tuple[int, list[int], list[int], float | None]] | None = None
        #: Each lineage's previous encoded prompt, which its next one is encoded from.
        self.prompts = LineagePrompts()
        #: The fleet server that generated the session's last recorded turn ("": none yet, or one backend).
        self.server = ""
        #: Awaited with the turn index when a turn's request arrives, before it is generated
        #: (configure_session(before_turn=...): the rollout snapshots the session's sandbox there).
        self.before_turn: Any = None

class _Refused(AgentlogError):
    """A request answered with an error before anything was recorded."""

    def __init__(self, status: int, kind: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.code = code


class TurnPath:
    """The turn path of :class:`~agentlog.gateway.server.Gateway` (a mixin)."""

    if TYPE_CHECKING:  # the Gateway's state and methods this uses (server.py)
        backend: Backend
        parser: ToolCallParser
        template: ChatTemplate
        config: GatewayConfig
        max_body_bytes: int
        stats: dict[str, int]
        timings: list[tuple[float, float, float]] | None
        _sessions: dict[str, _SessionCfg]
        _large_bodies: int
        _turns_inflight: int
        _turns_idle: asyncio.Event
        _draining: bool
        _api_key: Callable[[web.Request], str]
        _session_id: Callable[[str], str | None]
        _session: Callable[[str, str | None], Any]
        _body: Callable[[web.Request], Awaitable[dict[str, Any]]]
        _sampling: Callable[[str, TurnRequest], dict[str, Any]]
        _params: Callable[..., SamplingParams]
        _error: Callable[..., web.Response]
        _forget_if_ended: Callable[[str | None], None]

        @property
        def fatal_reason(self) -> str | None: ...

    async def _turn(self, request: web.Request, api_name: str) -> web.StreamResponse:
        api = APIS[api_name]
        key = self._api_key(request)
        sid = self._session_id(key)
        log = _log.bind(session_id=sid, api=api_name)  # the id, never the key
        reserved = 0
        self._turn_began()
        try:
            try:
                self._refuse_if_unable()
                h = self._session(key, sid)
                self._sessions.setdefault(h.session_id, _SessionCfg()).calls["requests"] += 1
                reserved = self._reserve_body(request)
                body = await self._body(request)
                try:
                    req = api.parse(body)
                except RequestError as exc:
                    raise _Refused(400, "invalid_request_error", f"{api_name} request: {exc}") from None
                _check_recordable(api_name, req)
                declared = declared_lineage(request, h)
                cfg = self._sessions.setdefault(h.session_id, _SessionCfg())
                merged = self._sampling(h.session_id, req)  # refuse unusable sampling values before anything runs
                cap = cfg.max_turns if cfg.max_turns is not None else self.config.max_turns
                if h.turns + cfg.inflight >= cap:
                    raise _Refused(429, "rate_limit_error", f"session {h.session_id!r} reached its turn cap of {cap} turns")
            except _Refused as exc:
                self.stats["refused"] += 1
                log.info("gateway.request_refused", status=exc.status, reason=str(exc))
                self._forget_if_ended(sid)
                return self._error(api.error_style, exc.status, exc.kind, str(exc), exc.code)
            cfg.inflight += 1
            try:
                return await self._generate_record_send(request, api, req, merged, h, cfg, log, declared)
            except _Refused as exc:
                self.stats["refused"] += 1
                log.info("gateway.request_refused", status=exc.status, reason=str(exc))
                return self._error(api.error_style, exc.status, exc.kind, str(exc), exc.code)
            except LogClosed as exc:  # the writer failed (or closed) while this turn was made durable
                log.error("gateway.turn_not_recorded", error=str(exc))
                return self._error(api.error_style, 503, "api_error", f"turn not recorded: {self.fatal_reason or exc}")
            except Exception as exc:  # a bug or a bad backend answer: logged in full and answered as JSON, never hidden
                log.exception("gateway.turn_failed", error=f"{type(exc).__name__}: {exc}")
                return self._error(api.error_style, 500, "api_error", f"turn failed: {type(exc).__name__}: {exc}")
            finally:
                cfg.inflight -= 1
                self._forget_if_ended(sid)
        finally:
            self._large_bodies -= reserved
            self._turn_ended()

    def _turn_began(self) -> None:
        self._turns_inflight += 1
        self._turns_idle.clear()

    def _turn_ended(self) -> None:
        self._turns_inflight -= 1
        if self._turns_inflight == 0:
            self._turns_idle.set()

    def _refuse_if_unable(self) -> None:
        """503 before anything runs when no turn can be recorded (or we are stopping)."""
        if self._draining:
            raise _Refused(503, "api_error", "gateway shutting down; it takes no new turns")
        reason = self.fatal_reason
        if reason is not None:
            raise _Refused(503, "api_error", f"gateway cannot record turns: {reason}")

    def _reserve_body(self, request: web.Request) -> int:
        """Count a large body against ``large_bodies_bytes`` before it is
        read (a body of unknown length counts as the body cap); returns the
        bytes reserved, which the caller gives back when its turn ends."""
        size = request.content_length
        size = self.max_body_bytes if size is None else min(size, self.max_body_bytes)
        if size < self.config.large_body_bytes:
            return 0
        budget = self.config.large_bodies_bytes
        if self._large_bodies + size > budget:
            raise _Refused(
                503, "api_error",
                f"too many large request bodies in flight ({self._large_bodies} of {budget} bytes; this one is {size}); retry shortly",
            )
        self._large_bodies += size
        return size

    async def _generate_record_send(
        self, request: web.Request, api: Any, req: TurnRequest, merged: dict[str, Any], h: Any, cfg: _SessionCfg, log: Any,
        declared: Declared | None = None,
    ) -> web.StreamResponse:
        t0 = time.perf_counter()
        if cfg.before_turn is not None:
            # The sandbox as this turn's request found it; its event lands before the turn's.
            await cfg.before_turn(h.turns)
        cache = cfg.prompts.pick(req.messages, None if declared is None else declared.id)
        prompt = cache.encode(self.template, req.messages, req.tools)
        prompt_ids = prompt.ids
        ctx = self.backend.context_length
        room = None if ctx is None else ctx - len(prompt_ids)
        if room is not None and room <= 0:
            # No room for a single output token: refused, never recorded as an empty turn.
            raise _Refused(
                400, "invalid_request_error",
                f"prompt is too long: {len(prompt_ids)} tokens, and the model's context is {ctx} tokens "
                "(leaving no room for output); shorten the conversation",
                "context_length_exceeded",
            )
        params = self._params(merged, req, room, cfg.max_new_tokens)
        # The backend routes on the key (a Fleet) and sends it upstream (an HTTP backend's routing header).
        ROUTING_KEY.set(h.group_id if self.config.route_by == "group" else h.session_id)
        try:
            work = h.in_flight()
        except IllegalTransition as exc:
            return self._error(api.error_style, 409, "invalid_request_error", str(exc))
        try:
            # Generated in this task, as the session's in-flight work (a terminal transition
            # waits for it, then cancels it): a task of its own would add two trips through the loop.
            with work:
                # A read-only int32 array: a sequence of ints to every backend (Backend.generate).
                gen = await self.backend.generate(cast(Sequence[int], prompt_ids), params)
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            cur = asyncio.current_task()
            if not work.cancelled_by_session or (cur is not None and cur.uncancel() > 0):
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
        if gen.version_spans is not msgspec.UNSET:
            sampling["weight_update"] = gen.weight_update  # how the update met this generation
        if gen.server:  # a fleet's answer: which server made the turn, and a move when there was one
            sampling[SERVER_KEY] = gen.server
            if cfg.server and cfg.server != gen.server:
                sampling[SERVER_MOVED_FROM_KEY] = cfg.server
                log.info("gateway.session_moved", server=gen.server, moved_from=cfg.server)
        try:
            # Staged here, before the first await: the turn joins the writer's
            # next flush without waiting for a task's turn on the shared loop.
            pending = h.begin_turn(
                messages=prompt.messages,
                prompt_ids=prompt.recorded,
                output_ids=gen.output_ids,
                output_log_probs=gen.log_probs,
                finish_reason=gen.finish_reason,
                response_message=response_message,
                policy_version=gen.policy_version,
                version_spans=gen.version_spans,
                ill_formed=parsed.ill_formed,
                generate_s=gen.generate_s or (time.perf_counter() - t0),
                sampling=sampling,
                # Parsed from this request, or the very objects recorded last turn
                # (PromptCache); nothing changes them after: repeated ones are not hashed again.
                # The session's entry, whose PromptCache holds them too, lives as long as the
                # session, so the engine's references to them cost a pointer each.
                frozen_messages=True,
                declared_lineage=declared,
            )
            t_rec = time.perf_counter()
            # Cancelling this wait (the client left) cancels nothing of the record.
            await pending.durable
        except asyncio.CancelledError:
            # The client left while the turn was being made durable: finish
            # recording it, then mark it undelivered so it is never trained.
            if await self._settle_record(pending, log) is not None:
                await self._undelivered(h, pending.turn_index, "client disconnected before the response was sent", log)
            raise
        except IllegalTransition as exc:
            log.info("gateway.turn_refused", reason=str(exc))
            return self._error(api.error_style, 409, "invalid_request_error", str(exc))
        except LineageError as exc:  # another turn changed the session's lineages since the check
            log.info("gateway.turn_refused", reason=str(exc))
            return self._error(api.error_style, 400, "invalid_request_error", f"{LINEAGE_HEADER}: {exc}")
        turn = pending.turn_index  # the engine's, as its lineage: the envelope's body is not decoded for them
        if gen.server:
            cfg.server = gen.server
        cfg.prompts.remember(pending.lineage, cache, prompt, response_message)
        self.stats["turns"] += 1
        cfg.calls["turns"] += 1
        if cfg.turns is not None:
            cfg.turns.append((turn, prompt_ids.tolist(), [int(t) for t in gen.output_ids], turn_temperature(sampling)))
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

    async def _settle_record(self, pending: PendingTurn, log: Any) -> Any:
        try:
            return await pending.settled()
        except (IllegalTransition, LineageError) as exc:  # refused (a contended record_turn): nothing to mark undelivered
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


#: The header an agent declares a turn's lineage with (its subagents, see
#: :mod:`agentlog.engine.lineages`): ``<id>``, then optionally ``; parent=<id>``
#: and ``; call=<tool call id>`` (the parent's call that spawned it).
LINEAGE_HEADER = "X-Agentlog-Lineage"


def declared_lineage(request: web.Request, h: Any) -> Declared | None:
    """The lineage the request's :data:`LINEAGE_HEADER` declares (None without
    the header), checked against the session's lineages: a malformed value, the header
    repeated with different values, an unknown parent or call, or one contradicting
    the lineage's first turn is a 400."""
    values = request.headers.getall(LINEAGE_HEADER, ())
    if not values:
        return None
    raw = values[0]
    fields: dict[str, str] = {}
    try:
        if any(v != raw for v in values[1:]):  # two different lineages for one turn: neither is taken
            raise LineageError(f"sent {len(values)} times with different values {[v[:100] for v in values[:4]]}; expected one")
        parts = [p.strip() for p in raw.split(";")]
        for part in parts[1:]:
            name, eq, value = part.partition("=")
            name = name.strip()
            if not eq or name not in ("parent", "call") or name in fields:
                raise LineageError(f"expected '<id>[; parent=<id>][; call=<tool call id>]', found {raw[:200]!r}")
            fields[name] = value.strip()
        declared = Declared(parts[0], **fields)
        h.check_lineage(declared)
    except LineageError as exc:
        raise _Refused(400, "invalid_request_error", f"{LINEAGE_HEADER}: {exc}") from None
    return declared


def _check_recordable(api_name: str, req: TurnRequest) -> None:
    """Refuse (400, before any generation) what the log could not record
    (:func:`~.chat.unrecordable`: an integer beyond 64 bits, a lone surrogate,
    nesting too deep) anywhere in the messages or the client's sampling values. Encoding them now costs what the
    record will cost anyway, and a failure after generation would be a 500
    with the model's work thrown away."""
    problem = unrecordable((req.messages, req.overrides, req.max_tokens))
    if problem is not None:
        raise _Refused(400, "invalid_request_error", f"{api_name} request: the messages hold {problem}")
