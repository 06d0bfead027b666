"""The online loop with its model served elsewhere: SGLang and vLLM weight sync at loop level.

The real learner and rollout worker run in this process (as in
test_gateway_rollout.py) on a small text task, with the in-code
``tiny-llama`` as the policy and ``[inference] backend`` set to ``sglang``
or ``vllm``. The server is a fake one on loopback (real HTTP) that serves
the real weights: it answers exactly the endpoints the worker's backend and
weight-sync client call, loads every new version with
``AutoModelForCausalLM.from_pretrained`` (from the directory SGLang is told
to load, or from the ``served_dir`` vLLM was launched on), and scores a fixed
reply (``done<|im_end|>``) with the weights it holds right then. So each
recorded turn's log-probs say which weights generated it, and the test can
tie every turn's ``policy_version`` to the published checkpoint it names.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from aiohttp import web

from aiohttp_helpers import serve_app
from hf_helpers import build_once  # noqa: F401  (sets HF_HUB_OFFLINE before transformers is imported)

from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionOpened, TurnRecorded
from agentlog.loop import FaultConfig, LoopConfig, LoopLearner, RolloutWorker, check_run
from agentlog.events import read_log
from agentlog.loop.policy import resolve_hf_model
from agentlog.loop.publish import hf_checkpoint_dir
from agentlog.loop.learner_records import read_learner_records

from test_gateway_rollout import EchoWordTask  # noqa: F401  (registers echo-word-test)

pytestmark = pytest.mark.required

REPLY = "done"


def weights_digest(model_dir: Path) -> str:
    """Which weights a directory holds: the sha256 of its safetensors file."""
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()


class FakeServedModel:
    """A fake SGLang (``kind="sglang"``) or vLLM (``"vllm"``) server over real weights.

    It records, in order, every generation (``("generate", weights)``, with the
    digest of the weights that scored it) and every reload (``("reload",
    weights, generations in flight)``), and checks each request's body: a
    wrong one is answered 400 and noted in ``errors``."""

    def __init__(self, kind: str, model_dir: Path, served_dir: Path | None = None) -> None:
        from transformers import AutoTokenizer

        self.kind = kind
        self.served_dir = served_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model, self.weights = self._load(model_dir)  # what the server was launched on
        self.events: list[tuple] = []
        self.reload_bodies: list[dict] = []
        self.aborts: list[dict] = []
        self.errors: list[str] = []
        #: (output ids, log-probs, the weights that produced them), per generation.
        self.scored: list[tuple[list[int], list[float], str]] = []
        self.inflight = 0
        self.weight_version = "0"
        self.streamed = 0  # /v1/completions answered as a stream
        self.runner: web.AppRunner | None = None
        self.url = ""

    @staticmethod
    def _load(model_dir: Path):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        return model.eval(), weights_digest(model_dir)

    async def start(self) -> "FakeServedModel":
        app = web.Application()
        app.router.add_get("/health", self.health)
        if self.kind == "sglang":
            app.router.add_post("/generate", self.generate)
            app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
            app.router.add_post("/abort_request", self.abort_request)
            app.router.add_post("/pause_generation", self.pause_generation)
            app.router.add_post("/continue_generation", self.continue_generation)
        else:
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_post("/collective_rpc", self.collective_rpc)
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
            app.router.add_post("/pause", self.pause)
            app.router.add_post("/resume", self.resume)
        self.runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    def _bad(self, what: str) -> web.Response:
        self.errors.append(what)
        return web.json_response({"success": False, "message": what, "detail": what}, status=400)

    async def _score(self, prompt: list[int], max_new: int, stop_ids: list[int]) -> tuple[list[int], list[float], str]:
        """The fixed reply, cut to ``max_new`` tokens, log-probs from the weights held right now."""
        import torch

        self.inflight += 1
        try:
            self.events.append(("generate", self.weights))
            weights, model = self.weights, self.model
            eos = self.tokenizer.eos_token_id
            if eos not in stop_ids:
                self.errors.append(f"stop ids {stop_ids} lack the end-of-turn token {eos}")
            ids = (self.tokenizer.encode(REPLY, add_special_tokens=False) + [eos])[:max_new]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
            lps = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
            await asyncio.sleep(0.005)  # a generation takes time: a reload must not land in it
            if self.weights != weights:
                self.errors.append("the weights changed during a generation")
            self.scored.append((ids, lps, weights))
            return ids, lps, "stop" if ids[-1] == eos else "length"
        finally:
            self.inflight -= 1

    def _reloading(self, weights: str) -> None:
        self.events.append(("reload", weights, self.inflight))

    # -- SGLang's native API

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        sp = body.get("sampling_params", {})
        if not (isinstance(body.get("input_ids"), list) and body.get("return_logprob") is True and body.get("rid")
                and sp.get("skip_special_tokens") is False and sp.get("no_stop_trim") is True):
            return self._bad(f"bad /generate body {body}")
        ids, lps, finish = await self._score(body["input_ids"], sp["max_new_tokens"], sp.get("stop_token_ids", []))
        meta = {"output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)], "finish_reason": {"type": finish},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(ids), "id": body["rid"],
                "weight_version": self.weight_version}
        return web.json_response({"text": self.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.reload_bodies.append(body)
        path = Path(body.get("model_path", ""))
        if set(body) != {"model_path", "weight_version", "flush_cache", "abort_all_requests"} or not path.is_dir():
            return self._bad(f"bad /update_weights_from_disk body {body}")
        self._reloading(weights_digest(path))
        self.model, self.weights = await asyncio.to_thread(self._load, path)
        self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body != {"mode": "abort"}:
            return self._bad(f"bad /pause_generation body {body}")
        self.events.append(("pause", self.inflight))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.events.append(("continue",))
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        self.aborts.append(await request.json())
        return web.Response(status=200)

    # -- vLLM's OpenAI completions and dev-mode reload

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") not in (None, str(self.served_dir)):
            # vLLM serves the model under the path it was launched with (no --served-model-name);
            # a request that names none gets that one, any other name is a 404.
            self.errors.append(f"/v1/completions for model {body['model']!r}")
            return web.json_response({"error": {"message": f"The model `{body['model']}` does not exist.", "type": "NotFoundError",
                                                "code": 404}}, status=404)
        if not (isinstance(body.get("prompt"), list) and body.get("logprobs") == 0 and body.get("return_tokens_as_token_ids") is True):
            return self._bad(f"bad /v1/completions body {body}")
        ids, lps, finish = await self._score(body["prompt"], body["max_tokens"], body.get("stop_token_ids", []))
        if body.get("stream"):  # partial rollouts: server-sent events, a token each (as vLLM streams)
            self.streamed += 1
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for k, (i, lp) in enumerate(zip(ids, lps)):
                event = {"choices": [{"index": 0, "text": self.tokenizer.decode([i]), "token_ids": [i],
                                      "finish_reason": finish if k == len(ids) - 1 else None,
                                      "logprobs": {"token_logprobs": [lp], "tokens": [f"token_id:{i}"]}}]}
                await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"choices": [{"index": 0, "text": self.tokenizer.decode(ids), "token_ids": ids, "finish_reason": finish,
                                               "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{i}" for i in ids]}}]})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.reload_bodies.append(body)
        if body != {"method": "reload_weights"}:
            return self._bad(f"bad /collective_rpc body {body}")
        self._reloading(weights_digest(self.served_dir))
        self.model, self.weights = await asyncio.to_thread(self._load, self.served_dir)
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.events.append(("reset_prefix_cache",))
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        if dict(request.query) != {"mode": "abort"}:
            return self._bad(f"bad /pause query {dict(request.query)}")
        self.events.append(("pause", self.inflight))
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.events.append(("continue",))  # SGLang's continue_generation, vLLM's resume: the same step
        return web.json_response({"status": "resumed"})


def _run_served_loop(kind: str, tmp_path: Path, weight_update: str = "drain"):
    """Two RL steps of echo-word-test with tiny-llama served by a fake ``kind`` server, new
    versions loaded as ``weight_update`` says."""
    run_dir = tmp_path / "run"
    base = LoopConfig(task="echo-word-test", hf_model="tiny-llama", seed=3)
    # The model is built into the run folder first, as an operator would launch the server on it.
    model_dir = resolve_hf_model(base, run_dir)
    served = tmp_path / "served"
    if kind == "vllm":
        shutil.copytree(model_dir, served)  # vLLM was launched on this directory and reloads from it

    async def body():
        server = await FakeServedModel(kind, model_dir, served if kind == "vllm" else None).start()
        try:
            inference = {"backend": kind, "url": server.url, "context_length": 512}
            if kind == "vllm":
                inference["served_dir"] = str(served)  # and no [inference] model: the server's one model
            cfg = LoopConfig(task="echo-word-test", hf_model="tiny-llama", seed=3, steps=2, groups_per_step=2, group_size=2,
                             warmup_steps=0, faults=FaultConfig.none(), stop_reward=0, time_budget_s=0, max_lag=0,
                             learner={"lr": 1e-2, "warmup_steps": 0, "entropy_coef": 0.01},
                             agent={"harness": "python-agent", "budget_s": 60}, inference=inference,
                             rollout={"weight_update": weight_update})
            worker = RolloutWorker(run_dir, cfg)
            await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), worker.run()), 60)
            return server, worker, cfg
        finally:
            await server.stop()

    server, worker, cfg = asyncio.run(body())
    return run_dir, server, worker, cfg


@pytest.mark.parametrize("kind, weight_update", [("sglang", "drain"), ("vllm", "drain"), ("sglang", "resubmit"),
                                                 ("vllm", "resubmit")])
def test_a_served_model_is_reloaded_between_batches_and_every_turn_records_the_weights_that_made_it(kind, weight_update, tmp_path):
    """With max_lag 0 no version is published while a batch generates, so partial rollouts
    (resubmit: SGLang's pause, update, continue; vLLM's streamed answers) go through the
    same sequence as draining, with the pause and continue calls around each SGLang reload."""
    run_dir, server, worker, cfg = _run_served_loop(kind, tmp_path, weight_update)
    assert not server.errors, server.errors
    assert (server.streamed > 0) == (kind == "vllm" and weight_update == "resubmit")
    # The worker held only the tokenizer: the server holds the weights.
    assert worker.model is None and worker.tokenizer is not None

    records = read_learner_records(run_dir / "learner")
    assert [r.policy_version for r in records] == [0, 1, 2]
    version_of = {weights_digest(hf_checkpoint_dir(r.checkpoint)): r.policy_version for r in records}
    assert len(version_of) == 3, "each version's weights differ (else the log-probs could not tell them apart)"
    published = [str(hf_checkpoint_dir(r.checkpoint)) for r in records]
    # A partial mode loads each version as soon as it is published: the last one too, when it
    # appears before the worker stops (it trains nothing more).
    reloads = len(server.reload_bodies)
    assert reloads == 2 or (weight_update != "drain" and reloads == 3), server.reload_bodies
    if kind == "sglang":
        assert [(b["model_path"], b["weight_version"]) for b in server.reload_bodies] == [(published[v], str(v)) for v in range(reloads)]
        assert not server.aborts  # nothing was cancelled
    else:
        assert server.reload_bodies == [{"method": "reload_weights"}] * reloads

    envs = list(read_log(run_dir / "rollout", 0))
    turns = [e for e in full_turns(envs) if isinstance(e.body, TurnRecorded)]
    per_batch = {b: [t for t in turns if t.session_id.startswith(f"b0000{b}")] for b in (0, 1)}
    assert per_batch[0] and per_batch[1] and len(turns) == len(per_batch[0]) + len(per_batch[1])
    # On the server: load v0, batch 0's generations, load v1 with none in flight, batch 1's generations
    # (vLLM: each reload followed by its prefix-cache reset).
    digest = {v: d for d, v in version_of.items()}
    reset = [("reset_prefix_cache",)] if kind == "vllm" else []
    paused = weight_update == "resubmit"  # SGLang: pause, update, continue; vLLM: pause, reload, reset, resume

    def reload(v: int) -> list:
        return ([("pause", 0)] if paused else []) + [("reload", digest[v], 0)] + reset + ([("continue",)] if paused else [])

    expected = (reload(0) + [("generate", 0)] * len(per_batch[0]) + reload(1) + [("generate", 1)] * len(per_batch[1])
                + (reload(2) if reloads == 3 else []))
    seen = [(e[0], version_of.get(e[1], "unpublished weights")) if e[0] == "generate" else e for e in server.events]
    assert seen == expected, seen
    # Every turn records its batch's version, and the log-probs it records came from that version's weights.
    for b, batch_turns in per_batch.items():
        for t in batch_turns:
            assert t.body.policy_version == b, (t.session_id, t.body.policy_version)
            ids, lps = t.body.output_tokens.tolist(), t.body.log_probs.tolist()
            # Recorded as float32: the same generation within 1e-5, another version's weights far from it.
            made_by = {version_of[w] for i, lp, w in server.scored if i == ids and max(abs(x - y) for x, y in zip(lp, lps)) < 1e-5}
            assert made_by == {b}, (t.session_id, made_by)

    opened = [e.session_id for e in envs if isinstance(e.body, SessionOpened)]
    terminal = [e.session_id for e in envs if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped))]
    assert len(opened) == 8 and sorted(terminal) == sorted(opened), (opened, terminal)  # exactly one terminal event each
    assert all(isinstance(e.body, SessionFinished) for e in envs if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped)))
    check = check_run(run_dir, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.digests_equal == check.steps == 2


def test_a_fleet_loses_no_turn_when_a_server_dies_mid_run_and_the_run_reconstructs_equal(tmp_path):
    """Three fake SGLang servers behind ``[inference] servers``; one is stopped while batch 0
    generates. Its generations in flight are retried on another server (nothing was recorded),
    its sessions move and say so, the update to version 1 reaches the two left (the dead one
    is out of routing), and the run's samples rebuild EQUAL."""
    from agentlog.events.schema.turn import turn_server

    run_dir = tmp_path / "run"
    base = LoopConfig(task="echo-word-test", hf_model="tiny-llama", seed=3)
    model_dir = resolve_hf_model(base, run_dir)

    async def body():
        servers = [await FakeServedModel("sglang", model_dir).start() for _ in range(3)]
        names = [s.url.split("://", 1)[1] for s in servers]
        victim = servers[0]

        async def kill_mid_batch() -> None:
            while len(victim.scored) < 1:
                await asyncio.sleep(0.005)
            await victim.stop()

        try:
            cfg = LoopConfig(task="echo-word-test", hf_model="tiny-llama", seed=3, steps=2, groups_per_step=4, group_size=2,
                             warmup_steps=0, faults=FaultConfig.none(), stop_reward=0, time_budget_s=0, max_lag=0,
                             learner={"lr": 1e-2, "warmup_steps": 0, "entropy_coef": 0.01},
                             agent={"harness": "python-agent", "budget_s": 60},
                             inference={"backend": "sglang", "servers": [s.url for s in servers], "context_length": 512,
                                        "probe_interval_s": 0.05})
            worker = RolloutWorker(run_dir, cfg)
            await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), worker.run(), kill_mid_batch()), 90)
            return servers, names, cfg
        finally:
            for s in servers[1:]:
                await s.stop()

    servers, names, cfg = asyncio.run(body())
    assert not any(s.errors for s in servers), [s.errors for s in servers]
    envs = list(read_log(run_dir / "rollout", 0))
    turns = [e for e in full_turns(envs) if isinstance(e.body, TurnRecorded)]
    by_session: dict[str, list] = {}
    for t in turns:
        by_session.setdefault(t.session_id, []).append(t.body)
    for sid, bodies in by_session.items():
        assert [b.turn_index for b in bodies] == list(range(len(bodies))), sid  # none lost, none twice
    placed = [turn_server(b) for bodies in by_session.values() for b in bodies]
    assert {s for s, _ in placed} <= set(names) and all(s for s, _ in placed)
    # The dead server answered only before it died: no turn of version 1 names it.
    assert all(turn_server(t.body)[0] != names[0] for t in turns if t.body.policy_version == 1)
    assert len(servers[0].reload_bodies) == 1  # version 0 only; the update to 1 could not reach it
    assert all(len(s.reload_bodies) >= 2 for s in servers[1:])
    opened = [e.session_id for e in envs if isinstance(e.body, SessionOpened)]
    assert all(isinstance(e.body, SessionFinished) for e in envs if isinstance(e.body, (SessionFinished, SessionAborted, SessionDropped)))
    assert len(opened) == 16
    check = check_run(run_dir, cfg)
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.digests_equal == check.steps == 2
