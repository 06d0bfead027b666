"""A user's own router in front of SGLang servers keeps each session on one server.

The real router: ``sglang-router`` (the SGLang Model Gateway, a Rust binary in a wheel, in the ``dev``
extra), run as a subprocess with its ``consistent_hashing`` policy in front of three fake SGLang
servers (``ScriptedSGLang``: real aiohttp servers that record each request's headers). agentlog's own
``SGLangBackend`` talks to the router and sends each call's ``ROUTING_KEY`` in the header the router
hashes, ``X-SMG-Routing-Key``. The router forwards that header to the server it picked, so each
server's recorded requests say which keys reached it.

sglang-router 0.3.x lists ``consistent_hashing`` in its Python API but not among its CLI's
``--policy`` choices, so the router starts through its own launcher with the policy set after
parsing (:data:`LAUNCH`, the command the README gives users).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest
from gateway_helpers import TEMPLATE, run
from nats_cluster import free_ports
from test_backends import ScriptedSGLang, header

from agentlog.gateway.backends import ROUTING_HEADER_DEFAULT
from agentlog.gateway import BackendError, SGLangBackend
from agentlog.gateway.backends import ROUTING_KEY, SamplingParams

pytestmark = [
    pytest.mark.required,  # sglang-router is in the dev extra: CI must run this
    pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                       reason="sglang-router is not installed (pip install -e '.[dev]')"),
]

#: The header sglang-router's consistent_hashing policy hashes (x-smg-routing-key; without it the
#: policy falls back to Authorization / X-Forwarded-For / Cookie, then to a random worker).
ROUTER_HEADER = "X-SMG-Routing-Key"
assert ROUTER_HEADER == ROUTING_HEADER_DEFAULT  # agentlog sends the key where the router looks, by default
#: sglang-router's own launcher with the consistent_hashing policy; the arguments are its CLI's.
LAUNCH = ("import sys; from sglang_router.launch_router import launch_router, parse_router_args; "
          "args = parse_router_args(sys.argv[1:]); args.policy = 'consistent_hashing'; launch_router(args)")
START_TIMEOUT_S = 30.0
SERVERS = 3
KEYS = [f"session-{i}" for i in range(30)]


class Router:
    """The running router subprocess: its URL, its log, and its worker admin API."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    async def workers(self) -> list[dict]:
        """The router's registry (``GET /workers``): url, id, is_healthy of each worker."""
        async with aiohttp.ClientSession() as http, http.get(self.url + "/workers") as resp:
            assert resp.status == 200, f"GET {self.url}/workers answered {resp.status}: {await resp.text()}"
            return (await resp.json())["workers"]

    async def wait_for(self, what: str, ready, timeout_s: float = START_TIMEOUT_S) -> list[dict]:
        """Poll the registry until ``ready(workers)``; fail naming ``what`` with the router's log otherwise."""
        deadline = time.monotonic() + timeout_s
        workers: list[dict] = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"sglang-router exited with status {self.proc.returncode} waiting for {what}:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientConnectionError):
                workers = await self.workers()
                if ready(workers):
                    return workers
            await asyncio.sleep(0.05)
        pytest.fail(f"sglang-router at {self.url}: no {what} within {timeout_s:g} s (registry: {workers}):\n{self.log_tail()}")

    async def remove(self, server_url: str) -> None:
        """Take a worker out at runtime (``DELETE /workers/{id}``, queued by the router) and wait until it is gone."""
        (worker,) = [w for w in await self.workers() if w["url"] == server_url]
        async with aiohttp.ClientSession() as http, http.delete(f"{self.url}/workers/{worker['id']}") as resp:
            assert resp.status in (200, 202), f"DELETE {self.url}/workers/{worker['id']} answered {resp.status}: {await resp.text()}"
        await self.wait_for(f"removal of {server_url}", lambda ws: server_url not in [w["url"] for w in ws], 10.0)

    async def add(self, server_url: str) -> None:
        """Add a worker at runtime (``POST /workers``, queued by the router) and wait until it is healthy."""
        async with aiohttp.ClientSession() as http, http.post(self.url + "/workers", json={"url": server_url}) as resp:
            assert resp.status in (200, 202), f"POST {self.url}/workers answered {resp.status}: {await resp.text()}"
        await self.wait_for(f"{server_url} added", lambda ws: [w["is_healthy"] for w in ws if w["url"] == server_url] == [True], 10.0)


@contextlib.asynccontextmanager
async def sglang_router(server_urls: list[str], log: Path, *extra: str):
    """sglang-router with consistent hashing over ``server_urls`` on a free loopback port, once it
    has every server registered and healthy; killed on exit."""
    port, metrics_port = free_ports(2)
    cmd = [sys.executable, "-c", LAUNCH, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *server_urls,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    router = Router(proc, f"http://127.0.0.1:{port}", log)
    try:
        await router.wait_for(f"{len(server_urls)} healthy workers",
                              lambda ws: sorted(w["url"] for w in ws if w["is_healthy"]) == sorted(server_urls))
        assert "policy: ConsistentHashing" in log.read_text(errors="replace"), router.log_tail()
        yield router
    finally:
        proc.kill()  # nothing to flush; a SIGTERM waits seconds for its graceful shutdown
        proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def servers_behind_a_router(tmp_path: Path, *router_args: str):
    """(servers, router, backend): SERVERS fake SGLang servers, the router over them, and agentlog's
    SGLangBackend at the router, sending routing keys in the header the router hashes."""
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(ScriptedSGLang().serve()) for _ in range(SERVERS)]
        router = await stack.enter_async_context(sglang_router([s.url for s in servers], tmp_path / "router.log", *router_args))
        backend = SGLangBackend(router.url, timeout_s=30)  # the default header is the one the router hashes
        stack.push_async_callback(backend.close)
        yield servers, router, backend


PARAMS = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=5, stop_ids=(TEMPLATE.EOS,))


async def generate_as(backend: SGLangBackend, key: str, prompt: list[int]):
    """One generation in its own task's context, under routing key ``key``."""
    async def call():
        ROUTING_KEY.set(key)
        return await backend.generate(prompt, PARAMS)

    return await asyncio.ensure_future(call())


async def route_all(backend: SGLangBackend, servers: list[ScriptedSGLang], keys: list[str], rounds: int) -> dict[str, set[int]]:
    """Send ``rounds`` generations per key, all at once, each with a prompt of its own (so nothing but
    the key can route two of them alike); returns the servers (indices) each key's requests reached."""
    seen = [len(s.requests) for s in servers]
    await asyncio.gather(*(generate_as(backend, key, [k, r, 7]) for r in range(rounds) for k, key in enumerate(keys)))
    landed: dict[str, set[int]] = defaultdict(set)
    for i, srv in enumerate(servers):
        for path, headers, _ in srv.requests[seen[i]:]:
            assert path == "/generate"
            landed[header(headers, ROUTER_HEADER)].add(i)
    assert sum(len(s.requests) - n for s, n in zip(servers, seen)) == len(keys) * rounds
    return landed


def check_sticky(landed: dict[str, set[int]], keys: list[str]) -> dict[str, int]:
    """Each key's requests all reached one server: key -> that server."""
    assert sorted(landed) == sorted(keys), f"keys that reached no server, or unknown ones: {sorted(landed)}"
    split = {k: sorted(s) for k, s in landed.items() if len(s) != 1}
    assert not split, f"keys whose requests reached more than one server: {split}"
    return {k: next(iter(s)) for k, s in landed.items()}


def test_the_router_keeps_each_sessions_key_on_one_server_and_spreads_keys(tmp_path):
    """30 keys x 3 generations through agentlog's SGLangBackend and the real router: every key's
    generations reach one server, the keys spread over at least 2 of the 3, and the router hands each
    server agentlog's /generate body as sent (rid, token ids, every sampling parameter)."""
    async def body():
        async with servers_behind_a_router(tmp_path) as (servers, router, backend):
            placed = check_sticky(await route_all(backend, servers, KEYS, rounds=3), KEYS)
            assert len(set(placed.values())) >= 2, f"30 keys all on one server: {placed}"
            gen = await generate_as(backend, "session-0", [1, 2, 3])  # the answer comes back whole
            assert gen.output_ids == TEMPLATE.encode_text("Hi!") + [TEMPLATE.EOS] and gen.finish_reason == "stop"
            assert gen.log_probs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
            _, _, sent = servers[placed["session-0"]].requests[-1]
            expected = backend.request_body([1, 2, 3], PARAMS, sent["rid"])
            assert sent["input_ids"] == expected["input_ids"] and sent["return_logprob"] is True
            assert sent["sampling_params"] == expected["sampling_params"]

    run(body(), timeout=60)


def test_keys_move_off_a_worker_removed_at_runtime_and_stick_again(tmp_path):
    """The router's admin API takes a server out: its keys, and only its, move to the others and each
    sticks to its new server; the removed server gets nothing more. Added back, it gets its keys back."""
    async def body():
        async with servers_behind_a_router(tmp_path) as (servers, router, backend):
            before = check_sticky(await route_all(backend, servers, KEYS, rounds=2), KEYS)
            gone = max(range(SERVERS), key=lambda i: sum(v == i for v in before.values()))  # the busiest
            n_gone = len(servers[gone].requests)
            await router.remove(servers[gone].url)
            after = check_sticky(await route_all(backend, servers, KEYS, rounds=3), KEYS)
            assert gone not in after.values() and len(servers[gone].requests) == n_gone
            assert [k for k in KEYS if after[k] != before[k]] == [k for k in KEYS if before[k] == gone]
            await router.add(servers[gone].url)
            assert check_sticky(await route_all(backend, servers, KEYS, rounds=2), KEYS) == before

    run(body(), timeout=60)


def test_keys_move_off_a_killed_server_once_the_router_marks_it_down(tmp_path):
    """A server dies: once the router's health check marks it down (checked every second here), its
    keys move to the others and stick there; no request reaches the dead one."""
    async def body():
        async with servers_behind_a_router(tmp_path, "--health-check-interval-secs", "1",
                                           "--health-failure-threshold", "1") as (servers, router, backend):
            before = check_sticky(await route_all(backend, servers, KEYS, rounds=1), KEYS)
            dead = before["session-0"]
            await servers[dead].runner.cleanup()
            await router.wait_for(f"server {dead} marked down",
                                  lambda ws: [w["is_healthy"] for w in ws if w["url"] == servers[dead].url] == [False], 10.0)
            n_dead = len(servers[dead].requests)
            try:
                after = check_sticky(await route_all(backend, servers, KEYS, rounds=2), KEYS)
            except BackendError as exc:
                pytest.fail(f"a generation failed after the router marked server {dead} down: {exc}\n{router.log_tail()}")
            assert dead not in after.values() and len(servers[dead].requests) == n_dead
            assert all(after[k] == before[k] for k in KEYS if before[k] != dead), "keys on live servers moved"

    run(body(), timeout=60)
