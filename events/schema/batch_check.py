"""The write-time check of a whole batch of event bodies (:func:`check_bodies`):
what :func:`~agentlog.events.schema.types.check_body` does for one body, for
a list of them, in a few msgspec calls.

A body's token and log-prob fields (``bytes``: tens of KiB in a turn) are
what makes decoding a batch back expensive: msgspec copies each one into
fresh memory (page faults, cache misses), only for the copy to hold the very
bytes the caller's body holds. So the batch is decoded strictly against
*mirrors* of the bodies with such fields, which differ from their bodies
only in taking those fields as ``memoryview`` (zero-copy views into the
encoded batch; msgpack ``bin`` only, exactly as ``bytes``). Each mirror is
then rebuilt as its body through the body's constructor, so every check of
``__post_init__`` runs on the decoded values, as a strict decode would run
it; a ``bytes`` field reuses the caller's ``bytes`` object when it is an exact
``bytes`` (its encoding is those bytes verbatim, so a reader decodes equal
ones), else a copy of the view. Every other field is the decoded value.
The turns' log-probs are scanned for NaN/inf once for the whole batch
(:data:`~agentlog.events.schema.validation.DEFERRED_FINITE_SCANS`).
"""

from __future__ import annotations

import keyword
from typing import Any, Callable, Union

import msgspec

from .packing import all_finite
from .validation import DEFERRED_FINITE_SCANS
from .types import EVENT_TYPES, EventValidationError, _body_encoder, _bodies_decoder, _payloads_decoder


def _mirror(cls: Any) -> tuple[type, tuple[str, ...]] | None:
    """``(mirror, names of its bytes fields)`` for an event type with bytes
    fields, None for one without (it is decoded as itself)."""
    infos = msgspec.structs.fields(cls)
    binary = tuple(f.name for f in infos if f.type is bytes)
    config = cls.__struct_config__
    if not binary or config.array_like or any(f.encode_name != f.name for f in infos):
        return None
    fields: list[tuple[Any, ...]] = []
    for f in infos:
        kind = memoryview if f.type is bytes else f.type
        if f.default is not msgspec.NODEFAULT:
            default: Any = memoryview(f.default) if f.type is bytes else f.default
            fields.append((f.name, kind, default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind))
    mirror = msgspec.defstruct(
        f"_Checked{cls.__name__}",
        fields,
        kw_only=True,
        tag=config.tag,
        tag_field=config.tag_field,
        forbid_unknown_fields=config.forbid_unknown_fields,
    )
    return mirror, binary


def _rebuilder(cls: type, binary: tuple[str, ...]) -> Callable[[Any, Any], Any]:
    """The function that rebuilds a decoded mirror as a ``cls`` body, running
    its checks (``__post_init__``) on the decoded values; its ``bytes`` fields
    are the caller's own ``bytes`` when exact (see the module docstring)."""
    names = tuple(f.name for f in msgspec.structs.fields(cls))
    if all(_is_plain_name(n) for n in names):
        return _compiled_rebuilder(cls, names, binary)

    def rebuild(back: Any, original: Any) -> Any:
        fields = msgspec.structs.asdict(back)
        same = type(original) is cls
        for name in binary:
            kept = getattr(original, name) if same else None
            fields[name] = kept if type(kept) is bytes else bytes(fields[name])
        return cls(**fields)  # the body's checks (__post_init__) on the decoded values

    return rebuild


def _is_plain_name(name: str) -> bool:
    # A field the generated rebuild can name in its source: an identifier
    # that is no keyword and cannot shadow the generated code's own names.
    return name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_")


def _compiled_rebuilder(cls: type, names: tuple[str, ...], binary: tuple[str, ...]) -> Callable[[Any, Any], Any]:
    """:func:`_rebuilder`'s function with the constructor call spelled out
    field by field (``cls(a=_back.a, ...)``): the same call as
    ``cls(**asdict(back))``, without building a dict per body, which with
    the keyword matching it saves was a third of the rebuild's cost."""
    lines = ["def _rebuild(_back, _original):", "    _same = type(_original) is _cls"]
    for name in binary:
        lines.append(f"    _kept_{name} = _original.{name} if _same else None")
        lines.append(f"    if type(_kept_{name}) is not bytes:")
        lines.append(f"        _kept_{name} = bytes(_back.{name})")
    args = ", ".join(f"{n}=_kept_{n}" if n in binary else f"{n}=_back.{n}" for n in names)
    lines.append(f"    return _cls({args})")
    namespace: dict[str, Any] = {"_cls": cls}
    exec("\n".join(lines), namespace)  # noqa: S102 - the source is built from the struct's own field names
    rebuild: Callable[[Any, Any], Any] = namespace["_rebuild"]
    return rebuild


_MIRRORED: dict[type, Any] = {}
_REBUILD: dict[type, Callable[[Any, Any], Any]] = {}
for _cls in EVENT_TYPES:
    _found = _mirror(_cls)
    if _found is not None:
        _MIRRORED[_cls] = _found[0]
        _REBUILD[_found[0]] = _rebuilder(_cls, _found[1])
_MIRRORED_TYPES = frozenset(_MIRRORED)
#: The batch decoded strictly, each body with bytes fields as its mirror.
_mirrors_decoder = msgspec.msgpack.Decoder(list[Union[tuple(_MIRRORED.get(c, c) for c in EVENT_TYPES)]])  # type: ignore[misc]


def check_bodies(bodies: list, kinds: set | frozenset | None = None) -> tuple[list[msgspec.Raw], list]:
    """:func:`~agentlog.events.schema.types.check_body` for a whole batch of
    schema event bodies: the list is encoded as one msgpack array, split into
    each body's payload (views into that one buffer, whose bytes are those
    ``encode_body`` gives: a body's encoding does not depend on what holds
    it) and decoded back strictly as a list, every body check on (see the
    module docstring for how bytes fields are decoded). ``kinds``, the set of
    the bodies' types, when the caller has it. Returns ``(payloads, decoded)``.
    Raises EventValidationError when any body fails, without saying which:
    the caller then checks the bodies one by one with ``check_body``, whose
    error names the event and the field (a refused batch is rare; the common
    path pays nothing to locate it)."""
    try:
        array = _body_encoder.encode(bodies)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise EventValidationError(f"a batch of {len(bodies)} bodies: one cannot be encoded: {exc}") from None
    if kinds is None:
        kinds = set(map(type, bodies))
    try:
        if kinds.isdisjoint(_MIRRORED_TYPES):
            decoded = _bodies_decoder.decode(array)
        else:
            decoded = _mirrors_decoder.decode(array)
            scans: list[bytes] = []
            token = DEFERRED_FINITE_SCANS.set(scans)
            try:
                rebuild = _REBUILD.get
                for i, back in enumerate(decoded):
                    how = rebuild(type(back))
                    if how is not None:
                        decoded[i] = how(back, bodies[i])
            finally:
                DEFERRED_FINITE_SCANS.reset(token)
            if scans and not all_finite(b"".join(scans)):
                raise EventValidationError(f"a batch of {len(bodies)} bodies: a turn's log-prob is not finite")
    except (msgspec.ValidationError, TypeError, ValueError, RecursionError) as exc:  # EventValidationError is a ValueError
        raise EventValidationError(f"a batch of {len(bodies)} bodies: one does not decode: {exc}") from None
    return _payloads_decoder.decode(array), decoded
