"""StatelessAdam is AdamW with its state cleared before every step."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from agentlog.learner.config import LearnerConfig
from agentlog.learner.optim import StatelessAdam, make_optimizer, make_scheduler


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_stateless_adam_equals_adamw_with_state_cleared_every_step(weight_decay):
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    a = [p.clone().requires_grad_(True) for p in init]
    b = [p.clone().requires_grad_(True) for p in init]
    ours = StatelessAdam(a, lr=0.01, eps=1e-8, weight_decay=weight_decay)
    ref = torch.optim.AdamW(b, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) * 10 ** torch.randint(-4, 2, (), generator=g) for p in init]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        ref.state.clear()
        ours.step()
        ref.step()
        for p, q in zip(a, b):
            assert_close(p, q)
    assert len(ours.state) == 0  # it really holds nothing


def test_stateless_adam_update_is_lr_times_g_over_abs_g_plus_eps():
    p = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    p.grad = torch.tensor([0.5, -1e-9, 0.0])
    StatelessAdam([p], lr=0.1, eps=1e-8, weight_decay=0.5).step()
    decayed = torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.1 * 0.5)
    expected = decayed - 0.1 * torch.tensor([0.5, -1e-9, 0.0]) / (torch.tensor([0.5, 1e-9, 0.0]) + 1e-8)
    assert_close(p.detach(), expected)


def test_stateless_adam_rejects_bad_hyperparameters():
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(ValueError, match="lr"):
        StatelessAdam(p, lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        StatelessAdam(p, weight_decay=-1.0)


def test_make_optimizer_builds_the_named_optimiser():
    p = [torch.zeros(2, requires_grad=True)]
    assert isinstance(make_optimizer(LearnerConfig(optimizer="adamw"), p), torch.optim.AdamW)
    opt = make_optimizer(LearnerConfig(optimizer="stateless_adam", lr=0.5, weight_decay=0.1), p)
    assert isinstance(opt, StatelessAdam) and opt.param_groups[0]["lr"] == 0.5


def test_warmup_ramps_the_learning_rate_linearly():
    p = [torch.zeros(1, requires_grad=True)]
    cfg = LearnerConfig(lr=1.0, warmup_steps=4)
    opt = make_optimizer(cfg, p)
    sched = make_scheduler(cfg, opt)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert_close(torch.tensor(seen), torch.tensor([0.25, 0.5, 0.75, 1.0, 1.0, 1.0]))
