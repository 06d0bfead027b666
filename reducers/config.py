"""The one configuration object of the reducers, recorded with their outputs.

Offline reconstruction may re-run a log under other settings (another fork
threshold, another context limit), so every output stream states the exact
configuration that produced it: :meth:`ReduceConfig.canonical_bytes` and
:meth:`ReduceConfig.digest` are stable across processes and hash seeds.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

# A ReduceConfig field holding a value it cannot take raises the package's one ConfigError.
from agentlog.events.errors import ConfigError

from .abort_classes import EXCLUDE_ALL, abort_outcome, check_abort_settings


class ReduceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a log is reduced into trajectories, samples, groups and metrics."""

    #: Token drift: a turn whose output is strictly shorter than this may
    #: REALIGN the last response instead of forking a new row; a generated
    #: assistant leaf shorter than this may be replaced by a client rewrite.
    #: 0 disables both (every drift forks, every rewrite forks).
    fork_threshold: int = 1024
    #: Rows longer than this many tokens (prompt + response) are cut to it;
    #: 0 means no limit. A cut row with no trainable token left is not emitted.
    max_context_tokens: int = 0
    #: A group with fewer valid (finished, usable reward) members is released
    #: as skipped.
    min_valid: int = 2
    #: Which entry of a dict reward is the training reward. None: a dict
    #: reward must hold exactly one entry.
    reward_key: str | None = None
    #: A valid member whose reward is >= this counts as solved (metrics).
    solve_threshold: float = 1.0
    #: What an aborted member of each abort class gets: class -> "exclude",
    #: "fail" or "refill" (:mod:`agentlog.reducers.abort_classes`). A class
    #: left out is excluded (as every abort was before abort classes; a
    #: run's [groups] table defaults to failing policy aborts); every class
    #: is then named.
    abort_outcomes: dict[str, str] = {}
    #: Abort reasons (exact, or the head before ":") -> class, over the defaults.
    abort_reasons: dict[str, str] = {}
    #: The reward of an aborted member whose class counts it as a failure.
    fail_reward: float = 0.0
    #: Replacements the engine may owe one group (refill outcome); past it, an
    #: aborted member of a refill class is excluded.
    max_refills: int = 2
    #: Train once (False, the default): a generated turn that several rows
    #: hold (a shared ancestor of a branching session) carries loss in the
    #: first row only, and is mask-0 context in the others, so every
    #: generated token is a training target at most once. True trains it
    #: in every row that holds it (repeated targets).
    allow_repeated_targets: bool = False

    def __post_init__(self) -> None:
        for name in ("fork_threshold", "max_context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"ReduceConfig.{name}: expected an int >= 0, found {value!r}")
        if not isinstance(self.min_valid, int) or isinstance(self.min_valid, bool) or self.min_valid < 1:
            raise ConfigError(f"ReduceConfig.min_valid: expected an int >= 1, found {self.min_valid!r}")
        if self.reward_key is not None and (not isinstance(self.reward_key, str) or not self.reward_key):
            raise ConfigError(f"ReduceConfig.reward_key: expected a non-empty str or None, found {self.reward_key!r}")
        if not isinstance(self.allow_repeated_targets, bool):
            raise ConfigError(f"ReduceConfig.allow_repeated_targets: expected true or false, found {self.allow_repeated_targets!r}")
        if not isinstance(self.solve_threshold, (int, float)) or not math.isfinite(self.solve_threshold):
            raise ConfigError(f"ReduceConfig.solve_threshold: expected a finite number, found {self.solve_threshold!r}")
        problem = check_abort_settings(self.abort_outcomes, self.abort_reasons, self.fail_reward, self.max_refills, "ReduceConfig")
        if problem:
            raise ConfigError(problem)
        # Every class named, defaults filled in: one configuration, one form (and digest).
        msgspec.structs.force_setattr(self, "abort_outcomes", {**EXCLUDE_ALL, **self.abort_outcomes})

    def outcome_of(self, reason: str) -> str:
        """What an aborted member with ``reason`` gets: "exclude", "fail" or "refill"."""
        return abort_outcome(reason, self.abort_outcomes, self.abort_reasons)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (for stream headers and JSON)."""
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReduceConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error naming them."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"ReduceConfig: {exc}") from None

    def canonical_bytes(self) -> bytes:
        """Deterministic msgpack of the configuration (sorted keys)."""
        return _canonical.encode(self.to_dict())

    def digest(self) -> str:
        """``sha256:<hex>`` of :meth:`canonical_bytes`: names the configuration in outputs."""
        return "sha256:" + hashlib.sha256(self.canonical_bytes()).hexdigest()


_canonical = msgspec.msgpack.Encoder(order="deterministic")

#: The configuration used when none is given.
DEFAULT_CONFIG = ReduceConfig()
