"""The fleet benchmark's pieces: the simulated server's bounded LRU prefix cache and health route (in
process, over real HTTP), and the whole benchmark at a tiny size (servers in their own processes, a
recorded run replayed through a gateway on a fleet, one server killed)."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from agentlog.tools.bench import bench_fleet
from agentlog.tools.bench.simulated_server import BLOCK, SimulatedSGLang


async def _generate(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict:
    """One generation of one token; the server's counters after it."""
    body = {"rid": "r", "input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    async with http.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
    async with http.get(url + "/stats") as r:
        return await r.json()


def _prompt(tag: int, blocks: int) -> list[int]:
    return [tag] + [7] * (blocks * BLOCK - 1)


def test_the_prefix_cache_evicts_least_recently_used_blocks_past_its_capacity_and_a_hit_refreshes_them():
    async def main():
        server = await SimulatedSGLang(0.0005, 0.0, 0.0, cache_tokens=4 * BLOCK + BLOCK // 2).start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url + "/health") as r:
                    assert r.status == 200
                a, b, c = _prompt(1, 2), _prompt(2, 2), _prompt(3, 2)
                seen = {"cached_tokens": 0}

                async def hit(prompt: list[int]) -> int:
                    stats = await _generate(http, server.url, prompt)
                    got = stats["cached_tokens"] - seen["cached_tokens"]
                    seen.update(stats)
                    assert stats["cache_blocks"] <= 4  # whole blocks only: half a block of room holds none
                    return got

                assert await hit(a) == 0 and await hit(b) == 0  # the cache is full: a's and b's 2 blocks each
                assert await hit(a) == 2 * BLOCK  # a hit, which makes a the most recently used
                assert await hit(c) == 0  # evicts b, the least recently used, not a
                assert await hit(a) == 2 * BLOCK
                assert await hit(b) == 0
                assert seen["evicted_blocks"] >= 4
                # One more block evicts the oldest prefix's (a's) tail, not its head: what
                # stays of a is its first block, still a usable prefix.
                assert await hit(_prompt(4, 1)) == 0
                assert await hit(a) == BLOCK
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_an_unbounded_cache_keeps_everything_as_before():
    server = SimulatedSGLang(0.001, 0.0, 0.0)
    server._touch(server._blocks(list(range(100 * BLOCK))))
    assert len(server.cache) == 100 and server.evicted_blocks == 0


def test_the_benchmark_replays_a_recorded_run_on_each_arm_and_loses_no_turn_when_a_server_dies(capsys):
    assert bench_fleet.main(["--sessions", "8", "--turns", "4", "--token-ms", "2", "--prefill-us", "1"]) == 0
    out = capsys.readouterr().out
    goals = re.findall(r"^GOAL (\w+): (.*) \(goal .*\) (PASS|MISS)$", out, re.M)
    assert [g[0] for g in goals] == ["prefix_cache_hit_affinity", "fleet_tokens_per_s_affinity_vs_round_robin",
                                     "failover_turns_lost", "gateway_added_p50_ms_4_servers"]
    assert goals[2][1:] == ("0", "PASS"), out
    killed = re.search(r"failover: killed (s\d) after (\d+) of 32 turns; (\d+) sessions moved", out)
    assert killed and 16 <= int(killed[2]) < 32 and int(killed[3]) >= 1, out
    assert "recorded twice 0, HTTP errors seen by the agents 0" in out
    assert "differs from the recording: 0" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["affinity"], ["round_robin"], ["failover"])
            and len(line.split()) == 11}
    assert set(rows) == {"affinity", "round_robin", "failover"}
    for name, row in rows.items():
        assert row[2] == "32" and row[8] == "0", (name, row)  # every turn recorded, none lost
    # Affinity keeps each session's turns on one server: more of its prompts come from the cache.
    assert float(rows["affinity"][5]) > float(rows["round_robin"][5])
