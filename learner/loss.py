"""The clipped policy-gradient loss (PPO-clip / GSPO) with its optional extras.

All per-token inputs are laid out one sample per row, ``(N, L)``, with
``loss_mask`` marking the trained tokens. Rows flagged in ``remove`` are
selected away before anything is computed, so they add nothing to any
numerator, any denominator or any metric: a batch with an aborted row gives
bit-for-bit the loss and gradients of the batch without it.

Masked positions must hold finite numbers (padding uses 0).
"""

from __future__ import annotations

import math

import torch

from agentlog.learner.config import ESTIMATORS, KL_TYPES, LOSS_AGGS


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = log_probs - ref_log_probs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type == "k3":
        # exp(-x) - 1 + x >= 0, unbiased and low-variance.
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_penalty: kl_type must be one of {KL_TYPES}, got {kl_type!r}")


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    remove: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    estimator: str = "grpo",
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    dual_clip: float | None = None,
    tis_cap: float | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    entropy_coef: float = 0.0,
    loss_agg: str = "token_mean",
    num_tokens: float | None = None,
    num_samples: float | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    teacher_mask: torch.Tensor | None = None,
    distill_coef: float = 0.0,
    top_log_probs: torch.Tensor | None = None,
    teacher_top_log_probs: torch.Tensor | None = None,
    teacher_top_mask: torch.Tensor | None = None,
    distill_topk_coef: float = 0.0,
    num_scored: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss and its metrics.

    Args:
        log_probs: (N, L) log-probs of the taken tokens under the policy being trained.
        old_log_probs: (N, L) the same under the policy that the ratio is taken against.
        advantages: (N,) per-sample or (N, L) per-token advantages.
        loss_mask: (N, L) 1 for trained tokens, 0 elsewhere.
        remove: (N,) bool, rows to leave out entirely (aborted placeholders).
        rollout_log_probs: (N, L) behaviour-policy log-probs, for truncated IS (needs tis_cap).
        ref_log_probs: (N, L) reference-policy log-probs, for the KL penalty (needs kl_coef).
        entropy: (N, L) per-token policy entropy, for the bonus and the metric.
        estimator: "gspo" uses the sequence-level ratio; grpo / dr_grpo the per-token one.
        num_tokens, num_samples: denominators of token_mean / sample_mean when a step
            is split into micro-batches (the step totals); default: this batch's counts.
        teacher_log_probs, teacher_mask: (N, L) teacher log-probs of the taken tokens and
            1 where a teacher scored them (on-policy distillation).
        distill_coef: lambda; on scored tokens the advantage becomes
            A - lambda * (rollout_log_prob - teacher_log_prob), a detached per-token
            advantage (needs rollout_log_probs and the teacher's).
        top_log_probs, teacher_top_log_probs, teacher_top_mask: (N, L, K) the policy's and the
            teacher's log-probs of the teacher's top-K ids, and which entries are real; with
            them the forward KL sum_k p_T(k) (log p_T(k) - log pi(k)), p_T renormalised over the
            top-K, is aggregated like the policy loss and added times ``distill_topk_coef``.
        num_scored: the step's count of trained, scored tokens (denominator of
            ``distill/reverse_kl``); default: this batch's.

    Returns ``(loss, metrics)``; metrics are detached scalars keyed
    ``loss/policy``, ``loss/kl``, ``loss/entropy``, ``stats/clip_frac``,
    ``stats/dual_clip_frac``, ``stats/approx_kl``, ``stats/entropy``,
    ``stats/tis_clip_frac``, ``stats/rollout_logprob_abs_diff``; the
    ``stats/*`` are token means over the trained tokens with the same
    denominator as the loss, so micro-batches sum. With teacher log-probs also
    ``distill/reverse_kl`` (mean of rollout - teacher log-prob over trained scored
    tokens), ``distill/scored_frac`` (scored / trained tokens) and, with top-K
    data, ``distill/topk_kl`` (the aggregated top-K forward KL).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"policy_loss: estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"policy_loss: loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if log_probs.dim() != 2 or log_probs.shape != old_log_probs.shape or log_probs.shape != loss_mask.shape:
        raise ValueError(
            "policy_loss: log_probs, old_log_probs and loss_mask must all be (N, L), got "
            f"{tuple(log_probs.shape)}, {tuple(old_log_probs.shape)}, {tuple(loss_mask.shape)}"
        )
    if tis_cap is not None and rollout_log_probs is None:
        raise ValueError("policy_loss: tis_cap is set but rollout_log_probs was not given")
    if kl_coef != 0.0 and ref_log_probs is None:
        raise ValueError("policy_loss: kl_coef is non-zero but ref_log_probs was not given")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("policy_loss: entropy_coef is non-zero but entropy was not given")
    if (teacher_log_probs is None) != (teacher_mask is None):
        raise ValueError("policy_loss: teacher_log_probs and teacher_mask go together; only one was given")
    if distill_coef != 0.0 and (teacher_log_probs is None or rollout_log_probs is None):
        raise ValueError("policy_loss: distill_coef is non-zero but teacher_log_probs or rollout_log_probs was not given")
    top = (top_log_probs, teacher_top_log_probs, teacher_top_mask)
    if any(t is None for t in top) and not all(t is None for t in top):
        raise ValueError(
            "policy_loss: top_log_probs, teacher_top_log_probs and teacher_top_mask go together; got "
            + ", ".join(name for name, t in zip(("top_log_probs", "teacher_top_log_probs", "teacher_top_mask"), top) if t is not None)
            + " alone"
        )

    # --- drop removed rows before any arithmetic ---------------------------
    if remove is not None and bool(remove.any()):
        keep = ~remove.to(torch.bool)
        log_probs, old_log_probs, loss_mask = log_probs[keep], old_log_probs[keep], loss_mask[keep]
        advantages = advantages[keep]
        rollout_log_probs = None if rollout_log_probs is None else rollout_log_probs[keep]
        ref_log_probs = None if ref_log_probs is None else ref_log_probs[keep]
        entropy = None if entropy is None else entropy[keep]
        teacher_log_probs = None if teacher_log_probs is None else teacher_log_probs[keep]
        teacher_mask = None if teacher_mask is None else teacher_mask[keep]
        if top_log_probs is not None:
            top_log_probs, teacher_top_log_probs = top_log_probs[keep], teacher_top_log_probs[keep]
            teacher_top_mask = teacher_top_mask[keep]

    mask = loss_mask.to(log_probs.dtype)
    flat_mask = mask.reshape(-1)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if num_tokens is None:
        num_tokens = flat_mask.sum().clamp(min=1.0)
    per_row = loss_agg == "sample_mean" or estimator == "gspo"
    tokens_per_sample = mask.sum(-1).clamp(min=1.0) if per_row else None
    if loss_agg == "sample_mean" and num_samples is None:
        num_samples = (mask.sum(-1) > 0).sum().clamp(min=1)

    def masked_sum(per_token: torch.Tensor) -> torch.Tensor:
        # One fused pass (and a one-op backward) instead of a multiply then a sum.
        return torch.dot(per_token.reshape(-1).to(flat_mask.dtype), flat_mask)

    def aggregate(per_token: torch.Tensor) -> torch.Tensor:
        if loss_agg == "token_mean":
            return masked_sum(per_token) / num_tokens
        per_sample = (per_token * mask).sum(-1) / tokens_per_sample
        return per_sample.sum() / num_samples

    def token_mean(per_token: torch.Tensor) -> torch.Tensor:
        return masked_sum(per_token).detach() / num_tokens

    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)

    # --- on-policy distillation: per-token advantage shaping (detached) -----
    if distill_coef != 0.0:
        scored = teacher_mask.to(log_probs.dtype)
        reverse = (rollout_log_probs - teacher_log_probs).detach() * scored
        advantages = advantages - distill_coef * reverse

    # --- importance ratio: per token (PPO) or per sequence (GSPO) -----------
    log_ratio = log_probs - old_log_probs
    if estimator == "gspo":
        seq_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / tokens_per_sample.unsqueeze(-1)
        log_ratio = seq_log_ratio.expand_as(log_probs)
    ratio = torch.exp(log_ratio)

    # --- clipped surrogate, asymmetric clip ---------------------------------
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    pg_loss = clipped_loss = torch.maximum(pg_loss1, pg_loss2)

    # --- dual clip: bound the loss of negative advantages at -c * A ----------
    if dual_clip is not None:
        pg_loss3 = -advantages * dual_clip
        negative = advantages < 0
        pg_loss = torch.where(negative, torch.minimum(clipped_loss, pg_loss3), clipped_loss)

    # --- truncated importance sampling against the rollout policy ------------
    if tis_cap is not None:
        tis_weight = torch.exp(old_log_probs - rollout_log_probs).detach()
        pg_loss = pg_loss * torch.clamp(tis_weight, max=tis_cap)

    policy = aggregate(pg_loss)
    loss = policy

    # --- KL penalty to the reference policy ----------------------------------
    kl_value = zero
    if ref_log_probs is not None:
        kl_value = aggregate(kl_penalty(log_probs, ref_log_probs, kl_type))
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl_value

    # --- top-K forward KL to the teacher ---------------------------------------
    topk_value = zero
    if top_log_probs is not None:
        real = teacher_top_mask.to(torch.bool)
        teacher_lp = teacher_top_log_probs.to(log_probs.dtype).masked_fill(~real, -math.inf)
        norm = torch.logsumexp(teacher_lp, dim=-1, keepdim=True)
        # p_T renormalised over the real top-K entries; absent entries (and tokens without
        # top-K data) weigh exactly 0, so nothing of them reaches the value or the gradient.
        teacher_lp = torch.where(real, teacher_lp - norm, torch.zeros_like(teacher_lp))
        p_teacher = torch.where(real, teacher_lp.exp(), torch.zeros_like(teacher_lp))
        topk_value = aggregate((p_teacher * (teacher_lp - top_log_probs)).sum(-1))
        if distill_topk_coef != 0.0:
            loss = loss + distill_topk_coef * topk_value

    # --- entropy bonus --------------------------------------------------------
    entropy_value = zero
    if entropy is not None:
        entropy_value = aggregate(entropy)
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * entropy_value

    # --- diagnostics, token means over trained tokens ------------------------
    with torch.no_grad():
        entropy_mean = zero
        if entropy is not None:
            entropy_mean = entropy_value if loss_agg == "token_mean" else token_mean(entropy)
        metrics = {
            "loss/policy": policy.detach(),
            "loss/kl": kl_value.detach(),
            "loss/entropy": entropy_value.detach(),
            "stats/clip_frac": token_mean((pg_loss2 > pg_loss1).to(mask.dtype)),
            "stats/dual_clip_frac": (
                token_mean((negative & (pg_loss3 < clipped_loss)).to(mask.dtype)) if dual_clip is not None else zero
            ),
            # k3 estimate of KL(pi_old || pi): (ratio - 1) - log ratio >= 0
            "stats/approx_kl": token_mean((ratio - 1.0) - log_ratio),
            "stats/entropy": entropy_mean.detach(),
            "stats/tis_clip_frac": token_mean((tis_weight > tis_cap).to(mask.dtype)) if tis_cap is not None else zero,
            # |log pi_old - log pi_rollout| (slime's train_rollout_logprob_abs_diff): ~0 when the
            # learner reproduces the sampler (same weights, same temperature), large when it does not.
            "stats/rollout_logprob_abs_diff": (
                token_mean((old_log_probs - rollout_log_probs).abs()) if rollout_log_probs is not None else zero
            ),
        }
        if teacher_log_probs is not None:
            scored = teacher_mask.to(mask.dtype)
            if num_scored is None:
                num_scored = (flat_mask * scored.reshape(-1)).sum().clamp(min=1.0)
            reverse_kl = zero
            if rollout_log_probs is not None:
                reverse_kl = masked_sum((rollout_log_probs - teacher_log_probs) * scored) / num_scored
            metrics["distill/reverse_kl"] = reverse_kl
            metrics["distill/scored_frac"] = token_mean(scored)
        if top_log_probs is not None:
            metrics["distill/topk_kl"] = topk_value.detach()
    return loss, metrics
