"""A fleet member whose update failed after the server may have changed its weights (its gate is
fatal: weights unknown) must be brought back by the next update that reaches it, even when a
health probe ran in between (the probe reports the gate's fatal reason)."""

from __future__ import annotations

from agentlog.gateway.backends import OpenAICompletionsBackend
from agentlog.gateway.fleet import Fleet, FleetMember
from agentlog.gateway.weight_sync import GatedBackend, VLLMWeightSync
from gateway_helpers import FakeServer, hf_dir, run


def test_a_member_left_fatal_by_a_failed_update_comes_back_with_the_next_update(tmp_path):
    async def main():
        servers, members = [], []
        for i in range(2):
            served = tmp_path / f"served{i}"
            served.mkdir()
            (served / "version.txt").write_text("0")
            s = await FakeServer("vllm", served).start()
            servers.append(s)
            backend = GatedBackend(OpenAICompletionsBackend(s.url, "m"))
            members.append(FleetMember(f"s{i}", backend, VLLMWeightSync(s.url, served, gate=backend.gate)))
        fleet = Fleet(members)
        try:
            servers[1].fail_next_reset = True  # the reload ran, the cache reset failed: s1's weights are unknown
            await fleet.reload_weights(hf_dir(tmp_path, 1), 1)
            assert members[1].out_reason is not None and members[1].backend.fatal_reason is not None
            await fleet.probe_all()  # the prober runs every 2 s: between two updates it always has
            assert members[1].out_reason is not None
            await fleet.reload_weights(hf_dir(tmp_path, 2), 2)
            # The next update reached s1 (its server is healthy) and brought it back at the fleet's version.
            assert servers[1].version == 2, members[1].out_reason
            assert members[1].out_reason is None and members[1].backend.policy_version == 2
            assert members[1].backend.fatal_reason is None
        finally:
            await fleet.close()
            for s in servers:
                await s.stop()

    run(main(), timeout=20)
