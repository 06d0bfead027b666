"""The admin API's requests, checked field by field before anything is appended.

``agentlog serve`` opens and ends sessions through ``POST /admin/sessions``
and ``POST /admin/sessions/{id}/{finish,abort,drop}``. Every field of those
bodies is checked here, against what the event schema will accept and what a
sampler can run: a value the log could not decode back, or one that would
fail every later turn, is refused with :class:`AdminFieldError`, which names
the field, what was expected and what was found (answered 400). Unknown
fields are refused too: a misspelt ``sample_idx`` silently ignored would
open the session with the wrong membership.

The sampling rules (:data:`SAMPLING_RULES`) are the gateway's single
statement of what a sampling value may be, the range a sampler can use: the
wire APIs check a client's values with them as a request is parsed
(``api._sampling``), and the turn path checks the merged per-turn values with
:func:`check_sampling` as well.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import msgspec

from agentlog.events.errors import AgentlogError
from agentlog.events.types import EventValidationError, normalize_reward, validate_id

#: The range a msgpack integer can hold (the log's body encoding).
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
    "temperature": (lambda v: _is_number(v) and MIN_TEMPERATURE <= v <= MAX_TEMPERATURE, f"a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]"),
    "top_p": (lambda v: _is_number(v) and MIN_TOP_P <= v <= 1, f"a number in [{MIN_TOP_P:.3g}, 1]"),
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


def check_json_value(field: str, value: Any) -> None:
    """A free-form JSON value (label, metadata, prompt) the log can encode:
    JSON decodes integers of any size, msgpack holds 64 bits. (The JSON
    decoder already refuses lone surrogates and non-finite numbers.) Walked
    iteratively, so depth costs no recursion."""
    stack: list[tuple[str, Any]] = [(field, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{where}.{k}", x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
        elif _is_int(v) and not _INT_MIN <= v <= _INT_MAX:
            raise AdminFieldError(where, "an integer in [-2**63, 2**64 - 1]", v)


def _known(body: dict[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise AdminFieldError(what, f"fields among {sorted(allowed)}", f"unknown fields {unknown}")


def _int(body: dict[str, Any], key: str, lo: int, default: Any) -> Any:
    value = body.get(key, default)
    if value is default:
        return value
    if not _is_int(value) or not lo <= value <= 2**63 - 1:
        raise AdminFieldError(key, f"an int >= {lo}", value)
    return value


def _text(body: dict[str, Any], key: str, default: str, *, non_empty: bool = False) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or (non_empty and not value):
        raise AdminFieldError(key, "a non-empty string" if non_empty else "a string", value)
    return value


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdminFieldError(key, "a JSON object", value)
    check_json_value(key, value)
    return value


def _id(body: dict[str, Any], key: str, default: Any) -> str:
    value = body.get(key, default)
    try:
        return validate_id(key, value)
    except EventValidationError as exc:
        raise AdminFieldError(key, "a non-empty id string with no path separator or control character", value) from exc


class OpenRequest(msgspec.Struct, frozen=True):
    """A checked ``POST /admin/sessions`` body."""

    session_id: str
    group_id: str
    group_size: int
    #: None: the engine assigns the group's next free index.
    sample_index: int | None
    prompt: list[dict[str, Any]]
    label: Any
    agent: str
    metadata: dict[str, Any]
    sampling: dict[str, Any]
    max_turns: int | None


_OPEN_FIELDS = frozenset(OpenRequest.__struct_fields__)


def parse_open(body: dict[str, Any]) -> OpenRequest:
    """Check an open body; raises AdminFieldError naming the first bad field."""
    _known(body, _OPEN_FIELDS, "request body")
    sid = _id(body, "session_id", None)
    prompt = body.get("prompt", [])
    if prompt is None:
        prompt = []
    if not isinstance(prompt, list):
        raise AdminFieldError("prompt", "a list of message objects", prompt)
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise AdminFieldError(f"prompt[{i}]", "a message object", message)
    check_json_value("prompt", prompt)
    label = body.get("label")
    check_json_value("label", label)
    sampling = _object(body, "sampling")
    check_sampling(sampling, "sampling")
    return OpenRequest(
        session_id=sid,
        group_id=_id(body, "group_id", sid),
        group_size=_int(body, "group_size", 1, 1),
        sample_index=_int(body, "sample_index", 0, None),
        prompt=prompt,
        label=label,
        agent=_text(body, "agent", ""),
        metadata=_object(body, "metadata"),
        sampling=sampling,
        max_turns=_int(body, "max_turns", 1, None),
    )


#: The fields each end action takes.
_END_FIELDS = {
    "finish": frozenset({"reward", "metadata"}),
    "abort": frozenset({"reason", "error"}),
    "drop": frozenset({"reason"}),
}


def parse_end(action: str, body: dict[str, Any]) -> dict[str, Any]:
    """Check a finish/abort/drop body; returns the keywords of the handle's
    method of that name. Raises KeyError for an unknown action and
    AdminFieldError naming the first bad field."""
    _known(body, _END_FIELDS[action], f"{action} body")
    if action == "finish":
        reward = body.get("reward")
        try:
            reward = normalize_reward("finish", "reward", reward, optional=True)
        except EventValidationError:
            raise AdminFieldError("reward", "a finite number, an object of finite numbers, or null (the last assigned reward)", reward) from None
        return {"reward": reward, "metadata": _object(body, "metadata")}
    if action == "abort":
        return {"reason": _text(body, "reason", "admin", non_empty=True), "error": _text(body, "error", "")}
    return {"reason": _text(body, "reason", "admin", non_empty=True)}


__all__ = ["AdminFieldError", "MAX_TEMPERATURE", "MIN_TEMPERATURE", "MIN_TOP_P", "OpenRequest", "SAMPLING_RULES", "check_json_value", "check_sampling", "parse_end", "parse_open"]
