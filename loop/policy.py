"""The policy side of the loop: the model, its supervised warm-up, and batched generation.

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
from typing import Sequence

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from agentlog.engine.tasks import Task
from agentlog.learner.model import GPT, GPTConfig
from agentlog.learner.optim import make_scheduler

from .config import LoopConfig

log = structlog.get_logger()


def build_model(cfg: LoopConfig, task: Task) -> GPT:
    """The built-in GPT sized for ``task`` (seeded from ``cfg.seed``)."""
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


def demonstration_batch(task: Task, rng: random.Random, n: int, wrong_rate: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` demonstration episodes as right-padded (ids, loss mask) tensors.

    The mask is 1 on generated-turn tokens and 0 on the prompt and tool
    output, exactly as the trajectory reducer masks real rollouts.
    """
    seqs: list[list[int]] = []
    masks: list[list[int]] = []
    for _ in range(n):
        ep = task.new_episode(rng)
        turns = task.demonstration(ep, rng, wrong_answer_rate=wrong_rate)
        ids = list(ep.prompt_ids)
        mask = [0] * len(ids)
        for t, out in enumerate(turns):
            ids += out
            mask += [1] * len(out)
            tool = task.tool_step(ep, t, out)
            if tool is None:
                break
            ids += tool.ids
            mask += [0] * len(tool.ids)
        seqs.append(ids)
        masks.append(mask)
    width = max(map(len, seqs))
    ids_t = torch.zeros(n, width, dtype=torch.long)
    mask_t = torch.zeros(n, width, dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids_t[i, : len(s)] = torch.tensor(s)
        mask_t[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids_t, mask_t


def supervised_warmup(model: GPT, task: Task, cfg: LoopConfig) -> dict[str, float]:
    """Teach the protocol before RL: ``cfg.warmup_steps`` steps of token-level
    cross-entropy on demonstrations whose answers are wrong with probability
    ``cfg.warmup_wrong_rate`` (AdamW, lr from the learner config, linear lr
    warm-up, grad-clip 1.0). Returns the final loss and timing."""
    if cfg.warmup_steps == 0:
        return {"warmup/steps": 0.0}
    lcfg = cfg.learner_config()
    rng = random.Random(cfg.seed * 7919 + 17)
    opt = torch.optim.AdamW(model.parameters(), lr=lcfg.lr, weight_decay=0.0)
    sched = make_scheduler(type(lcfg)(lr=lcfg.lr, warmup_steps=cfg.warmup_lr_steps), opt)
    model.train()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.warmup_threads)
    try:
        loss_v = _warmup_steps(model, task, cfg, rng, opt, sched)
    finally:
        torch.set_num_threads(threads)
    return {"warmup/steps": float(cfg.warmup_steps), "warmup/loss": loss_v, "warmup/seconds": time.perf_counter() - t0}


def _warmup_steps(model: GPT, task: Task, cfg: LoopConfig, rng: random.Random, opt, sched) -> float:
    loss_v = float("nan")
    for step in range(cfg.warmup_steps):
        ids, mask = demonstration_batch(task, rng, cfg.warmup_batch, cfg.warmup_wrong_rate)
        logits = model(ids[:, :-1])
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        m = mask[:, 1:].reshape(-1)
        loss = (nll * m).sum() / m.sum().clamp(min=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_v = loss.item()
        if step % 100 == 0:
            log.info("warmup.step", step=step, loss=round(loss_v, 4))
    return loss_v


@dataclass
class Generated:
    """One generation handed back to a session."""

    tokens: np.ndarray  # int32
    log_probs: np.ndarray  # float32
    finish_reason: str  # stop / length
    policy_version: int
    generate_s: float


class GenerationBatcher:
    """Gathers generation requests from concurrent sessions into batched ``sample`` calls.

    A batch runs as soon as every registered session is waiting for a
    generation, or ``max_wait_s`` after its first request, whichever comes
    first. ``before_batch`` (if set) runs just before each batch: the worker
    uses it to load newer weights, so each turn records the version that
    really generated it.
    """

    def __init__(self, model: GPT, task: Task, *, seed: int, max_wait_s: float = 0.02, before_batch=None,
                 temperature: float = 1.0) -> None:
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
            gen = self.model.sample(
                [p for p, _ in batch],
                self.task.max_new_tokens,
                temperature=self.temperature,
                stop_ids=(self.task.eos_id,),
                generator=self.generator,
            )
            dt = time.perf_counter() - t0
            self.busy_s += dt
            self.batches += 1
            for i, (_, fut) in enumerate(batch):
                if not fut.done():
                    fut.set_result(Generated(gen.tokens[i], gen.log_probs[i], gen.finish_reasons[i], self.version, dt))
            # Let the sessions we just served run before we gather the next batch.
            await asyncio.sleep(0)
