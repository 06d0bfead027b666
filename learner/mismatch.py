"""Training–inference mismatch: the learner's own log-probs against the recorded rollout log-probs.

Each step compares, token by token, the log-prob the learner computes in the
step's forward pass before its update (the ratio's ``old_log_probs``: the
policy at the learner's current version) with the log-prob the rollout
recorded for the same token (the behaviour policy). Only trained tokens
(loss mask 1) generated at the learner's current version count: a token of
an older version would mix staleness (the policy moved since) into a figure
that is about numerics, so stale tokens are left out here (their difference
stays in ``stats/rollout_logprob_abs_diff``, over every trained token) and
``stats/train_rollout_tokens`` says how many tokens the figures cover.
Without any such token (a step that trained only stale groups) the figures
are NaN.

Metrics (`MismatchStats.metrics`):

* ``stats/train_rollout_logprob_abs_diff``: mean of ``|log pi_train - log pi_rollout|``
  (slime's ``train_rollout_logprob_abs_diff``); ``..._max``: its maximum.
  0.0 and 0.0 with the built-in GPT in-process (`agentlog.learner.batch_invariant`).
* ``stats/train_rollout_kl``: slime's ``train_rollout_kl``, the k3 estimate
  of KL(pi_rollout || pi_train) from the rollout's own samples,
  ``exp(d) - 1 - d`` with ``d = log pi_train - log pi_rollout`` (slime's
  ``compute_approx_kl(rollout, train, "low_var_kl")``: clamped to [-10, 10]
  per token), averaged over the same tokens (slime averages per sample, then
  over samples; here the mean is over tokens, as the other ``stats/*``), in
  float64.
* ``stats/train_rollout_tokens``: how many tokens the three cover.

A token whose turn was interrupted by a weight update and went on with the
cache of the old weights (``weight_update = "continue"``) is counted at its
new version, yet its log-prob was computed on the old weights' keys: it can
differ even in-process.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

ABS_DIFF = "stats/train_rollout_logprob_abs_diff"
ABS_DIFF_MAX = "stats/train_rollout_logprob_abs_diff_max"
KL = "stats/train_rollout_kl"
TOKENS = "stats/train_rollout_tokens"
#: 1 where the step's mean difference passed the bound of `warn_past` (the loop's ``mismatch_warn_abs_diff``).
WARNED = "stats/train_rollout_mismatch_warned"

#: slime's per-token clamp of the ``low_var_kl`` estimate.
KL_CLAMP = 10.0


class MismatchStats:
    """Accumulates the mismatch over a step's micro-batches (`add`), then reports it (`metrics`)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.abs_sum = 0.0
        self.abs_max = 0.0
        self.kl_sum = 0.0

    @torch.no_grad()
    def add(self, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, counted: torch.Tensor) -> None:
        """Count the tokens where ``counted`` ((N, L) bool) is set: the learner's
        log-probs ``train_log_probs`` against ``rollout_log_probs``, both (N, L)."""
        if train_log_probs.shape != rollout_log_probs.shape or counted.shape != train_log_probs.shape:
            raise ValueError(
                f"MismatchStats.add: expected train, rollout log-probs and the token mask of one shape, got "
                f"{tuple(train_log_probs.shape)}, {tuple(rollout_log_probs.shape)}, {tuple(counted.shape)}"
            )
        d = (train_log_probs.detach() - rollout_log_probs)[counted].double()
        if d.numel() == 0:
            return
        self.tokens += d.numel()
        a = d.abs()
        self.abs_sum += float(a.sum())
        self.abs_max = max(self.abs_max, float(a.max()))
        self.kl_sum += float((torch.expm1(d) - d).clamp(-KL_CLAMP, KL_CLAMP).sum())

    def metrics(self) -> dict[str, float]:
        """The step's figures (NaN, and 0 tokens, when no token counted)."""
        if not self.tokens:
            return {ABS_DIFF: math.nan, ABS_DIFF_MAX: math.nan, KL: math.nan, TOKENS: 0.0}
        return {ABS_DIFF: self.abs_sum / self.tokens, ABS_DIFF_MAX: self.abs_max, KL: self.kl_sum / self.tokens,
                TOKENS: float(self.tokens)}


def warn_past(metrics: dict[str, float], bound: float, warn: Callable[..., Any], **where: Any) -> dict[str, float]:
    """``{WARNED: 1.0}`` when the step's mean difference (``metrics[ABS_DIFF]``) is
    above ``bound``, after calling ``warn("learner.train_rollout_mismatch", ...)``
    (a structlog logger's ``warning``) with the figures, the bound and ``where``;
    ``{WARNED: 0.0}`` when it is within; ``{}`` when the step measured nothing."""
    diff = metrics.get(ABS_DIFF, math.nan)
    if not math.isfinite(diff):
        return {}
    if diff <= bound:
        return {WARNED: 0.0}
    warn("learner.train_rollout_mismatch", abs_diff=diff, abs_diff_max=metrics.get(ABS_DIFF_MAX),
         kl=metrics.get(KL), tokens=metrics.get(TOKENS), bound=bound,
         note="the learner does not reproduce the rollout's log-probs at the same policy version: the inference "
              "engine and the trainer compute differently (kernels, dtype, batching); expect biased ratios "
              "(truncated importance sampling, tis_cap, corrects for it)", **where)
    return {WARNED: 1.0}
