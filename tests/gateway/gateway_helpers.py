"""Shared rig for the gateway tests: a log, an engine, a backend and a live gateway on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any, Callable, Sequence

from aiohttp import web

from aiohttp_helpers import serve_app

from agentlog.engine import SessionEngine
from agentlog.gateway import Backend, ByteChatTemplate, Gateway, GatewayConfig, Generation, SamplingParams, TorchBackend
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import TurnDelta, TurnRecorded, TurnUndelivered
from agentlog.gateway.backends import ROUTING_HEADER_DEFAULT
from agentlog.tools.cmd_serve import default_gateway_model

TEMPLATE = ByteChatTemplate()


#: Clients made by oa_client / an_client; rig() closes them on its own loop.
CLIENTS: list[Any] = []


def key_for(gw: Gateway, sid: str) -> str:
    """The API key an agent of session ``sid`` is given: the gateway's random
    key for a live session; for any other ``sid``, ``sid`` itself, i.e. a
    guessed key (the gateway must refuse it)."""
    return gw.session_key(sid) if gw.engine.get(sid) is not None else sid


def oa_client(gw: Gateway, sid: str) -> Any:
    """The official async OpenAI client with session ``sid``'s key (key_for), no retries."""
    import openai

    c = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key_for(gw, sid), max_retries=0, timeout=30)
    CLIENTS.append(c)
    return c


def an_client(gw: Gateway, sid: str) -> Any:
    """The official async Anthropic client with session ``sid``'s key (key_for), no retries."""
    import anthropic

    c = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key_for(gw, sid), max_retries=0, timeout=30)
    CLIENTS.append(c)
    return c


def bearer(gw: Gateway, sid: str) -> dict[str, str]:
    """The Authorization header of session ``sid``'s agent (key_for)."""
    return {"Authorization": f"Bearer {key_for(gw, sid)}"}


def run(coro: Any, timeout: float = 60.0) -> Any:
    """Run one async test body with a hard timeout (a hung test fails, never stalls CI)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class SpyBackend(Backend):
    """Wraps a real backend and keeps every generation it returned, by prompt,
    so a test can compare the log with what the backend actually produced."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.context_length = inner.context_length
        self.policy_version = inner.policy_version
        self.produced: list[tuple[list[int], Generation]] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        gen = await self.inner.generate(prompt_ids, params)
        self.produced.append((list(prompt_ids), gen))
        return gen

    async def close(self) -> None:
        await self.inner.close()


class ScriptedBackend(Backend):
    """Replies with text chosen by a function of the decoded prompt (the
    gateway, not the model, is under test); fixed log-probs per token."""

    name = "scripted"

    def __init__(self, reply: Callable[[str], str], log_prob: float = -0.25, context_length: int | None = None) -> None:
        self.reply = reply
        self.log_prob = log_prob
        self.context_length = context_length
        self.prompts: list[str] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        text = TEMPLATE.decode(list(prompt_ids))
        self.prompts.append(text)
        ids = TEMPLATE.encode_text(self.reply(text))[: params.max_new_tokens - 1] + [TEMPLATE.EOS]
        return Generation(ids, [self.log_prob] * len(ids), "stop", 0, 0.001)


class HangingBackend(ScriptedBackend):
    """A backend call that never finishes on its own (it must be cancelled);
    ``started`` is set once a call is in progress."""

    def __init__(self) -> None:
        super().__init__(lambda p: "")
        self.started = asyncio.Event()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.started.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable: the call was meant to be cancelled")


class GatedLog(MemoryLog):
    """A MemoryLog whose turn_recorded appends wait for ``gate``: lets a test
    disconnect a client deterministically while its turn is being made durable."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def append(self, session_id: str, session_seq: int, body: Any):
        if isinstance(body, (TurnRecorded, TurnDelta)):
            self.waiting.set()
            await self.gate.wait()
        return await super().append(session_id, session_seq, body)


@contextlib.asynccontextmanager
async def rig(backend: Backend | None = None, *, log: MemoryLog | None = None, config: GatewayConfig | None = None, **backend_kw: Any):
    """Yield (gateway, engine, log) with the gateway listening on 127.0.0.1."""
    log = log if log is not None else MemoryLog()
    engine = await SessionEngine.open(log)
    backend = backend if backend is not None else SpyBackend(TorchBackend(default_gateway_model(backend_kw.pop("seed", 0)), **backend_kw))
    gw = Gateway(engine, backend, config=config)
    await gw.start("127.0.0.1", 0)
    try:
        yield gw, engine, log
    finally:
        while CLIENTS:
            await CLIENTS.pop().close()
        await gw.stop()
        await engine.close()
        await backend.close()


async def open_running(engine: Any, sid: str, group: str | None = None, size: int = 1, index: int | None = None) -> Any:
    """Open and start a session the way a rollout does before launching its agent
    (in a group of its own unless ``group`` is given)."""
    group = sid if group is None else group
    h = await engine.open_session(sid, group_id=group, group_size=size, sample_index=index)
    await h.start(harness="test")
    return h


def turns_of(log: MemoryLog, sid: str | None = None) -> list[TurnRecorded]:
    """The full turns in the log (of one session, or all), deltas expanded."""
    return [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded) and (sid is None or e.session_id == sid)]


def undelivered_of(log: MemoryLog) -> list[TurnUndelivered]:
    """The turn_undelivered bodies in the log."""
    return [e.body for e in log.read() if isinstance(e.body, TurnUndelivered)]


def hf_dir(root: Any, version: int) -> Any:
    """A Hugging Face directory a fake server can "load" as ``version``: config.json, a
    safetensors file and version.txt (what the fake vLLM reads on reload)."""
    d = root / f"policy-v{version:05d}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w%d" % version)
    (d / "version.txt").write_text(str(version))
    return d


async def chat_through_reloads(gw: Gateway, engine: Any, reload: Callable[[int], Any], *, sessions: int = 4,
                               turns: int = 3, reloads: int = 3, max_tokens: int = 60) -> None:
    """``sessions`` sessions each play ``turns`` chat turns of ``max_tokens`` through the
    gateway while ``await reload(v)`` runs for v = 1..``reloads``, 30 ms apart, from the
    moment the first turn was sent."""
    import aiohttp

    started = asyncio.Event()

    async def agent(i: int) -> None:
        sid = f"s{i}"
        await open_running(engine, sid)
        async with aiohttp.ClientSession() as http:
            for t in range(turns):
                body = {"messages": [{"role": "user", "content": f"turn {t}"}], "max_tokens": max_tokens}
                started.set()
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=bearer(gw, sid)) as r:
                    assert r.status == 200, await r.text()

    async def learner() -> None:
        await started.wait()
        for v in range(1, reloads + 1):
            await asyncio.sleep(0.03)
            await reload(v)

    await asyncio.gather(learner(), *(agent(i) for i in range(sessions)))


def check_versions_made_the_tokens(turns: list[TurnRecorded], *, n_tokens: int = 60) -> None:
    """Against a fake server whose every token is the digit of the weights version that made
    it: each turn has ``n_tokens`` tokens, each span's tokens carry its version's digit, at
    least one turn spans versions, and every such turn says it was resubmitted."""
    from agentlog.events.schema.turn import turn_version_spans

    interrupted = [t for t in turns if len(turn_version_spans(t)) > 1]
    assert interrupted, "no generation was in flight at a reload"
    for turn in turns:
        spans = turn_version_spans(turn)
        made_by = [int(chr(tok)) for tok in turn.output_tokens]
        want: list[int] = []
        for k, (first, version) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(made_by)
            want += [version % 10] * (end - first)
        assert made_by == want, (spans, made_by)
        assert len(made_by) == n_tokens and turn.finish_reason == "length"
    assert all(t.sampling["weight_update"] == "resubmit" for t in interrupted)


class FakeServer:
    """A fake inference server holding a weights version; ``kind`` sglang or vllm."""

    def __init__(self, kind: str, served_dir=None) -> None:
        self.kind = kind
        self.version = 0
        self.inflight = 0
        self.violations: list[str] = []
        self.reloads: list[dict] = []
        self.calls: list[str] = []
        self.served_dir = served_dir
        self.fail_next_reload = False
        self.fail_next_reset = False
        self.hang_after_apply = 0.0  # sglang: apply the weights, then answer only after this many seconds
        self.runner: web.AppRunner | None = None
        self.url = ""
        #: The routing-key header of each generation it answered, in order.
        self.keys: list[str | None] = []
        self.healthy = True
        #: When set, the next generation is answered with this HTTP status (and nothing generated).
        self.fail_next_generate = 0
        #: When set, generations are taken and never answered (a hung server: its connections stay open).
        self.hang_generations = False
        #: Generations it took and holds unanswered while hung (released by :meth:`stop`).
        self.hung = 0
        self._unhang = asyncio.Event()

    async def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/update_weights_from_disk", self.update_from_disk)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/health", self.health)
        self.runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        self._unhang.set()  # a hung generation's handler ends, or the shutdown would wait a minute for it
        await self.runner.cleanup()

    async def _generate_ids(self) -> list[int]:
        self.inflight += 1
        try:
            v = self.version
            await asyncio.sleep(random.uniform(0.0, 0.01))
            if self.version != v:
                self.violations.append(f"weights changed from {v} to {self.version} during a generation")
            return [ord(str(v % 10)), TEMPLATE.EOS]
        finally:
            self.inflight -= 1

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503, text="" if self.healthy else "unhealthy")

    async def generate(self, request: web.Request) -> web.Response:
        if self.fail_next_generate:
            status, self.fail_next_generate = self.fail_next_generate, 0
            return web.json_response({"error": {"message": f"failing on purpose with {status}"}}, status=status)
        self.keys.append(request.headers.get(ROUTING_HEADER_DEFAULT))
        body = await request.json()
        assert isinstance(body["input_ids"], list) and body["return_logprob"] is True
        if self.hang_generations:
            self.hung += 1
            await self._unhang.wait()
            return web.json_response({"error": {"message": "stopped while hung"}}, status=503)
        ids = await self._generate_ids()
        return web.json_response({"text": "", "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids],
                                                            "finish_reason": {"type": "stop"}}})

    async def completions(self, request: web.Request) -> web.Response:
        self.keys.append(request.headers.get(ROUTING_HEADER_DEFAULT))
        body = await request.json()
        assert isinstance(body["prompt"], list)
        ids = await self._generate_ids()
        return web.json_response({"choices": [{"token_ids": ids, "finish_reason": "stop",
                                               "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": []}}]})

    def _reloading(self, what: str) -> None:
        self.calls.append(what)
        if self.inflight:
            self.violations.append(f"{what} while {self.inflight} generation(s) in flight")

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._reloading("update_weights_from_disk")
        self.reloads.append(body)
        if self.fail_next_reload:
            self.fail_next_reload = False
            return web.json_response({"success": False, "message": "cannot load", "num_paused_requests": 0}, status=400)
        expected = {"model_path", "weight_version", "flush_cache", "abort_all_requests"}
        if set(body) != expected or body["flush_cache"] is not True or not isinstance(body["weight_version"], str):
            return web.json_response({"success": False, "message": f"bad body {body}"}, status=400)
        await asyncio.sleep(0.01)
        self.version = int(body["weight_version"])
        if self.hang_after_apply:
            await asyncio.sleep(self.hang_after_apply)
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._reloading("collective_rpc")
        self.reloads.append(body)
        if body != {"method": "reload_weights"}:
            return web.json_response({"detail": f"bad body {body}"}, status=400)
        await asyncio.sleep(0.01)
        self.version = int((self.served_dir / "version.txt").read_text())
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._reloading("reset_prefix_cache")
        if self.fail_next_reset:
            self.fail_next_reset = False
            return web.json_response({"detail": "reset failed"}, status=500)
        return web.Response(status=200)
