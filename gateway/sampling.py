"""The gateway's sampling rules: its single statement of what a sampling
value may be, the range a sampler can use (:data:`SAMPLING_RULES`). The wire
APIs check a client's values with them as a request is parsed
(``api._sampling``), the admin API checks a session's values
(:mod:`~agentlog.gateway.admin`), and the turn path checks the merged
per-turn values with :func:`check_sampling` as well. A refused value raises
:class:`AdminFieldError`, which names the field, what was expected and what
was found.
"""

from __future__ import annotations

from typing import Any, Callable

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.validation import is_number


class AdminFieldError(AgentlogError, ValueError):
    """One field of an admin request holds a value we refuse (answered 400)."""

    def __init__(self, field: str, expected: str, found: Any) -> None:
        self.field = field
        shown = repr(found)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{field}: expected {expected}, found {shown}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)




#: The temperatures every backend samples at as given. vLLM raises a
#: temperature below 0.01 to 0.01 (its guard against inf/NaN logits) and
#: SGLang samples greedily below 1e-5, so the log-probs recorded for a lower
#: one would not be of the temperature recorded; the built-in sampler divides
#: float32 logits by it (5e-324 is 0 there: NaN probabilities, a failed
#: turn). Above 100 every token is close to equally likely already.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
#: The smallest top_p: float32's smallest normal number (the samplers hold
#: top_p in float32, where a smaller value is 0 or loses its precision).
MIN_TOP_P = 2.0**-126
#: The largest top_k, max_new_tokens: what a sampler's int32 holds.
_INT32_MAX = 2**31 - 1

#: Sampling keys a session (or a request) may set, with their rule and its
#: wording: the range a sampler can use. ``seed`` feeds
#: torch.Generator.manual_seed; temperature 0 (greedy) has no per-token
#: distribution to record log-probs from.
SAMPLING_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (lambda v: is_number(v) and MIN_TEMPERATURE <= v <= MAX_TEMPERATURE, f"a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]"),
    "top_p": (lambda v: is_number(v) and MIN_TOP_P <= v <= 1, f"a number in [{MIN_TOP_P:.3g}, 1]"),
    "top_k": (lambda v: _is_int(v) and -1 <= v <= _INT32_MAX, "an int in [-1, 2**31 - 1] (-1 or 0: off)"),
    "seed": (lambda v: _is_int(v) and 0 <= v < 2**63, "an int in [0, 2**63)"),
    "max_new_tokens": (lambda v: _is_int(v) and 1 <= v <= _INT32_MAX, "an int in [1, 2**31 - 1]"),
}


def check_sampling(values: dict[str, Any], where: str) -> None:
    """Raise AdminFieldError (field ``<where>.<key>``) for the first unknown
    key or value outside its rule in ``values``, naming the value and the
    accepted range."""
    unknown = sorted(set(values) - set(SAMPLING_RULES))
    if unknown:
        raise AdminFieldError(where, f"keys among {sorted(SAMPLING_RULES)}", f"unknown keys {unknown}")
    for key, value in values.items():
        ok, expected = SAMPLING_RULES[key]
        if not ok(value):
            raise AdminFieldError(f"{where}.{key}", expected, value)


__all__ = ["AdminFieldError", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "MIN_TOP_P", "SAMPLING_RULES", "check_sampling"]
