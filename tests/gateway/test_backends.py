"""HTTP backends against scripted inference servers (real aiohttp servers in the test).

The SGLang server speaks the native ``/generate`` and ``/abort_request``; the
vLLM-style server speaks ``/v1/completions`` with token-id log-probs.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import openai
import pytest
from aiohttp import web

from agentlog.gateway import OpenAICompletionsBackend, SGLangBackend
from agentlog.gateway.backends import ROUTING_HEADER_DEFAULT, ROUTING_KEY, SamplingParams
from aiohttp_helpers import serve_app
from gateway_helpers import TEMPLATE, bearer, oa_client, open_running, rig, run, turns_of

CHAT = [{"role": "user", "content": "hi"}]


class ScriptedSGLang:
    """A real HTTP server that answers like SGLang and keeps what it received."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, body)
        self.hold = False  # /generate waits until released (or aborted)
        self.release = asyncio.Event()
        self.status = 200
        self.finish = {"type": "stop", "matched": 128}
        self.reply = "Hi!"
        self.url = ""
        self.runner: web.AppRunner | None = None  # set while serving; ``await runner.cleanup()`` takes it down early

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/generate", dict(request.headers), body))
        if self.hold:
            await self.release.wait()
        if self.status != 200:
            return web.Response(status=self.status, text="server overloaded, retry later")
        ids = TEMPLATE.encode_text(self.reply) + [TEMPLATE.EOS]
        triples = [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]
        meta = {"id": body["rid"], "finish_reason": self.finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids), "output_token_logprobs": triples, "weight_version": "7"}
        return web.json_response({"text": self.reply, "output_ids": ids, "meta_info": meta})

    async def abort(self, request: web.Request) -> web.Response:
        self.requests.append(("/abort_request", dict(request.headers), await request.json()))
        self.release.set()
        return web.json_response({})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/v1/completions", dict(request.headers), body))
        ids = TEMPLATE.encode_text(self.reply) + [TEMPLATE.EOS]
        lp = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids)}
        return web.json_response({"choices": [{"index": 0, "text": self.reply, "logprobs": lp, "finish_reason": "stop"}]})

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's liveness probe (a router checks it before it sends a server work)."""
        return web.Response(text="")

    @contextlib.asynccontextmanager
    async def serve(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        self.runner, self.url = await serve_app(app)
        try:
            yield self
        finally:
            await self.runner.cleanup()


def test_sglang_request_body_and_headers_on_the_wire_and_the_recorded_turn():
    async def body():
        async with ScriptedSGLang().serve() as srv:
            async with rig(SGLangBackend(srv.url, api_key="secret-k")) as (gw, engine, log):
                await open_running(engine, "s")
                gw.configure_session("s", sampling={"temperature": 0.7, "top_k": 20})  # the session's defaults
                r = await oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT, temperature=0.3, max_tokens=40, top_p=0.9, stop=["END"])
                assert r.choices[0].message.content == "Hi!"
                ((path, headers, sent),) = srv.requests
                (turn,) = turns_of(log, "s")
                assert path == "/generate" and headers["Authorization"] == "Bearer secret-k"
                assert headers["Content-Type"].startswith("application/json")
                assert sent["input_ids"] == turn.prompt_tokens.tolist() and sent["return_logprob"] is True
                sp = sent["sampling_params"]
                assert sp["temperature"] == 0.3 and sp["top_p"] == 0.9 and sp["max_new_tokens"] == 40 and sp["top_k"] == 20
                assert sp["stop_token_ids"] == [TEMPLATE.EOS] and sp["skip_special_tokens"] is False
                assert turn.output_tokens.tolist() == TEMPLATE.encode_text("Hi!") + [TEMPLATE.EOS]
                assert turn.log_probs.tolist() == pytest.approx([-0.1 * (i + 1) for i in range(4)])
                assert turn.policy_version == 7 and turn.finish_reason == "stop"
                assert turn.sampling["client"] == {"temperature": 0.3, "top_p": 0.9, "stop": ["END"], "max_tokens": 40}  # what the client asked
                assert turn.sampling["ignored"] == ["stop"]  # and what no sampler honoured
                assert turn.sampling["temperature"] == 0.3 and turn.sampling["top_k"] == 20  # what was used

    run(body())


def test_sglang_client_cancel_posts_abort_request_for_the_same_rid_and_records_nothing():
    async def body():
        async with ScriptedSGLang().serve() as srv:
            srv.hold = True
            async with rig(SGLangBackend(srv.url)) as (gw, engine, log):
                await open_running(engine, "s")
                session = aiohttp.ClientSession()
                req = asyncio.ensure_future(session.post(gw.url + "/v1/chat/completions", json={"messages": CHAT}, headers=bearer(gw, "s")))
                for _ in range(500):
                    if srv.requests:
                        break
                    await asyncio.sleep(0.01)
                req.cancel()
                await session.close()
                await asyncio.wait_for(srv.release.wait(), 10)
                (gen, abort) = [r for r in srv.requests]
                assert abort[0] == "/abort_request" and abort[2] == {"rid": gen[2]["rid"]}
                await asyncio.sleep(0.05)
                assert turns_of(log) == [] and gw.stats["cancelled"] == 1

    run(body())


@pytest.mark.parametrize("failure", ["http_503", "finish_abort"])
def test_sglang_errors_surface_as_502_naming_the_upstream_and_record_nothing(failure):
    async def body():
        async with ScriptedSGLang().serve() as srv:
            if failure == "http_503":
                srv.status = 503
            else:
                srv.finish = {"type": "abort", "message": "aborted by server"}
            async with rig(SGLangBackend(srv.url)) as (gw, engine, log):
                await open_running(engine, "s")
                with pytest.raises(openai.InternalServerError) as ei:
                    await oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT)
                assert ei.value.status_code == 502
                text = str(ei.value)
                assert "sglang" in text and (("HTTP 503" in text and "overloaded" in text) if failure == "http_503" else "abort" in text)
                assert turns_of(log) == []

    run(body())


def test_sglang_unreachable_server_is_a_502_not_a_hang():
    async def body():
        async with rig(SGLangBackend("http://127.0.0.1:9", timeout_s=5)) as (gw, engine, log):
            await open_running(engine, "s")
            with pytest.raises(openai.InternalServerError, match="failed"):
                await oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT)
            assert turns_of(log) == []

    run(body())


def test_openai_completions_backend_sends_token_ids_and_records_token_log_probs():
    async def body():
        async with ScriptedSGLang().serve() as srv:
            async with rig(OpenAICompletionsBackend(srv.url, "served-model")) as (gw, engine, log):
                await open_running(engine, "s")
                r = await oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT, max_tokens=20)
                assert r.choices[0].message.content == "Hi!"
                ((path, _, sent),) = srv.requests
                (turn,) = turns_of(log, "s")
                assert path == "/v1/completions" and sent["model"] == "served-model"
                assert sent["prompt"] == turn.prompt_tokens.tolist() and sent["logprobs"] == 0
                assert sent["return_tokens_as_token_ids"] is True and sent["max_tokens"] == 20
                assert turn.output_tokens.tolist() == TEMPLATE.encode_text("Hi!") + [TEMPLATE.EOS]
                assert turn.log_probs.tolist() == [-0.5] * 4

    run(body())


def header(headers: dict, name: str) -> str | None:
    """``name``'s value in recorded request ``headers`` (HTTP header names are case-insensitive), or None."""
    return {k.lower(): v for k, v in headers.items()}.get(name.lower())


def test_the_routing_key_of_the_calling_context_goes_upstream_in_the_routing_header():
    """A task that set ROUTING_KEY sends it in the backend's routing header (concurrent tasks each their
    own); no header when no key is set or the backend's routing_header is "" or None."""
    async def generate_as(backend: SGLangBackend, key: str | None, prompt: int) -> None:
        if key is not None:
            ROUTING_KEY.set(key)  # this task's context only
        await backend.generate([prompt], SamplingParams(max_new_tokens=4))

    async def body():
        async with ScriptedSGLang().serve() as srv:
            plain, renamed = SGLangBackend(srv.url), SGLangBackend(srv.url, routing_header="X-Session-Route")
            off, none = SGLangBackend(srv.url, routing_header=""), SGLangBackend(srv.url, routing_header=None)
            try:
                await asyncio.gather(*(generate_as(plain, f"session-{i}", i) for i in range(8)))
                await asyncio.gather(generate_as(plain, None, 100), generate_as(renamed, "s-r", 101),
                                     generate_as(off, "s-off", 102), generate_as(none, "s-none", 103))
                assert ROUTING_KEY.get() is None  # each call set the key in its own task
            finally:
                for b in (plain, renamed, off, none):
                    await b.close()
            sent = {body["input_ids"][0]: headers for _, headers, body in srv.requests}
            assert {p: header(sent[p], ROUTING_HEADER_DEFAULT) for p in range(8)} == {i: f"session-{i}" for i in range(8)}
            assert ROUTING_HEADER_DEFAULT == "X-SMG-Routing-Key"  # the header sglang-router's consistent hashing reads
            assert header(sent[100], ROUTING_HEADER_DEFAULT) is None  # no key set
            assert header(sent[101], "X-Session-Route") == "s-r" and header(sent[101], ROUTING_HEADER_DEFAULT) is None
            for p in (102, 103):  # routing header switched off
                assert not [k for k in sent[p] if "routing" in k.lower()], sent[p]

    run(body())


def test_a_cancelled_calls_abort_carries_its_routing_key():
    """/abort_request goes with the key of the call it stops, so a router keyed on it can reach the
    server that is generating."""
    async def body():
        async with ScriptedSGLang().serve() as srv:
            srv.hold = True
            backend = SGLangBackend(srv.url)

            async def generate_as(key: str) -> None:
                ROUTING_KEY.set(key)
                await backend.generate([1, 2], SamplingParams(max_new_tokens=4))

            call = asyncio.ensure_future(generate_as("session-9"))
            for _ in range(500):
                if srv.requests:
                    break
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await backend.close()
            (gen, abort) = srv.requests
            assert abort[0] == "/abort_request" and abort[2] == {"rid": gen[2]["rid"]}
            assert header(gen[1], ROUTING_HEADER_DEFAULT) == header(abort[1], ROUTING_HEADER_DEFAULT) == "session-9"

    run(body())
