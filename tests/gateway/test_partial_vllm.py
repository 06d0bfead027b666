"""Partial rollouts against vLLM (a local fake on loopback): generations are streamed, a reload
cuts every stream in flight at the last token received before it touches the weights, the
weights are reloaded through vLLM's dev routes, and each cut generation is resubmitted with its
partial output. The recorded turn says which version made which tokens.

The fake streams one token per event, every TOKEN_S, and each token is the digit of the weights
version it holds while making it, so each recorded token's version can be checked against the
turn's version spans. It keeps generating for a client that went away until its next write
fails, as a server does: tokens made after a cut must never be recorded."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiohttp import web

from aiohttp_helpers import serve_app

from agentlog.events.errors import ConfigError
from agentlog.gateway import OpenAICompletionsBackend, SamplingParams
from agentlog.gateway.backends import BackendError
from agentlog.gateway.weight_sync import GatedBackend, VLLMWeightSync
from agentlog.loop import LoopConfig
from gateway_helpers import chat_through_reloads, check_versions_made_the_tokens, hf_dir, rig, run, turns_of

TOKEN_S = 0.002


class StreamingVLLM:
    """A fake vLLM: ``/v1/completions`` with ``stream`` answers server-sent events, one token each;
    ``/collective_rpc`` reloads the version written in the served directory."""

    def __init__(self, served_dir) -> None:
        self.served_dir = served_dir
        self.version = 0
        self.calls: list[str] = []
        self.violations: list[str] = []
        self.disconnected = 0
        self.finish_with: str | None = None  # force a finish reason (a misbehaving server)
        self.paused = False
        self.done_after_finish = asyncio.Event()  # set once a stream sent its finishing event
        self.linger_s = 0.0  # wait this long between the finishing event and [DONE]

    async def start(self) -> "StreamingVLLM":
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        self.runner, self.url = await serve_app(app)
        return self

    async def pause(self, request: web.Request) -> web.Response:
        self.calls.append("pause")
        if dict(request.query) != {"mode": "abort"}:
            self.violations.append(f"pause query {dict(request.query)}")
        self.paused = True
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls.append("resume")
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not (isinstance(body["prompt"], list) and body["logprobs"] == 0 and body.get("stream") is True):
            self.violations.append(f"completions body {sorted(body)}")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        try:
            for i in range(n):
                await asyncio.sleep(TOKEN_S)
                tok = ord(str(self.version % 10))
                last = i == n - 1
                event = {"choices": [{"index": 0, "text": "", "token_ids": [tok],
                                      "logprobs": {"tokens": [f"token_id:{tok}"], "token_logprobs": [-0.5]},
                                      "finish_reason": (self.finish_with or "length") if last else None}]}
                await resp.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
            self.done_after_finish.set()
            await asyncio.sleep(self.linger_s)
            await resp.write(b'data: {"choices": [], "usage": {}}\n\ndata: [DONE]\n\n')
        except (ConnectionResetError, ConnectionError):
            self.disconnected += 1
        return resp

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append("collective_rpc")
        if body != {"method": "reload_weights"}:
            self.violations.append(f"collective_rpc body {body}")
        if not self.paused:
            self.violations.append("reload while not paused")
        self.version = int((self.served_dir / "version.txt").read_text())
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.calls.append("reset_prefix_cache")
        return web.Response(status=200)


def test_reloads_cut_streams_and_resubmit_and_every_token_records_the_version_that_made_it(tmp_path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "version.txt").write_text("0")

    async def body():
        server = await StreamingVLLM(served).start()
        try:
            backend = GatedBackend(OpenAICompletionsBackend(server.url), weight_update="resubmit")
            sync = VLLMWeightSync(server.url, served, gate=backend.gate)
            async with rig(backend) as (gw, engine, log):
                await chat_through_reloads(gw, engine, lambda v: sync.reload(hf_dir(tmp_path / "ckpt", v), v))
                await sync.close()
                return server, turns_of(log)
        finally:
            await server.runner.cleanup()

    server, turns = run(body())
    assert not server.violations, server.violations
    assert server.calls == ["pause", "collective_rpc", "reset_prefix_cache", "resume"] * 3
    assert server.disconnected > 0  # the cut streams were closed: vLLM aborts a request whose client went away
    assert len(turns) == 12
    check_versions_made_the_tokens(turns)


def test_a_streamed_generation_that_ends_without_a_usable_finish_is_refused_by_name(tmp_path) -> None:
    async def body():
        server = await StreamingVLLM(tmp_path).start()
        server.finish_with = "abort"
        try:
            inner = OpenAICompletionsBackend(server.url)
            inner.partial = True
            with pytest.raises(BackendError, match=r"\(streamed\) finished with 'abort'"):
                await inner.generate([1, 2], SamplingParams(max_new_tokens=3))
            await inner.close()
        finally:
            await server.runner.cleanup()

    run(body())


def test_a_cut_before_any_token_resubmits_from_nothing_and_a_cut_outside_a_reload_is_an_error(tmp_path) -> None:
    async def body():
        server = await StreamingVLLM(tmp_path).start()
        try:
            backend = GatedBackend(OpenAICompletionsBackend(server.url), weight_update="resubmit")
            gen = asyncio.ensure_future(backend.generate([1], SamplingParams(max_new_tokens=5)))
            await asyncio.sleep(0)  # admitted and registered, nothing received yet
            assert backend.inner.interrupt() == 1
            with pytest.raises(BackendError, match="aborted a generation after 0 tokens while no weight update"):
                await gen
            await backend.close()
        finally:
            await server.runner.cleanup()

    run(body())


def test_continue_in_place_against_a_server_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"weight_update 'continue' with \[inference\] backend 'vllm'"):
        LoopConfig(hf_model="tiny-llama", inference={"backend": "vllm", "url": "http://127.0.0.1:9", "served_dir": "/x"},
                   rollout={"weight_update": "continue"})
    # resubmit is accepted for vLLM
    LoopConfig(hf_model="tiny-llama", inference={"backend": "vllm", "url": "http://127.0.0.1:9", "served_dir": "/x"},
               rollout={"weight_update": "resubmit"})


def test_a_cut_after_the_finishing_event_keeps_the_generation_whole(tmp_path) -> None:
    """A reload that lands between the event that finishes a generation and the end of its stream
    cuts nothing: the generation returns with its finish reason, not as a part to resubmit (which
    would run past its stop token)."""

    async def body():
        server = await StreamingVLLM(tmp_path).start()
        server.finish_with, server.linger_s = "stop", 0.5
        try:
            inner = OpenAICompletionsBackend(server.url)
            inner.partial = True
            call = asyncio.ensure_future(inner.generate([1, 2], SamplingParams(max_new_tokens=3)))
            await asyncio.wait_for(server.done_after_finish.wait(), 10)
            await asyncio.sleep(0.05)  # the finishing event reached the client
            assert inner.interrupt() == 1
            gen = await call
            await inner.close()
            return gen
        finally:
            await server.runner.cleanup()

    gen = run(body())
    assert gen.finish_reason == "stop" and len(gen.output_ids) == 3
