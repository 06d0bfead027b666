"""Advantages of sessions with subagents: by default every lineage's rows take
their session's advantage and the session counts once in its group's
baseline; with lineage_advantage = "member" each lineage is a member with its
own reward (the verifier's per-lineage reward where given); an aborted
session's lineages carry exactly zero either way."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lineage_sessions import spawning_session

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.learner.config import ConfigError, LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import GPT
from agentlog.reducers.pipeline import reduce_log


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, max_seq_len=32, n_layer=1, d_model=32, n_head=2)


async def session(engine, sid: str, index: int, end) -> None:
    await spawning_session(engine, sid, index, end, group_size=3)


def released_group():
    async def build():
        log = MemoryLog()
        engine = await SessionEngine.open(log)

        async def finish_with(reward):
            return lambda h: h.finish(reward)

        await session(engine, "a", 0, await finish_with({"reward": 1.0, "lineage/sub-1": 0.0}))
        await session(engine, "b", 1, await finish_with(0.0))
        await session(engine, "c", 2, lambda h: h.abort("sandbox_error", error="the sandbox died"))
        await engine.close()
        return log

    result = reduce_log(asyncio.run(build()))
    (group,) = result.groups
    return result.samples, group


def advantages(config: LearnerConfig):
    samples, group = released_group()
    kept, adv, _ = Learner(tiny_gpt(), config).prepare([group])
    return {(s.session_id, s.metadata["lineage"]): float(a) for s, a in zip(kept, adv)}, samples


def test_by_default_every_lineage_shares_its_sessions_advantage_and_reward():
    adv, samples = advantages(LearnerConfig())
    # Session a: reward 1 (its subagent's own 0 is recorded on its row), b: 0; c aborted, out of the baseline.
    assert adv[("a", "main")] == adv[("a", "sub-1")] == pytest.approx(1 / 2 ** 0.5, rel=1e-4)
    assert adv[("b", "main")] == adv[("b", "sub-1")] == pytest.approx(-1 / 2 ** 0.5, rel=1e-4)
    rows = {(s.session_id, s.metadata.get("lineage")): s for s in samples}
    assert rows[("a", "sub-1")].reward == 1.0 and rows[("a", "sub-1")].metadata["lineage_reward"] == 0.0
    assert rows[("a", "main")].reward == 1.0 and "lineage_reward" not in rows[("a", "main")].metadata
    # The aborted session: one zero-masked placeholder, no row of any lineage trained.
    (placeholder,) = [s for s in samples if s.session_id == "c"]
    assert placeholder.remove_sample and not placeholder.mask.any()
    assert not any(k[0] == "c" for k in adv)


def test_lineages_as_members_take_their_own_rewards_into_the_baseline():
    adv, _ = advantages(LearnerConfig(lineage_advantage="member"))
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # a/main, a/sub-1, b/main, b/sub-1
    expected = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    got = [adv[("a", "main")], adv[("a", "sub-1")], adv[("b", "main")], adv[("b", "sub-1")]]
    assert got == pytest.approx(expected, rel=1e-4)
    assert not any(k[0] == "c" for k in adv)


def test_an_unknown_lineage_advantage_mode_is_refused_by_name():
    with pytest.raises(ConfigError, match="lineage_advantage.*session.*member"):
        LearnerConfig(lineage_advantage="lineage")


def test_a_bad_per_lineage_reward_makes_the_session_reward_unusable_naming_it():
    from agentlog.reducers.samples import resolve_reward

    assert resolve_reward({"reward": 1.0, "lineage/sub-1": float("nan")})[1].startswith("reward['lineage/sub-1']: reward is not finite")
    assert resolve_reward({"reward": 1.0, "lineage/sub-1": 0.5}) == (1.0, "")
    assert "session's own reward is missing" in resolve_reward({"lineage/sub-1": 0.5})[1]


def test_a_lineage_reward_naming_no_lineage_of_the_session_is_listed_on_its_rows():
    async def build():
        log = MemoryLog()
        engine = await SessionEngine.open(log)

        async def end(h):
            await h.finish({"reward": 1.0, "lineage/sub-9": 0.5})

        await session(engine, "a", 0, end)
        await engine.close()
        return log

    samples = reduce_log(asyncio.run(build())).samples
    assert [s.metadata["lineage_reward_unknown"] for s in samples] == [["sub-9"], ["sub-9"]]
    assert all(s.reward == 1.0 and "lineage_reward" not in s.metadata for s in samples)
