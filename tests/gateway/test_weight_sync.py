"""Weight sync against local fake SGLang and vLLM servers (real HTTP on loopback).

Each fake server checks the shape of the reload requests it gets, and
answers every generation with the version of the weights it holds right
then (the output token is that version's digit). A reload that arrives
while a generation is in flight on the server is a violation: the gate must
have drained them. So comparing each recorded turn's ``policy_version`` with
the digit it carries checks the ordering guarantee end to end: no turn
generated after a reload is recorded with the old version.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.gateway import ByteChatTemplate, OpenAICompletionsBackend, SGLangBackend
from agentlog.gateway.weight_sync import GatedBackend, ReloadGate, SGLangWeightSync, VLLMWeightSync, WeightSyncError
from gateway_helpers import open_running, rig, run, turns_of

T = ByteChatTemplate()


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
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/update_weights_from_disk", self.update_from_disk)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _generate_ids(self) -> list[int]:
        self.inflight += 1
        try:
            v = self.version
            await asyncio.sleep(random.uniform(0.0, 0.01))
            if self.version != v:
                self.violations.append(f"weights changed from {v} to {self.version} during a generation")
            return [ord(str(v % 10)), T.EOS]
        finally:
            self.inflight -= 1

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert isinstance(body["input_ids"], list) and body["return_logprob"] is True
        ids = await self._generate_ids()
        return web.json_response({"text": "", "meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids],
                                                            "finish_reason": {"type": "stop"}}})

    async def completions(self, request: web.Request) -> web.Response:
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
        return web.Response(status=200)


def hf_dir(root, version: int):
    d = root / f"policy-v{version:05d}"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"w%d" % version)
    (d / "version.txt").write_text(str(version))
    return d


async def _loop_with_reloads(kind: str, tmp_path, sessions: int = 6, turns: int = 6, reloads: int = 3):
    served = tmp_path / "served"
    server = await FakeServer(kind, served).start()
    try:
        inner = SGLangBackend(server.url) if kind == "sglang" else OpenAICompletionsBackend(server.url, "m")
        backend = GatedBackend(inner)
        sync = (SGLangWeightSync(server.url, gate=backend.gate) if kind == "sglang"
                else VLLMWeightSync(server.url, served, gate=backend.gate))
        if kind == "vllm":
            served.mkdir()
            (served / "version.txt").write_text("0")
        async with rig(backend) as (gw, engine, log):
            done = asyncio.Event()

            async def agent(i: int) -> None:
                import aiohttp

                sid = f"s{i}"
                await open_running(engine, sid)
                headers = {"Authorization": f"Bearer {gw.session_key(sid)}"}
                t = 0
                async with aiohttp.ClientSession() as http:
                    # At least `turns` turns, and at least one begun after the last reload.
                    while True:
                        after_last = done.is_set()
                        body = {"messages": [{"role": "user", "content": f"turn {t}"}], "max_tokens": 4}
                        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                            assert r.status == 200, await r.text()
                        t += 1
                        if t >= turns and after_last:
                            return
                        await asyncio.sleep(random.uniform(0, 0.01))

            async def learner() -> None:
                for v in range(1, reloads + 1):
                    await asyncio.sleep(0.02)
                    await sync.reload(hf_dir(tmp_path / "ckpt", v), v)
                done.set()

            await asyncio.gather(learner(), *(agent(i) for i in range(sessions)))
            await sync.close()
            recorded = turns_of(log)
        return server, recorded
    finally:
        await server.stop()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_no_turn_generated_after_a_reload_is_recorded_with_the_old_version(kind, tmp_path):
    server, recorded = run(_loop_with_reloads(kind, tmp_path))
    assert not server.violations, server.violations
    assert len(recorded) >= 36
    for turn in recorded:
        generated_by = int(chr(turn.output_tokens[0]))
        assert turn.policy_version == generated_by, (turn.policy_version, generated_by)
    assert {t.policy_version for t in recorded} >= {0, 3}
    if kind == "sglang":
        assert [r["weight_version"] for r in server.reloads] == ["1", "2", "3"]
        assert all(r["model_path"].endswith(f"policy-v0000{i + 1}") for i, r in enumerate(server.reloads))
    else:
        assert server.calls == ["collective_rpc", "reset_prefix_cache"] * 3
        assert (tmp_path / "served" / "model.safetensors").read_bytes() == b"w3"
        assert not list((tmp_path / "served").glob(".*staging"))


def test_a_failed_reload_raises_naming_the_server_and_keeps_the_old_version(tmp_path):
    async def body():
        server = await FakeServer("sglang").start()
        try:
            backend = GatedBackend(SGLangBackend(server.url))
            sync = SGLangWeightSync(server.url, gate=backend.gate)
            server.fail_next_reload = True
            with pytest.raises(WeightSyncError, match=r"sglang weight sync: POST .*/update_weights_from_disk answered HTTP 400"):
                await sync.reload(hf_dir(tmp_path, 1), 1)
            assert backend.policy_version == 0
            with pytest.raises(WeightSyncError, match="expected a Hugging Face model directory"):
                await sync.reload(tmp_path / "nowhere", 1)
            await sync.reload(hf_dir(tmp_path, 2), 2)
            assert backend.policy_version == 2 and server.version == 2
            await sync.close()
            await backend.close()
        finally:
            await server.stop()

    run(body())


@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["gen", "reload"]), st.integers(0, 3)), min_size=1, max_size=25))
def test_reload_gate_orders_every_generation_against_every_reload(plan):
    """Random interleavings of generations and reloads: each generation
    records the version that was current for its whole run, and versions
    only grow."""

    async def body():
        gate = ReloadGate(0)
        weights = {"v": 0}
        seen: list[tuple[int, int]] = []
        next_version = iter(range(1, 100))

        async def generation(delay: int) -> None:
            v = await gate.admit()
            try:
                before = weights["v"]
                for _ in range(delay):
                    await asyncio.sleep(0)
                seen.append((v, before))
                assert weights["v"] == before, "weights changed under a running generation"
            finally:
                await gate.release()

        async def reload(delay: int) -> None:
            new = next(next_version)

            async def swap() -> None:
                for _ in range(delay):
                    await asyncio.sleep(0)
                weights["v"] = new

            await gate.reload(swap, new)

        tasks = []
        for kind, delay in plan:
            tasks.append(asyncio.ensure_future(generation(delay) if kind == "gen" else reload(delay)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert all(v == w for v, w in seen), seen
        assert gate.inflight == 0

    asyncio.run(body())
