"""The one JSON-over-HTTP client (gateway/http_json.py) against a real aiohttp server on loopback.

Each route answers the way a broken or hostile inference, weight-sync or
teacher server might: an error status with a JSON error body, NaN and
infinite numbers, nesting past the interpreter's recursion limit, an answer
larger than the caller's bound, no answer at all. Every one must come back
as an :class:`HTTPJSONError` naming the method, the URL, the status and
what was wrong, never a RecursionError, a float ``nan`` or a hang.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from aiohttp_helpers import serve_app

from agentlog.events.errors import AgentlogError
from agentlog.gateway.http_json import HTTPJSONError, JSONClient, NonFiniteJSON
from agentlog.gateway.json_depth import text_depth

#: Raw answers by route name: (status, body bytes).
ANSWERS: dict[str, tuple[int, bytes]] = {
    "ok": (200, b'{"ids": [1, 18446744073709551621], "text": "[[{{"}'),
    "empty": (200, b""),
    "openai_error": (503, b'{"error": {"message": "model overloaded", "type": "server_error"}}'),
    "detail_error": (400, b'{"detail": "bad body"}'),
    "text_error": (500, b"CUDA out of memory"),
    "nan": (200, b'{"meta": {"lp": [-0.5, NaN]}}'),
    "minus_infinity": (200, b'{"a": [[1, 2], [3, -Infinity]]}'),
    "overflow": (200, b'{"x": 1e400}'),
    "deep": (200, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "not_json": (200, b"<html>proxy</html>"),
    "big": (200, b"[" + b"0," * 100_000 + b"0]"),
}


async def _answer(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == "slow":
        await asyncio.sleep(2.0)
        return web.json_response({})
    if name == "echo":
        return web.json_response({"got": await request.json(), "auth": request.headers.get("Authorization")})
    status, body = ANSWERS[name]
    return web.Response(status=status, body=body, content_type="application/json")


def _with_server(fn):
    async def go():
        app = web.Application()
        app.router.add_route("*", "/{name}", _answer)
        runner, url = await serve_app(app)
        client = JSONClient(timeout_s=5, headers={"Authorization": "Bearer k"})
        try:
            return await fn(client, url)
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(go())


def test_a_json_answer_decodes_strictly_with_integers_of_any_size_and_the_body_and_headers_sent():
    async def go(client, url):
        return (await client.request("GET", f"{url}/ok"), await client.request("POST", f"{url}/echo", {"a": [1]}),
                await client.request("POST", f"{url}/empty", None, empty=True))

    ok, echo, empty = _with_server(go)
    assert ok == {"ids": [1, 2**64 + 5], "text": "[[{{"}
    assert echo == {"got": {"a": [1]}, "auth": "Bearer k"}
    assert empty is None


@pytest.mark.parametrize("route,status,text", [
    ("openai_error", 503, "model overloaded"),
    ("detail_error", 400, "bad body"),
    ("text_error", 500, "CUDA out of memory"),
])
def test_an_error_status_names_the_method_url_status_and_the_bodys_error_text(route, status, text):
    async def go(client, url):
        with pytest.raises(HTTPJSONError) as info:
            await client.request("POST", f"{url}/{route}", {"q": 1})
        return info.value, url

    err, url = _with_server(go)
    assert isinstance(err, AgentlogError)
    assert str(err) == f"POST {url}/{route} answered HTTP {status}, expected 200: {text}"
    assert (err.method, err.url, err.status, err.error_text, err.reached) == ("POST", f"{url}/{route}", status, text, True)
    expected_answer = ANSWERS[route][1].decode() if route == "text_error" else json.loads(ANSWERS[route][1])
    assert err.answer == expected_answer


@pytest.mark.parametrize("route,path,token", [
    ("nan", "$.meta.lp[1]", "NaN"),
    ("minus_infinity", "$.a[1][1]", "-Infinity"),
    ("overflow", "$.x", "1e400"),
])
def test_non_finite_numbers_are_refused_naming_their_path(route, path, token):
    async def go(client, url):
        with pytest.raises(NonFiniteJSON) as info:
            await client.request("GET", f"{url}/{route}")
        return info.value, url

    err, url = _with_server(go)
    assert (err.path, err.token, err.status) == (path, token, 200)
    assert f"GET {url}/{route}: the answer holds the number {token} at {path}; expected finite numbers" in str(err)


def test_an_answer_nested_past_the_recursion_limit_is_refused_with_its_depth_before_decoding():
    async def go(client, url):
        with pytest.raises(HTTPJSONError) as info:
            await client.request("GET", f"{url}/deep", max_depth=32)
        return info.value, url

    err, url = _with_server(go)
    assert str(err) == f"GET {url}/deep: the answer nests 100001 levels deep; expected at most 32"


def test_not_json_too_large_too_slow_and_unreachable_are_each_named():
    async def go(client, url):
        errors = {}
        for route, kw in (("not_json", {}), ("big", {"limit": 1000})):
            with pytest.raises(HTTPJSONError) as info:
                await client.request("GET", f"{url}/{route}", **kw)
            errors[route] = info.value
        quick = JSONClient(timeout_s=0.3)
        try:
            with pytest.raises(HTTPJSONError) as info:
                await quick.request("GET", f"{url}/slow")
            errors["slow"] = info.value
            with pytest.raises(HTTPJSONError) as info:
                await quick.request("GET", "http://127.0.0.1:9/x")
            errors["gone"] = info.value
        finally:
            await quick.close()
        return errors, url

    errors, url = _with_server(go)
    assert f"GET {url}/not_json: the answer is not JSON" in str(errors["not_json"])
    assert f"GET {url}/big: the answer is 200003 bytes (Content-Length), over the limit of 1000" in str(errors["big"])
    assert str(errors["slow"]) == f"GET {url}/slow failed: no answer within 0.3 s (timeout_s)"
    assert errors["slow"].status == 0 and errors["slow"].reached
    assert str(errors["gone"]).startswith("GET http://127.0.0.1:9/x failed: ClientConnectorError")
    assert not errors["gone"].reached


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=3), inner, max_size=3),
    max_leaves=20,
)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@given(_json_values, st.booleans())
@settings(max_examples=200, deadline=None)
def test_text_depth_is_the_nesting_of_the_value_brackets_in_strings_aside(value, pretty):
    raw = json.dumps(value, indent=1 if pretty else None).encode()
    assert text_depth(raw) == _depth(value)
    assert text_depth(msgspec.json.encode(value)) == _depth(value)


def _streaming(pieces: list[bytes], status: int = 200):
    """A server whose POST /sse answers ``pieces``, each written (and flushed) on its own."""

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.001)
        return resp

    async def go(limit: int):
        app = web.Application()
        app.router.add_post("/sse", sse)
        runner, url = await serve_app(app)
        client = JSONClient(timeout_s=5)
        try:
            return [e async for e in client.server_sent_events(url + "/sse", {"q": 1}, limit=limit)]
        finally:
            await client.close()
            await runner.cleanup()

    return go


@settings(max_examples=25, deadline=None)
@given(events=st.lists(st.dictionaries(st.sampled_from(["a", "bb", "text"]), st.integers(-5, 10**6) | st.text(max_size=30),
                                       max_size=3), min_size=1, max_size=6),
       crlf=st.booleans(), spaced=st.booleans(), cuts=st.lists(st.integers(1, 400), max_size=8))
def test_server_sent_events_yield_each_data_line_whatever_the_chunking(events, crlf, spaced, cuts) -> None:
    """Each ``data:`` line's JSON comes back once, in order, however the stream is cut into chunks,
    with LF or CRLF line ends, with or without the space after the colon; comments and other
    fields are skipped; ``data: [DONE]`` ends it."""
    nl = b"\r\n" if crlf else b"\n"
    sep = b"data: " if spaced else b"data:"
    body = b": a comment" + nl + b"event: message" + nl
    for e in events:
        body += sep + msgspec.json.encode(e) + nl + nl
    body += sep + b"[DONE]" + nl + nl
    pieces, at = [], 0
    for c in sorted(set(cuts)):
        if at < c < len(body):
            pieces.append(body[at:c])
            at = c
    pieces.append(body[at:])
    assert asyncio.run(_streaming(pieces)(1 << 20)) == events


def test_a_stream_without_done_an_error_status_and_an_over_long_line_are_each_named() -> None:
    with pytest.raises(HTTPJSONError, match=r"POST http://127\.0\.0\.1:\d+/sse: the event stream ended without 'data: \[DONE\]'"):
        asyncio.run(_streaming([b'data: {"a": 1}\n\n'])(1 << 20))
    with pytest.raises(HTTPJSONError, match=r"answered HTTP 503, expected 200: overloaded") as err:
        asyncio.run(_streaming([b'{"error": {"message": "overloaded"}}'], status=503)(1 << 20))
    assert err.value.status == 503
    with pytest.raises(HTTPJSONError, match="an event's line is over the limit of 100 bytes"):
        asyncio.run(_streaming([b"data: " + b"[" + b"1," * 100 + b"1]\n\n", b"data: [DONE]\n\n"])(100))
    with pytest.raises(HTTPJSONError, match="an event's line is over the limit of 100 bytes"):  # a line still arriving
        asyncio.run(_streaming([b"data: " + b"x" * 80, b"y" * 80])(100))
    with pytest.raises(NonFiniteJSON, match=r"the answer holds the number NaN at \$\.a"):
        asyncio.run(_streaming([b'data: {"a": NaN}\n\n'])(1 << 20))
