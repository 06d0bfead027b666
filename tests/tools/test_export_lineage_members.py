"""export-dataset's advantage column follows the learner's lineage_advantage: with
"member" each lineage of a session gets the advantage the learner trains it with."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lineage_sessions import spawning_session

from agentlog.engine import SessionEngine
from agentlog.events.log.api import MemoryLog
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import GPT
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log
from agentlog.tools.dataset_rows import DatasetFold, group_advantages


async def _session(engine, sid: str, index: int, reward) -> None:
    async def end(h):
        await h.finish(reward)

    await spawning_session(engine, sid, index, end, group_size=2)


def _log() -> MemoryLog:
    async def build() -> MemoryLog:
        log = MemoryLog()
        engine = await SessionEngine.open(log)
        await _session(engine, "a", 0, {"reward": 1.0, "lineage/sub-1": 0.0})
        await _session(engine, "b", 1, 0.0)
        await engine.close()
        return log

    return asyncio.run(build())


@pytest.mark.parametrize("mode", ["session", "member"])
def test_the_export_advantage_of_each_lineage_is_the_learners(mode):
    log = _log()
    fold = DatasetFold(ReduceConfig(), group_advantages("grpo", 1e-6), lineage_members=mode == "member")
    rows = [r for env in log.read() for r in fold.feed(None, env)] + fold.finish()
    exported = {(r["session_id"], r["lineage"]): r["advantage"] for r in rows}
    (group,) = reduce_log(log).groups
    torch.manual_seed(0)
    model = GPT(vocab_size=16, max_seq_len=16, n_layer=1, d_model=16, n_head=2)
    kept, adv, _ = Learner(model, LearnerConfig(lineage_advantage=mode)).prepare([group])
    trained = {(s.session_id, s.metadata["lineage"]): float(a) for s, a in zip(kept, adv)}
    assert exported.keys() == trained.keys() == {("a", "main"), ("a", "sub-1"), ("b", "main"), ("b", "sub-1")}
    assert exported == pytest.approx(trained, rel=1e-6)
    if mode == "member":
        assert exported[("a", "main")] > 0 > exported[("a", "sub-1")]  # the subagent's own reward 0
    else:
        assert exported[("a", "main")] == exported[("a", "sub-1")] > 0


def test_sessions_n_counts_sessions_and_never_cuts_one_between_its_lineages(tmp_path):
    import json

    from agentlog.events import FileLog
    from agentlog.tools.cli import main

    async def build() -> None:
        log = FileLog.open(tmp_path / "log")
        engine = await SessionEngine.open(log)
        await _session(engine, "a", 0, 1.0)
        await _session(engine, "b", 1, 0.0)
        await engine.close()
        log.close()

    asyncio.run(build())
    rc = main(["export-dataset", str(tmp_path / "log"), "-o", str(tmp_path / "out"), "--format", "jsonl", "--sessions", "1", "-q"])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "sessions.jsonl").read_text().splitlines()]
    # One session, both of its lineages (the limit used to count rows: 1 row, the subagent's cut off).
    assert [(r["session_id"], r["lineage"]) for r in rows] == [("a", "main"), ("a", "sub-1")]
