"""Samples to tensors, by padding or by packing.

Padding puts one sample per row, right-padded to the longest row of the
micro-batch; plain causal attention then needs no mask. Packing places
several samples in one row (first-fit decreasing), restarts position ids at
every sample and gives each row a block-diagonal causal attention mask, so
no token sees another sample.

Either way the per-token training tensors (``loss_mask``,
``rollout_log_probs``) come out one sample per row, ``(N, L)``, over the
response only. The response tokens themselves are listed flat (``targets``),
with ``predict_index`` pointing at the flattened input position whose logits
predict each and ``slots`` at its place in the ``(N, L)`` layout, so log-probs
are taken on real response tokens only. The loss never sees the layout.

Teacher scores (on-policy distillation) travel the same way: ``teacher_log_probs``
and ``teacher_mask`` are ``(N, L)`` like ``rollout_log_probs``, the teacher's
top-K ids and log-probs ``(N, L, K)``; all None when no sample carries them.

Samples with ``remove_sample`` are dropped here, before any tensor is built:
they cost no forward pass and reach no loss. Each sample's ``temperature``
is spread over its response tokens (``temperatures``), so samples drawn at
different temperatures can share a micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from agentlog.reducers.samples import Sample


@dataclass
class Batch:
    """One micro-batch: model inputs plus per-sample response tensors."""

    input_ids: torch.Tensor
    """(R, T) long: token ids, padding with the pad id."""
    position_ids: torch.Tensor | None
    """(R, T) long: positions restarting at 0 for each packed sample (and for the padding tail); None when padded."""
    segment_ids: torch.Tensor | None
    """(R, T) long: which sample of its row each position belongs to, -1 for padding; None when padded."""
    predict_index: torch.Tensor
    """(M,) long: for each of the M response tokens, the flattened (R*T) position whose logits predict it."""
    targets: torch.Tensor
    """(M,) long: the response tokens, sample after sample."""
    slots: torch.Tensor
    """(M,) long: where each response token sits in the flattened (N, L) per-sample layout."""
    loss_mask: torch.Tensor
    """(N, L) float32: 1 for trained tokens."""
    rollout_log_probs: torch.Tensor
    """(N, L) float32: log-probs recorded at rollout time."""
    advantages: torch.Tensor
    """(N,) float32: one advantage per sample."""
    sample_indices: list[int]
    """Position of each of the N samples in the list given to `make_batches`."""
    num_tokens: int
    """Real (non-padding) tokens in input_ids."""
    temperatures: torch.Tensor | None = None
    """(M,) float32: the sampling temperature of each response token's sample (logits are divided
    by it before log-probs are taken); None when every sample was sampled at temperature 1."""
    teacher_log_probs: torch.Tensor | None = None
    """(N, L) float32: teacher log-probs aligned like rollout_log_probs (0 where not scored); None when
    no sample of the batch was scored by a teacher."""
    teacher_mask: torch.Tensor | None = None
    """(N, L) float32: 1 where a teacher scored the token; None with teacher_log_probs."""
    teacher_top_ids: torch.Tensor | None = None
    """(N, L, K) long: the teacher's top-K token ids (K the largest top-K of the batch; 0 where absent);
    None when no sample of the batch carries top-K data."""
    teacher_top_log_probs: torch.Tensor | None = None
    """(N, L, K) float32: the teacher's log-probs of those ids (0 where absent)."""
    teacher_top_mask: torch.Tensor | None = None
    """(N, L, K) bool: which top-K entries are real (a scored token of a sample with top-K data)."""
    versions: torch.Tensor | None = None
    """(N, L) long: the policy version that generated each response token (`Sample.versions`; 0 in padding)."""

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """(R, T, T) bool, True where a query may attend to a key: block-diagonal and
        causal when packed (built on demand), None when padded (plain causal)."""
        if self.segment_ids is None:
            return None
        seg = self.segment_ids
        T = seg.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
        return (seg[:, :, None] == seg[:, None, :]) & causal

    @property
    def num_padded(self) -> int:
        """Tokens the model actually runs on, padding included (R * T)."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> "Batch":
        """A copy with every tensor on ``device``."""
        def mv(t):
            return t.to(device, non_blocking=True) if torch.is_tensor(t) else t

        return Batch(**{
            f.name: list(self.sample_indices) if f.name == "sample_indices" else mv(getattr(self, f.name))
            for f in dataclasses.fields(self)
        })


@dataclass
class _Item:
    index: int
    tokens: np.ndarray
    prompt_length: int
    response_length: int
    mask: np.ndarray
    log_probs: np.ndarray
    advantage: float
    temperature: float
    sample: Sample  # for its teacher arrays


def _check_teacher(sample: Sample, where: str) -> None:
    """The teacher arrays, when present, must be aligned with the response (the distillation contract: one entry per response token)."""
    n = sample.response_length
    if not (sample.teacher_log_probs or sample.teacher_scored or sample.teacher_top_k):
        return
    if len(sample.teacher_log_probs) != 4 * n or len(sample.teacher_scored) != n:
        raise ValueError(
            f"{where}: expected teacher_log_probs of {4 * n} bytes and teacher_scored of {n} bytes"
            f" (response_length {n}), got {len(sample.teacher_log_probs)} and {len(sample.teacher_scored)}"
        )
    k = sample.teacher_top_k
    if k < 0 or (k and not len(sample.teacher_top_ids) == len(sample.teacher_top_log_probs) == 4 * n * k):
        raise ValueError(
            f"{where}: teacher_top_k {k}: expected teacher_top_ids and teacher_top_log_probs of {4 * n * max(k, 0)}"
            f" bytes each, got {len(sample.teacher_top_ids)} and {len(sample.teacher_top_log_probs)}"
        )


def _check(sample: Sample, index: int) -> None:
    where = f"sample {index} (session {sample.session_id!r}, row {sample.row_index})"
    n_tok = len(sample.tokens) // 4
    if len(sample.tokens) % 4:
        raise ValueError(f"{where}: tokens is {len(sample.tokens)} bytes, expected a multiple of 4 (int32)")
    if sample.response_length < 1:
        raise ValueError(f"{where}: response_length must be >= 1, got {sample.response_length}")
    if not (len(sample.loss_mask) == len(sample.rollout_log_probs) // 4 == sample.response_length):
        raise ValueError(
            f"{where}: expected len(loss_mask) == len(rollout_log_probs) == response_length, got "
            f"{len(sample.loss_mask)}, {len(sample.rollout_log_probs) // 4}, {sample.response_length}"
        )
    if n_tok - sample.response_length < 1:
        raise ValueError(
            f"{where}: needs at least one prompt token before the response "
            f"({n_tok} tokens, response_length {sample.response_length})"
        )
    _check_teacher(sample, where)


def make_batches(
    samples: Sequence[Sample],
    advantages: Sequence[float] | torch.Tensor | None = None,
    *,
    packing: bool = True,
    max_tokens_per_batch: int = 16384,
    max_tokens_per_row: int | None = None,
    pad_id: int = 0,
) -> list[Batch]:
    """Split samples into micro-batches of at most ``max_tokens_per_batch`` padded tokens.

    ``advantages`` is aligned with ``samples`` (default 0). Samples with
    ``remove_sample`` are dropped before anything is built; a micro-batch
    holds at least one row even if that row alone exceeds the budget.
    """
    if advantages is None:
        adv = np.zeros(len(samples), dtype=np.float32)
    else:
        adv = np.asarray(advantages.detach().cpu() if torch.is_tensor(advantages) else advantages, dtype=np.float32)
        if adv.shape != (len(samples),):
            raise ValueError(f"make_batches: expected {len(samples)} advantages, got shape {adv.shape}")
    items: list[_Item] = []
    for i, s in enumerate(samples):
        if s.remove_sample:
            continue
        _check(s, i)
        tok = s.token_ids
        items.append(_Item(
            i, tok, len(tok) - s.response_length, s.response_length, s.mask, s.log_probs, float(adv[i]),
            float(s.temperature), s,
        ))
    if not items:
        return []
    if packing:
        # A sample longer than the capacity gets a row of its own.
        capacity = max_tokens_per_row or max(len(it.tokens) for it in items)
        rows = _first_fit_decreasing(items, capacity)
    else:
        rows = [[it] for it in items]
    batches = []
    for chunk in _split_rows(rows, max_tokens_per_batch):
        batches.append(_collate(chunk, packed=packing, pad_id=pad_id))
    return batches


def _first_fit_decreasing(items: list[_Item], capacity: int) -> list[list[_Item]]:
    rows: list[list[_Item]] = []
    free: list[int] = []
    for it in sorted(items, key=lambda it: len(it.tokens), reverse=True):
        n = len(it.tokens)
        for r, room in enumerate(free):
            if room >= n:
                rows[r].append(it)
                free[r] -= n
                break
        else:
            rows.append([it])
            free.append(capacity - n)
    return rows


def _split_rows(rows: list[list[_Item]], budget: int) -> list[list[list[_Item]]]:
    chunks: list[list[list[_Item]]] = []
    current: list[list[_Item]] = []
    width = 0
    for row in rows:
        n = sum(len(it.tokens) for it in row)
        if current and (len(current) + 1) * max(width, n) > budget:
            chunks.append(current)
            current, width = [], 0
        current.append(row)
        width = max(width, n)
    if current:
        chunks.append(current)
    return chunks


def _collate(rows: list[list[_Item]], *, packed: bool, pad_id: int) -> Batch:
    R = len(rows)
    T = max(sum(len(it.tokens) for it in row) for row in rows)
    flat = [it for row in rows for it in row]
    N, L = len(flat), max(it.response_length for it in flat)

    input_ids = np.full((R, T), pad_id, dtype=np.int64)
    positions = np.zeros((R, T), dtype=np.int64)
    segments = np.full((R, T), -1, dtype=np.int64)  # -1: padding, attends only to padding
    M = sum(it.response_length for it in flat)
    predict_index = np.zeros(M, dtype=np.int64)
    targets = np.zeros(M, dtype=np.int64)
    slots = np.zeros(M, dtype=np.int64)
    loss_mask = np.zeros((N, L), dtype=np.float32)
    rollout = np.zeros((N, L), dtype=np.float32)
    versions = np.zeros((N, L), dtype=np.int64)
    advantages = np.zeros(N, dtype=np.float32)
    temperatures = np.ones(M, dtype=np.float32)
    scored_any = any(it.sample.teacher_scored for it in flat)
    K = max(max(it.sample.teacher_top_k, 0) for it in flat)
    teacher = np.zeros((N, L), dtype=np.float32) if scored_any else None
    teacher_mask = np.zeros((N, L), dtype=np.float32) if scored_any else None
    top_ids = np.zeros((N, L, K), dtype=np.int64) if K else None
    top_lp = np.zeros((N, L, K), dtype=np.float32) if K else None
    top_mask = np.zeros((N, L, K), dtype=bool) if K else None

    n = j = 0
    for r, row in enumerate(rows):
        offset = 0
        for k, it in enumerate(row):
            length = len(it.tokens)
            input_ids[r, offset : offset + length] = it.tokens
            positions[r, offset : offset + length] = np.arange(length)
            segments[r, offset : offset + length] = k
            m = it.response_length
            start = offset + it.prompt_length  # first response token
            # The logits at position t predict the token at t + 1.
            predict_index[j : j + m] = r * T + np.arange(start - 1, start - 1 + m)
            targets[j : j + m] = it.tokens[it.prompt_length :]
            slots[j : j + m] = n * L + np.arange(m)
            temperatures[j : j + m] = it.temperature
            j += m
            loss_mask[n, :m] = it.mask
            rollout[n, :m] = it.log_probs
            versions[n, :m] = it.sample.versions
            advantages[n] = it.advantage
            if it.sample.teacher_scored:
                teacher[n, :m] = it.sample.teacher_lp
                teacher_mask[n, :m] = it.sample.teacher_mask
                top = it.sample.teacher_top()
                if top is not None:
                    k = it.sample.teacher_top_k
                    top_ids[n, :m, :k], top_lp[n, :m, :k] = top
                    top_mask[n, :m, :k] = it.sample.teacher_mask[:, None] != 0
            offset += length
            n += 1
        # The padding tail is a segment of its own: its positions restart at 0 too.
        positions[r, offset:] = np.arange(T - offset)

    return Batch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(positions) if packed else None,
        segment_ids=torch.from_numpy(segments) if packed else None,
        predict_index=torch.from_numpy(predict_index),
        targets=torch.from_numpy(targets),
        slots=torch.from_numpy(slots),
        loss_mask=torch.from_numpy(loss_mask),
        rollout_log_probs=torch.from_numpy(rollout),
        advantages=torch.from_numpy(advantages),
        sample_indices=[it.index for it in flat],
        num_tokens=sum(len(it.tokens) for it in flat),
        temperatures=None if all(it.temperature == 1.0 for it in flat) else torch.from_numpy(temperatures),
        teacher_log_probs=None if teacher is None else torch.from_numpy(teacher),
        teacher_mask=None if teacher_mask is None else torch.from_numpy(teacher_mask),
        teacher_top_ids=None if top_ids is None else torch.from_numpy(top_ids),
        teacher_top_log_probs=None if top_lp is None else torch.from_numpy(top_lp),
        teacher_top_mask=None if top_mask is None else torch.from_numpy(top_mask),
        versions=torch.from_numpy(versions),
    )
