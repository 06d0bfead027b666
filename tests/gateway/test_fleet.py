"""A fleet of inference servers behind one gateway (gateway/fleet.py), against fake SGLang servers on loopback.

Each fake server (gateway_helpers.FakeServer) answers with the digit of the weights version it holds and
records the routing-key header of every generation, so a test reads which server saw which session.
"""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.errors import ConfigError
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import TurnRecorded
from agentlog.events.schema.turn import turn_server
from agentlog.gateway import GatewayConfig, SGLangBackend
from agentlog.gateway.backends import Backend, Generation
from agentlog.gateway.fleet import Fleet, FleetMember
from agentlog.gateway.weight_sync import GatedBackend, SGLangWeightSync
from agentlog.loop.config_sections import InferenceConfig
from agentlog.tools.cmd_show import transcript_lines
from gateway_helpers import FakeServer, bearer, hf_dir, open_running, rig, run, turns_of


async def _fleet(n: int, **kw) -> tuple[Fleet, list[FakeServer]]:
    servers = [await FakeServer("sglang").start() for _ in range(n)]
    members = []
    for i, s in enumerate(servers):
        backend = GatedBackend(SGLangBackend(s.url))
        members.append(FleetMember(f"s{i}", backend, SGLangWeightSync(s.url, gate=backend.gate)))
    return Fleet(members, **kw), servers


async def _play(gw, engine, sids, turns: int, *, between=None) -> None:
    """Each session in ``sids`` plays ``turns`` chat turns; ``between(sid, t)`` runs after each."""
    async def agent(sid: str) -> None:
        await open_running(engine, sid)
        async with aiohttp.ClientSession() as http:
            for t in range(turns):
                body = {"messages": [{"role": "user", "content": f"{sid} turn {t}"}], "max_tokens": 8}
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=bearer(gw, sid)) as r:
                    assert r.status == 200, await r.text()
                if between is not None:
                    await between(sid, t)

    await asyncio.gather(*(agent(s) for s in sids))


def _servers_by_session(log) -> dict[str, list[str]]:
    out: dict[str, list[str]] = collections.defaultdict(list)
    for e in log.read():
        if isinstance(e.body, TurnRecorded) or type(e.body).__name__ == "TurnDelta":
            out[e.session_id].append(turn_server(e.body)[0])
    return out


def test_every_turn_of_a_session_goes_to_one_server_and_records_it():
    async def main():
        fleet, servers = await _fleet(3)
        async with rig(fleet) as (gw, engine, log):
            sids = [f"sess-{i}" for i in range(24)]
            await _play(gw, engine, sids, 4)
            by_session = _servers_by_session(log)
            assert sorted(by_session) == sorted(sids)
            for sid, names in by_session.items():
                assert len(names) == 4 and len(set(names)) == 1, (sid, names)
            # Most sessions went to their key's home; those past a server's share went on to the next.
            assert sum(names[0] == fleet.home(sid).name for sid, names in by_session.items()) >= 16
            counts = collections.Counter(names[0] for names in by_session.values())
            assert len(counts) == 3 and max(counts.values()) <= 10  # ceil(1.25 * 24 / 3): the bound held
            # The routing key travelled upstream: each server saw only its own sessions' keys.
            for i, s in enumerate(servers):
                assert set(s.keys) == {sid for sid, names in by_session.items() if names[0] == f"s{i}"}
            assert all(turn_server(t)[1] == "" for t in turns_of(log))
            async with aiohttp.ClientSession() as http, http.get(gw.url + "/health") as r:
                health = await r.json()
            assert [m["name"] for m in health["servers"]] == ["s0", "s1", "s2"]
            assert all(m["in_routing"] for m in health["servers"])
        for s in servers:
            await s.stop()

    run(main())


def test_a_group_routed_together_shares_one_server():
    async def main():
        fleet, servers = await _fleet(3)
        async with rig(fleet, config=GatewayConfig(route_by="group")) as (gw, engine, log):
            for g in range(6):
                for m in range(3):
                    h = await engine.open_session(f"g{g}-m{m}", group_id=f"g{g}", group_size=3, sample_index=m)
                    await h.start(harness="test")
            async with aiohttp.ClientSession() as http:
                async def turn(sid):
                    body = {"messages": [{"role": "user", "content": sid}], "max_tokens": 4}
                    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=bearer(gw, sid)) as r:
                        assert r.status == 200, await r.text()
                await asyncio.gather(*(turn(f"g{g}-m{m}") for g in range(6) for m in range(3)))
            by_session = _servers_by_session(log)
            for g in range(6):
                assert len({by_session[f"g{g}-m{m}"][0] for m in range(3)}) == 1
            assert {k for s in servers for k in s.keys} == {f"g{g}" for g in range(6)}  # the group id went upstream
        for s in servers:
            await s.stop()

    run(main())


def test_a_killed_server_loses_no_turn_and_its_sessions_record_the_move():
    async def main():
        fleet, servers = await _fleet(3, probe_interval_s=0.05)
        victim = servers[0]
        killed = asyncio.Event()

        async def between(sid: str, t: int) -> None:
            if t == 1 and fleet._placed.get(sid) is fleet.members[0] and not killed.is_set():
                killed.set()
                await victim.stop()  # mid-run: other sessions have turns in flight
            await asyncio.sleep(0.01)

        async with rig(fleet) as (gw, engine, log):
            sids = [f"sess-{i}" for i in range(18)]
            await _play(gw, engine, sids, 4, between=between)
            assert killed.is_set()
            turns = collections.defaultdict(list)
            for e in log.read():
                if isinstance(e.body, TurnRecorded) or type(e.body).__name__ == "TurnDelta":
                    turns[e.session_id].append(e.body)
            moved = 0
            for sid in sids:
                bodies = turns[sid]
                assert [b.turn_index for b in bodies] == [0, 1, 2, 3]  # none lost, none recorded twice
                names = [turn_server(b)[0] for b in bodies]
                if names[0] == "s0":
                    first_off = next(i for i, n in enumerate(names) if n != "s0")
                    assert all(n != "s0" for n in names[first_off:])
                    assert turn_server(bodies[first_off])[1] == "s0"
                    moved += 1
                    shown = "\n".join(transcript_lines([e for e in log.read() if e.session_id == sid], False))
                    assert f"turn {first_off} " in shown and f"server {names[first_off]} (moved from s0)" in shown
                else:
                    assert len(set(names)) == 1 and all(turn_server(b)[1] == "" for b in bodies)
            assert moved >= 1
            out = {m["name"]: m for m in fleet.describe()}
            assert not out["s0"]["in_routing"] and out["s0"]["reason"]
            async with aiohttp.ClientSession() as http, http.get(gw.url + "/health") as r:
                assert r.status == 200  # two servers still serve
        for s in servers[1:]:
            await s.stop()

    run(main())


def test_a_server_that_fails_an_update_is_taken_out_and_never_serves_the_new_version(tmp_path):
    async def main():
        fleet, servers = await _fleet(3)
        async with rig(fleet) as (gw, engine, log):
            sids = [f"sess-{i}" for i in range(12)]
            await _play(gw, engine, sids[:6], 1)
            servers[1].fail_next_reload = True
            await fleet.reload_weights(hf_dir(tmp_path, 1), 1)
            member = {m.name: m for m in fleet.members}
            assert member["s1"].out_reason is not None and "version 1" in member["s1"].out_reason
            assert member["s1"].backend.policy_version == 0  # its gate never claimed the version it does not serve
            assert fleet.version == 1 and servers[1].version == 0
            served_before = len(servers[1].keys)
            await _play(gw, engine, sids[6:], 3)
            assert len(servers[1].keys) == served_before  # out of routing: nothing new reached it
            for t in turns_of(log)[6:]:
                assert turn_server(t)[0] != "s1" and t.policy_version == 1
                assert t.output_tokens[0] == ord("1")  # the version the server says made the tokens
            # A later update that reaches it brings it back, at the fleet's version.
            await fleet.reload_weights(hf_dir(tmp_path, 2), 2)
            assert member["s1"].out_reason is None and member["s1"].backend.policy_version == 2
        for s in servers:
            await s.stop()

    run(main())


def test_an_update_that_fails_everywhere_raises_naming_every_server(tmp_path):
    async def main():
        fleet, servers = await _fleet(2)
        for s in servers:
            s.fail_next_reload = True
        with pytest.raises(Exception, match=r"reached no server: s0: .*; s1: ") as info:
            await fleet.reload_weights(hf_dir(tmp_path, 1), 1)
        assert "version 1" in str(info.value)
        assert fleet.version == 0 and all(m.out_reason is None for m in fleet.members)
        await fleet.close()
        for s in servers:
            await s.stop()

    run(main())


def test_a_server_failing_its_health_probe_is_taken_out_and_comes_back():
    async def main():
        fleet, servers = await _fleet(2)
        servers[0].healthy = False
        await fleet.probe_all()
        assert [m.out_reason is None for m in fleet.members] == [False, True]
        assert "health probe failed" in fleet.members[0].out_reason
        assert fleet.choose("any-key").name == "s1"
        servers[0].healthy = True
        await fleet.probe_all()
        assert all(m.out_reason is None for m in fleet.members)
        servers[1].healthy = False
        servers[0].healthy = False
        await fleet.probe_all()
        assert "no server left in routing" in fleet.fatal_reason and "s0: health probe failed" in fleet.fatal_reason
        await fleet.close()
        for s in servers:
            await s.stop()

    run(main())


def test_a_generation_waiting_on_a_hung_server_goes_elsewhere_once_its_probe_fails():
    """A hung server keeps its connections open and answers nothing (a wedged GPU, a
    server stuck shutting down). The turn waiting on it must not wait for the client's
    timeout (600 s): once the probe takes the server out, the generation is given up
    there and made on another server, recorded once, naming the move."""
    async def main():
        fleet, servers = await _fleet(2, probe_interval_s=0.05)
        hung: list = []

        async def hang_its_server(sid: str, t: int) -> None:
            if t == 0:  # its first turn placed it: its server hangs from now on
                hung.append(servers[fleet.members.index(fleet._placed[sid])])
                hung[0].hang_generations = True

        async def fail_the_probe_once_hung() -> None:
            while not (hung and hung[0].hung):
                await asyncio.sleep(0.005)
            hung[0].healthy = False

        async with rig(fleet) as (gw, engine, log):
            started = asyncio.get_running_loop().time()
            await asyncio.wait_for(asyncio.gather(_play(gw, engine, ["s"], 2, between=hang_its_server),
                                                  fail_the_probe_once_hung()), 10)
            took = asyncio.get_running_loop().time() - started
            home = fleet.members[servers.index(hung[0])]
            names = _servers_by_session(log)["s"]
            assert names[0] == home.name and names[1] != home.name and hung[0].hung == 1
            assert "health probe failed" in home.out_reason and home.failures == 1
            assert took < 5, f"two turns took {took:.1f} s with one server hung"
        for server in servers:
            await server.stop()

    run(main())


class _Idle(Backend):
    """A member that never generates: routing is decided by Fleet.choose alone."""

    async def generate(self, prompt_ids, params) -> Generation:  # pragma: no cover - never called
        raise AssertionError("not used")


def _static_fleet(n: int, **kw) -> Fleet:
    return Fleet([FleetMember(f"m{i}", _Idle()) for i in range(n)], **kw)


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=40, unique=True),
       n=st.integers(2, 6), gone=st.integers(0, 5))
def test_taking_a_server_out_moves_only_its_own_keys(keys, n, gone):
    fleet = _static_fleet(n)
    before = {k: fleet.choose(k).name for k in keys}
    assert {k: fleet.choose(k).name for k in keys} == before  # a key keeps its server
    victim = fleet.members[gone % n]
    victim.out_reason = "test"
    after = {k: fleet.choose(k).name for k in keys}
    for k in keys:
        if before[k] != victim.name:
            assert after[k] == before[k]  # consistent hashing: the others keep their server
        else:
            assert after[k] != victim.name


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=60, unique=True),
       n=st.integers(2, 6), factor=st.sampled_from([1.0, 1.25, 2.0]))
def test_a_server_at_its_share_gives_way(keys, n, factor):
    import math

    fleet = _static_fleet(n, load_factor=factor)
    for i, key in enumerate(keys):
        cap = math.ceil(factor * (i + 1) / n)
        home = fleet.home(key)
        home_was_under = home.keys < cap
        chosen = fleet.choose(key)
        assert chosen.keys <= cap  # nobody past its share
        if home_was_under:
            assert chosen is home
    assert sum(m.keys for m in fleet.members) == len(keys)


def test_round_robin_ignores_the_key():
    fleet = _static_fleet(3, policy="round_robin")
    assert len({fleet.choose("same").name for _ in range(3)}) == 3


def test_fleet_settings_are_checked():
    with pytest.raises(ValueError, match="unique"):
        Fleet([FleetMember("a", _Idle()), FleetMember("a", _Idle())])
    with pytest.raises(ValueError, match="load_factor"):
        _static_fleet(2, load_factor=0.5)
    with pytest.raises(ValueError, match="policy"):
        _static_fleet(2, policy="random")
    with pytest.raises(ValueError, match="route_by"):
        GatewayConfig(route_by="user")


def test_inference_servers_config():
    cfg = InferenceConfig(backend="sglang", servers=["http://127.0.0.1:3000", {"url": "http://h2:3000", "name": "b"}])
    assert cfg.servers == [{"name": "127.0.0.1:3000", "url": "http://127.0.0.1:3000", "served_dir": ""},
                           {"name": "b", "url": "http://h2:3000", "served_dir": ""}]
    assert InferenceConfig(servers=["in-process", "in-process"]).servers[1]["name"] == "in-process-1"
    cases = [
        (dict(backend="sglang", servers=["ftp://x"]), r"servers\[0\]: expected the server's http"),
        (dict(backend="sglang", servers=["in-process"]), r"servers\[0\]: backend 'sglang' takes http"),
        (dict(servers=["http://a"]), r"servers\[0\]: backend 'in-process' takes \"in-process\""),
        (dict(backend="vllm", servers=["http://a"]), r"servers\[0\]: backend 'vllm' needs served_dir"),
        (dict(backend="sglang", servers=["http://a", "http://a"]), "names must be unique"),
        (dict(backend="sglang", url="http://a", servers=["http://b"]), "not both"),
        (dict(backend="sglang", servers=[{"url": "http://a", "port": 1}]), r"servers\[0\]: expected a URL"),
        (dict(route_by="user"), "route_by"),
        (dict(route_policy="random"), "route_policy"),
        (dict(load_factor=0.9), "load_factor"),
        (dict(routing_header="bad header"), "routing_header"),
    ]
    for kw, match in cases:
        with pytest.raises(ConfigError, match=match):
            InferenceConfig(**kw)


def test_a_single_backend_records_no_server_and_stores_turns_as_before():
    import msgspec

    async def main():
        async with rig(log=MemoryLog()) as (gw, engine, log):
            await _play(gw, engine, ["solo"], 2)
            for t in turns_of(log):
                assert turn_server(t) == ("", "") and "server" not in t.sampling
            assert all(b"server" not in msgspec.msgpack.encode(e.body) for e in log.read())

    run(main())


def _gen_params():
    from agentlog.gateway.backends import SamplingParams

    return SamplingParams(max_new_tokens=4)


async def _generate_as(fleet: Fleet, key: str):
    from agentlog.gateway.backends import ROUTING_KEY

    async def go():
        ROUTING_KEY.set(key)
        return await fleet.generate([1, 2, 3], _gen_params())

    return await asyncio.create_task(go())


def test_a_5xx_retries_elsewhere_but_leaves_the_server_in_routing_and_a_4xx_is_raised():
    from agentlog.gateway.backends import BackendError

    async def main():
        fleet, servers = await _fleet(2)
        home = fleet.home("k").name
        first = servers[int(home[1:])]
        first.fail_next_generate = 500
        gen = await _generate_as(fleet, "k")
        assert gen.server != home and all(m.out_reason is None for m in fleet.members)
        fleet._placed.clear()
        for m in fleet.members:
            m.keys = 0
        first.fail_next_generate = 400
        with pytest.raises(BackendError, match="400"):
            await _generate_as(fleet, "k")
        assert all(m.out_reason is None for m in fleet.members)
        assert sum(len(s.keys) for s in servers) == 1  # the 4xx was not sent anywhere else
        await fleet.close()
        for s in servers:
            await s.stop()

    run(main())


def test_a_one_server_fleet_comes_back_when_its_server_does():
    async def main():
        fleet, servers = await _fleet(1, probe_interval_s=0.02)
        await _generate_as(fleet, "k")  # starts the prober
        servers[0].healthy = False
        for _ in range(200):
            if fleet.fatal_reason:
                break
            await asyncio.sleep(0.01)
        assert "health probe failed" in fleet.fatal_reason
        servers[0].healthy = True
        for _ in range(200):
            if fleet.fatal_reason is None:
                break
            await asyncio.sleep(0.01)
        assert fleet.fatal_reason is None
        assert (await _generate_as(fleet, "k")).server == "s0"
        await fleet.close()
        await servers[0].stop()

    run(main())


def test_a_restarted_server_is_updated_to_the_fleets_version_before_it_comes_back(tmp_path):
    async def main():
        fleet, servers = await _fleet(2)
        await fleet.reload_weights(hf_dir(tmp_path, 1), 1)
        assert [s.version for s in servers] == [1, 1]
        # s0 dies and a supervisor restarts it on its launch weights: its gate still says version 1.
        servers[0].healthy = False
        await fleet.probe_all()
        servers[0].version = 0
        servers[0].healthy = True
        await fleet.probe_all()
        assert fleet.members[0].out_reason is None
        assert servers[0].version == 1 and len(servers[0].reloads) == 2  # updated again before it came back
        # A restarted server that cannot load the version stays out.
        servers[1].healthy = False
        await fleet.probe_all()
        servers[1].healthy, servers[1].fail_next_reload = True, True
        await fleet.probe_all()
        assert fleet.members[1].out_reason is not None and "coming back" in fleet.members[1].out_reason
        await fleet.close()
        for s in servers:
            await s.stop()

    run(main())
