"""The learner's loss as composable terms, read in the papers' order.

``total_loss(inputs, config)`` is

    policy_gradient_loss                      PPO-clip / GSPO, dual clip, TIS
    + kl_coef * kl_loss                       KL penalty to a reference policy
    + distill_topk_coef * topk_distill_loss   forward KL to a teacher's top-K
    - entropy_coef * entropy_bonus            entropy bonus

with the advantages first shaped by ``distill_advantages`` (on-policy
distillation: the teacher's reverse KL as a per-token advantage) when
``distill_coef`` is set. Each term is a plain function of a `LossInputs`
(the micro-batch's per-token tensors) and an `Aggregation` (how per-token
values become a scalar); the additive ones are registered by name in
`TERMS`, with the `LearnerConfig` field that weighs each and the input it
reads. A term whose input is given is measured (its metrics) even at weight
0; it enters the loss only with a non-zero weight.

All per-token inputs are laid out one sample per row, ``(N, L)``, with
``loss_mask`` marking the trained tokens. Masked positions must hold finite
numbers (padding uses 0). A row that must not train at all (an aborted
placeholder) is taken out with `LossInputs.without_rows` before any
arithmetic, so it adds nothing to any numerator, any denominator or any
metric: a batch with an aborted row gives bit-for-bit the loss and gradients
of the batch without it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from agentlog.learner.config import ESTIMATORS, KL_TYPES, LOSS_AGGS, LearnerConfig

Metrics = dict[str, torch.Tensor]

#: Metrics every `total_loss` reports, in this order (0 where their term is off); the
#: ``distill/*`` ones follow when teacher scores are given.
METRICS = (
    "loss/policy", "loss/kl", "loss/entropy", "stats/clip_frac", "stats/dual_clip_frac", "stats/approx_kl",
    "stats/entropy", "stats/tis_clip_frac", "stats/rollout_logprob_abs_diff",
)


@dataclass(eq=False, slots=True)
class LossInputs:
    """One micro-batch's per-token tensors, one sample per row: ``(N, L)`` unless said otherwise."""

    log_probs: torch.Tensor
    """Log-probs of the taken tokens under the policy being trained (differentiable)."""
    old_log_probs: torch.Tensor
    """The same under the policy the ratio is taken against (fixed for the whole step)."""
    advantages: torch.Tensor
    """(N,) per-sample or (N, L) per-token advantages."""
    loss_mask: torch.Tensor
    """1 for trained tokens, 0 elsewhere."""
    rollout_log_probs: torch.Tensor | None = None
    """Behaviour-policy log-probs recorded at sampling time (TIS, distillation, a diagnostic)."""
    ref_log_probs: torch.Tensor | None = None
    """Reference-policy log-probs (the ``kl`` term)."""
    entropy: torch.Tensor | None = None
    """Per-token policy entropy (the ``entropy`` term and its metric; differentiable when it is weighed)."""
    teacher_log_probs: torch.Tensor | None = None
    """Teacher log-probs of the taken tokens (distillation); goes with ``teacher_mask``."""
    teacher_mask: torch.Tensor | None = None
    """1 where a teacher scored the token."""
    top_log_probs: torch.Tensor | None = None
    """(N, L, K) the policy's log-probs of the teacher's top-K ids (the ``distill_topk`` term; differentiable)."""
    teacher_top_log_probs: torch.Tensor | None = None
    """(N, L, K) the teacher's log-probs of its top-K ids."""
    teacher_top_mask: torch.Tensor | None = None
    """(N, L, K) which top-K entries are real."""

    def __post_init__(self) -> None:
        lp, old, mask = self.log_probs, self.old_log_probs, self.loss_mask
        if lp.dim() != 2 or lp.shape != old.shape or lp.shape != mask.shape:
            raise ValueError(
                "LossInputs: log_probs, old_log_probs and loss_mask must all be (N, L), got "
                f"{tuple(lp.shape)}, {tuple(old.shape)}, {tuple(mask.shape)}"
            )
        if (self.teacher_log_probs is None) != (self.teacher_mask is None):
            raise ValueError("LossInputs: teacher_log_probs and teacher_mask go together; only one was given")
        top = (self.top_log_probs, self.teacher_top_log_probs, self.teacher_top_mask)
        if (top[0] is None) != (top[1] is None) or (top[0] is None) != (top[2] is None):
            names = ("top_log_probs", "teacher_top_log_probs", "teacher_top_mask")
            given = [name for name, t in zip(names, top) if t is not None]
            raise ValueError(
                f"LossInputs: top_log_probs, teacher_top_log_probs and teacher_top_mask go together; got "
                f"{', '.join(given)} alone"
            )

    def without_rows(self, remove: torch.Tensor | None) -> LossInputs:
        """These inputs less the rows flagged in ``remove`` ((N,) bool), every per-row tensor alike.

        This is how a row that must contribute exactly nothing (an aborted
        placeholder) leaves a batch: structurally, before any arithmetic, not
        through a zero mask."""
        if remove is None or not bool(remove.any()):
            return self
        keep = ~remove.to(torch.bool)
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name)[keep] for f in dataclasses.fields(self) if getattr(self, f.name) is not None
        })


class Aggregation:
    """How per-token values become scalars over this micro-batch's trained tokens.

    ``loss`` aggregates a term as ``loss_agg`` says (token_mean: over every
    trained token; sample_mean: the mean of per-sample means); ``token_mean``
    is a detached metric. The denominators are the step's totals when a step
    is split into micro-batches, so micro-batch losses and metrics sum;
    by default this micro-batch's own counts (each at least 1, so a fully
    masked batch never gives NaN)."""

    def __init__(
        self,
        loss_mask: torch.Tensor,
        dtype: torch.dtype,
        loss_agg: str,
        *,
        num_tokens: float | torch.Tensor | None = None,
        num_samples: float | torch.Tensor | None = None,
    ) -> None:
        if loss_agg not in LOSS_AGGS:
            raise ValueError(f"Aggregation: loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
        self.loss_agg = loss_agg
        self.mask = loss_mask.to(dtype)
        self.flat_mask = self.mask.reshape(-1)
        self.num_tokens = self.flat_mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        self.num_samples = num_samples
        if loss_agg == "sample_mean" and num_samples is None:
            self.num_samples = (self.mask.sum(-1) > 0).sum().clamp(min=1)

    @cached_property
    def tokens_per_sample(self) -> torch.Tensor:
        """(N,) trained tokens of each row, at least 1."""
        return self.mask.sum(-1).clamp(min=1.0)

    def masked_sum(self, per_token: torch.Tensor) -> torch.Tensor:
        """Sum over the trained tokens."""
        # One fused pass (and a one-op backward) instead of a multiply then a sum.
        return torch.dot(per_token.reshape(-1).to(self.flat_mask.dtype), self.flat_mask)

    def loss(self, per_token: torch.Tensor) -> torch.Tensor:
        """A term's scalar, aggregated as ``loss_agg`` says (differentiable)."""
        if self.loss_agg == "token_mean":
            return self.masked_sum(per_token) / self.num_tokens
        per_sample = (per_token * self.mask).sum(-1) / self.tokens_per_sample
        return per_sample.sum() / self.num_samples

    def token_mean(self, per_token: torch.Tensor) -> torch.Tensor:
        """A detached metric: the mean over the trained tokens (the step's, when split)."""
        return self.masked_sum(per_token).detach() / self.num_tokens


def _zero(x: LossInputs) -> torch.Tensor:
    return torch.zeros((), dtype=x.log_probs.dtype, device=x.log_probs.device)


# --- on-policy distillation: the teacher's reverse KL as a per-token advantage ------


def distill_advantages(x: LossInputs, advantages: torch.Tensor, distill_coef: float) -> torch.Tensor:
    """``A - distill_coef * (rollout_log_prob - teacher_log_prob)`` on scored tokens, ``A`` elsewhere.

    Behaviour log-probs, detached: an advantage, not a differentiable term
    (slime's and tinker's on-policy distillation). ``advantages`` is (N, 1)
    or (N, L)."""
    scored = x.teacher_mask.to(x.log_probs.dtype)
    reverse = (x.rollout_log_probs - x.teacher_log_probs).detach() * scored
    return advantages - distill_coef * reverse


def distill_metrics(x: LossInputs, agg: Aggregation, num_scored: float | torch.Tensor | None = None) -> Metrics:
    """``distill/reverse_kl``: rollout - teacher log-prob over trained scored tokens (``num_scored``,
    the step's count, is its denominator; default this batch's); ``distill/scored_frac``: scored /
    trained tokens."""
    with torch.no_grad():
        scored = x.teacher_mask.to(agg.mask.dtype)
        if num_scored is None:
            num_scored = (agg.flat_mask * scored.reshape(-1)).sum().clamp(min=1.0)
        reverse_kl = _zero(x)
        if x.rollout_log_probs is not None:
            reverse_kl = agg.masked_sum((x.rollout_log_probs - x.teacher_log_probs) * scored) / num_scored
        return {"distill/reverse_kl": reverse_kl, "distill/scored_frac": agg.token_mean(scored)}


# --- policy gradient: clipped surrogate ---------------------------------------------


def policy_gradient_loss(
    x: LossInputs, advantages: torch.Tensor, agg: Aggregation, config: LearnerConfig
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate with an asymmetric clip (clip-higher), GSPO's sequence-level
    ratio (``estimator="gspo"``), the dual clip and truncated importance sampling.

    ``advantages`` is (N, 1) or (N, L). Returns the aggregated loss and its
    metrics: ``loss/policy``, ``stats/clip_frac``, ``stats/approx_kl`` and,
    where their variant or input is on, ``stats/dual_clip_frac``,
    ``stats/tis_clip_frac`` and ``stats/rollout_logprob_abs_diff``; the
    ``stats/*`` are token means over the trained tokens."""
    c = config
    if c.estimator not in ESTIMATORS:
        raise ValueError(f"policy_gradient_loss: estimator must be one of {ESTIMATORS}, got {c.estimator!r}")
    if c.tis_cap is not None and x.rollout_log_probs is None:
        raise ValueError("policy_gradient_loss: tis_cap is set but rollout_log_probs was not given")

    # importance ratio: per token (PPO) or per sequence (GSPO)
    log_ratio = x.log_probs - x.old_log_probs
    if c.estimator == "gspo":
        seq_log_ratio = (log_ratio * agg.mask).sum(-1, keepdim=True) / agg.tokens_per_sample.unsqueeze(-1)
        log_ratio = seq_log_ratio.expand_as(x.log_probs)
    ratio = torch.exp(log_ratio)

    # clipped surrogate, asymmetric clip
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - c.eps_clip, 1.0 + c.eps_clip_high)
    pg_loss = clipped_loss = torch.maximum(pg_loss1, pg_loss2)

    # dual clip: bound the loss of negative advantages at -c * A
    if c.dual_clip is not None:
        pg_loss3 = -advantages * c.dual_clip
        negative = advantages < 0
        pg_loss = torch.where(negative, torch.minimum(clipped_loss, pg_loss3), clipped_loss)

    # truncated importance sampling against the rollout (behaviour) policy
    if c.tis_cap is not None:
        tis_weight = torch.exp(x.old_log_probs - x.rollout_log_probs).detach()
        pg_loss = pg_loss * torch.clamp(tis_weight, max=c.tis_cap)

    policy = agg.loss(pg_loss)

    with torch.no_grad():
        dtype = agg.mask.dtype
        clipfrac = agg.token_mean((pg_loss2 > pg_loss1).to(dtype))
        # k3 estimate of KL(pi_old || pi): (ratio - 1) - log ratio >= 0
        approx_kl = agg.token_mean((ratio - 1.0) - log_ratio)
        metrics = {"loss/policy": policy.detach(), "stats/clip_frac": clipfrac, "stats/approx_kl": approx_kl}
        if c.dual_clip is not None:
            metrics["stats/dual_clip_frac"] = agg.token_mean((negative & (pg_loss3 < clipped_loss)).to(dtype))
        if c.tis_cap is not None:
            metrics["stats/tis_clip_frac"] = agg.token_mean((tis_weight > c.tis_cap).to(dtype))
        if x.rollout_log_probs is not None:
            # |log pi_old - log pi_rollout| (slime's train_rollout_logprob_abs_diff): ~0 when the learner
            # reproduces the sampler (same weights, same temperature), large when it does not.
            metrics["stats/rollout_logprob_abs_diff"] = agg.token_mean((x.old_log_probs - x.rollout_log_probs).abs())
    return policy, metrics


# --- KL penalty to the reference policy ---------------------------------------------


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


def kl_loss(x: LossInputs, agg: Aggregation, config: LearnerConfig) -> tuple[torch.Tensor, Metrics]:
    """The ``config.kl_type`` KL estimate to the reference, aggregated like the policy loss (``loss/kl``)."""
    kl = agg.loss(kl_penalty(x.log_probs, x.ref_log_probs, config.kl_type))
    return kl, {"loss/kl": kl.detach()}


# --- top-K forward KL to the teacher -------------------------------------------------


def topk_distill_loss(x: LossInputs, agg: Aggregation, config: LearnerConfig) -> tuple[torch.Tensor, Metrics]:
    """Forward KL ``sum_k p_T(k) (log p_T(k) - log pi(k))`` over the teacher's top-K ids, p_T
    renormalised over the real entries, aggregated like the policy loss (``distill/topk_kl``)."""
    real = x.teacher_top_mask.to(torch.bool)
    teacher_lp = x.teacher_top_log_probs.to(x.log_probs.dtype).masked_fill(~real, -math.inf)
    norm = torch.logsumexp(teacher_lp, dim=-1, keepdim=True)
    # Absent entries (and tokens without top-K data) weigh exactly 0, so nothing of them
    # reaches the value or the gradient.
    teacher_lp = torch.where(real, teacher_lp - norm, torch.zeros_like(teacher_lp))
    p_teacher = torch.where(real, teacher_lp.exp(), torch.zeros_like(teacher_lp))
    topk_kl = agg.loss((p_teacher * (teacher_lp - x.top_log_probs)).sum(-1))
    return topk_kl, {"distill/topk_kl": topk_kl.detach()}


# --- entropy bonus -------------------------------------------------------------------


def entropy_bonus(x: LossInputs, agg: Aggregation, config: LearnerConfig) -> tuple[torch.Tensor, Metrics]:
    """The policy's entropy aggregated like the policy loss (``loss/entropy``) and as a token
    mean (``stats/entropy``); `TERMS` subtracts it."""
    entropy = agg.loss(x.entropy)
    if agg.loss_agg == "token_mean":
        entropy_mean = entropy.detach()
    else:
        with torch.no_grad():
            entropy_mean = agg.token_mean(x.entropy)
    return entropy, {"loss/entropy": entropy.detach(), "stats/entropy": entropy_mean}


# --- the total -----------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """An additive loss term: ``loss += sign * config.<weight> * value``."""

    compute: Callable[[LossInputs, Aggregation, LearnerConfig], tuple[torch.Tensor, Metrics]]
    """The term: its value (aggregated, differentiable) and its metrics."""
    weight: str
    """The `LearnerConfig` field that weighs it; 0 leaves it out of the loss."""
    needs: str
    """The `LossInputs` field it reads; the term is measured whenever that is given."""
    sign: float = 1.0
    """+1 for a penalty, -1 for a bonus."""
    optional: bool = False
    """With a weight but without its input: left out (data some batches lack) rather than an error."""


#: The additive terms by name, in the order they are added.
TERMS: dict[str, Term] = {
    "kl": Term(kl_loss, "kl_coef", "ref_log_probs"),
    # Top-K data is where the teacher gave it: a batch without it trains without the term.
    "distill_topk": Term(topk_distill_loss, "distill_topk_coef", "top_log_probs", optional=True),
    "entropy": Term(entropy_bonus, "entropy_coef", "entropy", sign=-1.0),
}


def total_loss(
    x: LossInputs,
    config: LearnerConfig,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_samples: float | torch.Tensor | None = None,
    num_scored: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The loss of one micro-batch and its metrics, as ``config`` composes it.

    ``num_tokens`` and ``num_samples`` are the denominators of token_mean /
    sample_mean and ``num_scored`` that of ``distill/reverse_kl`` when a step
    is split into micro-batches (the step's totals); by default this batch's.

    Returns ``(loss, metrics)``: detached scalars keyed as in `METRICS`,
    plus, with teacher scores, ``distill/reverse_kl`` and ``distill/scored_frac``
    and, with top-K data, ``distill/topk_kl``. The ``stats/*`` are token
    means with the loss's denominator, so micro-batches sum."""
    if config.distill_coef != 0.0 and (x.teacher_log_probs is None or x.rollout_log_probs is None):
        raise ValueError(
            "total_loss: distill_coef is non-zero but teacher_log_probs or rollout_log_probs was not given"
        )
    measured = []  # (term, weight) of every term whose input is given
    for name, term in TERMS.items():
        given = getattr(x, term.needs) is not None
        weight = getattr(config, term.weight)
        if weight != 0.0 and not given and not term.optional:
            raise ValueError(
                f"total_loss: {term.weight} is non-zero but {term.needs} was not given (the {name!r} term needs it)"
            )
        if given:
            measured.append((term, weight))
    agg = Aggregation(x.loss_mask, x.log_probs.dtype, config.loss_agg, num_tokens=num_tokens, num_samples=num_samples)
    metrics = dict.fromkeys(METRICS, _zero(x))

    # on-policy distillation shapes the advantage before the policy gradient sees it
    advantages = x.advantages.unsqueeze(-1) if x.advantages.dim() == 1 else x.advantages
    if config.distill_coef != 0.0:
        advantages = distill_advantages(x, advantages, config.distill_coef)
    if x.teacher_log_probs is not None:
        metrics.update(distill_metrics(x, agg, num_scored))

    loss, pg_metrics = policy_gradient_loss(x, advantages, agg, config)
    metrics.update(pg_metrics)

    for term, weight in measured:
        value, term_metrics = term.compute(x, agg, config)
        metrics.update(term_metrics)
        if weight != 0.0:
            loss = loss + (term.sign * weight) * value
    return loss, metrics
