"""The admin API: its requests, checked field by field before anything is
appended, and its handlers (:class:`AdminRoutes`, mixed into the gateway).

``agentlog serve`` opens and ends sessions through ``POST /admin/sessions``
and ``POST /admin/sessions/{id}/{finish,abort,drop}``. Every field of those
bodies is checked here, against what the event schema will accept and what a
sampler can run: a value the log could not decode back, or one that would
fail every later turn, is refused with :class:`AdminFieldError`, which names
the field, what was expected and what was found (answered 400). Unknown
fields are refused too: a misspelt ``sample_idx`` silently ignored would
open the session with the wrong membership.

The sampling rules live in :mod:`~agentlog.gateway.sampling`.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec
from aiohttp import web

from agentlog._logging import get_logger
from agentlog.engine.core import DuplicateSession
from agentlog.events.schema.lifecycle import TERMINAL_STATES, IllegalTransition
from agentlog.events.log.api import LogClosed
from agentlog.events.schema.types import EventValidationError, normalize_reward, validate_id
from agentlog.reducers.groups import GroupError

# The sampling names are re-exported: they were first defined here.
from .sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P, SAMPLING_RULES, AdminFieldError, _is_int, check_sampling
from .turn import _Refused

if TYPE_CHECKING:
    from agentlog.engine.core import SessionEngine

    from .backends import Backend

_log = get_logger("agentlog.gateway")

#: The range a msgpack integer can hold (the log's body encoding).
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def check_json_value(field: str, value: Any) -> None:
    """A free-form JSON value (label, metadata, prompt) the log can encode:
    JSON decodes integers of any size, msgpack holds 64 bits. (The JSON
    decoder already refuses lone surrogates and non-finite numbers.) Walked
    iteratively, so depth costs no recursion."""
    stack: list[tuple[str, Any]] = [(field, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{where}.{k}", x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
        elif _is_int(v) and not _INT_MIN <= v <= _INT_MAX:
            raise AdminFieldError(where, "an integer in [-2**63, 2**64 - 1]", v)


def _known(body: dict[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise AdminFieldError(what, f"fields among {sorted(allowed)}", f"unknown fields {unknown}")


def _int(body: dict[str, Any], key: str, lo: int, default: Any) -> Any:
    value = body.get(key, default)
    if value is default:
        return value
    if not _is_int(value) or not lo <= value <= 2**63 - 1:
        raise AdminFieldError(key, f"an int >= {lo}", value)
    return value


def _text(body: dict[str, Any], key: str, default: str, *, non_empty: bool = False) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or (non_empty and not value):
        raise AdminFieldError(key, "a non-empty string" if non_empty else "a string", value)
    return value


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdminFieldError(key, "a JSON object", value)
    check_json_value(key, value)
    return value


def _id(body: dict[str, Any], key: str, default: Any) -> str:
    value = body.get(key, default)
    try:
        return validate_id(key, value)
    except EventValidationError as exc:
        raise AdminFieldError(key, "a non-empty id string with no path separator or control character", value) from exc


class OpenRequest(msgspec.Struct, frozen=True):
    """A checked ``POST /admin/sessions`` body."""

    session_id: str
    group_id: str
    group_size: int
    #: None: the engine assigns the group's next free index.
    sample_index: int | None
    prompt: list[dict[str, Any]]
    label: Any
    agent: str
    metadata: dict[str, Any]
    sampling: dict[str, Any]
    max_turns: int | None


_OPEN_FIELDS = frozenset(OpenRequest.__struct_fields__)


def parse_open(body: dict[str, Any]) -> OpenRequest:
    """Check an open body; raises AdminFieldError naming the first bad field."""
    _known(body, _OPEN_FIELDS, "request body")
    sid = _id(body, "session_id", None)
    prompt = body.get("prompt", [])
    if prompt is None:
        prompt = []
    if not isinstance(prompt, list):
        raise AdminFieldError("prompt", "a list of message objects", prompt)
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise AdminFieldError(f"prompt[{i}]", "a message object", message)
    check_json_value("prompt", prompt)
    label = body.get("label")
    check_json_value("label", label)
    sampling = _object(body, "sampling")
    check_sampling(sampling, "sampling")
    return OpenRequest(
        session_id=sid,
        group_id=_id(body, "group_id", sid),
        group_size=_int(body, "group_size", 1, 1),
        sample_index=_int(body, "sample_index", 0, None),
        prompt=prompt,
        label=label,
        agent=_text(body, "agent", ""),
        metadata=_object(body, "metadata"),
        sampling=sampling,
        max_turns=_int(body, "max_turns", 1, None),
    )


#: The fields each end action takes.
_END_FIELDS = {
    "finish": frozenset({"reward", "metadata"}),
    "abort": frozenset({"reason", "error"}),
    "drop": frozenset({"reason"}),
}


def parse_end(action: str, body: dict[str, Any]) -> dict[str, Any]:
    """Check a finish/abort/drop body; returns the keywords of the handle's
    method of that name. Raises KeyError for an unknown action and
    AdminFieldError naming the first bad field."""
    _known(body, _END_FIELDS[action], f"{action} body")
    if action == "finish":
        reward = body.get("reward")
        try:
            reward = normalize_reward("finish", "reward", reward, optional=True)
        except EventValidationError:
            raise AdminFieldError("reward", "a finite number, an object of finite numbers, or null (the last assigned reward)", reward) from None
        return {"reward": reward, "metadata": _object(body, "metadata")}
    if action == "abort":
        return {"reason": _text(body, "reason", "admin", non_empty=True), "error": _text(body, "error", "")}
    return {"reason": _text(body, "reason", "admin", non_empty=True)}



# ---------------------------------------------------------------- the handlers


class AdminRoutes:
    """The admin API's handlers (``agentlog serve``) of
    :class:`~agentlog.gateway.server.Gateway` (a mixin: it holds no state of
    its own; it uses the gateway's engine, backend, admin token and session
    table)."""

    if TYPE_CHECKING:  # the Gateway's state and methods this uses (server.py)
        engine: SessionEngine
        backend: Backend
        admin_token: str | None
        url: str
        _body: Callable[[web.Request], Awaitable[dict[str, Any]]]
        _error: Callable[..., web.Response]
        _forget_if_ended: Callable[[str | None], None]
        _log_unable: Callable[[], str | None]
        configure_session: Callable[..., None]
        session_key: Callable[[str], str]

        @property
        def fatal_reason(self) -> str | None: ...

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

    def _admin_unable(self, what: str, reason: str) -> web.Response:
        """503 for an admin request that cannot be recorded (the log's writer
        is fatal, or for an open the gateway cannot take turns): answered at
        once with the reason, logged as one line, nothing appended."""
        _log.warning("gateway.admin_unavailable", what=what, reason=reason)
        return self._error("openai", 503, "api_error", f"{what}: not recorded: {reason}")

    def _admin_failed(self, what: str, exc: BaseException) -> web.Response:
        """An admin request that failed for a reason not its own (the log, a bug)."""
        _log.exception("gateway.admin_failed", what=what, error=f"{type(exc).__name__}: {exc}")
        return self._error("openai", 500, "api_error", f"{what} failed: {type(exc).__name__}: {exc}")

    async def _admin_open(self, request: web.Request) -> web.Response:
        """Open and start a session (fields: gateway.admin.OpenRequest);
        answers its id, state, sample_index and ``api_key``: the key its agent
        must send (the session id is not one)."""
        if not self._admin_ok(request):
            return self._error("openai", 403, "permission_error", "admin API: missing or wrong X-Admin-Token")
        # Before the body is read: a session opened now could neither be recorded nor take a turn.
        reason = self.fatal_reason
        if reason is not None:
            return self._admin_unable("admin open", reason)
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
        except LogClosed as exc:  # the writer went fatal (or closed) meanwhile
            return self._admin_unable(what, self._log_unable() or str(exc))
        except Exception as exc:  # a bug: logged in full and answered as JSON, never hidden
            return self._admin_failed(what, exc)
        try:
            await h.start(harness=req.agent, sandbox="external", details={"gateway": self.url})
            self.configure_session(req.session_id, sampling=req.sampling, max_turns=req.max_turns)
            key = self.session_key(req.session_id)
        except LogClosed as exc:  # the writer went fatal meanwhile: nothing more can be appended, not even an abort
            self._forget_if_ended(req.session_id)
            return self._admin_unable(f"{what} (opened, not started)", self._log_unable() or str(exc))
        except IllegalTransition as exc:  # ended before it started (an admin drop or abort overtook it): nothing to undo
            self._forget_if_ended(req.session_id)
            return self._admin_refused(409, "invalid_request_error", f"{what} (opened, then ended before it started: {h.state})", exc)
        except Exception as exc:  # opened but not started: end it, so no session is left half-done
            if h.state not in TERMINAL_STATES:
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
        reason = self._log_unable()  # ending a session only appends: only the log's state matters
        if reason is not None:
            return self._admin_unable(what, reason)
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
        except LogClosed as exc:  # the writer went fatal (or closed) meanwhile
            return self._admin_unable(what, self._log_unable() or str(exc))
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

__all__ = ["AdminFieldError", "AdminRoutes", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "MIN_TOP_P", "OpenRequest", "SAMPLING_RULES", "check_json_value", "check_sampling", "parse_end", "parse_open"]
