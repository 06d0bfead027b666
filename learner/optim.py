"""Optimisers: AdamW, and StatelessAdam (Adam with its moments reset every step)."""

from __future__ import annotations

from typing import Iterable

import torch

from agentlog.learner.config import OPTIMIZERS, LearnerConfig


class StatelessAdam(torch.optim.Optimizer):
    """Adam whose moments are reset before every step (slime PR #2118).

    With fresh moments Adam's bias-corrected update collapses to a sign-like
    step, ``p -= lr * g / (|g| + eps)``, so the optimiser holds no state and
    its memory cost is zero. Weight decay is decoupled, as in AdamW:
    ``p *= 1 - lr * weight_decay`` before the update.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"StatelessAdam: lr must be > 0, got {lr}")
        if not eps >= 0:
            raise ValueError(f"StatelessAdam: eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"StatelessAdam: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                p.addcdiv_(g, g.abs().add_(eps), value=-lr)
        return loss


def make_optimizer(config: LearnerConfig, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimiser named by ``config.optimizer`` over ``params``."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, eps=config.adam_eps, weight_decay=config.weight_decay
        )
    if config.optimizer == "stateless_adam":
        return StatelessAdam(params, lr=config.lr, eps=config.adam_eps, weight_decay=config.weight_decay)
    raise ValueError(f"make_optimizer: optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}")


def make_scheduler(config: LearnerConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``config.warmup_steps`` optimiser steps, then constant."""
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
