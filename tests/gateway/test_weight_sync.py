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

from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.gateway import ByteChatTemplate, OpenAICompletionsBackend, SGLangBackend
from agentlog.gateway.weight_sync import GatedBackend, ReloadGate, SGLangWeightSync, VLLMWeightSync, WeightSyncError
from agentlog.gateway.backends import SamplingParams
from gateway_helpers import FakeServer, HangingBackend, hf_dir, open_running, rig, run, turns_of

T = ByteChatTemplate()


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
            # The first reload waits for a turn answered by version 0, so that
            # version 0 is in the log however slowly a loaded machine runs the agents.
            answered = asyncio.Event()

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
                        answered.set()
                        t += 1
                        if t >= turns and after_last:
                            return
                        await asyncio.sleep(random.uniform(0, 0.01))

            async def learner() -> None:
                await answered.wait()
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
            assert backend.fatal_reason is None  # an explicit refusal: SGLang rolled back, the old version answers
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
                gate.release()

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


async def _refused_turn(backend) -> tuple[int, str]:
    """Status and body of one chat turn through a gateway over ``backend``."""
    import aiohttp

    async with rig(backend) as (gw, engine, log):
        await open_running(engine, "s0")
        headers = {"Authorization": f"Bearer {gw.session_key('s0')}"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
                return r.status, await r.text()


def test_vllm_cache_reset_failure_keeps_the_new_version_and_makes_the_gateway_refuse_turns(tmp_path):
    async def body():
        served = tmp_path / "served"
        server = await FakeServer("vllm", served).start()
        try:
            backend = GatedBackend(OpenAICompletionsBackend(server.url, "m"))
            sync = VLLMWeightSync(server.url, served, gate=backend.gate)
            server.fail_next_reset = True
            with pytest.raises(WeightSyncError, match="reset_prefix_cache answered HTTP 500"):
                await sync.reload(hf_dir(tmp_path / "ckpt", 1), 1)
            # The reload RPC succeeded: the server runs version 1, and the gate says so.
            assert server.version == 1 and backend.policy_version == 1
            reason = backend.fatal_reason
            assert reason is not None and "vllm" in reason and "policy version 1" in reason
            assert "POST /reset_prefix_cache" in reason
            status, text = await _refused_turn(backend)
            assert status == 503 and "reset_prefix_cache" in text, (status, text)
            await sync.reload(hf_dir(tmp_path / "ckpt", 2), 2)  # a later reload succeeds: turns again
            assert backend.fatal_reason is None and backend.policy_version == 2
            status, text = await _refused_turn(backend)
            assert status == 200, text
            await sync.close()
        finally:
            await server.stop()

    run(body())


def test_vllm_failure_after_files_were_replaced_is_fatal(tmp_path):
    async def body():
        served = tmp_path / "served"
        server = await FakeServer("vllm", served).start()
        await server.stop()  # nothing listens: the RPC cannot even connect
        backend = GatedBackend(OpenAICompletionsBackend(server.url, "m"))
        sync = VLLMWeightSync(server.url, served, gate=backend.gate)
        with pytest.raises(WeightSyncError, match="collective_rpc failed"):
            await sync.reload(hf_dir(tmp_path / "ckpt", 1), 1)
        # served_dir already holds version 1's files: whatever the server loads next is not version 0.
        assert (served / "model.safetensors").read_bytes() == b"w1"
        assert backend.policy_version == 0
        reason = backend.fatal_reason
        assert reason is not None and "policy version 1" in reason and "vllm" in reason
        # Reloading the served directory in place sends nothing with effects
        # before the failed connection: not fatal on its own.
        backend2 = GatedBackend(OpenAICompletionsBackend(server.url, "m"))
        sync2 = VLLMWeightSync(server.url, served, gate=backend2.gate)
        with pytest.raises(WeightSyncError, match="collective_rpc failed: ClientConnectorError"):
            await sync2.reload(served, 1)
        assert backend2.fatal_reason is None and backend2.policy_version == 0
        await sync.close()
        await sync2.close()

    run(body())


def test_sglang_timeout_after_the_server_applied_the_weights_is_fatal(tmp_path):
    async def body():
        server = await FakeServer("sglang").start()
        try:
            backend = GatedBackend(SGLangBackend(server.url))
            sync = SGLangWeightSync(server.url, gate=backend.gate, timeout_s=0.3)
            server.hang_after_apply = 2.0
            with pytest.raises(WeightSyncError, match="update_weights_from_disk failed"):
                await sync.reload(hf_dir(tmp_path, 1), 1)
            assert server.version == 1 and backend.policy_version == 0
            reason = backend.fatal_reason
            assert reason is not None
            assert "sglang" in reason and "policy version 1" in reason and "POST /update_weights_from_disk" in reason
            server.hang_after_apply = 0.0
            await sync.reload(hf_dir(tmp_path, 2), 2)
            assert backend.fatal_reason is None and backend.policy_version == 2
            await sync.close()
        finally:
            await server.stop()

    run(body())


def test_release_is_synchronous_and_a_doubly_cancelled_generation_does_not_leak():
    async def body():
        inner = HangingBackend()
        backend = GatedBackend(inner)
        gate = backend.gate
        await gate.admit()
        assert gate.release() is None and gate.inflight == 0  # not a coroutine: nothing to be cancelled in
        with pytest.raises(RuntimeError, match="release without admit"):
            gate.release()
        task = asyncio.ensure_future(backend.generate([1], SamplingParams(max_new_tokens=2)))
        await inner.started.wait()
        assert gate.inflight == 1
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.inflight == 0
        assert await gate.reload(lambda: asyncio.sleep(0, "ok"), 1, drain_timeout_s=1.0) == "ok"

    run(body())


def test_a_drain_that_does_not_finish_fails_naming_the_generations_in_flight():
    async def body():
        gate = ReloadGate(0, drain_timeout_s=0.05)
        await gate.admit()
        await gate.admit()
        ran = []
        with pytest.raises(WeightSyncError, match=r"policy version 1: 2 generation\(s\) still in flight after waiting 0.05 s"):
            await gate.reload(lambda: asyncio.sleep(0, ran.append(1)), 1)
        assert not ran and gate.version == 0
        assert await gate.admit() == 0  # the gate opened again
        for _ in range(3):
            gate.release()
        await gate.reload(lambda: asyncio.sleep(0), 1)
        assert gate.version == 1

    run(body())


def test_a_generation_waiting_at_the_gate_is_refused_when_the_reload_leaves_the_weights_unknown():
    """A reload that fails after the server may have changed its weights reopens the gate at the
    old version with a fatal reason: a generation that waited meanwhile must not run on weights
    no version names (a fleet then sends it to another server)."""
    from agentlog.gateway.backends import BackendError
    from gateway_helpers import ScriptedBackend

    async def main():
        inner = ScriptedBackend(lambda text: "ok")
        backend = GatedBackend(inner)
        gate = backend.gate

        async def failing() -> None:
            await asyncio.sleep(0.05)
            gate.fail("sglang: update to version 1 sent, no answer: the served weights are unknown")
            raise WeightSyncError("no answer")

        reload = asyncio.create_task(gate.reload(failing, 1))
        await asyncio.sleep(0.01)
        waiting = asyncio.create_task(backend.generate([1, 2], SamplingParams(max_new_tokens=4)))
        with pytest.raises(WeightSyncError):
            await reload
        with pytest.raises(BackendError, match="served weights are unknown"):
            await waiting
        assert gate.inflight == 0 and inner.prompts == []  # released, and nothing reached the server

    run(main())
