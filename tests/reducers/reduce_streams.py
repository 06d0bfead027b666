"""Builders of event streams for the reducer tests (not a test module).

Log-probs are derived from token ids (``-token / 64``, exact in float32), so
a hand-written expectation can name them without another table.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import (
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TurnRecorded,
    TurnUndelivered,
)
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import ReduceResult, reduce_log


def lp(tokens: Iterable[int]) -> list[float]:
    """The log-probs the builders attach to ``tokens``."""
    return [-t / 64 for t in tokens]


def msg(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


class Script:
    """One session's events, in order."""

    def __init__(self, sid: str, group_id: str = "g", group_size: int = 1, sample_index: int = 0, policy_version: int = 0):
        self.sid = sid
        self.bodies: list[Any] = [
            SessionOpened(group_id=group_id, group_size=group_size, sample_index=sample_index, policy_version=policy_version),
            SessionStarted(),
        ]
        self._turn = 0

    def turn(
        self,
        messages: list[dict[str, Any]],
        prompt: list[int],
        output: list[int],
        *,
        response: dict[str, Any] | None = None,
        finish: str = "stop",
        log_probs: list[float] | None | str = "auto",
        policy_version: int = 0,
        sampling: dict[str, Any] | None = None,
    ) -> "Script":
        lps = lp(output) if log_probs == "auto" else (log_probs or [])
        self.bodies.append(
            TurnRecorded(
                turn_index=self._turn,
                messages=messages,
                prompt_ids=prompt,
                output_ids=output,
                output_log_probs=lps,
                finish_reason=finish,
                response_message=response,
                policy_version=policy_version,
                sampling=sampling or {},
            )
        )
        self._turn += 1
        return self

    def undelivered(self, turn_index: int, reason: str = "client_gone") -> "Script":
        self.bodies.append(TurnUndelivered(turn_index=turn_index, reason=reason))
        return self

    def reward(self, value: Any) -> "Script":
        self.bodies.append(RewardAssigned(reward=value))
        return self

    def finish(self, reward: Any = 1.0) -> "Script":
        self.bodies.append(SessionFinished(reward=reward))
        return self

    def abort(self, reason: str = "timeout") -> "Script":
        self.bodies.append(SessionAborted(reason=reason))
        return self

    def drop(self, reason: str = "cancelled") -> "Script":
        self.bodies.append(SessionDropped(reason=reason))
        return self

    def records(self) -> list[tuple[str, int, Any]]:
        return [(self.sid, i, b) for i, b in enumerate(self.bodies)]


def log_of(*scripts: Script, interleave: bool = False) -> MemoryLog:
    """A MemoryLog holding the scripts one after another (or round-robin)."""
    log = MemoryLog(clock=lambda: 0)
    if not interleave:
        for s in scripts:
            log.append_batch(s.records())
        return log
    queues = [s.records() for s in scripts]
    pos = [0] * len(queues)
    while any(p < len(q) for p, q in zip(pos, queues)):
        for i, q in enumerate(queues):
            if pos[i] < len(q):
                log.append_batch([q[pos[i]]])
                pos[i] += 1
    return log


def reduce_scripts(*scripts: Script, config: ReduceConfig | None = None, interleave: bool = False) -> ReduceResult:
    return reduce_log(log_of(*scripts, interleave=interleave), config or ReduceConfig())


def row_view(sample) -> tuple[list[int], int, list[int], list[float]]:
    """(tokens, response_length, mask, log-probs) as plain lists."""
    return (
        sample.token_ids.tolist(),
        sample.response_length,
        sample.mask.tolist(),
        [float(x) for x in sample.log_probs],
    )


def expect_row(sample, tokens: list[int], mask: list[int], trained: list[int] | None = None) -> None:
    """Assert a sample's tokens and mask; log-probs are ``-tok/64`` where the
    mask is 1 and 0 elsewhere."""
    got_tokens, resp_len, got_mask, got_lps = row_view(sample)
    assert got_tokens == tokens, f"tokens {got_tokens} != {tokens}"
    assert resp_len == len(mask), f"response_length {resp_len} != {len(mask)}"
    assert got_mask == mask, f"mask {got_mask} != {mask}"
    response = tokens[len(tokens) - len(mask) :]
    want_lps = [(-t / 64 if m else 0.0) for t, m in zip(response, mask)]
    np.testing.assert_array_equal(np.asarray(got_lps, dtype=np.float32), np.asarray(want_lps, dtype=np.float32))


# ---------------------------------------------------------------- random valid streams


class RandomStream:
    """A random but valid interleaved event stream; ``repr`` shows its seed so
    a failure can be replayed with ``RandomStream(seed).log()``."""

    def __init__(self, seed: int, max_groups: int = 4, max_group_size: int = 4, max_turns: int = 6) -> None:
        import random

        self.seed = seed
        self._rng = random.Random(seed)
        self.max_groups = max_groups
        self.max_group_size = max_group_size
        self.max_turns = max_turns

    def __repr__(self) -> str:
        return f"RandomStream(seed={self.seed})"

    def _session(self, sid: str, gid: str, size: int, index: int) -> list[tuple[str, int, Any]]:
        rng = self._rng
        outcome = rng.choices(["finish", "abort", "drop", "abort_early", "drop_early"], [6, 2, 1, 1, 1])[0]
        bodies: list[Any] = [SessionOpened(group_id=gid, group_size=size, sample_index=index, policy_version=rng.randrange(3))]
        if outcome.endswith("_early"):
            bodies.append(SessionAborted(reason="boot_failed") if outcome == "abort_early" else SessionDropped(reason="cancelled"))
            return [(sid, i, b) for i, b in enumerate(bodies)]
        bodies.append(SessionStarted())
        use_messages = rng.random() < 0.85
        system = msg("system", f"sys{rng.randrange(2)}")
        # (messages, tokens) states a later turn may branch from.
        states = [([system, msg("user", "task")], [1, 2, 3, 4][: rng.randrange(1, 5)])]
        msgs, ctx = states[0]
        last_prompt = None
        for turn in range(rng.randrange(self.max_turns + 1)):
            action = rng.choices(["continue", "branch", "rewrite", "retry"], [6, 2, 1, 1])[0]
            if action == "retry" and last_prompt is not None:
                # The client re-sends the previous prompt verbatim: routing matches it entirely.
                msgs, ctx = last_prompt
            if action == "branch" and len(states) > 1:
                msgs, ctx = states[rng.randrange(len(states))]
            if action == "rewrite" and len(msgs) > 2 and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1] + [msg("assistant", msgs[-1]["content"] + " ")]
            tool = [100 + rng.randrange(50) for _ in range(rng.randrange(0, 3))]
            if turn and action != "retry":
                msgs = msgs + [msg("tool", f"t{turn}-{rng.randrange(3)}")]
            prompt = list(ctx) + tool if turn and action != "retry" else list(ctx)
            drift = rng.random()
            if turn and drift < 0.15 and len(prompt) > 1:
                prompt[rng.randrange(len(prompt))] = 999  # anywhere: realign or fork
            output = [200 + rng.randrange(100) for _ in range(rng.randrange(0, 5))]
            finish = rng.choices(["stop", "length", "abort"], [8, 1, 1])[0]
            lps = [] if rng.random() < 0.1 else [-(t % 7) / 8 for t in output]
            response = msg("assistant", "ok" if rng.random() < 0.2 else f"r{turn}-{rng.randrange(4)}")
            bodies.append(
                TurnRecorded(
                    turn_index=turn,
                    messages=msgs if use_messages else [],
                    prompt_ids=prompt,
                    output_ids=output,
                    output_log_probs=lps,
                    finish_reason=finish,
                    response_message=response,
                    policy_version=rng.randrange(3),
                )
            )
            if rng.random() < 0.05:
                bodies.append(TurnUndelivered(turn_index=turn, reason="client_gone"))
            last_prompt = (msgs, prompt)
            msgs = msgs + [response]
            ctx = prompt + output
            states.append((msgs, ctx))
        if outcome == "finish":
            kind = rng.randrange(4)
            if kind == 0:
                bodies.append(RewardAssigned(reward=float(rng.randrange(2))))
                bodies.append(SessionFinished(reward=None))
            elif kind == 1:
                bodies.append(SessionFinished(reward={"pass": float(rng.randrange(2))}))
            else:
                bodies.append(SessionFinished(reward=rng.choice([0.0, 0.5, 1.0])))
        elif outcome == "abort":
            bodies.append(SessionAborted(reason=rng.choice(["timeout", "exception"])))
        else:
            bodies.append(SessionDropped(reason="shutdown"))
        return [(sid, i, b) for i, b in enumerate(bodies)]

    def log(self) -> MemoryLog:
        """Build the MemoryLog (deterministic in the seed)."""
        rng = self._rng
        queues = []
        for g in range(rng.randrange(1, self.max_groups + 1)):
            size = rng.randrange(1, self.max_group_size + 1)
            for i in range(size):
                queues.append(self._session(f"g{g}-s{i}", f"g{g}", size, i))
        log = MemoryLog(clock=lambda: 0)
        pos = [0] * len(queues)
        live = [i for i in range(len(queues))]
        while live:
            i = rng.choice(live)
            log.append_batch([queues[i][pos[i]]])
            pos[i] += 1
            if pos[i] == len(queues[i]):
                live.remove(i)
        return log
