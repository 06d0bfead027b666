"""The training Sample, its canonical encoding, and the sample-stream digest.

A Sample carries the fields slime users know (``tokens``, ``response_length``,
``loss_mask``, ``rollout_log_probs``, ``reward``, ``status``,
``remove_sample``...) plus provenance: the LSN range it came from. Arrays are
stored as packed little-endian bytes (int32 tokens, uint8 mask, float32
log-probs) so the canonical encoding is byte-exact and cheap; accessors hand
back numpy views.

Invariant: ``len(loss_mask) == len(rollout_log_probs) == response_length >= 1``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import msgspec
import numpy as np

COMPLETED = "completed"
TRUNCATED = "truncated"
ABORTED = "aborted"
SAMPLE_STATUSES = (COMPLETED, TRUNCATED, ABORTED)


class Sample(msgspec.Struct, frozen=True):
    """One training row."""

    group_id: str
    session_id: str
    sample_index: int
    tokens: bytes  # int32 LE: prompt + response tokens
    response_length: int  # the last response_length tokens are the response
    loss_mask: bytes  # uint8, one per response token
    rollout_log_probs: bytes  # float32 LE, one per response token
    reward: float
    status: str
    remove_sample: bool = False
    policy_version: int = 0
    turns: int = 0
    row_index: int = 0  # which trajectory row of the session (0 for most)
    lsn_first: int = -1
    lsn_last: int = -1
    metadata: dict[str, Any] = {}

    @property
    def token_ids(self) -> np.ndarray:
        """All tokens (prompt + response) as an int32 view."""
        return np.frombuffer(self.tokens, dtype="<i4")

    @property
    def mask(self) -> np.ndarray:
        """Loss mask over the response as a uint8 view."""
        return np.frombuffer(self.loss_mask, dtype=np.uint8)

    @property
    def log_probs(self) -> np.ndarray:
        """Rollout log-probs over the response as a float32 view."""
        return np.frombuffer(self.rollout_log_probs, dtype="<f4")

    @property
    def prompt_length(self) -> int:
        """Number of tokens before the response."""
        return len(self.tokens) // 4 - self.response_length


def aborted_placeholder(
    group_id: str,
    session_id: str,
    sample_index: int,
    abort_reason: str,
    *,
    policy_version: int = 0,
    turns: int = 0,
    lsn_first: int = -1,
    lsn_last: int = -1,
) -> Sample:
    """The one zero-masked row an aborted session yields, so its group knows a
    member failed. It contributes nothing to any gradient or baseline."""
    return Sample(
        group_id=group_id,
        session_id=session_id,
        sample_index=sample_index,
        tokens=np.zeros(2, dtype="<i4").tobytes(),
        response_length=1,
        loss_mask=b"\x00",
        rollout_log_probs=np.zeros(1, dtype="<f4").tobytes(),
        reward=0.0,
        status=ABORTED,
        remove_sample=True,
        policy_version=policy_version,
        turns=turns,
        lsn_first=lsn_first,
        lsn_last=lsn_last,
        metadata={"abort_reason": abort_reason},
    )


# Deterministic: dict keys sorted, so the bytes never depend on insertion
# order or PYTHONHASHSEED.
_canonical = msgspec.msgpack.Encoder(order="deterministic")
_sample_decoder = msgspec.msgpack.Decoder(Sample)


def encode_sample(sample: Sample) -> bytes:
    """The canonical bytes of a sample (msgpack, deterministic key order)."""
    return _canonical.encode(sample)


def decode_sample(raw: bytes) -> Sample:
    """Inverse of encode_sample."""
    return _sample_decoder.decode(raw)


class SampleDigest:
    """Running sha256 over a sample stream: length-prefixed canonical bytes."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.count = 0

    def update(self, sample: Sample) -> None:
        """Fold one sample into the digest."""
        raw = encode_sample(sample)
        self._h.update(len(raw).to_bytes(8, "little"))
        self._h.update(raw)
        self.count += 1

    def hexdigest(self) -> str:
        """``sha256:<hex>`` of everything folded so far."""
        return "sha256:" + self._h.hexdigest()


def digest_samples(samples: Iterable[Sample]) -> str:
    """``sha256:<hex>`` of a whole sample stream."""
    d = SampleDigest()
    for s in samples:
        d.update(s)
    return d.hexdigest()


# ---------------------------------------------------------------- rewards and rows -> samples


def final_raw_reward(finished: Any, assigned: Any) -> Any:
    """The raw reward a finished session ends with: ``SessionFinished.reward``
    when it is given, else the last ``RewardAssigned`` value (None if neither)."""
    return finished if finished is not None else assigned


def resolve_reward(value: Any, reward_key: str | None = None) -> tuple[float | None, str]:
    """The training reward of a raw reward value, or why there is none.

    Returns ``(reward, "")`` or ``(None, problem)``. Never raises: int and
    bool become floats; a dict gives its ``reward_key`` entry, or its only
    entry; None, NaN, infinities, strings and ambiguous dicts are reported.
    """
    if isinstance(value, bool):
        return float(value), ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            f = float(value)
        except OverflowError:
            return None, f"reward {value!r} does not fit a float"
        if f != f or f in (float("inf"), float("-inf")):
            return None, f"reward is not finite: {value!r}"
        return f, ""
    if isinstance(value, dict):
        if reward_key is not None and reward_key in value:
            inner, problem = resolve_reward(value[reward_key], None)
            return inner, (f"reward[{reward_key!r}]: {problem}" if problem else "")
        if len(value) == 1:
            (key, inner_value), = value.items()
            if isinstance(inner_value, dict):
                return None, f"reward[{key!r}] is itself a dict"
            inner, problem = resolve_reward(inner_value, None)
            return inner, (f"reward[{key!r}]: {problem}" if problem else "")
        keys = sorted(str(k) for k in value)[:8]
        wanted = f"key {reward_key!r} missing" if reward_key is not None else "no reward_key configured"
        return None, f"dict reward with keys {keys}: {wanted} (set ReduceConfig.reward_key)"
    if value is None:
        return None, "no reward (SessionFinished.reward is None and no RewardAssigned)"
    return None, f"reward of type {type(value).__name__} is not a number"


def finished_samples(
    rows: Iterable[Any],
    *,
    group_id: str,
    session_id: str,
    sample_index: int,
    reward: float | None,
    reward_problem: str = "",
    turns: int,
    lsn_first: int,
    lsn_last: int,
) -> list[Sample]:
    """Samples of a finished session: one per trajectory row, each with the
    session's reward. A row whose chain ended on a ``length`` finish is
    TRUNCATED. Without a usable reward (``reward`` None) the rows are kept
    for inspection but marked ``remove_sample`` with ``reward_error``, so they
    carry no gradient and stay out of every baseline."""
    out = []
    for row_index, row in enumerate(rows):
        metadata: dict[str, Any] = {
            "turn_indices": list(row.turn_indices),
            "leaf": row.leaf,
            "use_tool": row.use_tool,
            "ill_formed": row.ill_formed,
        }
        if row.cut:
            metadata["cut_to_max_context"] = True
        if reward is None:
            metadata["reward_error"] = reward_problem
        out.append(
            Sample(
                group_id=group_id,
                session_id=session_id,
                sample_index=sample_index,
                tokens=row.tokens,
                response_length=row.response_length,
                loss_mask=row.loss_mask,
                rollout_log_probs=row.rollout_log_probs,
                reward=0.0 if reward is None else reward,
                status=TRUNCATED if row.truncated else COMPLETED,
                remove_sample=reward is None,
                policy_version=row.policy_version,
                turns=turns,
                row_index=row_index,
                lsn_first=lsn_first,
                lsn_last=lsn_last,
                metadata=metadata,
            )
        )
    return out


def check_sample(sample: Sample) -> None:
    """Raise ValueError naming the session if a sample breaks the invariant
    ``len(loss_mask) == len(rollout_log_probs) == response_length >= 1``."""
    n_mask = len(sample.loss_mask)
    n_lp = len(sample.rollout_log_probs) // 4
    n_tok = len(sample.tokens) // 4
    if not (n_mask == n_lp == sample.response_length >= 1) or sample.response_length > n_tok:
        raise ValueError(
            f"sample of session {sample.session_id!r} row {sample.row_index}: expected"
            f" len(loss_mask) == len(rollout_log_probs) == response_length >= 1 (and <= {n_tok} tokens),"
            f" found {n_mask}, {n_lp}, {sample.response_length}"
        )
