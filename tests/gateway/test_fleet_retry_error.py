"""The fleet's errors name what failed. When every member in routing answered a 5xx (and another member is out), the error the
turn gets must be the servers' own, not "no server left in routing (s0: None; ...)": the
members that failed are still in routing, and their reason is not None."""

from __future__ import annotations

import contextlib

import pytest

from agentlog.gateway import SGLangBackend
from agentlog.gateway.backends import BackendError, ROUTING_KEY, SamplingParams
from agentlog.gateway.fleet import Fleet, FleetMember
from agentlog.gateway.weight_sync import GatedBackend, SGLangWeightSync
from gateway_helpers import FakeServer, run


@contextlib.asynccontextmanager
async def _sglang_fleet(n: int):
    """A fleet of ``n`` gated SGLang members over fake servers: (servers, members, fleet), all stopped after."""
    servers = [await FakeServer("sglang").start() for _ in range(n)]
    members = []
    for i, s in enumerate(servers):
        backend = GatedBackend(SGLangBackend(s.url))
        members.append(FleetMember(f"s{i}", backend, SGLangWeightSync(s.url, gate=backend.gate)))
    fleet = Fleet(members)
    try:
        yield servers, members, fleet
    finally:
        await fleet.close()
        for s in servers:
            await s.stop()


def test_every_member_in_routing_failing_with_a_5xx_raises_their_error():
    async def main():
        async with _sglang_fleet(3) as (servers, members, fleet):
            servers[2].healthy = False
            await fleet.probe_all()
            assert [m.out_reason is None for m in members] == [True, True, False]
            servers[0].fail_next_generate = servers[1].fail_next_generate = 500

            async def go():
                ROUTING_KEY.set("k")
                return await fleet.generate([1, 2, 3], SamplingParams(max_new_tokens=4))

            with pytest.raises(BackendError) as info:
                await go()
            msg = str(info.value)
            assert "failing on purpose with 500" in msg, msg
            assert ": None" not in msg, msg
            assert [m.out_reason is None for m in members] == [True, True, False]  # a 5xx leaves them in routing

    run(main(), timeout=20)


def test_an_update_with_every_member_out_names_each_members_reason():
    """With every member out for a failed probe, an update reaches none: its error used to end in
    "reached no server: " and nothing after it."""
    async def main():
        async with _sglang_fleet(2) as (servers, members, fleet):
            for s in servers:
                s.healthy = False
            await fleet.probe_all()
            with pytest.raises(BackendError, match=r"reached no server: every server is out of routing.*s0: health probe failed.*s1: health probe failed"):
                await fleet.reload_weights("/nowhere/v1", 1)

    run(main(), timeout=20)


def test_an_in_process_replicas_refusal_of_the_request_is_raised_leaving_every_replica_in():
    """A prompt outside the model's vocabulary is the request's fault. An in-process replica raised it
    as "no answer" (status 0): each replica tried in turn was taken out, and the fleet was empty."""
    from agentlog.gateway import TorchBackend
    from agentlog.tools.cmd_serve import default_gateway_model

    async def main():
        model = default_gateway_model()
        members = [FleetMember(f"r{i}", TorchBackend(model), None) for i in range(2)]
        fleet = Fleet(members)
        try:
            ROUTING_KEY.set("k")
            with pytest.raises(BackendError, match="outside the model's vocabulary") as info:
                await fleet.generate([1, 2, 10**6], SamplingParams(max_new_tokens=2))
            assert info.value.status == 400
            assert [m.out_reason for m in members] == [None, None]
        finally:
            await fleet.close()

    run(main(), timeout=30)
