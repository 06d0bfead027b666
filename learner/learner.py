"""The training step: released groups in, one new policy version out.

``Learner(model, config).step(groups)`` computes group-relative advantages
over valid members, drops every row that cannot train (aborted placeholders,
members without a usable reward, rows with no trained token, rows sampled
with a truncation the learner cannot reproduce, and, when distilling, rows a
teacher did not fully score) before any forward pass,
splits the rest into ``num_steps_per_rollout`` mini-batches and, for each,
batches it (packing or padding), recomputes log-probs at each sample's own
temperature, takes the clipped policy loss against the old log-probs fixed
before the first mini-batch, accumulates gradients over micro-batches, clips
the gradient norm and steps the optimiser; then bumps ``policy_version``.

Checkpoints are ``torch.save`` files of state dicts and plain values, written
atomically (temp file, fsync, rename) and read back with
``torch.load(weights_only=True)``: loading one never runs code.
"""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from agentlog._logging import get_logger
from agentlog.learner.advantages import compute_advantages
from agentlog.learner.batching import make_batches
from agentlog.learner.config import LearnerConfig
from agentlog.learner.loss import LossInputs, total_loss
from agentlog.learner.mismatch import MismatchStats
from agentlog.learner.model import token_log_probs, token_stats
from agentlog.learner.optim import make_optimizer, make_scheduler
from agentlog.events.fs import atomic_file
from agentlog.events.schema.lineage import ROOT_LINEAGE
from agentlog.reducers.groups import reward_mean, row_removed, row_trains
from agentlog.reducers.samples import Sample, distill_problem, sampling_problem

CHECKPOINT_FORMAT = "agentlog.learner.v1"


@dataclass
class _Member:
    """One group member as the learner sees it."""

    group: str
    session_id: str
    valid: bool
    reward: float
    samples: Sequence[Sample]


def _by_lineage(members: list[_Member]) -> list[_Member]:
    """Each member split into one member per lineage of its session (lineages as members): a
    lineage's reward is the verifier's per-lineage reward (``metadata["lineage_reward"]``), else its session's."""
    out: list[_Member] = []
    for m in members:
        parts: dict[str, _Member] = {}
        for s in m.samples:
            lineage = s.metadata.get("lineage", ROOT_LINEAGE)
            part = parts.get(lineage)
            if part is None:
                reward = float(s.metadata["lineage_reward"]) if m.valid and "lineage_reward" in s.metadata else m.reward
                part = parts[lineage] = _Member(m.group, f"{m.session_id}#{lineage}", m.valid, reward, [])
                out.append(part)
            part.samples.append(s)
        if not parts:
            out.append(m)
    return out


def _members_from(items: Sequence[Any], lineage_members: bool = False) -> tuple[list[_Member], int]:
    """Normalise released groups or plain samples into members; count skipped groups.
    ``lineage_members``: each lineage of a session is a member of its own."""
    members, skipped = _session_members(items)
    return (_by_lineage(members) if lineage_members else members), skipped


def _session_members(items: Sequence[Any]) -> tuple[list[_Member], int]:
    members: list[_Member] = []
    skipped = 0
    if not items:
        return members, skipped
    if all(isinstance(x, Sample) for x in items):
        # Plain samples: a member is a (group_id, session_id); its rows share the reward.
        by_key: dict[tuple[str, str], _Member] = {}
        for s in items:
            key = (s.group_id, s.session_id)
            m = by_key.get(key)
            reward = float(s.reward)
            if m is None:
                m = by_key[key] = _Member(s.group_id, s.session_id, not _out_of_baseline(s), reward, [])
                members.append(m)
            elif reward != m.reward and not (math.isnan(reward) and math.isnan(m.reward)):
                raise ValueError(
                    f"Learner.step: session {s.session_id!r} of group {s.group_id!r} has rows with different "
                    f"rewards ({m.reward} and {s.reward}); a session has one reward"
                )
            m.samples.append(s)
            m.valid = m.valid and not _out_of_baseline(s)
        return members, skipped
    for g in items:
        if isinstance(g, Sample):
            raise TypeError("Learner.step: pass either released groups or samples, not a mixture")
        if not hasattr(g, "members"):
            raise TypeError(f"Learner.step: expected released groups (reducers.groups.Group) or Samples, got {type(g).__name__}")
        if g.skipped:
            skipped += 1
            continue
        for m in g.members:
            reward = m.reward if (m.valid and m.reward is not None) else 0.0
            members.append(_Member(g.group_id, m.session_id, bool(m.valid), float(reward), m.samples))
    return members, skipped


class Learner:
    """Owns the model, its optimiser and the policy version; trains on groups."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: LearnerConfig | None = None,
        *,
        ref_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.config = config or LearnerConfig()
        self.optimizer = make_optimizer(self.config, [p for p in model.parameters() if p.requires_grad])
        self.scheduler = make_scheduler(self.config, self.optimizer)
        self.policy_version = 0
        self.steps = 0
        self.ref_model = None
        if self.config.kl_coef != 0.0:
            # The reference is the policy as it was handed over, frozen.
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.eval().requires_grad_(False)
        self.log = get_logger("agentlog.learner", component="learner")

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live."""
        return next(self.model.parameters()).device

    def prepare(
        self,
        items: Sequence[Any],
        advantages: Sequence[float] | torch.Tensor | None = None,
    ) -> tuple[list[Sample], torch.Tensor, dict[str, float]]:
        """Trainable samples, their advantages and rollout metrics, from groups or samples.

        With ``advantages`` (one per sample of a plain sample list) those are
        used as given; otherwise they are computed per group over the valid
        members. Only rows of valid members that are not removed and have at
        least one trained token come back.
        """
        items = list(items)
        if advantages is not None:
            if not all(isinstance(x, Sample) for x in items):
                raise TypeError("Learner.step: explicit advantages need a plain list of Samples")
            adv = torch.as_tensor(advantages, dtype=torch.float32).flatten()
            if len(adv) != len(items):
                raise ValueError(f"Learner.step: {len(items)} samples but {len(adv)} advantages")
            refused = self._refuse_sampling(items)
            distill_refused = self._refuse_distill(items, refused)
            keep = [
                i for i, s in enumerate(items)
                if row_trains(True, s) and i not in refused and i not in distill_refused
            ]
            rewards = [float(s.reward) for s in items if not s.remove_sample]
            metrics = {
                "rollout/groups": float(len({s.group_id for s in items})),
                "rollout/groups_skipped": 0.0,
                "rollout/removed": float(sum(s.remove_sample for s in items)),
                "rollout/sampling_refused": float(len(refused) + sum(_sampling_removed(s) for s in items)),
                "rollout/distill_refused": float(len(distill_refused)),
            }
            metrics.update(_reward_stats(rewards))
            return [items[i] for i in keep], adv[keep], metrics

        members, skipped = _members_from(items, self.config.lineage_advantage == "member")
        for m in members:
            if m.valid and not math.isfinite(m.reward):
                raise ValueError(
                    f"Learner.step: session {m.session_id!r} of group {m.group!r} has non-finite reward {m.reward}"
                )
        group_index: dict[str, int] = {}
        gids = torch.tensor([group_index.setdefault(m.group, len(group_index)) for m in members], dtype=torch.long)
        rewards = torch.tensor([m.reward for m in members], dtype=torch.float64)
        valid = torch.tensor([m.valid for m in members], dtype=torch.bool)
        member_adv = compute_advantages(
            rewards, gids, valid, estimator=self.config.estimator, eps=self.config.adv_eps, dtype=torch.float32
        )
        samples: list[Sample] = []
        adv: list[torch.Tensor] = []
        removed = sampling_removed = 0
        for m, a in zip(members, member_adv):
            for s in m.samples:
                if row_removed(m.valid, s):
                    removed += 1
                    sampling_removed += _sampling_removed(s)
                    continue
                if not row_trains(m.valid, s):  # no trained token
                    continue
                samples.append(s)
                adv.append(a)
        refused = self._refuse_sampling(samples)
        distill_refused = self._refuse_distill(samples, refused)
        if refused or distill_refused:
            samples = [s for i, s in enumerate(samples) if i not in refused and i not in distill_refused]
            adv = [a for i, a in enumerate(adv) if i not in refused and i not in distill_refused]
        metrics = {
            "rollout/groups": float(len(group_index) + skipped),
            "rollout/groups_skipped": float(skipped),
            "rollout/removed": float(removed),
            "rollout/sampling_refused": float(len(refused) + sampling_removed),
            "rollout/distill_refused": float(len(distill_refused)),
        }
        metrics.update(_reward_stats([m.reward for m in members if m.valid]))
        return samples, (torch.stack(adv) if adv else torch.zeros(0)), metrics

    def _refuse_sampling(self, samples: Sequence[Sample]) -> set[int]:
        """Indices of the samples not already removed whose sampling settings
        cannot be reproduced (`reducers.samples.sampling_problem`); each is
        logged with its reason and left out of training. Samples from the
        reducers arrive already removed; this guards hand-built ones."""
        refused = set()
        for i, s in enumerate(samples):
            if s.remove_sample:
                continue
            problem = sampling_problem(s.temperature, s.top_p, s.top_k)
            if problem:
                refused.add(i)
                self.log.warning("learner.sample_refused", session_id=s.session_id, group_id=s.group_id,
                                 row_index=s.row_index, reason=problem)
        return refused

    def _refuse_distill(self, samples: Sequence[Sample], refused: set[int]) -> set[int]:
        """When distilling (`LearnerConfig.distills`), indices of the trainable
        samples (not removed, not in ``refused``, with a trained token) that a
        teacher did not fully score (`reducers.samples.distill_problem`): each
        is logged with its reason and left out, so nothing trains without
        scores. The loop learner skips such groups whole before they get here."""
        if not self.config.distills:
            return set()
        out = set()
        for i, s in enumerate(samples):
            if s.remove_sample or i in refused or not s.mask.any():
                continue
            problem = distill_problem(s)
            if problem:
                out.add(i)
                self.log.warning("learner.sample_refused", session_id=s.session_id, group_id=s.group_id,
                                 row_index=s.row_index, reason=f"distill: {problem}")
        return out

    def step(
        self,
        items: Sequence[Any],
        advantages: Sequence[float] | torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One training step on released groups (or a plain list of Samples).

        The trainable samples are split into ``num_steps_per_rollout``
        mini-batches (fewer when there are fewer samples), each trained with
        one optimiser step against old log-probs taken before the first, so
        from the second mini-batch on the ratio leaves 1 and the clip acts.
        Log-probs, the reference's and the entropy are those of each sample's
        own sampling temperature.

        The step is all or nothing: a non-finite gradient norm in any
        mini-batch raises FloatingPointError with the model, optimiser and
        schedule restored to where they were before the step.

        Returns metrics (``loss/*``, ``stats/*``, ``rollout/*``, ``perf/*``,
        ``learner/*``, and ``distill/*`` when samples carry teacher scores;
        loss, stats and distill averaged over the mini-batches), with the
        training–inference mismatch over the trained tokens of this
        version (`agentlog.learner.mismatch`: ``stats/train_rollout_*``). When
        nothing is trainable (every row removed or masked) no optimiser step
        is taken, ``policy_version`` is unchanged and ``learner/skipped`` is 1.
        """
        t0 = time.perf_counter()
        c = self.config
        samples, adv, metrics = self.prepare(items, advantages)
        metrics["rollout/samples"] = float(len(samples))
        # Contiguous, near-equal mini-batches of samples (slime splits the rollout batch the same way).
        bounds = np.linspace(0, len(samples), min(c.num_steps_per_rollout, len(samples)) + 1).round().astype(int).tolist()
        minis = [
            [
                b.to(self.device)
                for b in make_batches(
                    samples[lo:hi], adv[lo:hi], packing=c.packing, max_tokens_per_batch=c.max_tokens_per_batch,
                    max_tokens_per_row=c.max_tokens_per_row, pad_id=c.pad_id,
                )
            ]
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]
        minis = [m for m in minis if m]
        if not minis:
            metrics.update({"learner/skipped": 1.0, "learner/policy_version": float(self.policy_version)})
            self.log.info("learner.step_skipped", reason="no trainable tokens", **_short(metrics))
            return metrics

        self.model.train()
        old = ref = None
        if len(minis) > 1:
            # Fixed for the whole step: every mini-batch's ratio is taken against the policy before it.
            with torch.no_grad():
                old = [[token_log_probs(self.model, b)[0] for b in mini] for mini in minis]
        if self.ref_model is not None:
            with torch.no_grad():
                ref = [[token_log_probs(self.ref_model, b)[0] for b in mini] for mini in minis]
        before = self._snapshot() if len(minis) > 1 else None

        sums: dict[str, float] = {}
        mismatch = MismatchStats()
        grad_norm = torch.zeros(())
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for k, mini in enumerate(minis):
            self.optimizer.zero_grad(set_to_none=True)
            num_tokens = sum(float(b.loss_mask.sum()) for b in mini)
            num_samples = sum(float((b.loss_mask.sum(-1) > 0).sum()) for b in mini)
            num_scored = sum(float((b.loss_mask * b.teacher_mask).sum()) for b in mini if b.teacher_mask is not None)
            for i, b in enumerate(mini):
                with_top = c.distill_topk_coef != 0.0 and b.teacher_top_ids is not None
                log_probs, entropy, top = token_stats(self.model, b, with_entropy=True, with_top=with_top)
                if c.entropy_coef == 0.0:
                    entropy = entropy.detach()  # metric only: keep it out of the graph
                inputs = LossInputs(
                    log_probs,
                    log_probs.detach() if old is None else old[k][i],
                    b.advantages,
                    b.loss_mask,
                    rollout_log_probs=b.rollout_log_probs,
                    ref_log_probs=None if ref is None else ref[k][i],
                    entropy=entropy,
                    teacher_log_probs=b.teacher_log_probs,
                    teacher_mask=b.teacher_mask,
                    top_log_probs=top,
                    teacher_top_log_probs=b.teacher_top_log_probs if with_top else None,
                    teacher_top_mask=b.teacher_top_mask if with_top else None,
                )
                # The policy before this step's update against the recorded one, on tokens of this version.
                counted = b.loss_mask > 0
                if b.versions is not None:
                    counted &= b.versions == self.policy_version
                mismatch.add(inputs.old_log_probs, b.rollout_log_probs, counted)
                loss, m = total_loss(inputs, c, num_tokens=num_tokens, num_samples=num_samples,
                                     num_scored=max(num_scored, 1.0))
                loss.backward()
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, c.grad_clip if c.grad_clip is not None else math.inf)
            if not torch.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                if before is not None:
                    self._restore(before)
                raise FloatingPointError(
                    f"Learner.step: gradient norm is {float(grad_norm)} in mini-batch {k + 1} of {len(minis)} at"
                    f" step {self.steps}; no update of this step was applied"
                    + (" (model, optimiser and schedule restored to before the step)" if before is not None else "")
                )
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.policy_version += 1

        elapsed = time.perf_counter() - t0
        batches = [b for mini in minis for b in mini]
        real = sum(b.num_tokens for b in batches)
        padded = sum(b.num_padded for b in batches)
        metrics.update({k: v / len(minis) for k, v in sums.items()})
        metrics.update(mismatch.metrics())
        metrics.update({
            "learner/step": float(self.steps),
            "learner/policy_version": float(self.policy_version),
            "learner/lr": float(lr),
            "learner/skipped": 0.0,
            "learner/optimizer_steps": float(len(minis)),
            "stats/grad_norm": float(grad_norm),
            "perf/tokens": float(real),
            "perf/trained_tokens": sum(float(b.loss_mask.sum()) for b in batches),
            "perf/padded_tokens": float(padded),
            "perf/padding_waste": 1.0 - real / padded,
            "perf/micro_batches": float(len(batches)),
            "perf/step_s": elapsed,
            "perf/tokens_per_s": real / elapsed if elapsed > 0 else 0.0,
        })
        self.log.debug("learner.step", **_short(metrics))
        return metrics

    def _snapshot(self) -> dict[str, Any]:
        """Copies (on the CPU) of everything an optimiser step changes, for `_restore`."""
        return {
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        """Put back what `_snapshot` copied."""
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])  # moves the state back to the params' device
        self.scheduler.load_state_dict(snapshot["scheduler"])

    # --- checkpoints ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimiser, schedule, counters, config."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "policy_version": self.policy_version,
            "steps": self.steps,
            "config": self.config.to_dict(),
        }
        if self.ref_model is not None:
            state["ref_model"] = self.ref_model.state_dict()
        model_config = _model_config(self.model)
        if model_config is not None:
            state["model_config"] = model_config
        return state

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write a resumable checkpoint atomically; returns its path."""
        return save_state(self.state_dict(), path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume from a checkpoint written by `save_checkpoint` (loaded with weights_only=True)."""
        state = load_state(path)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not a learner checkpoint (format {state.get('format')!r}, expected {CHECKPOINT_FORMAT!r})")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ref_model is not None and "ref_model" in state:
            self.ref_model.load_state_dict(state["ref_model"])
        self.policy_version = int(state["policy_version"])
        self.steps = int(state["steps"])


def save_state(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """``torch.save`` a dict of tensors and plain values atomically (temp, fsync, rename, fsync dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        torch.save(state, f)
    return path


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """Read a file written by `save_state`; never unpickles arbitrary objects."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise ValueError(f"{path}: cannot load as a weights-only checkpoint: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a dict checkpoint, found {type(state).__name__}")
    return state


def save_weights(model: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Write only the model weights (what rollout workers load)."""
    return save_state({"format": "agentlog.weights.v1", "model": model.state_dict()}, path)


def load_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load model weights from a learner checkpoint or a `save_weights` file."""
    state = load_state(path)
    if "model" not in state:
        raise ValueError(f"{path}: no 'model' weights in checkpoint (keys {sorted(state)})")
    model.load_state_dict(state["model"])


def read_policy(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """``(state_dict, model_config)`` of a policy file: a learner checkpoint, a
    `save_weights` file or a bare state dict (all read with weights_only=True).
    ``model_config`` is the built-in GPT's config when the file recorded it
    (learner checkpoints record it since HF policies were added), else None."""
    state = load_state(path)
    if "model" in state:
        model = state["model"]
        if not isinstance(model, dict):
            raise ValueError(f"{path}: 'model' is {type(model).__name__}, expected a state dict")
        config = state.get("model_config")
        return model, config if isinstance(config, dict) else None
    if state and all(torch.is_tensor(v) for v in state.values()):
        return state, None
    raise ValueError(
        f"{path}: expected a learner checkpoint, a weights file or a state dict of tensors, "
        f"found keys {sorted(map(str, state))[:8]}"
    )


def _model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The built-in GPT's config as plain data (None for other models)."""
    import dataclasses

    from agentlog.learner.model import GPTConfig

    cfg = getattr(model, "config", None)
    return dataclasses.asdict(cfg) if isinstance(cfg, GPTConfig) else None


def _reward_stats(rewards: Iterable[float]) -> dict[str, float]:
    values = [float(x) for x in rewards]
    r = torch.tensor(values, dtype=torch.float64)
    if len(r) == 0:
        return {"rollout/reward_mean": math.nan, "rollout/reward_std": math.nan, "rollout/valid_members": 0.0}
    return {
        "rollout/reward_mean": reward_mean(values),
        "rollout/reward_std": float(r.std()) if len(r) > 1 else 0.0,
        "rollout/valid_members": float(len(r)),
    }


def _sampling_removed(sample: Sample) -> bool:
    """Whether the reducers removed this row because its sampling cannot be reproduced."""
    return sample.remove_sample and "sampling_error" in sample.metadata


def _out_of_baseline(sample: Sample) -> bool:
    """Whether a plain sample's removal takes its session out of the group's baseline: any removal
    but one for its sampling alone (the row is not trained, the session's reward still counts, as
    its released group says: reducers.samples)."""
    return sample.remove_sample and not (_sampling_removed(sample) and "reward_error" not in sample.metadata)


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) copied to the CPU."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _short(metrics: dict[str, float]) -> dict[str, float]:
    keys = ("learner/policy_version", "loss/policy", "rollout/reward_mean", "rollout/samples", "perf/step_s")
    return {k.replace("/", "_"): round(metrics[k], 5) for k in keys if k in metrics}
