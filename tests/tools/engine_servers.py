"""Inference servers that follow SGLang's and vLLM's public routes, backed by a real torch
model, for ``verify-tokens`` tests: each runs an aiohttp app in a thread of the test process.

* SGLang: ``POST /generate`` with ``input_ids``: scoring (``max_new_tokens`` 0,
  ``return_logprob``, ``logprob_start_len``: ``meta_info.input_token_logprobs`` as
  ``[logprob, id, null]``, the first position's logprob null) or greedy generation
  (``meta_info.output_token_logprobs``, ``finish_reason`` ``{"type": ...}``).
* vLLM: ``POST /v1/completions`` with a token-id ``prompt``: ``prompt_logprobs`` (per position
  ``{id: {"logprob", "rank", "decoded_token"}}``, null first) and greedy generation
  (``logprobs.token_logprobs``, ``token_ids``); ``POST /tokenize`` with ``messages``
  (the model's chat template, generation prompt added) answers ``{"count", "max_model_len", "tokens"}``.

Log-probs are ``log_softmax(logits / T)`` of one full forward of the sequence (T 1 for a
greedy request), as an engine computes prompt log-probs. Not a test module.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch
from aiohttp import web


class EngineServer:
    """A fake SGLang + vLLM server over ``model`` (and ``template`` for /tokenize)."""

    def __init__(self, model: torch.nn.Module, template: Any = None) -> None:
        self.model = model.eval()
        self.template = template
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---------------------------------------------------------------- model
    def _log_probs(self, ids: list[int], temperature: float) -> list[float | None]:
        """Log-prob of each token given those before it (None for the first)."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids], dtype=torch.long))[0].float()
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]

    def _greedy(self, prompt: list[int], n: int, stops: list[int]) -> tuple[list[int], list[float], str]:
        ids, out, lps = list(prompt), [], []
        with torch.no_grad():
            for _ in range(n):
                logp = torch.log_softmax(self.model(torch.tensor([ids], dtype=torch.long))[0, -1].float(), dim=-1)
                tok = int(logp.argmax())
                out.append(tok)
                lps.append(float(logp[tok]))
                ids.append(tok)
                if tok in stops:
                    return out, lps, "stop"
        return out, lps, "length"

    # ---------------------------------------------------------------- routes
    async def _sglang_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/generate", body))
        ids, sp = body["input_ids"], body.get("sampling_params", {})
        if sp.get("max_new_tokens") == 0:
            start = int(body.get("logprob_start_len", 0))
            lps = self._log_probs(ids, float(sp.get("temperature", 1.0)))
            triples = [[lps[i], ids[i], None] for i in range(start, len(ids))]
            return web.json_response({"text": "", "meta_info": {"input_token_logprobs": triples, "finish_reason": {"type": "length"}}})
        out, lps, finish = self._greedy(ids, int(sp["max_new_tokens"]), list(sp.get("stop_token_ids") or ()))
        meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)], "finish_reason": {"type": finish}}
        return web.json_response({"text": "", "meta_info": meta})

    async def _vllm_completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/v1/completions", body))
        ids = body["prompt"]
        if body.get("prompt_logprobs") is not None:
            lps = self._log_probs(ids, float(body.get("temperature", 1.0)))
            prompt_lps = [None] + [{str(ids[i]): {"logprob": lps[i], "rank": 1, "decoded_token": ""}} for i in range(1, len(ids))]
            choice = {"index": 0, "text": "", "token_ids": [0], "prompt_logprobs": prompt_lps, "finish_reason": "length",
                      "logprobs": {"token_logprobs": [0.0], "tokens": ["token_id:0"]}}
            return web.json_response({"choices": [choice]})
        out, lps, finish = self._greedy(ids, int(body["max_tokens"]), list(body.get("stop_token_ids") or ()))
        choice = {"index": 0, "text": "", "token_ids": out, "finish_reason": finish,
                  "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in out]}}
        return web.json_response({"choices": [choice]})

    async def _vllm_tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("/tokenize", body))
        if self.template is None:
            return web.json_response({"object": "error", "message": "no chat template"}, status=400)
        tokens = self.template.tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        if not isinstance(tokens, list):
            tokens = tokens["input_ids"]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": list(tokens)})

    # ---------------------------------------------------------------- life
    async def _start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self._sglang_generate)
        app.router.add_post("/v1/completions", self._vllm_completions)
        app.router.add_post("/tokenize", self._vllm_tokenize)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    def __enter__(self) -> "EngineServer":
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
