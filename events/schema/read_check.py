"""The read-time check of a stored body: that a payload decodes as
:func:`~agentlog.events.schema.types.decode_body` decodes it, without building
the body. The file log's lazy readers (:mod:`agentlog.events.log.lazy`) run it
on every payload they hand out, so corruption is still reported during the
read while the body itself is built only on first use."""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin

import msgspec

from .types import EVENT_TYPES, decode_body


def _accepting_alike(typ: Any) -> Any:
    """A type msgspec decodes the same values into (and refuses the same
    ones), building less: ``bytes`` as a ``memoryview`` of the payload, inside
    lists, dicts and unions too. ``Any`` stays ``Any``: its values are built to
    be checked, since ``msgspec.Raw`` only delimits a value, and a string that
    is not UTF-8, a malformed timestamp or an unhashable map key would pass it
    and fail only when the body is built (about 3 µs more for a record with
    twenty messages; the token arrays, a turn's bulk, are still not copied)."""
    if typ is bytes:
        return memoryview
    origin, args = get_origin(typ), get_args(typ)
    if origin in (list, dict) and args:
        return origin[tuple(_accepting_alike(a) for a in args)]
    if origin in (Union, UnionType):
        return Union[tuple(_accepting_alike(a) for a in args)]
    return typ


def _checking_view(body: Any) -> type:
    """A struct with ``body``'s tag and fields, each of a type that accepts
    alike (:func:`_accepting_alike`): decoding a payload into it checks every
    field as decoding ``body`` does, but copies none of the token bytes and
    runs no ``__post_init__``."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(body):
        typ = _accepting_alike(f.type)
        if f.required:
            fields.append((f.name, typ))
        elif f.default_factory is not msgspec.NODEFAULT:
            # A [] or {} default is kept as a factory: the field is as optional here as in the body
            # (an older writer's record leaves it out), whatever the view builds for it.
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ, f.default))
    cfg = body.__struct_config__
    return msgspec.defstruct("_Checked" + body.__name__, fields, tag=cfg.tag, tag_field=cfg.tag_field, kw_only=True, module=__name__)


_event_structs: tuple[Any, ...] = EVENT_TYPES
_checking_views = {_checking_view(t): t.__struct_config__.tag for t in _event_structs}
_checking_decoder = msgspec.msgpack.Decoder(Union[tuple(_checking_views)])


def checked_tag(payload: bytes | memoryview) -> Any:
    """Check that a stored payload decodes as :func:`decode_body` decodes it,
    without building the body (no field is copied out of ``payload``), and
    return its tag. A payload that is no known event is handed to
    :func:`decode_body`: its result (an :class:`UnknownEvent`) is returned
    instead of a tag, or its error raised. So a caller gets a ``str`` (the
    body is known to decode) or the body itself, and every error is
    decode_body's own."""
    try:
        return _checking_views[type(_checking_decoder.decode(payload))]
    except (msgspec.DecodeError, RecursionError):  # ValidationError included: the rare path, decode_body says what it is
        return decode_body(payload)
