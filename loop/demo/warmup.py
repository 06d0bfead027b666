"""The supervised warm-up (demo-only): teach the built-in GPT a task's protocol before RL.

With ``LoopConfig.warmup_steps > 0`` the learner, on a fresh start, trains
the model with token-level cross-entropy on the task's demonstrations
(``Task.demonstration``) whose answers are wrong with probability
``warmup_wrong_rate``: the lookup demo then starts RL knowing the protocol
but not the answers (reward <= 0.3). The result is policy version 0.
"""

from __future__ import annotations

import random
import time
from typing import Callable

import torch
import torch.nn.functional as F

from agentlog._logging import get_logger
from agentlog.engine.tasks import Task
from agentlog.learner.model import GPT
from agentlog.learner.optim import make_scheduler

from ..config import LoopConfig

log = get_logger("agentlog.loop.demo.warmup")
#: The event the warm-up logs about every 1% of its steps (fields ``step``, ``steps``).
WARMUP_PROGRESS_EVENT = "warmup.progress"


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


def supervised_warmup(model: GPT, task: Task, cfg: LoopConfig, *, stop: Callable[[GPT], bool] | None = None,
                      check_every: int = 0) -> dict[str, float]:
    """Teach the protocol before RL: ``cfg.warmup_steps`` steps of token-level
    cross-entropy on demonstrations whose answers are wrong with probability
    ``cfg.warmup_wrong_rate`` (AdamW, lr from the learner config, linear lr
    warm-up, grad-clip 1.0). Returns the final loss, the steps run and timing.

    ``stop`` (with ``check_every`` > 0): called with the model every
    ``check_every`` steps; training ends early once it returns True (the
    demo's teacher trains until it solves the task)."""
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
    # No rollout to agree with here: the warm-up trains through torch's own kernels (faster);
    # RL samples and trains on the batch-invariant path again.
    invariant = getattr(model, "batch_invariant", None)
    if invariant is not None:
        model.batch_invariant = False
    try:
        loss_v, steps = _warmup_steps(model, task, cfg, rng, opt, sched, stop, check_every)
    finally:
        torch.set_num_threads(threads)
        if invariant is not None:
            model.batch_invariant = invariant
    return {"warmup/steps": float(steps), "warmup/loss": loss_v, "warmup/seconds": time.perf_counter() - t0}


def _warmup_steps(model: GPT, task: Task, cfg: LoopConfig, rng: random.Random, opt, sched,
                  stop: Callable[[GPT], bool] | None, check_every: int) -> tuple[float, int]:
    loss_v = float("nan")
    step = 0
    progress_every = max(1, cfg.warmup_steps // 100)
    for step in range(1, cfg.warmup_steps + 1):
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
        if step % 100 == 1:
            log.info("warmup.step", step=step - 1, loss=round(loss_v, 4))
        if step % progress_every == 0 or step == cfg.warmup_steps:
            # What the run's progress bar shows during the warm-up (tools.progress.LoopProgress reads it).
            log.debug(WARMUP_PROGRESS_EVENT, step=step, steps=cfg.warmup_steps)
        if stop is not None and check_every > 0 and step % check_every == 0 and stop(model):
            break
    return loss_v, step
