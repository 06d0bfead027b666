"""Group-relative advantages (GRPO, Dr.GRPO, GSPO) over valid members only.

An aborted member is invalid: it gets advantage 0 and is absent from its
group's mean and std. The statistics are computed on the valid entries alone
(selected first, then summed per group), so the advantages of the valid
members are bit-for-bit the same whether or not invalid members are present.
"""

from __future__ import annotations

import torch

from agentlog.learner.config import ESTIMATORS
from agentlog.reducers.groups import group_means


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor,
    estimator: str = "grpo",
    eps: float = 1e-6,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-member advantages, grouped by ``group_ids`` (never by batch shape).

    - grpo / gspo: ``(r - mean_valid) / (std_valid + eps)``, std unbiased.
    - dr_grpo: ``r - mean_valid`` (no std scaling).

    ``rewards``, ``group_ids`` (integers) and ``valid`` (bool) are 1-D and of
    equal length. Invalid members get 0. A group with fewer than two valid
    members, or whose valid rewards are all equal, gives 0 (never NaN).
    Returns a tensor of ``dtype``: by default ``rewards``' (float32 if it is not floating).
    Statistics are taken in float64 whatever it is. Finite rewards too large to normalise (their
    sum or squares past float64, an advantage past ``dtype``) raise ValueError naming the group.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"compute_advantages: estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not (rewards.dim() == group_ids.dim() == valid.dim() == 1):
        raise ValueError(
            "compute_advantages: rewards, group_ids and valid must be 1-D, got shapes "
            f"{tuple(rewards.shape)}, {tuple(group_ids.shape)}, {tuple(valid.shape)}"
        )
    if not (len(rewards) == len(group_ids) == len(valid)):
        raise ValueError(
            "compute_advantages: rewards, group_ids and valid must have equal length, got "
            f"{len(rewards)}, {len(group_ids)}, {len(valid)}"
        )
    if group_ids.is_floating_point():
        raise ValueError(f"compute_advantages: group_ids must be integers, got dtype {group_ids.dtype}")
    valid = valid.to(torch.bool)
    out_dtype = dtype if dtype is not None else rewards.dtype if rewards.is_floating_point() else torch.float32
    r_all = rewards.to(torch.float64)  # statistics in float64; small groups, no cost
    bad = valid & ~torch.isfinite(r_all)
    if bad.any():
        idx = torch.nonzero(bad).flatten().tolist()
        raise ValueError(f"compute_advantages: non-finite reward for valid member(s) at index {idx}")

    advantages = torch.zeros_like(r_all)
    if not valid.any():
        return advantages.to(out_dtype)

    # Select valid members first: everything below sees exactly the same
    # numbers whether or not invalid members were in the input.
    r = r_all[valid]
    _, g = torch.unique(group_ids[valid], return_inverse=True)
    n_groups = int(g.max()) + 1

    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    # The baseline's one definition (reducers.groups.reward_mean), per group.
    mean = torch.tensor(group_means(r.tolist(), g.tolist()), dtype=torch.float64, device=r.device)
    centered = r - mean[g]

    # Equal rewards can still leave a rounding residue in r - mean; decide
    # "no signal" from the rewards themselves, not from the residue.
    r_max = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, g, r, "amax")
    r_min = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, g, r, "amin")
    has_signal = (count >= 2) & (r_max > r_min)

    overflow = has_signal & ~torch.isfinite(mean)
    if estimator == "dr_grpo":
        adv = centered
    else:
        sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, centered * centered)
        std = (sq / (count - 1).clamp(min=1)).sqrt()  # unbiased, as torch.std
        adv = centered / (std[g] + eps)
        overflow |= has_signal & ~torch.isfinite(std)  # an infinite std would give a silent 0, not the signal
    adv = torch.where(has_signal[g], adv, torch.zeros_like(adv))
    advantages[valid] = adv
    out = advantages.to(out_dtype)
    overflow.index_fill_(0, torch.unique(g[~torch.isfinite(out[valid])]), True)  # past out_dtype's range
    if overflow.any():
        # Finite rewards whose sum or squares leave float64 (or whose advantages leave out_dtype): say which.
        k = int(torch.nonzero(overflow).flatten()[0])
        gid = int(group_ids[valid][g == k][0])
        raise ValueError(f"compute_advantages: the rewards of group {gid} are too large to normalise "
                         f"({r[g == k].tolist()!r:.200}); bound the rewards the verifier gives")
    return out
