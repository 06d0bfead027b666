"""Requests and backend answers of the wrong shape: each is refused with a JSON error in the
dialect that names the field (400 for the client's, 502 for the server's), nothing is recorded,
and nothing the server did not produce reaches the log."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from agentlog.gateway import GatewayConfig, OpenAICompletionsBackend, SGLangBackend
from aiohttp_helpers import serve_app
from gateway_helpers import TEMPLATE, ScriptedBackend, key_for, open_running, rig, run, turns_of


async def _post_raw(url: str, path: str, key: str, data: bytes, headers: dict | None = None) -> tuple[int, str, str]:
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {key}", **(headers or {})}
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url + path, data=data, headers=h, compress=None) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.text()


# ------------------------------------------------------------ 1. chat tool_calls that are not a list


@pytest.mark.parametrize("tool_calls", [5, True, 1.5, "abc", {"a": 1}])
def test_chat_tool_calls_that_are_not_a_list_are_a_json_400_naming_the_field(tool_calls):
    """A number (once a TypeError out of the parser: aiohttp's plain-text 500) or a string or
    object (once read item by item, a 400 about tool_calls[0].function) is a 400 saying that
    tool_calls must be a list."""
    async def body():
        backend = ScriptedBackend(lambda p: "x")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", "tool_calls": tool_calls}]
            status, ctype, text = await _post_raw(gw.url, "/v1/chat/completions", key_for(gw, "s"),
                                                  json.dumps({"messages": messages}).encode())
            assert status == 400 and ctype.startswith("application/json"), (status, text)
            message = json.loads(text)["error"]["message"]
            assert "messages[1].tool_calls" in message and "a list" in message, message
            assert backend.prompts == [] and turns_of(log) == []

    run(body())


# ------------------------------------------------------------ 2. a sampling integer beyond the float range


@pytest.mark.parametrize("path, payload, field", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1%s}', "temperature"),
    ("/v1/messages", '{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "top_p": 1%s}', "top_p"),
])
def test_a_sampling_integer_beyond_the_float_range_is_a_json_400_naming_the_field(path, payload, field):
    """An integer past a float's range (a 1 with 400 zeros; math.isfinite raised OverflowError on
    it, a plain-text 500) is out of the rule's range: a 400 naming the field."""
    async def body():
        backend = ScriptedBackend(lambda p: "x")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            status, ctype, text = await _post_raw(gw.url, path, key_for(gw, "s"), (payload % ("0" * 400)).encode())
            assert status == 400 and ctype.startswith("application/json"), (status, text[:200])
            assert field in json.loads(text)["error"]["message"]
            assert backend.prompts == [] and turns_of(log) == []

    run(body())


# ------------------------------------------------------------ 3. a compressed body that does not decompress


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decompress_is_a_json_400_naming_the_encoding(encoding):
    """A Content-Encoding the body does not decode with (aiohttp's RequestPayloadError from
    request.read(); once a plain-text 500) is a JSON 400 naming the encoding."""
    async def body():
        backend = ScriptedBackend(lambda p: "x")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            status, ctype, text = await _post_raw(gw.url, "/v1/chat/completions", key_for(gw, "s"), b"not compressed at all",
                                                  {"Content-Encoding": encoding})
            assert status == 400 and ctype.startswith("application/json"), (status, text[:200])
            assert encoding in json.loads(text)["error"]["message"]
            assert backend.prompts == [] and turns_of(log) == []

    run(body())


# ------------------------------------------------------------ 4. an SGLang answer with ill-shaped token items


async def _answered_502_naming(route: str, answer: dict, make_backend, shown: str) -> None:
    """A fake inference server answering ``route`` with ``answer``: the gateway's chat turn through
    ``make_backend(url)`` is a 502 whose message holds ``shown``, and nothing is recorded."""
    async def handler(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post(route, handler)
    runner, url = await serve_app(app)
    try:
        async with rig(make_backend(url)) as (gw, engine, log):
            await open_running(engine, "s")
            status, _, text = await _post_raw(gw.url, "/v1/chat/completions", key_for(gw, "s"),
                                              json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
            assert status == 502, (status, text[:300])
            assert shown in json.loads(text)["error"]["message"]
            assert turns_of(log) == []
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("item, shown", [
    ({"logprob": -0.1, "token_id": 72}, "output_token_logprobs[0]"),  # an object: once a 500 "KeyError: 0"
    ([-0.1, 72.9, None], "output_token_logprobs[0]"),              # int(72.9) once recorded token 72
    ([-0.1, True, None], "output_token_logprobs[0]"),              # int(True) once recorded token 1
    (["-0.1", 72, None], "output_token_logprobs[0]"),              # a string is no log-prob
])
def test_an_sglang_answer_with_ill_shaped_token_items_is_a_502_naming_the_field_and_records_nothing(item, shown):
    """Token ids are taken as the server sent them (ints), never converted into tokens it did not produce."""
    triples = [item] + [[-0.1, t, None] for t in TEMPLATE.encode_text("i") + [TEMPLATE.EOS]]
    answer = {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": triples, "weight_version": "1"}}
    run(_answered_502_naming("/generate", answer, lambda url: SGLangBackend(url, timeout_s=5), shown))


@pytest.mark.parametrize("token_ids, log_probs, shown", [
    ([72.9], [-0.1], "choices[0].token_ids[0]"),        # int(72.9) once recorded token 72
    ([True], [-0.1], "choices[0].token_ids[0]"),        # int(True) once recorded token 1
    ("72", [-0.1], "choices[0].token_ids"),             # a string is no list of ids
    ([72], ["-0.1"], "token_logprobs[0]"),              # a string is no log-prob
    ([72], [False], "token_logprobs[0]"),               # nor is a bool
])
def test_a_vllm_answer_with_ill_typed_token_ids_or_log_probs_is_a_502_naming_the_field_and_records_nothing(
        token_ids, log_probs, shown):
    """The OpenAI-compatible completions backend takes token ids and log-probs as the server sent them."""
    answer = {"choices": [{"text": "", "token_ids": token_ids, "finish_reason": "stop",
                           "logprobs": {"token_logprobs": log_probs, "tokens": ["token_id:72"]}}]}
    run(_answered_502_naming("/v1/completions", answer, lambda url: OpenAICompletionsBackend(url, "m", timeout_s=5), shown))


# ------------------------------------------------------------ 5. count_tokens and the large-body budget


def test_count_tokens_bodies_count_against_the_large_body_budget():
    """/v1/messages/count_tokens reserves a large body against large_bodies_bytes before reading
    it, as the turn routes do (it once read and decoded any number at once). Two large bodies
    held half-sent use the budget up: a third large one is a 503, as on /v1/messages."""
    async def body():
        config = GatewayConfig(large_body_bytes=10_000, large_bodies_bytes=25_000, body_timeout_s=10)
        async with rig(ScriptedBackend(lambda p: "x"), config=config) as (gw, engine, log):
            for sid in ("a", "b", "c"):
                await open_running(engine, sid)
            big = json.dumps({"max_tokens": 5, "messages": [{"role": "user", "content": "y" * 12_000}]}).encode()
            host, port = gw.url[len("http://"):].split(":")
            held = []
            for sid in ("a", "b"):  # each sends its head and half its body, then stalls
                r, w = await asyncio.open_connection(host, int(port))
                w.write(f"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: x\r\nx-api-key: {key_for(gw, sid)}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(big)}\r\n\r\n".encode() + big[: len(big) // 2])
                await w.drain()
                held.append(w)
            await asyncio.sleep(0.3)
            try:
                status, _, text = await _post_raw(gw.url, "/v1/messages/count_tokens", key_for(gw, "c"), big)
                assert status == 503 and "large request bodies in flight" in text, (status, text[:200])
            finally:
                for w in held:
                    w.close()

    run(body())
