"""LearnerConfig: every knob of the policy-optimisation step, in one dataclass.

Names are chosen by string (estimator, kl_type, loss_agg, optimizer); an
unknown name, an unknown field or an out-of-range value raises ConfigError (a
ValueError) that says which field, what was given and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from agentlog.events.errors import ConfigError
from agentlog.events.schema.validation import is_number

ESTIMATORS = ("grpo", "dr_grpo", "gspo")
LINEAGE_ADVANTAGES = ("session", "member")
KL_TYPES = ("k1", "k2", "k3")
LOSS_AGGS = ("token_mean", "sample_mean")
OPTIMIZERS = ("adamw", "stateless_adam")

#: Fields that no longer exist, with what replaced them (named in the error, so an old config fails clearly).
REMOVED_FIELDS = {
    "temperature": (
        "each sample carries the temperature it was sampled at (Sample.temperature, from the turns' recorded"
        " sampling) and log-probs are taken at that temperature; record it with the turn instead"
    ),
    "updates_per_step": (
        "use num_steps_per_rollout, which splits the rollout batch into that many mini-batches with one"
        " optimiser step each (updates_per_step repeated full-batch updates)"
    ),
}


@dataclass
class LearnerConfig:
    """Configuration of `Learner.step` (advantages, loss, optimiser, batching)."""

    estimator: str = "grpo"
    """Advantage estimator: grpo (mean/std-normalised), dr_grpo (mean only) or gspo (grpo advantage, sequence-level ratio)."""
    lineage_advantage: str = "session"
    """How a session's lineages (its agent's subagents) share advantages: session (the default:
    the group's members are its sessions, and every lineage's tokens take their session's
    advantage) or member (each lineage is a member of the group with its own reward, the
    verifier's per-lineage reward where it gave one)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing (grpo, gspo)."""
    eps_clip: float = 0.2
    """PPO clip range below 1: the ratio is clipped at 1 - eps_clip."""
    eps_clip_high: float = 0.28
    """PPO clip range above 1: the ratio is clipped at 1 + eps_clip_high (asymmetric, "clip-higher")."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the loss is capped at -c * A. None disables it."""
    tis_cap: float | None = None
    """Truncated importance sampling: weight tokens by min(pi_old / pi_rollout, tis_cap). None disables it."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy; 0 disables it (and the reference model)."""
    kl_type: str = "k3"
    """KL estimator: k1 (log ratio), k2 (half squared log ratio) or k3 (low-variance, always >= 0)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    loss_agg: str = "token_mean"
    """Loss aggregation: token_mean (over all trained tokens of the step) or sample_mean (mean of per-sample means)."""
    lr: float = 1e-3
    """Learning rate (suits the built-in GPT; use about 1e-6 for billion-parameter LMs)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas (AdamW only; StatelessAdam has no moments to decay)."""
    adam_eps: float = 1e-8
    """Adam epsilon in the update denominator."""
    weight_decay: float = 0.0
    """Decoupled weight decay: p *= 1 - lr * weight_decay each step."""
    optimizer: str = "adamw"
    """Optimiser: adamw or stateless_adam (Adam with moments reset every step)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value before each optimiser step; None disables clipping."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimiser steps (0: full lr from the start)."""
    num_steps_per_rollout: int = 1
    """Optimiser steps per step() (slime's --num-steps-per-rollout): the rollout batch is split into this
    many mini-batches, one optimiser step each, all against the old log-probs taken before the first.
    With 1 the PPO ratio is exactly 1 and the clip never acts; above 1 later mini-batches see a moved
    policy and the clip (and ``stats/clip_frac``) can act."""
    packing: bool = True
    """Pack several samples into one row (position resets, block-diagonal causal attention) instead of padding each."""
    max_tokens_per_batch: int = 16384
    """Micro-batch budget in padded tokens (rows x row length); a step accumulates gradients over micro-batches."""
    max_tokens_per_row: int | None = None
    """Packed row capacity; None uses the longest sample of the step. A longer sample gets a row of its own."""
    pad_id: int = 0
    """Token id written into padding positions (never attended to by real tokens, never trained)."""
    distill_coef: float = 0.0
    """On-policy distillation weight lambda: on teacher-scored tokens the advantage becomes
    A - lambda * (rollout_log_prob - teacher_log_prob) (behaviour log-probs, as slime and tinker do);
    with zero reward advantage this is pure distillation. 0 disables it. Above 0, samples with a
    trained token no teacher scored (or a failed teacher) are refused, never trained without scores."""
    distill_topk_coef: float = 0.0
    """Weight of the top-K forward KL to the teacher, sum_k p_T(k) (log p_T(k) - log pi(k)) over the
    teacher's top-K tokens (p_T renormalised over them), where samples carry top-K data. 0 disables it."""

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ConfigError:
            return ConfigError(
                f"LearnerConfig.{name}: expected {allowed}, got {getattr(self, name)!r}"
            )

        if self.estimator not in ESTIMATORS:
            raise bad("estimator", f"one of {ESTIMATORS}")
        if self.lineage_advantage not in LINEAGE_ADVANTAGES:
            raise bad("lineage_advantage", f"one of {LINEAGE_ADVANTAGES}")
        if self.kl_type not in KL_TYPES:
            raise bad("kl_type", f"one of {KL_TYPES}")
        if self.loss_agg not in LOSS_AGGS:
            raise bad("loss_agg", f"one of {LOSS_AGGS}")
        if self.optimizer not in OPTIMIZERS:
            raise bad("optimizer", f"one of {OPTIMIZERS}")
        if not 0 <= self.eps_clip < 1:
            raise bad("eps_clip", "a value in [0, 1)")
        if not self.eps_clip_high >= 0:
            raise bad("eps_clip_high", "a value >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise bad("dual_clip", "None or a value > 1")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise bad("tis_cap", "None or a value > 0")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise bad("grad_clip", "None or a value > 0")
        # A NaN or infinite coefficient would surface only as a NaN loss or NaN weights a step later.
        for name, above, at_least in (("lr", 0, None), ("adam_eps", 0, None), ("adv_eps", None, 0), ("kl_coef", None, 0),
                                      ("weight_decay", None, 0), ("entropy_coef", None, None)):
            if not is_number(getattr(self, name), above=above, at_least=at_least):
                bound = "" if above is None and at_least is None else f" > {above}" if above is not None else f" >= {at_least}"
                raise bad(name, f"a finite value{bound}")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else ()
        if len(betas) != 2 or not all(is_number(b, at_least=0) and b < 1 for b in betas):
            raise bad("betas", "two values in [0, 1)")
        if self.warmup_steps < 0:
            raise bad("warmup_steps", "an integer >= 0")
        if self.num_steps_per_rollout < 1:
            raise bad("num_steps_per_rollout", "an integer >= 1")
        if self.max_tokens_per_batch < 1:
            raise bad("max_tokens_per_batch", "an integer >= 1")
        if self.max_tokens_per_row is not None and self.max_tokens_per_row < 1:
            raise bad("max_tokens_per_row", "None or an integer >= 1")
        for name in ("distill_coef", "distill_topk_coef"):
            value = getattr(self, name)
            if not is_number(value, at_least=0):
                raise bad(name, "a finite number >= 0")
        self.betas = tuple(self.betas)  # TOML and JSON hand back lists

    @property
    def distills(self) -> bool:
        """Whether a teacher term is on (``distill_coef`` or ``distill_topk_coef`` > 0): samples must then
        be fully teacher-scored to train (`reducers.samples.distill_problem`)."""
        return self.distill_coef > 0 or self.distill_topk_coef > 0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LearnerConfig":
        """Build a config from a mapping (e.g. a TOML table); unknown keys raise."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in sorted(set(values) & set(REMOVED_FIELDS)):
            raise ConfigError(f"LearnerConfig.{name} was removed: {REMOVED_FIELDS[name]}")
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"LearnerConfig: unknown field(s) {unknown}; known fields are {sorted(known)}"
            )
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (round-trips through from_dict)."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d
