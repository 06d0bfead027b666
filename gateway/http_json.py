"""The one JSON-over-HTTP client: inference backends, weight sync and teacher servers.

Every outgoing JSON exchange of the library (:mod:`agentlog.gateway.backends`,
:mod:`agentlog.gateway.weight_sync`, :mod:`agentlog.loop.teacher`) goes
through :class:`JSONClient`, which owns what they would otherwise each
redo:

* the session and its ``timeout_s`` limit on a whole exchange;
* the answer read up to a byte ``limit`` and no further (an error answer:
  only its first :data:`ERROR_BYTES`);
* a nesting bound checked on the raw text before decoding
  (:func:`~agentlog.gateway.json_depth.text_depth`), so nothing recurses
  near the interpreter's limit;
* strict JSON decoding (msgspec): ``NaN`` and ``Infinity`` are not JSON, and
  an answer holding one is refused with :class:`NonFiniteJSON`, naming the
  path of the first such number;
* every failure as an :class:`HTTPJSONError` naming the method, the URL,
  the HTTP status (0: no answer) and the error text of the answer's body.

Callers wrap an :class:`HTTPJSONError` in their own error type
(``BackendError``, ``WeightSyncError``, ``TeacherError``) with what they
were doing.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator

import msgspec

from agentlog.events.errors import AgentlogError
from agentlog.gateway.json_depth import MAX_JSON_DEPTH, text_depth

def base_url_problem(url: str) -> str:
    """Why ``url`` is not an http(s) base URL a client can connect to ("" when it is): a
    scheme, a host, a port in 1..65535 when given, no whitespace. Config checks and the
    teacher's URL use this one rule; each raises its own error naming the setting."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number, or out of range
    except ValueError as exc:
        return f"not an http(s) base URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "not an http(s) URL"
    if not parts.hostname or any(c.isspace() for c in url):
        return "no host (expected http://host:port)"
    if port == 0:
        return "port 0 (expected a port in 1..65535)"
    return ""


#: Bytes of an error answer read for its message (the rest is never read).
ERROR_BYTES = 4096
#: Characters of an error answer's text shown in a message.
ERROR_TEXT_SHOWN = 500


class HTTPJSONError(AgentlogError, RuntimeError):
    """A JSON-over-HTTP exchange failed.

    ``method`` / ``url``: the request; ``status``: the HTTP status (0: no
    answer); ``error_text``: the answer's error text (a JSON body's ``error``,
    ``message`` or ``detail``, else its first characters); ``answer``: the
    decoded error body (its text when not JSON, None without one);
    ``reached``: False only when no connection was made, so the request
    cannot have reached the server."""

    def __init__(self, message: str, *, method: str, url: str, status: int = 0, error_text: str = "",
                 answer: Any = None, reached: bool = True) -> None:
        super().__init__(message)
        self.method = method
        self.url = url
        self.status = status
        self.error_text = error_text
        self.answer = answer
        self.reached = reached


class NonFiniteJSON(HTTPJSONError, ValueError):
    """An answer holding ``NaN``, ``Infinity`` or a number beyond the float
    range; ``path`` is the JSON path of the first one (``$.a[0]``), ``token``
    its text."""

    def __init__(self, message: str, *, method: str, url: str, status: int, path: str, token: str) -> None:
        super().__init__(message, method=method, url=url, status=status)
        self.path = path
        self.token = token


class _NonFinite:
    """A non-finite number found while locating one (see :func:`_non_finite_path`)."""

    def __init__(self, token: str) -> None:
        self.token = token


def _parse_float(text: str) -> Any:
    value = float(text)
    return _NonFinite(text) if math.isinf(value) else value


def _non_finite_path(raw: bytes) -> tuple[str, str] | None:
    """(path, token) of the first non-finite number in the JSON text ``raw``
    (``NaN``, ``Infinity``, ``-Infinity``, ``1e400``); None when it has none or
    is no JSON at all. Called only on text within the nesting bound."""
    try:
        value = json.loads(raw, parse_constant=_NonFinite, parse_float=_parse_float)
    except ValueError:
        return None
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _NonFinite):
            return path, v.token
        if type(v) is dict:
            stack.extend((x, f"{path}.{k}") for k, x in reversed(list(v.items())))
        elif type(v) is list:
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def error_text(raw: bytes) -> str:
    """The error an answer's body states: a JSON object's ``error`` (or its
    ``message``), ``message`` or ``detail``; else the body's first characters."""
    text = raw.decode("utf-8", "replace")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return text[:ERROR_TEXT_SHOWN]
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            found = body.get(key)
            if isinstance(found, dict) and isinstance(found.get("message"), str):
                found = found["message"]
            if isinstance(found, str) and found:
                return found[:ERROR_TEXT_SHOWN]
    return text[:ERROR_TEXT_SHOWN]


class JSONClient:
    """JSON requests to one or more servers over one aiohttp session.

    ``timeout_s`` bounds each whole exchange; ``headers`` go with every
    request; ``connection_limit`` caps concurrent connections (0: none, for a
    backend that serves many sessions at once). Safe to use concurrently
    from one event loop; :meth:`close` releases the connections."""

    def __init__(self, *, timeout_s: float, headers: dict[str, str] | None = None, connection_limit: int = 100) -> None:
        if not timeout_s > 0:
            raise ValueError(f"JSONClient: timeout_s must be > 0, found {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.headers = dict(headers or {})
        self._json_headers = {"Content-Type": "application/json", **self.headers}
        self.connection_limit = connection_limit
        self._session: Any = None

    def _client(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                  connector=aiohttp.TCPConnector(limit=self.connection_limit))
        return self._session

    async def request(self, method: str, url: str, body: Any = None, *, limit: int = 64 << 20,
                      max_depth: int = MAX_JSON_DEPTH, empty: bool = False, headers: dict[str, str] | None = None) -> Any:
        """The decoded JSON answer (status 200) to ``method url`` with ``body`` as JSON
        (None: no body). At most ``limit`` bytes are read; an answer nesting deeper than
        ``max_depth`` is refused before it is decoded; ``empty``: an empty answer is None
        rather than an error; ``headers`` go with this request only, over the client's own.
        Every failure is an :class:`HTTPJSONError`."""
        import aiohttp

        where = f"{method} {url}"
        try:
            # msgspec encodes a 100k-token prompt about 20x faster than aiohttp's json=
            # (the standard library's json.dumps).
            data, sent = (None, self.headers) if body is None else (msgspec.json.encode(body), self._json_headers)
            async with self._client().request(method, url, data=data, headers={**sent, **headers} if headers else sent) as resp:
                status = resp.status
                raw = await self._read(where, resp, limit if status == 200 else ERROR_BYTES, refuse=status == 200)
        except asyncio.TimeoutError:
            raise HTTPJSONError(f"{where} failed: no answer within {self.timeout_s:g} s (timeout_s)",
                                method=method, url=url) from None
        except aiohttp.ClientConnectorError as exc:
            raise HTTPJSONError(f"{where} failed: {type(exc).__name__}: {exc}", method=method, url=url,
                                reached=False) from exc
        except aiohttp.ClientError as exc:
            raise HTTPJSONError(f"{where} failed: {type(exc).__name__}: {exc}", method=method, url=url) from exc
        if status != 200:
            raise self._status_error(where, status, raw)
        if empty and not raw.strip():
            return None
        return self.decode(raw, method=method, url=url, max_depth=max_depth, status=status)

    @staticmethod
    def _status_error(where: str, status: int, raw: bytes) -> "HTTPJSONError":
        """The error for an answer with HTTP ``status`` other than 200 and body ``raw``."""
        method, url = where.split(" ", 1)
        text = error_text(raw)
        try:
            answer: Any = msgspec.json.decode(raw) if raw.strip() else None
        except msgspec.DecodeError:
            answer = raw.decode("utf-8", "replace")
        return HTTPJSONError(f"{where} answered HTTP {status}, expected 200: {text}", method=method, url=url,
                             status=status, error_text=text, answer=answer)

    async def server_sent_events(self, url: str, body: Any, *, limit: int = 64 << 20, max_depth: int = MAX_JSON_DEPTH,
                                 headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """POST ``body`` as JSON and yield the decoded JSON of each server-sent event's
        ``data:`` line (an OpenAI-style stream) until ``data: [DONE]``. An event's line
        longer than ``limit`` bytes, a stream that ends before ``[DONE]``, and every other
        failure are an :class:`HTTPJSONError`. Cancelling the consumer closes the
        connection, which tells the server to stop. ``headers``: as :meth:`request`'s."""
        import aiohttp

        where = f"POST {url}"
        try:
            async with self._client().request("POST", url, data=msgspec.json.encode(body),
                                              headers={**self._json_headers, **headers} if headers else self._json_headers) as resp:
                if resp.status != 200:
                    raise self._status_error(where, resp.status, await self._read(where, resp, ERROR_BYTES, refuse=False))
                parts: list[bytes] = []  # the line not ended yet, in the pieces it came in
                held = 0
                async for chunk in resp.content.iter_any():
                    if b"\n" in chunk:
                        *lines, rest = chunk.split(b"\n")
                        if parts:
                            lines[0] = b"".join(parts) + lines[0]
                        parts, held = ([rest], len(rest)) if rest else ([], 0)
                    else:
                        lines = []
                        parts.append(chunk)
                        held += len(chunk)
                    if held > limit or any(len(line) > limit for line in lines):
                        raise HTTPJSONError(f"{where}: an event's line is over the limit of {limit} bytes; the rest "
                                            "was not read", method="POST", url=url, status=200)
                    for line in lines:
                        # Other SSE fields (event:, id:, retry:) and comments (":...") carry nothing here.
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        yield self.decode(bytes(data), method="POST", url=url, max_depth=max_depth)
                raise HTTPJSONError(f"{where}: the event stream ended without 'data: [DONE]'", method="POST", url=url,
                                    status=200)
        except asyncio.TimeoutError:
            raise HTTPJSONError(f"{where} failed: no end of the stream within {self.timeout_s:g} s (timeout_s)",
                                method="POST", url=url) from None
        except aiohttp.ClientConnectorError as exc:
            raise HTTPJSONError(f"{where} failed: {type(exc).__name__}: {exc}", method="POST", url=url,
                                reached=False) from exc
        except aiohttp.ClientError as exc:
            raise HTTPJSONError(f"{where} failed: {type(exc).__name__}: {exc}", method="POST", url=url) from exc

    @staticmethod
    def decode(raw: bytes, *, method: str, url: str, max_depth: int = MAX_JSON_DEPTH, status: int = 200) -> Any:
        """``raw`` decoded as strict JSON after the nesting check; an :class:`HTTPJSONError`
        (:class:`NonFiniteJSON` for NaN or infinite numbers) names what is wrong."""
        where = f"{method} {url}"
        depth = text_depth(raw)
        if depth > max_depth:
            raise HTTPJSONError(f"{where}: the answer nests {depth} levels deep; expected at most {max_depth}",
                                method=method, url=url, status=status)
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            found = _non_finite_path(raw)
            if found is not None:
                path, token = found
                raise NonFiniteJSON(f"{where}: the answer holds the number {token} at {path}; expected finite numbers "
                                    "(JSON has no NaN or Infinity)", method=method, url=url, status=status,
                                    path=path, token=token) from None
            raise HTTPJSONError(f"{where}: the answer is not JSON ({exc}): {raw[:120]!r}", method=method, url=url,
                                status=status) from None

    @staticmethod
    async def _read(where: str, resp: Any, limit: int, *, refuse: bool) -> bytes:
        """The body of ``resp``, at most ``limit`` bytes held at any time. Past ``limit``
        (declared by Content-Length or found while reading, after decompression), an
        HTTPJSONError when ``refuse``, else the first ``limit`` bytes; the rest is never read."""
        method, url = where.split(" ", 1)
        declared = resp.content_length
        if refuse and declared is not None and declared > limit:
            raise HTTPJSONError(f"{where}: the answer is {declared} bytes (Content-Length), over the limit of {limit} "
                                "for this request; not read", method=method, url=url, status=resp.status)
        raw = bytearray()
        while len(raw) <= limit:
            chunk = await resp.content.read(min(1 << 16, limit + 1 - len(raw)))
            if not chunk:
                return bytes(raw)
            raw += chunk
        if refuse:
            raise HTTPJSONError(f"{where}: the answer is over the limit of {limit} bytes for this request; the rest "
                                "was not read", method=method, url=url, status=resp.status)
        return bytes(raw[:limit])

    async def close(self) -> None:
        """Close the session (a later request opens a new one)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


__all__ = ["ERROR_BYTES", "HTTPJSONError", "JSONClient", "NonFiniteJSON", "error_text"]
