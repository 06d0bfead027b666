"""`agentlog ui`'s session rows and folds (tools/ui/views.py), on the real server.

Each row's rollout log-prob and version ribbons show only what the turns
recorded (never a made-up 0.0 / version 0 for a token nobody trained), token
kinds come from where each turn's output sits in the row (an output that also
appears in a tool result is not mistaken for it), and the released groups are
folded incrementally as the log grows.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ui_helpers import start_ui, ui_run  # noqa: F401  (ui_run is a fixture)

SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": "Fix it."}
BASE = [1, 2, 3, 4]


def _reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


async def _write(path: Path) -> None:
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    log = FileLog.open(path, fsync="batch")
    eng = await SessionEngine.open(log, drain_s=0.1)
    # abort-turn: turn 0 finished "abort" (generated, untrained: its recorded log-probs and version 3),
    # turn 1 a partial rollout (versions 3 then 4) whose prompt's tool result repeats turn 1's output.
    h = await eng.open_session("abort-turn", group_id="g", group_size=2, sample_index=0)
    await h.start()
    await h.record_turn(messages=[SYSTEM, USER], prompt_ids=BASE, output_ids=[20, 21], output_log_probs=[-0.25, -0.5],
                        finish_reason="abort", policy_version=3, response_message=_reply("a"))
    await h.record_turn(messages=[SYSTEM, USER, _reply("a"), {"role": "tool", "content": "30 31"}],
                        prompt_ids=BASE + [20, 21, 30, 31], output_ids=[30, 31, 32], output_log_probs=[-1.0, -1.5, -2.0],
                        policy_version=3, version_spans=[(0, 3), (1, 4)], response_message=_reply("b"))
    await h.finish(reward=1.0)
    # no-logprobs: turn 0 recorded without log-probs (untrainable: null ribbon, its real version), turn 1 trained.
    h = await eng.open_session("no-logprobs", group_id="g", group_size=2, sample_index=1)
    await h.start()
    await h.record_turn(messages=[SYSTEM, USER], prompt_ids=BASE, output_ids=[40, 41], policy_version=5,
                        response_message=_reply("c"))
    await h.record_turn(messages=[SYSTEM, USER, _reply("c"), {"role": "user", "content": "more"}],
                        prompt_ids=BASE + [40, 41, 9], output_ids=[42], output_log_probs=[-0.75], policy_version=5,
                        response_message=_reply("d"))
    await h.finish(reward=0.0)
    await eng.close()
    log.close()


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ui-views") / "run.log"
    asyncio.run(_write(path))
    return path


def _ok(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _recorded_turns(log: Path) -> dict[str, dict[int, Any]]:
    """session -> turn index -> its turn_recorded (deltas expanded), read straight from the log."""
    from agentlog.events.log.source import open_source
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded

    out: dict[str, dict[int, Any]] = {}
    for env in full_turns(open_source(str(log)).read()):
        if isinstance(env.body, TurnRecorded):
            out.setdefault(env.session_id, {})[env.body.turn_index] = env.body
    return out


def _check_ribbons(view: dict, turns: dict[int, Any]) -> int:
    """Every non-null rollout log-prob / version of each row is the one the turn that generated the token
    recorded there (found by the turn's prompt length and exact output tokens); mask 1 is never null."""
    import numpy as np

    checked = 0
    branches = {b["row"]: b["turns"] for b in view["forks"]["branches"]}
    for r in view["rows"]:
        truth: dict[int, tuple[float | None, int]] = {}
        for t in branches[r["row"]]:
            body = turns[t]
            start = len(body.prompt_ids) // 4
            out = np.frombuffer(body.output_ids, dtype="<i4").tolist()
            if r["tokens"][start:start + len(out)] != out:
                continue
            lps = np.frombuffer(body.output_log_probs, dtype="<f4").tolist() if len(body.output_log_probs) == 4 * len(out) else None
            spans = list(body.version_spans) if body.version_spans else [(0, body.policy_version)]
            for j in range(len(out)):
                version = [v for first, v in spans if first <= j][-1]
                truth[start + j] = (None if lps is None else lps[j], version)
        for i, (lp, version, m) in enumerate(zip(r["rollout_logprob"], r["version"], r["mask"])):
            if m:
                assert lp is not None and version is not None, (view["session_id"], r["row"], i)
            if lp is not None:
                assert i in truth and truth[i][0] == lp, (view["session_id"], r["row"], i, lp, truth.get(i))
                checked += 1
            if version is not None:
                assert i in truth and truth[i][1] == version, (view["session_id"], r["row"], i, version, truth.get(i))
    return checked


def test_ribbons_show_only_recorded_log_probs_and_versions(crafted, tmp_path):
    url, stop = start_ui(crafted, index_path=tmp_path / "ix.sqlite")
    try:
        turns = _recorded_turns(crafted)
        view = _ok(f"{url}/api/session/abort-turn")
        (row,) = view["rows"]
        n = len(BASE)
        # prompt; turn 0's output (aborted: generated, untrained); the tool result [30, 31]; turn 1's output [30, 31, 32].
        assert row["kinds"] == ["prompt"] * n + ["generated_untrained"] * 2 + ["tool"] * 2 + ["trained"] * 3
        assert row["rollout_logprob"] == [None] * n + [-0.25, -0.5, None, None, -1.0, -1.5, -2.0]
        assert row["version"] == [None] * n + [3, 3, None, None, 3, 4, 4]
        assert _check_ribbons(view, turns["abort-turn"]) == 5

        view = _ok(f"{url}/api/session/no-logprobs")
        (row,) = view["rows"]
        assert row["kinds"] == ["prompt"] * n + ["generated_untrained"] * 2 + ["given", "trained"]
        assert row["rollout_logprob"] == [None] * n + [None, None, None, -0.75]  # recorded without log-probs: unknown, not 0
        assert row["version"] == [None] * n + [5, 5, None, 5]
        _check_ribbons(view, turns["no-logprobs"])
    finally:
        stop()


def test_every_sessions_ribbons_are_the_recorded_values(ui_run, tmp_path):  # noqa: F811
    url, stop = start_ui(ui_run.log, index_path=tmp_path / "ix.sqlite")
    try:
        turns = _recorded_turns(ui_run.log)
        checked = 0
        for sid in turns:
            checked += _check_ribbons(_ok(f"{url}/api/session/{sid}"), turns[sid])
        assert checked >= 16  # fin-0 3 + 2, fin-1 3, fork-2 3 + 2, strag-3 3 (aborted sessions make no rows)
    finally:
        stop()


def test_released_groups_are_folded_incrementally_as_the_log_grows(ui_run, tmp_path):  # noqa: F811
    """RunViews.released over a growing log equals a fresh fold of the whole log, and reads only new records."""
    from agentlog.events.log.source import open_source
    from agentlog.reducers.config import DEFAULT_CONFIG
    from agentlog.reducers.partitioned import reduce_partitions
    from agentlog.tools.ui.views import RunViews

    log = tmp_path / "live.log"
    shutil.copytree(ui_run.log, log, ignore=shutil.ignore_patterns("LOCK"))
    source = open_source(str(log))
    views = RunViews(source, None, DEFAULT_CONFIG)
    first = views.released()
    assert {pid: set(g) for pid, g in first.items()} == {pid: set(g) for pid, g in reduce_partitions({0: source.read()}).items()}
    frontier = dict(views._fold.frontier)

    async def finish_live() -> None:
        from agentlog.engine import SessionEngine
        from agentlog.events import FileLog

        fl = FileLog.open(log, fsync="batch")
        eng = await SessionEngine.open(fl, drain_s=0.1)
        h = await eng.open_session("live-1", group_id="g-new", group_size=1, sample_index=0)
        await h.start()
        await h.record_turn(messages=[SYSTEM, USER], prompt_ids=BASE, output_ids=[5], output_log_probs=[-0.1],
                            response_message=_reply("e"))
        await h.finish(reward=1.0)
        await eng.close()
        fl.close()

    asyncio.run(finish_live())
    fold = views._fold
    second = views.released()
    assert views._fold is fold and fold.frontier[0] > frontier[0]  # the same fold went on from its frontier
    assert "g-new" in second[0] and "g-new" not in first[0]
    fresh = reduce_partitions({0: source.read()})
    assert {pid: {g: r.members for g, r in gs.items()} for pid, gs in second.items()} == \
        {pid: {g: r.members for g, r in gs.items()} for pid, gs in fresh.items()}


def test_the_reconstruct_cache_stays_bounded_as_the_position_moves(ui_run):  # noqa: F811
    """On a live run the index position moves every poll: the per-step check cache keeps at most
    MAX_CACHED_CHECKS entries instead of one per position ever asked."""
    from agentlog.tools.cli_common import check_log_path, learner_log_of, reduce_config_of
    from agentlog.tools.ui.views import MAX_CACHED_CHECKS, RunViews

    source = check_log_path(str(ui_run.demo), allow_empty=True)
    views = RunViews(source, learner_log_of(source), reduce_config_of(source), source.run_dir)
    step = max(r.step for r in views.records())
    assert step >= 1
    for position in range(MAX_CACHED_CHECKS + 10):
        assert views.reconstruct(step, position)["equal"]
    assert len(views._checks) == MAX_CACHED_CHECKS


def test_the_teacher_ribbon_is_the_teachers_recorded_log_probs(tmp_path):
    """A distilled session: turn 0 scored by the teacher, turn 1 not (the teacher failed on it). The
    teacher ribbon holds the teacher's log-probs on turn 0's tokens and nothing elsewhere."""
    log = tmp_path / "log"

    async def write() -> None:
        from agentlog.engine import SessionEngine
        from agentlog.events import FileLog

        fl = FileLog.open(log, fsync="batch")
        eng = await SessionEngine.open(fl, drain_s=0.1)
        h = await eng.open_session("s-teach", group_id="g", group_size=1)
        await h.start()
        await h.record_turn(prompt_ids=[1, 2], output_ids=[30, 31], output_log_probs=[-1.5, -0.75], sampling={"temperature": 0.5})
        await h.record_turn(prompt_ids=[1, 2, 30, 31, 5], output_ids=[40], output_log_probs=[-2.0], sampling={"temperature": 0.5})
        await h.record_teacher_scores(0, teacher="big", teacher_version="v1", temperature=0.5, log_probs=[-0.25, -0.5])
        await h.record_teacher_failure(1, teacher="big", teacher_version="v1", error="timeout after 2 s")
        await h.finish(reward=1.0)
        await eng.close()
        fl.close()

    asyncio.run(write())
    url, stop = start_ui(log, index_path=tmp_path / "ix.sqlite")
    try:
        (row,) = _ok(f"{url}/api/session/s-teach")["rows"]
    finally:
        stop()
    assert row["tokens"] == [1, 2, 30, 31, 5, 40] and row["mask"] == [0, 0, 1, 1, 0, 1]
    assert row["rollout_logprob"] == [None, None, -1.5, -0.75, None, -2.0]
    assert row["teacher_logprob"] == [None, None, -0.25, -0.5, None, None]
