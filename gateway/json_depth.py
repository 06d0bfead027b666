"""The nesting bound on every JSON value the gateway reads from a client.

JSON decoders and encoders recurse once per nesting level. A body nested
some 975 levels deep still decodes (the decoder's own limit is the
interpreter's recursion limit, 1000), then fails later wherever the value is
walked again with a deeper stack underneath: the chat template's
``json.dumps``, the log's encoder. Every JSON value a client sends (request
bodies of every route, tool-call arguments carried as JSON text, the tool
calls parsed out of model text) is therefore checked where it is decoded:
nesting beyond :data:`MAX_JSON_DEPTH` levels is refused with
:class:`JSONTooDeep`, which names the limit and the path where it was
crossed. The bound is far below the interpreter's limit, so a value that
passes can be walked by any recursive code after it.

JSON read from a server (:mod:`agentlog.gateway.http_json`) is measured
before it is decoded, by :func:`text_depth`: a scan of the text with no
recursion at all, so an answer nested past the decoder's limit is refused
with its depth rather than a RecursionError.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np

from agentlog.events.errors import AgentlogError

#: Levels of nested arrays and objects a client's JSON may have (the
#: outermost object is level 1). Real tool schemas and messages stay well
#: under 20; the interpreter's recursion limit is 1000.
MAX_JSON_DEPTH = 64

#: Path elements shown before the rest of a too-deep path is elided.
_PATH_SHOWN = 12


class JSONTooDeep(AgentlogError, ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH` levels."""

    def __init__(self, where: str, path: str | None) -> None:
        at = f" at {path}" if path else " (so deep that the decoder's stack ran out before the path was read)"
        super().__init__(f"{where}: JSON nested deeper than the limit of {MAX_JSON_DEPTH} levels{at}")
        self.where = where
        self.path = path


def _containers(value: Any) -> list[Any]:
    items = value.values() if type(value) is dict else value
    return [x for x in items if type(x) is dict or type(x) is list]


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests deeper than the limit (iterative: no recursion)."""
    level = [value] if type(value) is dict or type(value) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return True
        level = [c for v in level for c in _containers(v)]
    return False


def _deep_path(value: Any, root: str) -> str:
    """The path (``$.a[0].b...``) of a container just past the limit in ``value``."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            shown = "".join(path[:_PATH_SHOWN])
            return f"{root}{shown}...({len(path) - _PATH_SHOWN} levels more)" if len(path) > _PATH_SHOWN else root + shown
        pairs = ((f".{k}", x) for k, x in v.items()) if type(v) is dict else ((f"[{i}]", x) for i, x in enumerate(v))
        stack.extend((x, path + (step,)) for step, x in pairs if type(x) is dict or type(x) is list)
    return root


def check_json_depth(value: Any, where: str) -> Any:
    """``value`` itself when it nests at most :data:`MAX_JSON_DEPTH` levels;
    else raise :class:`JSONTooDeep` naming ``where`` and the path."""
    if _too_deep(value):
        raise JSONTooDeep(where, _deep_path(value, "$"))
    return value


# A JSON string token, escapes included (unrolled, so long strings match in linear time).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_CHUNK = 1 << 20


def text_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``raw`` (brackets inside strings
    do not count), without decoding it: linear time, no recursion, memory a few times
    a 1 MiB chunk beyond the text without its strings. Malformed text gets a number too
    (decoding then refuses it)."""
    bare = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    depth = deepest = 0
    for start in range(0, len(bare), _DEPTH_CHUNK):
        codes = bare[start : start + _DEPTH_CHUNK]
        step = ((codes == ord("[")) | (codes == ord("{"))).astype(np.int32)
        step -= (codes == ord("]")) | (codes == ord("}"))
        levels = np.cumsum(step) + depth
        if len(levels):
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
    return deepest


def decode_json(raw: bytes, where: str) -> Any:
    """Decode a client's JSON bytes (msgspec: strict JSON, integers of any
    size) with the nesting bound. Raises ``msgspec.DecodeError`` for
    malformed JSON and :class:`JSONTooDeep` for deep nesting."""
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:  # far past the limit: the decoder's stack ran out first
        raise JSONTooDeep(where, None) from None
    return check_json_depth(value, where)


def loads_json_text(text: str, where: str) -> Any:
    """``json.loads`` of JSON text a client or the model wrote (tool-call
    arguments), with the nesting bound. Raises ``ValueError`` for malformed
    JSON, :class:`JSONTooDeep` (a ValueError) for deep nesting."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONTooDeep(where, None) from None
    return check_json_depth(value, where)


__all__ = ["JSONTooDeep", "MAX_JSON_DEPTH", "check_json_depth", "decode_json", "loads_json_text", "text_depth"]
