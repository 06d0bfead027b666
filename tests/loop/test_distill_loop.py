"""On-policy distillation in the online loop: the worker scores every finished session with its teachers.

A short real loop (the learner and the rollout worker in this process) on the
lookup task, with the ``[distill]`` table set: every turn of every finished
session gets one ``teacher_scored`` event per teacher, after the turn and
before the session's terminal event; aborted and dropped sessions get none.
A teacher server that fails (HTTP 500) or is too slow (past ``timeout_s``)
gives recorded teacher failures instead, and the samples of those sessions
say they cannot be distilled (``distill_problem``), so they are never
trained by distillation without scores.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
import torch
from aiohttp import web

from aiohttp_helpers import serve_app

from agentlog.engine.tasks import select_task
from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionOpened, TeacherScored, TurnDelta, TurnRecorded
from agentlog.learner.learner import save_state
from agentlog.loop import FaultConfig, LoopLearner, RolloutWorker, check_run
from agentlog.events import FileLog, read_log
from agentlog.loop.config import ConfigError, DistillConfig, LoopConfig
from agentlog.loop.policy import build_model
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.samples import distill_problem

from loop_helpers import small_config
from teacher_helpers import sglang_answer


def teacher_file(tmp_path: Path, cfg: LoopConfig, seed: int = 7) -> Path:
    """A built-in GPT teacher for cfg's task (another seed than the student), saved as a policy file."""
    model = build_model(dataclasses.replace(cfg, seed=seed), select_task(cfg.task))
    return save_state({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, tmp_path / "teacher.pt")


def run_loop_here(run_dir: Path, cfg: LoopConfig) -> None:
    async def train() -> None:
        await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), RolloutWorker(run_dir, cfg).run()), 120)

    asyncio.run(train())


def sessions_of(run_dir: Path, *, envelopes: bool = False) -> dict[str, list]:
    """Session id -> its event bodies (or envelopes) in log order."""
    log = FileLog.open(run_dir / "rollout", fsync="never")
    try:
        out: dict[str, list] = {}
        for env in log.read(0):
            if env.session_id:
                out.setdefault(env.session_id, []).append(env if envelopes else env.body)
        return out
    finally:
        log.close()


#: The teacher's timeout in the loop tests: generous, since the fake server shares the test's
#: event loop (and two CPUs) with the learner and the worker; a "slow" answer takes twice as long.
TEACHER_TIMEOUT_S = 2.0


def loop_config(steps: int = 3, **distill) -> LoopConfig:
    return small_config(steps=steps, groups_per_step=4, group_size=4, stop_reward=0, temperature=0.8,
                        faults=FaultConfig(exception_rate=0.1, timeout_rate=0.0, drop_rate=0.1, straggler_rate=0.0,
                                           empty_marker_rate=0.0),
                        distill=distill)


def test_torch_teacher_scores_every_turn_of_every_finished_session_before_its_end(tmp_path):
    path = teacher_file(tmp_path, loop_config())
    cfg = loop_config(teachers=[{"name": "gpt-big", "checkpoint": str(path)}], topk=2)
    run_dir = tmp_path / "run"
    run_loop_here(run_dir, cfg)

    from agentlog.loop.teacher import TorchTeacher

    teacher = TorchTeacher.from_checkpoint(path, name="gpt-big")
    sessions = sessions_of(run_dir)
    finished = [s for s, ev in sessions.items() if isinstance(ev[-1], SessionFinished)]
    ended_otherwise = [s for s, ev in sessions.items() if isinstance(ev[-1], (SessionAborted, SessionDropped))]
    assert len(finished) >= 8 and ended_otherwise, "the run should have both finished and aborted/dropped sessions"
    checked = 0
    for sid, events in sessions.items():
        turns = [e for e in events if isinstance(e, (TurnRecorded, TurnDelta))]
        scored = [e for e in events if isinstance(e, TeacherScored)]
        if sid not in finished:
            assert scored == [], f"{sid} ended {type(events[-1]).__name__} and was scored"
            continue
        end = len(events) - 1
        assert sorted(e.turn_index for e in scored) == list(range(len(turns))), sid
        for e in scored:
            pos = events.index(e)
            turn_pos = [i for i, x in enumerate(events) if isinstance(x, (TurnRecorded, TurnDelta))][e.turn_index]
            assert turn_pos < pos < end, f"{sid}: teacher_scored of turn {e.turn_index} not between its turn and the end"
            assert e.error == "" and e.teacher == "gpt-big" and e.teacher_version == teacher.version
            assert e.temperature == 0.8 and e.top_k == 2 and e.start == 0
        # The recorded scores are the teacher's own (checked on the first session).
        if checked == 0:
            opened = events[0]
            assert isinstance(opened, SessionOpened)
            from agentlog.events.schema.turn_delta import full_turns

            full = [env.body for env in full_turns(sessions_of(run_dir, envelopes=True)[sid]) if isinstance(env.body, TurnRecorded)]
            for e in scored:
                t = full[e.turn_index]
                prompt = [int(x) for x in np.frombuffer(t.prompt_ids, "<i4")]
                output = [int(x) for x in np.frombuffer(t.output_ids, "<i4")]
                want = asyncio.run(teacher.score(prompt, output, temperature=0.8, top_k=2))
                np.testing.assert_allclose(e.scores, want.log_probs, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(e.top()[0], want.top_ids)
            checked += 1
    assert checked
    # Every trained sample carries the teacher's scores on each of its trained tokens.
    res = reduce_log(FileLog.open(run_dir / "rollout", fsync="never"), ReduceConfig(min_valid=cfg.min_valid))
    finished_samples = [s for g in res.groups for m in g.members if m.status == "finished" for s in m.samples]
    assert finished_samples and all(distill_problem(s) == "" for s in finished_samples)
    assert all(s.metadata.get("teachers") == [f"gpt-big@{teacher.version}"] for s in finished_samples)
    assert check_run(run_dir, cfg).ok


class FlakyTeacherServer:
    """A fake SGLang teacher whose answers go through ``modes`` in turn: ok, HTTP 500, or too slow
    (past the client's timeout)."""

    def __init__(self, model: torch.nn.Module, temperature: float, modes=("ok",) * 5 + ("http500",) + ("ok",) * 5 + ("slow",)) -> None:
        self.model = model
        self.temperature = temperature
        self.modes = itertools.cycle(modes)
        self.errors: list[str] = []
        self.served = {"ok": 0, "http500": 0, "slow": 0}

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner, url = await serve_app(app)
        return url

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids, start, sp = body["input_ids"], body["logprob_start_len"], body["sampling_params"]
        if sp.get("max_new_tokens") != 0 or sp.get("temperature") != self.temperature or body.get("return_logprob") is not True \
                or not 0 <= start < len(ids) - 1:
            self.errors.append(json.dumps(body)[:200])
            return web.json_response({"error": "bad request"}, status=400)
        mode = next(self.modes)
        self.served[mode] += 1
        if mode == "http500":
            return web.Response(status=500, text="teacher overloaded")
        if mode == "slow":
            await asyncio.sleep(2 * TEACHER_TIMEOUT_S)
        return web.json_response(sglang_answer(self.model, body))


def run_with_flaky_teacher(run_dir: Path, server_modes: Sequence[str] | None = None, **distill) -> tuple[LoopConfig, FlakyTeacherServer]:
    """Two steps of the loop with one teacher, "remote", served by a FlakyTeacherServer over a
    built-in GPT (its answers going through ``server_modes``); ``distill`` adds [distill] settings."""
    cfg0 = loop_config()
    model = build_model(dataclasses.replace(cfg0, seed=7), select_task(cfg0.task)).eval()
    server = FlakyTeacherServer(model, 0.8, *([server_modes] if server_modes else []))

    async def go() -> LoopConfig:
        url = await server.start()
        cfg = loop_config(2, teachers=[{"name": "remote", "url": url, "version": "teacher-v3", "scales_temperature": True}],
                          timeout_s=TEACHER_TIMEOUT_S, **distill)
        try:
            await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), RolloutWorker(run_dir, cfg).run()), 120)
        finally:
            await server.runner.cleanup()
        return cfg

    return asyncio.run(go()), server


def test_a_failing_teacher_server_is_recorded_and_its_groups_are_never_distilled_without_scores(tmp_path):
    run_dir = tmp_path / "run"
    cfg, server = run_with_flaky_teacher(run_dir)
    assert server.errors == []
    assert min(server.served.values()) >= 1, server.served
    sessions = sessions_of(run_dir)
    failures = {"http500": 0, "timeout": 0}
    failed_sessions = set()
    for sid, events in sessions.items():
        scored = [e for e in events if isinstance(e, TeacherScored)]
        if not isinstance(events[-1], SessionFinished):
            assert scored == []
            continue
        turns = [e for e in events if isinstance(e, (TurnRecorded, TurnDelta))]
        assert sorted(e.turn_index for e in scored) == list(range(len(turns)))
        for e in scored:
            assert e.teacher_version == "teacher-v3"
            if e.error:
                failed_sessions.add(sid)
                assert e.log_probs == b"" and e.top_k == 0
                if "answered HTTP 500, expected 200: teacher overloaded" in e.error:
                    failures["http500"] += 1
                elif f"no answer within {TEACHER_TIMEOUT_S:g} s" in e.error or f"no scores within {TEACHER_TIMEOUT_S:g} s ([distill] timeout_s)" in e.error:
                    # The client's own timeout or the worker's cap on the whole score, whichever fires first.
                    failures["timeout"] += 1
                else:
                    pytest.fail(f"unexpected teacher error: {e.error}")
    assert failures["http500"] >= 1 and failures["timeout"] >= 1, failures
    # Each sample of a session whose teacher failed says why it cannot be distilled; the others can be.
    res = reduce_log(FileLog.open(run_dir / "rollout", fsync="never"), ReduceConfig(min_valid=cfg.min_valid))
    for g in res.groups:
        for m in g.members:
            if m.status != "finished":
                continue
            for s in m.samples:
                problem = distill_problem(s)
                if m.session_id in failed_sessions:
                    assert "remote" in problem, (m.session_id, problem)
                else:
                    assert problem == "", problem
    assert any(distill_problem(s) for g in res.groups for s in g.samples)
    assert check_run(run_dir, cfg).ok


def test_distill_table_is_checked_and_feeds_the_learner_config(tmp_path):
    cfg = LoopConfig.from_dict({"distill": {"coef": 0.5, "topk": 4, "teachers": [
        {"name": "a", "checkpoint": "t.pt"}, {"name": "b", "url": "http://127.0.0.1:30000", "version": "v1"}]}},
        base_dir=tmp_path)
    assert cfg.distill.teachers[0].checkpoint == str(tmp_path / "t.pt")
    assert LoopConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).distill == cfg.distill
    assert cfg.learner_config().distill_coef == 0.5  # [distill] coef is the learner's lambda
    clash = LoopConfig.from_dict({"learner": {"distill_coef": 0.3}, "distill": {"coef": 0.5, "teachers": [{"name": "a", "url": "http://x"}]}})
    with pytest.raises(ConfigError, match=r"distill_coef: \[learner\] says 0.3 and \[distill\] coef says 0.5; keep one"):
        clash.learner_config()
    for bad, match in [
        ({"coef": 0.5}, "no teachers are configured"),
        ({"teachers": [{"name": "a"}]}, r"expected exactly one of \['url', 'checkpoint', 'hf_model'\], found none"),
        ({"teachers": [{"name": "a", "url": "http://x", "checkpoint": "y"}]}, "found \\['url', 'checkpoint'\\]"),
        ({"teachers": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "names must be unique"),
        ({"teachers": [{"name": "a", "checkpoint": "x", "version": "v"}]}, "version is for url teachers"),
        ({"teachers": [{"name": "a", "checkpoint": "x", "scales_temperature": True}]}, "scales_temperature is for url teachers"),
        ({"teachers": [{"name": "a", "url": "http://x", "port": 1}]}, r"unknown key\(s\) \['port'\]"),
        ({"timeout_s": 0}, "timeout_s: expected a number of seconds > 0"),
        ({"topk": -1}, "topk: expected an int >= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            LoopConfig.from_dict({"distill": bad})
    assert DistillConfig().teachers == [] and LoopConfig().distill.coef == 0.0
    # A TOML file: [distill] with [[distill.teachers]] tables, paths relative to the file.
    (tmp_path / "conf").mkdir()
    toml = tmp_path / "conf" / "run.toml"
    toml.write_text('steps = 2\n[distill]\ncoef = 0.25\ntimeout_s = 5\n'
                    '[[distill.teachers]]\nname = "big"\ncheckpoint = "teachers/big.pt"\n'
                    '[[distill.teachers]]\nname = "served"\nurl = "http://10.0.0.7:30000/generate"\n')
    cfg = LoopConfig.load(toml)
    assert [(t.name, t.checkpoint, t.url) for t in cfg.distill.teachers] == [
        ("big", str(tmp_path / "conf" / "teachers" / "big.pt"), ""), ("served", "", "http://10.0.0.7:30000/generate")]
    assert (cfg.distill.coef, cfg.distill.timeout_s, cfg.distill.topk) == (0.25, 5, 0)


def test_text_task_sessions_are_scored_through_the_gateways_recorded_turns(tmp_path):
    """A text task (turns recorded by the gateway): each finished session's turns are scored
    before its end with the turns' own prompt and output ids, equal to the teacher's scores of them."""
    from test_gateway_rollout import EchoWordTask  # noqa: F401  (registers echo-word-test)

    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.loop.gateway_rollout import build_text_model
    from agentlog.loop.teacher import TorchTeacher

    base = dict(task="echo-word-test", steps=1, groups_per_step=2, group_size=2, warmup_steps=0, faults=FaultConfig.none(),
                stop_reward=0, time_budget_s=0, max_lag=0, d_model=32, n_layer=1, n_head=2, temperature=0.9,
                agent={"harness": "python-agent", "budget_s": 60}, inference={"context_length": 512})
    model = build_text_model(LoopConfig(**{**base, "seed": 5}))
    path = save_state({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, tmp_path / "text-teacher.pt")
    cfg = LoopConfig(**base, distill={"teachers": [{"name": "bytes", "checkpoint": str(path)}]})
    run_dir = tmp_path / "run"
    run_loop_here(run_dir, cfg)
    teacher = TorchTeacher.from_checkpoint(path, name="bytes")
    envs = list(read_log(run_dir / "rollout", 0))
    full = {(e.session_id, e.body.turn_index): e.body for e in full_turns(envs) if isinstance(e.body, TurnRecorded)}
    finished = {e.session_id: e.lsn for e in envs if isinstance(e.body, SessionFinished)}
    assert len(finished) == 4
    scored = [e for e in envs if isinstance(e.body, TeacherScored)]
    assert {(e.session_id, e.body.turn_index) for e in scored} == set(full)
    for e in scored:
        assert e.lsn < finished[e.session_id] and e.body.error == "" and e.body.temperature == 0.9
        t = full[(e.session_id, e.body.turn_index)]
        prompt = [int(x) for x in np.frombuffer(t.prompt_ids, "<i4")]
        output = [int(x) for x in np.frombuffer(t.output_ids, "<i4")]
        want = asyncio.run(teacher.score(prompt, output, temperature=0.9))
        np.testing.assert_allclose(e.body.scores, want.log_probs, rtol=1e-5, atol=1e-6)
    assert check_run(run_dir, cfg).ok


def test_distilling_learner_skips_the_groups_a_teacher_failed_on_and_trains_the_others(tmp_path):
    """With distill coef > 0 and a teacher server that sometimes fails, no group with a teacher
    failure is trained: each is recorded skipped with a 'distill: ...' reason naming the teacher."""
    from agentlog.loop.learner_records import read_learner_records

    run_dir = tmp_path / "run"
    cfg, server = run_with_flaky_teacher(run_dir, ["ok"] * 20 + ["http500"] + ["ok"] * 20 + ["slow"], coef=0.5)
    assert cfg.learner_config().distill_coef == 0.5
    assert server.errors == [] and server.served["http500"] and server.served["slow"], server.served
    failed_groups = {sid.rsplit("-", 1)[0] for sid, events in sessions_of(run_dir).items()
                     if isinstance(events[-1], SessionFinished) and any(isinstance(e, TeacherScored) and e.error for e in events)}
    records = read_learner_records(run_dir / "learner")
    trained = {g for r in records for g in r.groups}
    skipped = {g: why for r in records for g, why in r.skipped.items()}
    assert failed_groups and trained, (failed_groups, trained)
    for g in failed_groups:
        assert g not in trained, f"group {g} trained although its teacher failed"
        if g in skipped and skipped[g].startswith("distill:"):
            assert "remote" in skipped[g], skipped[g]
    assert any(skipped.get(g, "").startswith("distill:") for g in failed_groups), skipped
    assert check_run(run_dir, cfg).ok
