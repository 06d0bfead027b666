"""The policy side of the loop: the model and batched generation.

The worker's many concurrent sessions ask for generations one at a time, as
agents ask an inference server; :class:`GenerationBatcher` gathers those
requests and runs one batched ``GPT.sample`` for all of them, so the
sessions stay independent coroutines (a session that fails never holds the
others up) while the model still sees batches.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

from agentlog.engine.tasks import Task
from agentlog.events.fs import write_dir_atomically
from agentlog.learner.model import GPT, GPTConfig

from .config import ConfigError, LoopConfig

#: Where a run keeps the tiny HF model it built (``<run>/hf-model/<name>``).
HF_MODEL_DIR = "hf-model"


def resolve_hf_model(cfg: LoopConfig, run_dir: Path | None = None) -> Path | None:
    """The local directory of ``cfg.hf_model``, or None for the built-in GPT.

    The in-code names (``tiny-llama``, ``tiny-qwen2``) are built on first use
    into ``<run>/hf-model/<name>`` (seeded from ``cfg.seed``; built in a
    temporary directory and renamed, so a process that reads it never sees
    half of it). Anything else must be an existing local directory: nothing
    is ever downloaded."""
    from agentlog.learner.hf_tiny import TINY_MODELS

    name = cfg.hf_model
    if not name:
        return None
    if name in TINY_MODELS:
        if run_dir is None:
            raise ConfigError(f"LoopConfig.hf_model: {name!r} is built into the run folder, and none was given")
        target = Path(run_dir) / HF_MODEL_DIR / name
        if not (target / "config.json").exists():
            from agentlog.learner.hf_tiny import build_tiny_hf

            write_dir_atomically(target, lambda tmp: build_tiny_hf(tmp, TINY_MODELS[name], seed=cfg.seed), replace=False)
        return target
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"LoopConfig.hf_model: {name!r} is not a local Hugging Face model directory (no config.json there) "
            f"and not one of the in-code models {sorted(TINY_MODELS)}; nothing is downloaded"
        )
    return path.resolve()


def load_tokenizer(hf_dir: Path | None) -> Any:
    """The tokenizer of the local HF model directory ``hf_dir`` (never downloaded); a
    ConfigError names the directory when there is none or it has no tokenizer."""
    if hf_dir is None:
        raise ConfigError("LoopConfig.hf_model: a tokenizer was needed, and no HF model is configured")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"LoopConfig.hf_model: no tokenizer could be loaded from {hf_dir} ({type(exc).__name__}: {exc})") from exc


def build_model(cfg: LoopConfig, task: Task, run_dir: Path | None = None) -> torch.nn.Module:
    """The policy: the HF model of ``cfg.hf_model`` when set (:func:`resolve_hf_model`),
    else the built-in GPT sized for ``task`` (seeded from ``cfg.seed``); for a
    text task, the one the gateway's byte-level template reads and writes."""
    hf_dir = resolve_hf_model(cfg, run_dir)
    if hf_dir is not None:
        from agentlog.learner.hf_model import HFCausalLM

        return HFCausalLM(hf_dir, gradient_checkpointing=cfg.gradient_checkpointing)
    from agentlog.engine.tasks import TextTask

    if isinstance(task, TextTask):
        # The built-in GPT the gateway's byte-level template reads and writes.
        from .gateway_rollout import build_text_model

        return build_text_model(cfg)
    torch.manual_seed(cfg.seed)
    max_len = len(task.new_episode(random.Random(0)).prompt_ids) + task.max_turns * (task.max_new_tokens + 8) + 8
    model = GPT(
        GPTConfig(
            vocab_size=task.vocab_size,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            d_model=cfg.d_model,
            max_seq_len=max(64, max_len),
            tie_embeddings=cfg.tie_embeddings,
        )
    )
    if cfg.embedding_init_std > 0:
        # Measured on the lookup task (tied embeddings, so the output layer
        # starts as a token-identity read-out): with GPT-2's 0.02 init the
        # warmed-up policy never learns to copy the tool's value under RL
        # (reward flat at ~0.05 for 100 steps). With torch's default N(0, 1)
        # it learns, but its logits are so large that on some seeds a few
        # values collapse onto one wrong answer with probability ~1, where the
        # policy gradient vanishes (seed 3 stuck at 0.81-0.87 for 400 steps).
        # N(0, 0.5) reaches a 10-step mean of 0.9 in 24-35 steps on seeds 0-4.
        torch.nn.init.normal_(model.tok_emb.weight, std=cfg.embedding_init_std)
        torch.nn.init.normal_(model.pos_emb.weight, std=cfg.embedding_init_std)
    return model


@dataclass
class Generated:
    """One generation handed back to a session."""

    tokens: np.ndarray  # int32
    log_probs: np.ndarray  # float32
    finish_reason: str  # stop / length
    policy_version: int
    generate_s: float
    #: ``((first token, version), ...)`` when a weight update landed mid-generation, else UNSET.
    version_spans: Any = msgspec.UNSET


class GenerationBatcher:
    """Gathers generation requests from concurrent sessions into batched ``sample`` calls.

    A batch runs as soon as every registered session is waiting for a
    generation, or ``max_wait_s`` after its first request, whichever comes
    first. ``before_batch`` (if set) runs just before each batch: the worker
    uses it to load newer weights, so each turn records the version that
    really generated it. With ``weight_update`` ``"continue"`` or
    ``"resubmit"`` it also runs at the batch's token boundaries (at most every
    ``check_every_s``), and a version it loads there applies from the next
    token on (a partial rollout, recorded as the turn's version spans).
    """

    def __init__(self, model: GPT, task: Task, *, seed: int, max_wait_s: float = 0.02, before_batch=None,
                 temperature: float = 1.0, weight_update: str = "drain", check_every_s: float = 0.02) -> None:
        self.model = model
        self.task = task
        self.temperature = temperature  # sessions record it with each turn
        self.version = 0
        self.max_wait_s = max_wait_s
        self.before_batch = before_batch
        self.generator = torch.Generator().manual_seed(seed)
        self._active = 0
        self._pending: list[tuple[Sequence[int], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self.batches = 0
        self.busy_s = 0.0
        self.weight_update = weight_update
        self.check_every_s = check_every_s
        self._checked_at = 0.0

    def register(self) -> None:
        """A session that will ask for generations started."""
        self._active += 1

    def unregister(self) -> None:
        """A session will ask for no more generations."""
        self._active -= 1
        self._wake.set()

    async def generate(self, prompt_ids: Sequence[int]) -> Generated:
        """Sample one turn for ``prompt_ids`` (batched with the other sessions)."""
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run())
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, fut))
        self._wake.set()
        return await fut

    async def close(self) -> None:
        """Stop the batching task."""
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            deadline = time.monotonic() + self.max_wait_s
            while len(self._pending) < self._active and time.monotonic() < deadline:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    break
            batch, self._pending = self._pending, []
            batch = [(p, f) for p, f in batch if not f.done()]  # cancelled sessions
            if not batch:
                continue
            if self.before_batch is not None:
                self.before_batch()
            t0 = time.perf_counter()
            results = self._sample([list(map(int, p)) for p, _ in batch])
            dt = time.perf_counter() - t0
            self.busy_s += dt
            self.batches += 1
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(Generated(res[0], res[1], res[2], res[3], dt, res[4]))
            # Let the sessions we just served run before we gather the next batch.
            await asyncio.sleep(0)

    def _sample(self, prompts: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray, str, int, Any]]:
        """One batch: per prompt (tokens, log-probs, finish reason, policy version, version spans)."""
        allowance = self.task.max_new_tokens
        if self.weight_update == "drain":
            gen = self.model.sample(prompts, allowance, temperature=self.temperature, stop_ids=(self.task.eos_id,),
                                    generator=self.generator)
            return [(gen.tokens[i], gen.log_probs[i], gen.finish_reasons[i], self.version, msgspec.UNSET)
                    for i in range(len(prompts))]
        from agentlog.events.schema.turn import canonical_version_spans
        from agentlog.gateway.torch_backend import sample_through_updates

        rows = sample_through_updates(self.model, prompts, [allowance] * len(prompts), stops=(self.task.eos_id,),
                                      temperature=self.temperature, generator=self.generator, mode=self.weight_update,
                                      version=self.version, updates=self._updates_between_tokens)
        out = []
        for toks, lps, starts in rows:
            finish = "stop" if toks and toks[-1] == self.task.eos_id else "length"
            version, spans = canonical_version_spans(starts, len(toks))
            out.append((np.asarray(toks, dtype=np.int32), np.asarray(lps, dtype=np.float32), finish, version, spans))
        return out

    def _updates_between_tokens(self) -> list[int]:
        """At a token boundary: load newer weights (``before_batch``), at most every ``check_every_s``."""
        now = time.monotonic()
        if self.before_batch is None or now - self._checked_at < self.check_every_s:
            return []
        self._checked_at = now
        old = self.version
        self.before_batch()
        return [self.version] if self.version != old else []
