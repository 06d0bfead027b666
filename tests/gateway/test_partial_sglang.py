"""Partial rollouts against an SGLang server (a local fake on loopback that
checks the order and shape of the control calls): a reload pauses the
server with ``mode="abort"``, updates its weights and lets it go on; the
gated backend resubmits each aborted generation with its partial output, and
the recorded turn says which version made which tokens.

The fake answers every token with the digit of the weights version it holds
while generating it, so each recorded token's version can be checked against
the turn's version spans."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from aiohttp_helpers import serve_app

from agentlog.events.errors import ConfigError
from agentlog.gateway import SamplingParams, SGLangBackend
from agentlog.gateway.weight_sync import GatedBackend, SGLangWeightSync, WeightSyncError
from agentlog.loop import LoopConfig
from gateway_helpers import HangingBackend, chat_through_reloads, check_versions_made_the_tokens, hf_dir, rig, run, turns_of

TOKEN_S = 0.002


class PausingSGLang:
    """A fake SGLang: ``/generate`` makes one token every TOKEN_S; the control
    routes must come as pause(abort) -> update -> continue, and an update
    while generations run or the server is not paused is a violation."""

    def __init__(self) -> None:
        self.version = 0
        self.running = asyncio.Event()
        self.running.set()
        self.aborts: dict[int, asyncio.Event] = {}
        self.calls: list[str] = []
        self.violations: list[str] = []
        self.refuse_next_update = False
        self.aborted = 0

    async def start(self) -> "PausingSGLang":
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_post("/continue_generation", self.go_on)
        self.runner, self.url = await serve_app(app)
        return self

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert isinstance(body["input_ids"], list) and body["return_logprob"] is True
        await self.running.wait()  # SGLang holds a request that arrives while paused
        abort = self.aborts[id(body)] = asyncio.Event()
        version, out, finish = self.version, [], {"type": "length", "length": body["sampling_params"]["max_new_tokens"]}
        try:
            for _ in range(body["sampling_params"]["max_new_tokens"]):
                if abort.is_set():
                    finish = {"type": "abort", "message": "paused"}
                    self.aborted += 1
                    break
                await asyncio.sleep(TOKEN_S)
                if self.version != version:
                    self.violations.append(f"weights changed from {version} to {self.version} mid-generation")
                out.append(ord(str(version % 10)))
        finally:
            del self.aborts[id(body)]
        return web.json_response({"text": "", "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in out], "finish_reason": finish,
            "weight_version": str(version)}})

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append("pause")
        if body != {"mode": "abort"}:
            self.violations.append(f"pause body {body}")
        self.running.clear()
        for ev in self.aborts.values():
            ev.set()
        while self.aborts:  # the aborted requests answer before the pause does
            await asyncio.sleep(0.001)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append("update")
        if self.running.is_set() or self.aborts:
            self.violations.append("update while not paused or with generations running")
        if self.refuse_next_update:
            self.refuse_next_update = False
            return web.json_response({"success": False, "message": "cannot load"}, status=400)
        self.version = int(body["weight_version"])
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def go_on(self, request: web.Request) -> web.Response:
        self.calls.append("continue")
        self.running.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def _sessions_through_reloads(tmp_path, sessions: int = 4, reloads: int = 3):
    server = await PausingSGLang().start()
    try:
        backend = GatedBackend(SGLangBackend(server.url), weight_update="resubmit")
        sync = SGLangWeightSync(server.url, gate=backend.gate)
        async with rig(backend) as (gw, engine, log):
            await chat_through_reloads(gw, engine, lambda v: sync.reload(hf_dir(tmp_path / "ckpt", v), v),
                                       sessions=sessions, reloads=reloads)
            await sync.close()
            return server, turns_of(log)
    finally:
        await server.runner.cleanup()


def test_reloads_abort_and_resubmit_and_every_token_records_the_version_that_made_it(tmp_path) -> None:
    server, turns = run(_sessions_through_reloads(tmp_path))
    assert not server.violations, server.violations
    assert server.calls == ["pause", "update", "continue"] * 3
    assert server.aborted > 0 and len(turns) == 12
    check_versions_made_the_tokens(turns)


def test_a_refused_update_lets_the_server_go_on_at_the_old_version(tmp_path) -> None:
    async def body():
        server = await PausingSGLang().start()
        try:
            backend = GatedBackend(SGLangBackend(server.url), weight_update="resubmit")
            sync = SGLangWeightSync(server.url, gate=backend.gate)
            server.refuse_next_update = True
            with pytest.raises(WeightSyncError, match="update_weights_from_disk"):
                await sync.reload(hf_dir(tmp_path / "ckpt", 1), 1)
            after = await backend.generate([1, 2], SamplingParams(max_new_tokens=3))
            await sync.close()
            await backend.close()
            return server, backend, after
        finally:
            await server.runner.cleanup()

    server, backend, after = run(body())
    assert server.calls == ["pause", "update", "continue"] and server.running.is_set()
    assert backend.gate.fatal_reason is None and backend.gate.version == 0
    assert after.policy_version == 0 and after.output_ids == [ord("0")] * 3


def test_partial_modes_a_server_cannot_record_exactly_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="weight_update: expected 'drain' or 'resubmit'"):
        GatedBackend(SGLangBackend("http://127.0.0.1:9"), weight_update="continue")
    with pytest.raises(ValueError, match="needs a backend that returns aborted partial outputs"):
        GatedBackend(HangingBackend(), weight_update="resubmit")
    with pytest.raises(ConfigError, match=r"weight_update 'continue' with \[inference\] backend 'sglang'"):
        LoopConfig(hf_model="tiny-llama", inference={"backend": "sglang", "url": "http://127.0.0.1:9"},
                   rollout={"weight_update": "continue"})



def test_a_fleet_in_resubmit_mode_takes_every_version_to_every_server_mid_generation(tmp_path) -> None:
    """Two servers behind a fleet, each gated in resubmit mode: every reload reaches both with
    pause, update, continue, and every token of every turn records the version that made it."""
    from agentlog.events.schema.turn import turn_server
    from agentlog.gateway.fleet import Fleet, FleetMember

    async def main():
        servers = [await PausingSGLang().start() for _ in range(2)]
        try:
            members = []
            for i, server in enumerate(servers):
                backend = GatedBackend(SGLangBackend(server.url), weight_update="resubmit")
                members.append(FleetMember(f"s{i}", backend, SGLangWeightSync(server.url, gate=backend.gate)))
            fleet = Fleet(members)
            async with rig(fleet) as (gw, engine, log):
                await chat_through_reloads(gw, engine, lambda v: fleet.reload_weights(hf_dir(tmp_path / "ckpt", v), v),
                                           sessions=6, reloads=3)
                return servers, fleet, turns_of(log)
        finally:
            for server in servers:
                await server.runner.cleanup()

    servers, fleet, turns = run(main())
    for server in servers:
        assert not server.violations, server.violations
        assert server.calls == ["pause", "update", "continue"] * 3
    assert fleet.version == 3 and all(m.out_reason is None for m in fleet.members)
    assert len(turns) == 18 and {turn_server(t)[0] for t in turns} == {"s0", "s1"}
    check_versions_made_the_tokens(turns)
