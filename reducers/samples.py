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
