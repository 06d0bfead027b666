"""`agentlog ui`'s trainer ribbon (tools/ui/trainer.py), on the real server.

``GET /api/session/{id}/trainer`` scores each recorded turn with the run's own policy at the
version that generated it. Checked against :meth:`loop.model_scorer.ModelScorer.score_batch`
of the same turns at their versions, placed where each turn's output sits in the row: on the
short demo (whose tiny GPT generated those very turns, so the trainer agrees with the
recorded rollout log-probs), and on a run folder built from the demo's config and checkpoints
with a perturbed version 1 and no version 2: a partial rollout's parts each take their own
version's log-probs, and the turn whose version has no checkpoint stays null, explained. A
bare log is refused with the reason; the bounds answer 413; the token guards the route.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ui_helpers import start_ui, ui_run  # noqa: F401  (ui_run is a fixture)

#: The largest |trainer - rollout| where the rollout was sampled from the very checkpoint (the
#: demo's turns: the same tiny GPT on the same CPU code path).
ROLLOUT_AGREEMENT = 1e-3
#: The largest |endpoint - ModelScorer.score_batch| (same computation, batched differently).
SCORER_AGREEMENT = 1e-6

PROMPT = [1, 3, 12, 7]
OUTPUT = [5, 17, 3, 9, 30]  # not what the demo's policy would say: log-probs far from 0
SECOND_OUTPUT = [7, 7]
TEMPERATURE = 0.7


def _get(url: str, timeout: float = 60) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _ok(url: str) -> Any:
    status, body = _get(url)
    assert status == 200, (url, body)
    return body


def _scorer(run_dir: Path, version: int) -> Any:
    from agentlog.loop.model_scorer import ModelScorer, load_policy
    from agentlog.loop.run_folder import Run

    model = load_policy(run_dir, Run.load_config(run_dir), version)
    assert model is not None, (run_dir, version)
    return ModelScorer(model)


def _expected(run_dir: Path, log: Path, session_id: str) -> dict[int, tuple[int, list[int], list[float | None]]]:
    """turn index -> (prompt length, output ids, per output token the log-prob of the version that
    generated it, by ModelScorer.score_batch; None where that version has no checkpoint)."""
    from agentlog.events.log.source import open_source
    from agentlog.events.schema.turn import turn_temperature, turn_version_spans
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded

    out = {}
    for env in full_turns(open_source(str(log)).read()):
        b = env.body
        if env.session_id != session_id or not isinstance(b, TurnRecorded):
            continue
        prompt, output = np.frombuffer(b.prompt_ids, "<i4"), b.output_tokens
        spans = turn_version_spans(b)
        lps: list[float | None] = [None] * len(output)
        for k, (first, version) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else len(output)
            if (run_dir / "checkpoints" / f"policy-v{version:05d}.pt").is_file():
                got = _scorer(run_dir, version).score_batch([(prompt, output, turn_temperature(b.sampling) or 1.0)])[0]
                lps[first:end] = got[first:end]
        out[b.turn_index] = (len(prompt), output.tolist(), lps)
    return out


def _truth(view_row: dict, turns: dict) -> dict[int, float | None]:
    """Row position -> expected trainer log-prob, for every position a turn's output sits at (found by the
    turn's prompt length and its exact output tokens)."""
    truth: dict[int, float | None] = {}
    for start, output, lps in turns.values():
        if view_row["tokens"][start:start + len(output)] == output:
            truth.update({start + j: lp for j, lp in enumerate(lps)})
    return truth


def test_the_demos_trainer_ribbon_is_its_policy_at_each_turns_version_and_agrees_with_the_rollout(ui_run, tmp_path):  # noqa: F811
    url, stop = start_ui(ui_run.demo, index_path=tmp_path / "ix.sqlite")
    try:
        finished = _ok(f"{url}/api/sessions?status=finished&limit=6&sort=session_id")["rows"]
        compared = 0
        for s in finished:
            sid = s["session_id"]
            view = _ok(f"{url}/api/session/{sid}")
            assert view["trainer_scoring"] == {"available": True, "why": None}
            assert all(r["trainer_logprob"] == [None] * len(r["tokens"]) for r in view["rows"])  # not scored yet
            got = _ok(f"{url}/api/session/{sid}/trainer")
            assert got["missing"] == [] and got["cached"] is False and got["problem"] is None
            assert [r["row"] for r in got["rows"]] == [r["row"] for r in view["rows"]]
            turns = _expected(ui_run.demo, ui_run.demo / "rollout", sid)
            for row, trainer in zip(view["rows"], got["rows"]):
                ribbon = trainer["trainer_logprob"]
                truth = _truth(row, turns)
                assert len(ribbon) == len(row["tokens"])
                for i, (lp, rollout, version) in enumerate(zip(ribbon, row["rollout_logprob"], row["version"])):
                    # Exactly the generated tokens (those with a version) have one: every checkpoint is there.
                    assert (lp is None) == (version is None), (sid, row["row"], i)
                    if lp is None:
                        continue
                    assert abs(lp - truth[i]) <= SCORER_AGREEMENT, (sid, row["row"], i, lp, truth[i])
                    if rollout is not None:
                        assert abs(lp - rollout) <= ROLLOUT_AGREEMENT, (sid, row["row"], i, lp, rollout)
                        compared += 1
            again = _ok(f"{url}/api/session/{sid}/trainer")
            assert again["cached"] is True and again["rows"] == got["rows"]
        assert compared >= 12
    finally:
        stop()


# ---------------------------------------------------------------- a partial rollout, a pruned checkpoint


async def _write_log(path: Path, first_lps: list[float]) -> None:
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    log = FileLog.open(path, fsync="batch")
    eng = await SessionEngine.open(log, drain_s=0.1)
    h = await eng.open_session("partial", group_id="g", group_size=1, sample_index=0)
    await h.start()
    user = {"role": "user", "content": "look it up"}
    # Turn 0: a weight update landed after its second token (versions 0 then 1); turn 1 at version 2, whose
    # checkpoint this run folder does not keep.
    await h.record_turn(messages=[user], prompt_ids=PROMPT, sampling={"temperature": TEMPERATURE}, output_ids=OUTPUT,
                        output_log_probs=first_lps, policy_version=0, version_spans=[(0, 0), (2, 1)],
                        response_message={"role": "assistant", "content": "a"})
    await h.record_turn(messages=[user, {"role": "assistant", "content": "a"}, {"role": "user", "content": "again"}],
                        prompt_ids=PROMPT + OUTPUT + [9], sampling={"temperature": TEMPERATURE},
                        output_ids=SECOND_OUTPUT, output_log_probs=[-1.0, -1.0], policy_version=2,
                        response_message={"role": "assistant", "content": "b"})
    await h.finish(reward=1.0)
    await eng.close()
    log.close()


@pytest.fixture(scope="module")
def pruned_run(ui_run, tmp_path_factory) -> tuple[Path, dict[int, list[float]]]:  # noqa: F811
    """(run folder, per version 0 and 1 the policy's log-probs of turn 0's output): the demo's config,
    its version 0 checkpoint, a version 1 perturbed to differ, no version 2; a rollout log of one session
    whose turn 0 is a partial rollout (recorded with the log-probs its versions really give)."""
    import torch

    run = tmp_path_factory.mktemp("ui-trainer") / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ui_run.demo / "config.json", run / "config.json")
    shutil.copy(ui_run.demo / "checkpoints" / "policy-v00000.pt", run / "checkpoints" / "policy-v00000.pt")
    state = torch.load(ui_run.demo / "checkpoints" / "policy-v00001.pt", weights_only=True)
    gen = torch.Generator().manual_seed(0)
    state["model"] = {k: v + 0.2 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                      for k, v in state["model"].items()}
    torch.save(state, run / "checkpoints" / "policy-v00001.pt")
    by_version = {v: _scorer(run, v).score_batch([(PROMPT, OUTPUT, TEMPERATURE)])[0] for v in (0, 1)}
    asyncio.run(_write_log(run / "rollout", by_version[0][:2] + by_version[1][2:]))
    return run, by_version


def test_a_partial_rollouts_parts_take_their_own_versions_and_a_pruned_version_stays_null_explained(pruned_run, tmp_path):
    run, by_version = pruned_run
    # The two versions really differ on the tokens version 1 generated: a ribbon scored at one version fails.
    assert max(abs(a - b) for a, b in zip(by_version[0][2:], by_version[1][2:])) > 0.05
    url, stop = start_ui(run, token="s3cret", index_path=tmp_path / "ix.sqlite")
    try:
        status, body = _get(f"{url}/api/session/partial/trainer")
        assert status == 401 and "token" in body["error"]
        server = stop.server  # type: ignore[attr-defined]
        server.trainer.max_turns = 1  # the session has 2 turns: refused before any model loads
        status, body = _get(f"{url}/api/session/partial/trainer?token=s3cret")
        assert status == 413 and "2 turns" in body["error"] and "at most 1 turns" in body["error"], body
        server.trainer.max_turns, server.trainer.max_forward_tokens = 10, 10
        status, body = _get(f"{url}/api/session/partial/trainer?token=s3cret")
        assert status == 413 and "10 tokens" in body["error"], body
        server.trainer.max_forward_tokens = 10_000
        status, body = _get(f"{url}/api/session/nobody/trainer?token=s3cret")
        assert status == 404 and "nobody" in body["error"]

        view = _ok(f"{url}/api/session/partial?token=s3cret")
        got = _ok(f"{url}/api/session/partial/trainer?token=s3cret")
        (row,) = view["rows"]
        (trainer,) = got["rows"]
        n, m = len(PROMPT), len(OUTPUT)
        ribbon = trainer["trainer_logprob"]
        assert row["version"] == [None] * n + [0, 0, 1, 1, 1] + [None] + [2, 2]
        expected = by_version[0][:2] + by_version[1][2:]
        assert ribbon[:n] == [None] * n and ribbon[n + m] is None  # prompt, and the user's token between turns
        assert np.abs(np.array(ribbon[n:n + m]) - expected).max() <= SCORER_AGREEMENT
        # Recorded with these versions' log-probs: the trainer agrees with the rollout on the scored tokens.
        assert np.abs(np.array(ribbon[n:n + m]) - np.array(row["rollout_logprob"][n:n + m])).max() <= ROLLOUT_AGREEMENT
        assert ribbon[n + m + 1:] == [None, None] and row["rollout_logprob"][n + m + 1:] == [-1.0, -1.0]
        (missing,) = got["missing"]
        assert missing["version"] == 2 and missing["turns"] == [1] and missing["tokens"] == 2
        assert "policy-v00002.pt" in missing["why"] and "keep_checkpoints" in missing["why"]
        assert got["turns"][0] == {"turn": 0, "temperature": TEMPERATURE, "parts": [
            {"from": 0, "to": 2, "version": 0, "scored": True, "why": None},
            {"from": 2, "to": 5, "version": 1, "scored": True, "why": None}]}
        assert got["turns"][1]["parts"] == [{"from": 0, "to": 2, "version": 2, "scored": False, "why": missing["why"]}]
        assert got["scored_tokens"] == m and got["forward_tokens"] == 2 * (n + m)
    finally:
        stop()


def test_a_bare_log_is_refused_with_why_scoring_needs_a_run_folder(ui_run, tmp_path):  # noqa: F811
    url, stop = start_ui(ui_run.log, index_path=tmp_path / "ix.sqlite")
    try:
        view = _ok(f"{url}/api/session/fin-0")
        assert view["trainer_scoring"]["available"] is False
        assert "run folder with checkpoints" in view["trainer_scoring"]["why"]
        status, body = _get(f"{url}/api/session/fin-0/trainer")
        assert status == 409 and view["trainer_scoring"]["why"] in body["error"], body
    finally:
        stop()


# ---------------------------------------------------------------- the server stays answering; the bounds bound memory


def test_requests_waiting_for_the_scorer_leave_every_other_route_answering(ui_run, tmp_path):  # noqa: F811
    """Scoring is serialised; requests waiting their turn must not hold the worker threads the
    session view (and the log follower) run in."""
    url, stop = start_ui(ui_run.demo, index_path=tmp_path / "ix.sqlite")
    lock = stop.server.trainer._lock  # type: ignore[attr-defined]
    answers: list[tuple[int, Any]] = []
    waiting = min(32, (os.cpu_count() or 1) + 4)  # as many as the default executor has threads
    try:
        sid = _ok(f"{url}/api/sessions?status=finished&limit=1&sort=session_id")["rows"][0]["session_id"]
        threads = [threading.Thread(target=lambda: answers.append(_get(f"{url}/api/session/{sid}/trainer")), daemon=True)
                   for _ in range(waiting)]
        lock.acquire()  # a long scoring under way
        try:
            for t in threads:
                t.start()
            time.sleep(1.0)  # every request is waiting for the scorer
            t0 = time.perf_counter()
            status, view = _get(f"{url}/api/session/{sid}", timeout=20)
            assert status == 200 and view["session_id"] == sid and time.perf_counter() - t0 < 20
        finally:
            lock.release()
        for t in threads:
            t.join(60)
        assert [a[0] for a in answers] == [200] * waiting, answers[:1]
        assert sum(not a[1]["cached"] for a in answers) == 1  # scored once, the others from the cache
    finally:
        stop()


def test_a_session_past_the_bounds_is_refused_before_its_turns_are_expanded(tmp_path):
    """The 413 is decided on the stored turn deltas: expanding every turn's full prompt first
    would take the memory the bounds are there to spare (here about 15 MB, each prompt
    repeating all the turns before)."""
    from agentlog.events.schema.types import Envelope, TurnDelta
    from agentlog.reducers.config import ReduceConfig
    from agentlog.tools.ui.trainer import TooMuchToScore, TrainerScores

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.json").write_text("{}")  # never read: refused before any policy loads
    (tmp_path / "checkpoints" / "policy-v00000.pt").write_bytes(b"")
    new, turns, held = np.arange(2000, dtype="<i4").tobytes(), 60, 0
    envs = []
    for k in range(turns):
        envs.append(Envelope(k, "long", k, k, TurnDelta(k, output_ids=np.int32([7]).tobytes(), shared_tokens=held, new_prompt_ids=new)))
        held += 2000 + 1
    trainer = TrainerScores(tmp_path, ReduceConfig(), max_turns=1000, max_forward_tokens=100_000)
    tracemalloc.start()
    try:
        with pytest.raises(TooMuchToScore, match=f"{turns} turns and {sum(2001 * (k + 1) for k in range(turns)):,} tokens"):
            trainer.session("long", envs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2_000_000, f"{peak:,} bytes taken to refuse"


def test_a_turn_longer_than_the_policys_context_is_a_422_naming_it(ui_run, tmp_path):  # noqa: F811
    """The policy raises for a turn past its max_seq_len: the route answers 422 naming the turn, the
    version and the model's error (it answered a JSON 500 before)."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.loop.run_folder import Run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ui_run.demo / "config.json", run / "config.json")
    shutil.copy(ui_run.demo / "checkpoints" / "policy-v00000.pt", run / "checkpoints" / "policy-v00000.pt")
    context = Run.load_config(run).inference.context_length

    async def write() -> None:
        log = FileLog.open(run / "rollout", fsync="batch")
        eng = await SessionEngine.open(log)
        h = await eng.open_session("long", group_id="g", group_size=1, sample_index=0)
        await h.start()
        await h.record_turn(messages=[{"role": "user", "content": "fits"}], prompt_ids=PROMPT, output_ids=OUTPUT,
                            sampling={"temperature": TEMPERATURE}, response_message={"role": "assistant", "content": "a"})
        await h.record_turn(prompt_ids=[3] * (context + 10), output_ids=SECOND_OUTPUT, sampling={"temperature": TEMPERATURE},
                            response_message={"role": "assistant", "content": "b"})
        await h.finish(reward=1.0)
        await eng.close()
        log.close()

    asyncio.run(write())
    url, stop = start_ui(run, index_path=tmp_path / "ix.sqlite")
    try:
        status, body = _get(f"{url}/api/session/long/trainer")
        assert status == 422, body
        assert "'long'" in body["error"] and "turns [1]" in body["error"] and "policy version 0" in body["error"], body
        assert "max_seq_len" in body["error"], body  # the model's own words
        assert _get(f"{url}/api/session/long")[0] == 200  # the session's view is unaffected
    finally:
        stop()


def test_a_batch_that_fails_where_each_turn_passes_alone_is_scored_turn_by_turn():
    """A batch too big for memory (a RuntimeError, as torch's out-of-memory is) scores turn by turn and
    keeps those scores; only turns the policy refuses alone are named, in a TurnNotScorable."""
    from agentlog.tools.ui.trainer import TrainerScores, TurnNotScorable, _Turn

    class PolicyOfContext:
        """Scores one turn at a time up to 8 tokens (prompt + output); any batch of two or more fails."""

        def score_batch(self, items):
            if len(items) > 1:
                raise RuntimeError("out of memory: tried to allocate 2.00 GiB")
            ((prompt, output, _t),) = items
            if len(prompt) + len(output) > 8:
                raise ValueError(f"position {len(prompt) + len(output) - 1} is beyond max_seq_len=8")
            return [[-0.25 * (k + 1) for k in range(len(output))]]

    def turns(prompt_lengths):
        return [_Turn(index=i, prompt=np.arange(n, dtype=np.int32), output=np.arange(3, dtype=np.int32), temperature=1.0,
                      parts=[(0, 3, 0)]) for i, n in enumerate(prompt_lengths)]

    trainer = TrainerScores(None, None)
    trainer._scorer = lambda version: (PolicyOfContext(), "")
    fits = turns([4, 5, 3])
    assert trainer._score(fits) == {}
    assert [t.log_probs for t in fits] == [[-0.25, -0.5, -0.75]] * 3
    with pytest.raises(TurnNotScorable, match=r"turns \[1\] .*policy version 0.*ValueError: position 9 is beyond max_seq_len=8"):
        trainer._score(turns([4, 7, 3]))
