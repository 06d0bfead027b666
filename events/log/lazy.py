"""The envelopes the file log's readers yield, and its ``stage`` acknowledges
with: :class:`LazyEnvelope`, whose body is built the first time it is used.

A reader hands over every record, but many consumers look at the headers of
many and the bodies of few (a replay of one session, a count of events by
type, a fold that skips what it does not need). The header fields (``lsn``,
``session_id``, ``session_seq``, ``ts_ns``) come from the frame and the event
``tag`` from the read-time check; the body is decoded on first access to
``body`` and kept. Until then the envelope holds a zero-copy view of its
frame's payload, which keeps that frame's read chunk (256 KiB), or its
segment's mapping, alive, as a raw record's payload does; decoding releases it.

Errors stay where they were: the reader checks every payload as it reads it
(:func:`~agentlog.events.schema.read_check.checked_tag` decodes every field into a
view that copies none of the big ones), so a payload that does not decode
raises during the iteration, as an eager read did, with the same error
(:func:`agentlog.events.log.scan.payload_error`: ``SchemaError`` for a known
tag whose fields this version cannot read, else ``LogCorruption``, naming the
segment, the offset and the LSN). Only building the body waits.

The file log's ``stage`` (the engine's way in) acknowledges with one too
(:func:`staged_envelope`): the record was encoded and decoded back strictly
when it was staged, so a reader can decode it, but that decoded copy is not
kept. Kept, it would be five or six more objects for the garbage collector
to walk for each record in flight (a turn's messages, its sampling, its
response message), which held a capture's collections at twice the rate
(``tools/bench/capture_cpu.py``); the engine applies the body it built, and
whoever asks for ``body`` gets it decoded from the stored bytes.

A LazyEnvelope is an :class:`~agentlog.events.schema.types.Envelope` in every
way a caller observes through attributes: ``isinstance``, equality (with
eager envelopes too), hashing, ``repr``, pickling (as a plain Envelope,
decoded: what Ray and multiprocessing send) and ``msgspec.structs.replace``.
msgspec's encoders and ``msgspec.structs.asdict``/``astuple`` read the
fields' slots directly, past ``body``: an encoder refuses an undecoded
envelope (TypeError naming :class:`UndecodedStoredBody`), ``asdict`` would hand the
StoredBody over. Call :meth:`LazyEnvelope.eager` (or touch ``body``) first.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import msgspec

from ..schema.read_check import checked_tag
from ..schema.types import Envelope, UnknownEvent, decode_body
from .scan import Frame, payload_error

__all__ = ["LazyEnvelope", "StoredBody", "UndecodedStoredBody", "staged_envelope"]

#: The slot ``Envelope.body`` is stored in; LazyEnvelope's ``body`` property reads and fills it.
_body_slot = Envelope.__dict__["body"]
_get_slot = _body_slot.__get__
_set_slot = _body_slot.__set__


class UndecodedStoredBody:
    """The value of :attr:`StoredBody.undecoded`: a type no msgspec encoder takes."""

    __slots__ = ()


_UNDECODED = UndecodedStoredBody()


class StoredBody(msgspec.Struct, gc=False):
    """An undecoded body that is known to decode: its payload, where it lies
    (the segment's name and the frame's offset, what an error names) and the
    event's tag. Not a body msgspec can encode: its ``undecoded`` field holds
    an :class:`UndecodedStoredBody`, so an encoder that meets it raises
    (naming that type) instead of writing it.

    A struct, not a class of our own, for its untracked instances (``gc=False``):
    one is made for each record a reader yields and each record the file log's
    ``stage`` acknowledges in its common case, and an object the garbage collector tracks would cost each of them
    its walks. Safe untracked: what it holds (bytes or a view of them, strings,
    an int, a shared marker) can never lead back to it."""

    payload: Any
    segment: str
    offset: int
    tag: str
    undecoded: UndecodedStoredBody = _UNDECODED


def _decode(env: "LazyEnvelope", stored: StoredBody) -> Any:
    try:
        body = decode_body(stored.payload)
    except msgspec.DecodeError as exc:  # ValidationError included
        # The error names the segment, the frame's offset and the LSN (its end and flags are not kept, nor read).
        frame = Frame(stored.offset, stored.offset, env.lsn, env.session_seq, env.ts_ns, 0, env.session_id, stored.payload)
        raise payload_error(stored.segment, frame, exc) from exc
    _set_slot(env, body)  # the slot, not the frozen struct's setattr: the envelope's value does not change
    return body


def _body(env: "LazyEnvelope") -> Any:
    """The body, decoded on first access and kept."""
    body = _get_slot(env)
    if type(body) is StoredBody:
        return _decode(env, body)
    return body


class LazyEnvelope(Envelope, frozen=True, gc=False):
    """An Envelope read from a log file (or staged to one), its body decoded on first
    use (see the module docstring). Built by the log's readers and its ``stage``, never by hand."""

    @property
    def tag(self) -> str:
        """The event's tag, known without decoding the body (an unknown tag is
        its stored one, as :func:`~agentlog.events.schema.types.event_tag` gives)."""
        body = _get_slot(self)
        if type(body) is StoredBody:
            return body.tag
        return body.tag if type(body) is UnknownEvent else body.__struct_config__.tag

    @property
    def unknown(self) -> bool:
        """True when the event's type is one this version does not know (a newer writer's)."""
        return type(_get_slot(self)) is UnknownEvent

    @property
    def decoded(self) -> bool:
        """True once the body has been decoded."""
        return type(_get_slot(self)) is not StoredBody

    def eager(self) -> Envelope:
        """The same record as a plain Envelope (its body decoded)."""
        return Envelope(self.lsn, self.session_id, self.session_seq, self.ts_ns, _body(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Envelope):
            return NotImplemented
        if type(other) is LazyEnvelope:
            other = other.eager()
        return self.eager().__eq__(other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.eager())

    def __repr__(self) -> str:
        return repr(self.eager())

    def __rich_repr__(self) -> Any:
        return self.eager().__rich_repr__()

    def __reduce__(self) -> Any:
        # Pickled (Ray, multiprocessing) as the plain Envelope it reads as.
        return (Envelope, (self.lsn, self.session_id, self.session_seq, self.ts_ns, _body(self)))

    def __copy__(self) -> "LazyEnvelope":
        return self


# The property replaces the field's slot descriptor on this class only: Envelope's
# fields, and the way msgspec builds and compares them, stay as they are. (Set
# after the class is made: in the class body, msgspec would take it for the
# field's default.)
LazyEnvelope.body = property(_body, doc="The event body, decoded on first access (then kept).")  # type: ignore[assignment]


def staged_envelope(lsn: int, session_id: str, session_seq: int, ts_ns: int, event_type: type, payload: bytes,
                    segment: str, offset: int) -> LazyEnvelope:
    """The LazyEnvelope of a record the writer has just staged: ``payload``, the bytes it
    stores (an ``event_type`` body's) as the frame at ``offset`` of segment ``segment``,
    already checked to decode (:func:`~agentlog.events.log.api.check_record_body`)."""
    tag = event_type.__struct_config__.tag  # type: ignore[attr-defined]  # every event type is a tagged struct
    return LazyEnvelope(lsn, session_id, session_seq, ts_ns, StoredBody(payload, segment, offset, tag))  # type: ignore[arg-type]  # the body, until built


def lazy_envelope(frame: Frame, segment: str) -> LazyEnvelope:
    """The LazyEnvelope of a CRC-valid frame of segment ``segment``. Its
    payload is checked here (:func:`~agentlog.events.schema.read_check.checked_tag`:
    every field, nothing built), so a payload that does not decode raises now,
    as an eager read did: SchemaError or LogCorruption, naming the segment,
    the offset and the LSN. An unknown tag's body is decoded here (an
    UnknownEvent, small and rare)."""
    try:
        tag = checked_tag(frame.payload)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise payload_error(segment, frame, exc) from exc
    if type(tag) is str:
        return LazyEnvelope(frame.lsn, frame.session_id, frame.session_seq, frame.ts_ns, StoredBody(frame.payload, segment, frame.offset, tag))  # type: ignore[arg-type]  # the body, until built
    return LazyEnvelope(frame.lsn, frame.session_id, frame.session_seq, frame.ts_ns, tag)


def lazy_envelopes(frames: Iterable[Frame], segment: str, from_lsn: int = 0) -> Iterator[LazyEnvelope]:
    """:func:`lazy_envelope` of each frame whose LSN is ``from_lsn`` or more,
    in order: the readers' per-record loop, with the same checks and errors
    (raised when the consumer reaches that record) and less Python per record."""
    check, make, stored = checked_tag, LazyEnvelope, StoredBody
    for fr in frames:
        lsn = fr[2]  # the fields by position: a Frame is a tuple (offset, end, lsn, seq, ts, flags, sid, payload)
        if lsn < from_lsn:
            continue
        try:
            tag = check(fr[7])
        except msgspec.DecodeError as exc:  # ValidationError included
            raise payload_error(segment, fr, exc) from exc
        yield make(lsn, fr[6], fr[3], fr[4], stored(fr[7], segment, fr[0], tag) if type(tag) is str else tag)  # type: ignore[arg-type]
