"""Hand-built samples for the learner tests."""

from __future__ import annotations

import numpy as np

from agentlog.reducers.samples import COMPLETED, Sample


def make_sample(
    group_id: str,
    session_id: str,
    prompt: list[int],
    response: list[int],
    *,
    reward: float = 0.0,
    mask: list[int] | None = None,
    log_probs: list[float] | None = None,
    sample_index: int = 0,
    row_index: int = 0,
) -> Sample:
    """A finished-session sample built by hand."""
    n = len(response)
    return Sample(
        group_id=group_id,
        session_id=session_id,
        sample_index=sample_index,
        tokens=np.asarray(prompt + response, dtype="<i4").tobytes(),
        response_length=n,
        loss_mask=np.asarray(mask if mask is not None else [1] * n, dtype=np.uint8).tobytes(),
        rollout_log_probs=np.asarray(log_probs if log_probs is not None else [0.0] * n, dtype="<f4").tobytes(),
        reward=float(reward),
        status=COMPLETED,
        row_index=row_index,
    )


def random_samples(rng: np.random.Generator, n: int, vocab: int, *, group: str = "g", max_prompt: int = 6,
                   max_response: int = 9) -> list[Sample]:
    """Samples of random lengths, masks, log-probs and rewards."""
    out = []
    for i in range(n):
        p = int(rng.integers(1, max_prompt + 1))
        r = int(rng.integers(1, max_response + 1))
        mask = rng.integers(0, 2, r)
        mask[0] = 1
        out.append(make_sample(
            group, f"{group}-s{i}", rng.integers(0, vocab, p).tolist(), rng.integers(0, vocab, r).tolist(),
            reward=float(rng.integers(0, 3)), mask=mask.tolist(),
            log_probs=(-rng.random(r) * 3).astype(np.float32).tolist(), sample_index=i,
        ))
    return out
