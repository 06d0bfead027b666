"""Schema v1: every event body, the envelope, and their validation.

Bodies are frozen, tagged msgspec Structs. Schema evolution rules: a new
field goes at the end and carries a default; tags are never renamed; field
types never change.

Validated on write, tolerant on read. The checks of each body (``__post_init__``)
run when it is built in Python and again when the log writer decodes the
encoded body back (:func:`check_body`; a whole batch at once:
:func:`.batch_check.check_bodies`), so nothing reaches a log that a reader cannot decode. Reading a stored record (:func:`decode_body`) skips them: the
record was checked by the version that wrote it, and a newer one may allow
more (a new finish reason, a relaxed bound). Unknown fields are skipped and an
unknown tag decodes to an :class:`UnknownEvent`, so an old reader can read a
newer log and say what it does not understand.

Every body is untracked by the cyclic garbage collector (``gc=False``, as
the envelope is): a body holds plain data, never anything that refers back
to it (the write check refuses a body that contains itself: msgpack cannot
hold a cycle), and thousands in flight are each kept past their batch's
fsync, into the collector's old generation, where every full collection
would walk them. Their lists and dicts are tracked as any are.

Token ids and log-probs travel as raw little-endian ``int32`` / ``float32``
bytes (:mod:`.packing`). The two turn bodies and the fields they share live
in :mod:`.turn`; what the checks share, in :mod:`.validation`. Their public
names are re-exported here.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Union

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

# The turn bodies, token packing and the checks' shared parts live in their
# own modules; their public names are re-exported here.
from .packing import log_probs_view, pack_log_probs, pack_tokens, packed_field, tokens_view  # noqa: F401
from .turn import FINISH_REASONS, TURN_BODY_FIELDS, TurnBody, TurnDelta, TurnRecorded, turn_temperature  # noqa: F401
from .validation import MAX_ID_BYTES, READING_STORED, EventValidationError, fail, normalize_reward, on_fresh_stack, validate_id  # noqa: F401
from .resume_events import SNAPSHOT_DIGEST_RE, SandboxSnapshotted, SessionResumed  # noqa: F401

SCHEMA_VERSION = 1

Reward = Union[float, dict[str, float]]


# ---------------------------------------------------------------- bodies


class SessionOpened(msgspec.Struct, frozen=True, gc=False, tag="session_opened"):
    """A session was created; it belongs to a GRPO group of ``group_size``."""

    group_id: str
    group_size: int
    sample_index: int = 0
    prompt: list[dict[str, Any]] = []
    prompt_ids: bytes = b""
    label: Any = None
    agent: str = ""
    policy_version: int = 0
    metadata: dict[str, Any] = {}
    #: A replacement member (per-sample refill): the id of the aborted member of
    #: the same group whose ``session_aborted`` owed one (``refill``). Unset for
    #: every other member, so their bytes are those of a log before refills.
    replaces: str | UnsetType = UNSET

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        validate_id("session_opened.group_id", self.group_id)
        if self.replaces is not UNSET:
            validate_id("session_opened.replaces", self.replaces)
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 1:
            fail("session_opened", "group_size", "an int >= 1", self.group_size)
        if not isinstance(self.sample_index, int) or isinstance(self.sample_index, bool) or self.sample_index < 0:
            fail("session_opened", "sample_index", "an int >= 0", self.sample_index)
        packed_field(self, "prompt_ids", pack_tokens)

    @property
    def prompt_tokens(self) -> np.ndarray:
        """Prompt token ids as an int32 view."""
        return tokens_view(self.prompt_ids)


class SessionStarted(msgspec.Struct, frozen=True, gc=False, tag="session_started"):
    """The agent began: sandbox ready, harness launched."""

    harness: str = ""
    sandbox: str = ""
    details: dict[str, Any] = {}


class TurnUndelivered(msgspec.Struct, frozen=True, gc=False, tag="turn_undelivered"):
    """A recorded turn's response never reached the agent; it is not trained."""

    turn_index: int
    reason: str = ""


class TeacherScored(msgspec.Struct, frozen=True, gc=False, tag="teacher_scored"):
    """A teacher scored the output tokens of one of the session's turns
    (on-policy distillation): its log-prob of each scored token, at the
    turn's own sampling temperature, and optionally its top-K tokens.

    Appended while the session runs, after the turn it scores (the loop
    scores a finished session before its terminal event). Several teachers
    may score one turn: one event each. ``error`` says the teacher failed on
    this turn (no log-probs): the turn is then not distilled."""

    turn_index: int
    teacher: str
    teacher_version: str
    temperature: float
    log_probs: bytes = b""  # float32 LE, one per scored token
    start: int = 0  # index in the turn's output_ids of the first scored token
    top_k: int = 0
    top_ids: bytes = b""  # int32 LE, top_k per scored token, row-major
    top_log_probs: bytes = b""  # float32 LE, top_k per scored token
    error: str = ""

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        ev = "teacher_scored"
        for field in ("turn_index", "start", "top_k"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                fail(ev, field, "an int >= 0", v)
        for field in ("teacher", "teacher_version"):
            v = getattr(self, field)
            if not isinstance(v, str) or not v.strip():
                fail(ev, field, "a non-empty str (the teacher's name / weights digest or version)", v)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < math.inf:
            fail(ev, "temperature", "a number > 0 (the scored turn's sampling temperature)", t)
        if not isinstance(self.error, str):
            fail(ev, "error", "a str", self.error)
        lp = packed_field(self, "log_probs", pack_log_probs)
        n = len(lp) // 4
        if self.error:
            if n or self.top_k:
                fail(ev, "error", "no log-probs and no top-K beside an error", f"{n} log-probs, top_k {self.top_k}")
            return
        if n == 0:
            fail(ev, "log_probs", "at least one log-prob (or an error)", "none")
        values = log_probs_view(lp)
        ok = np.isfinite(values) & (values <= 0.0)
        if not ok.all():
            i = int(np.argmin(ok))
            fail(ev, f"log_probs[{i}]", "a finite log-prob <= 0", float(values[i]))
        ids = packed_field(self, "top_ids", pack_tokens)
        tlp = packed_field(self, "top_log_probs", pack_log_probs)
        want = n * self.top_k
        if len(ids) // 4 != want or len(tlp) // 4 != want:
            fail(ev, "top_ids/top_log_probs", f"top_k x scored tokens = {want} entries each",
                  f"{len(ids) // 4} ids and {len(tlp) // 4} log-probs")
        if want:
            top = log_probs_view(tlp)
            ok = np.isfinite(top) & (top <= 0.0)
            if not ok.all():
                i = int(np.argmin(ok))
                fail(ev, f"top_log_probs[{i}]", "a finite log-prob <= 0", float(top[i]))
            if (tokens_view(ids) < 0).any():
                fail(ev, "top_ids", "token ids >= 0", "a negative id")

    @property
    def scores(self) -> np.ndarray:
        """The scored tokens' log-probs as a float32 view."""
        return log_probs_view(self.log_probs)

    def top(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids (n, top_k) int32, log-probs (n, top_k) float32), or None without top-K."""
        if not self.top_k:
            return None
        return tokens_view(self.top_ids).reshape(-1, self.top_k), log_probs_view(self.top_log_probs).reshape(-1, self.top_k)


class CommandRan(msgspec.Struct, frozen=True, gc=False, tag="command_ran"):
    """A command ran in the session's sandbox (recorded for debugging)."""

    command: str
    exit_code: int | None = None
    budget_exceeded: bool = False
    duration_s: float = 0.0
    output_tail: str = ""


class RewardAssigned(msgspec.Struct, frozen=True, gc=False, tag="reward_assigned"):
    """A verifier or reward model scored the session."""

    reward: Reward
    source: str = ""

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        msgspec.structs.force_setattr(self, "reward", normalize_reward("reward_assigned", "reward", self.reward))


class SessionFinished(msgspec.Struct, frozen=True, gc=False, tag="session_finished"):
    """Terminal: the session ended normally. ``reward`` None means: use the last RewardAssigned."""

    reward: Reward | None = None
    metadata: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        msgspec.structs.force_setattr(
            self, "reward", normalize_reward("session_finished", "reward", self.reward, optional=True)
        )


#: Cap on the traceback text kept in a SessionAborted.
MAX_TRACEBACK_CHARS = 8192


class SessionAborted(msgspec.Struct, frozen=True, gc=False, tag="session_aborted"):
    """Terminal: the session failed. It yields one zero-masked placeholder
    sample, unless its reason's abort class counts it as a failure
    (:mod:`agentlog.reducers.abort_classes`)."""

    reason: str
    error: str = ""
    traceback: str = ""
    #: True: the engine owes the group a replacement for this member
    #: (per-sample refill); the group is released only once a session that
    #: ``replaces`` it has ended too. Unset otherwise (the bytes of an abort
    #: before refills).
    refill: bool | UnsetType = UNSET

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        if not isinstance(self.reason, str) or not self.reason:
            fail("session_aborted", "reason", "a non-empty str", self.reason)
        if self.refill is not UNSET and self.refill is not True:
            fail("session_aborted", "refill", "true (a replacement is owed) or unset", self.refill)
        # A traceback of the wrong type is left to the writer's schema check.
        if isinstance(self.traceback, str) and len(self.traceback) > MAX_TRACEBACK_CHARS:
            # Keep the end: the innermost frames say what actually failed.
            msgspec.structs.force_setattr(self, "traceback", "..." + self.traceback[-(MAX_TRACEBACK_CHARS - 3) :])


class SessionDropped(msgspec.Struct, frozen=True, gc=False, tag="session_dropped"):
    """Terminal: cleanup only; the session is discarded without any sample."""

    reason: str

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        if not isinstance(self.reason, str) or not self.reason:
            fail("session_dropped", "reason", "a non-empty str", self.reason)


class MemberRef(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """A group member as the learner consumed it: the session and the LSN
    of its terminal event in its partition (dropped members included)."""

    session_id: str
    terminal_lsn: int


class GroupRef(msgspec.Struct, frozen=True, gc=False):
    """One group a learner step consumed, named where it lives: its
    partition, its id, its members, and why it trained nothing ("" when it
    was trained). What a replay of the learner log needs to rebuild the
    step's batch from the partitions, whatever order they arrived in."""

    partition: int
    group_id: str
    members: list[MemberRef] = []
    skip_reason: str = ""


class PolicyUpdated(msgspec.Struct, frozen=True, gc=False, tag="policy_updated"):
    """Learner side: one optimiser step produced ``policy_version``."""

    step: int
    policy_version: int
    checkpoint: str = ""
    metrics: dict[str, float] = {}
    sample_digest: str = ""
    lsn_start: int = -1
    lsn_end: int = -1
    groups: list[str] = []
    #: Groups consumed by this step without training: group id -> reason
    #: (skipped by the reducer, or stale). With ``groups`` it makes every
    #: released group appear in exactly one record of the learner log.
    skipped: dict[str, str] = {}
    #: The low-water LSN after this step: the oldest ``session_opened`` of any
    #: member of a group still pending in the learner's reducer (``lsn_end + 1``
    #: when none is). A restarted learner replays the rollout log from here
    #: instead of from 0 (:class:`agentlog.reducers.pipeline.InFlightWindow`).
    #: -1: not recorded (a log written before this field): replay from 0.
    lsn_low_water: int = -1
    #: The learner-log LSN of the oldest record a restart after this one must
    #: read: every group released at or after ``lsn_low_water``, and the
    #: rewards the stop rule looks back on, are in the records from there on.
    #: -1: not recorded: read the learner log from 0.
    records_from_lsn: int = -1
    #: Every group this step consumed, in consumption order (trained ones in
    #: the order of ``groups``), each named by partition and members
    #: (:class:`GroupRef`). Empty in records written before partitions.
    batch: list[GroupRef] = []
    #: Per partition, the next LSN the learner had not read when it cut this
    #: step: its read frontier. Empty before partitions.
    frontier: dict[int, int] = {}
    #: Per partition, the low-water LSN after this step (``lsn_low_water``
    #: of each partition); a restart reads each partition from here.
    low_water: dict[int, int] = {}
    #: Partitions the learner declared lost at this step -> why; it reads
    #: nothing more from them.
    lost_partitions: dict[int, str] = {}
    #: The object holding this version's weights in the run's JetStream object
    #: store (``policy-vNNNNN.pt`` / ``.tar``; loop/weight_store.py), and its
    #: SHA-256 digest as the store writes it (``SHA-256=<base64url>``), which
    #: a worker checks what it fetched against. Unset (and then not encoded,
    #: so such a record is stored byte for byte as before): not put there.
    weights_object: str | UnsetType = UNSET
    weights_digest: str | UnsetType = UNSET


Event = Union[
    SessionOpened,
    SessionStarted,
    TurnRecorded,
    TurnUndelivered,
    CommandRan,
    RewardAssigned,
    SessionFinished,
    SessionAborted,
    SessionDropped,
    PolicyUpdated,
    TurnDelta,
    TeacherScored,
    SandboxSnapshotted,
    SessionResumed,
]

EVENT_TYPES: tuple[type, ...] = Event.__args__  # type: ignore[attr-defined]
TERMINAL_EVENT_TYPES = (SessionFinished, SessionAborted, SessionDropped)
#: The tags this version knows.
KNOWN_TAGS: frozenset[str] = frozenset(t.__struct_config__.tag for t in EVENT_TYPES)


class UnknownEvent(msgspec.Struct, frozen=True, gc=False):
    """A stored record whose tag this version does not know: a newer
    agentlog wrote it. Readers hand it over instead of failing, so ``replay``,
    ``stats`` and ``verify`` can show it; a fold that must interpret it raises
    (``reducers.errors.UnknownEventError``: upgrade agentlog). Never appended:
    the writer takes schema events only."""

    #: The record's tag (its ``type`` field).
    tag: str
    #: Every other field, as plain msgpack data.
    fields: dict[str, Any] = {}


def event_tag(body: Any) -> str:
    """The snake_case tag of an event body (``session_opened``...); for an
    :class:`UnknownEvent`, the tag it was stored with."""
    if type(body) is UnknownEvent:
        return body.tag
    return type(body).__struct_config__.tag


class Envelope(msgspec.Struct, frozen=True, gc=False):
    """One log record: position, session, per-session sequence, wall time, body."""

    # gc=False: an envelope never takes part in a reference cycle, and a log
    # read or append creates millions of them; untracked, they cost the cyclic
    # GC nothing (about 1.4x on the append path).

    lsn: int
    session_id: str
    session_seq: int
    ts_ns: int
    body: Event

    # The log's readers yield a subclass whose body is decoded on first use
    # (events/log/lazy.py); these let a caller ask for the type without
    # knowing which it has, and without decoding the body there.

    @property
    def tag(self) -> str:
        """The body's tag, as :func:`event_tag` gives it."""
        return event_tag(self.body)

    @property
    def unknown(self) -> bool:
        """True when the body is of a type this version does not know (an :class:`UnknownEvent`)."""
        return type(self.body) is UnknownEvent

    def eager(self) -> "Envelope":
        """This record as a plain Envelope with its body decoded (itself, here)."""
        return self


# ---------------------------------------------------------------- codec

_body_encoder = msgspec.msgpack.Encoder()
_body_decoder = msgspec.msgpack.Decoder(Event)
#: A batch's write-time check (:func:`.batch_check.check_bodies`): the array of encoded
#: bodies split into each body's bytes (zero-copy views), and decoded strictly.
_payloads_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_bodies_decoder = msgspec.msgpack.Decoder(list[Event])
#: msgspec's location suffix: ``Expected `int`, got `str` - at `$.group_size```.
_AT_PATH = re.compile(r" - at `\$(.*)`$")


def encode_body(body: Any) -> bytes:
    """msgpack bytes of an event body (tag included)."""
    return _body_encoder.encode(body)


def decode_body(payload: bytes | memoryview) -> Any:
    """Decode a stored event body, tolerantly: the bodies' write-time checks
    are not run, unknown fields are skipped, and an unknown tag gives an
    :class:`UnknownEvent`. Raises msgspec.ValidationError when a known tag's
    fields do not have this version's types, or the payload is not a tagged
    map (:func:`stored_tag` tells the two apart), and msgspec.DecodeError when
    it is not msgpack (or nests deeper than the decoder follows: :func:`too_deep`)."""
    token = READING_STORED.set(True)
    try:
        return _body_decoder.decode(payload)
    except msgspec.ValidationError:
        # Only now look at the tag: the common path pays nothing for it.
        unknown = as_unknown_event(payload)
        if unknown is None:
            raise
        return unknown
    except RecursionError:
        return decode_deep(_body_decoder.decode, payload)
    finally:
        READING_STORED.reset(token)


def decode_deep(decode: Callable[[Any], Any], payload: bytes | memoryview) -> Any:
    """``decode(payload)`` (an UnknownEvent for a tag this version does not know) after it raised
    RecursionError here: again at the bottom of a fresh stack (:func:`.validation.on_fresh_stack`;
    the writer that checked the payload may have had more stack left than this reader), else a
    DecodeError (:func:`too_deep`). The readers' rare path: their common one decodes inline."""
    def known_or_unknown(data: bytes | memoryview) -> Any:
        try:
            return decode(data)
        except msgspec.ValidationError:
            unknown = as_unknown_event(data)
            if unknown is None:
                raise
            return unknown

    try:
        return on_fresh_stack(known_or_unknown, payload)
    except RecursionError as exc:
        raise too_deep(exc) from None


def too_deep(exc: RecursionError) -> msgspec.DecodeError:
    """The error of a stored payload nested deeper than msgspec's decoder
    follows (it raises RecursionError): a DecodeError, as for any payload that
    does not decode, so every reader reports it where it lies (segment,
    offset, LSN) instead of letting a bare RecursionError through."""
    return msgspec.DecodeError(f"the payload nests deeper than the decoder follows ({exc})")


def _stored_map(payload: bytes | memoryview) -> dict | None:
    try:
        data = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def stored_tag(payload: bytes | memoryview) -> str | None:
    """The ``type`` of a stored payload when it is a msgpack map with a str
    tag, else None (not an event body at all)."""
    data = _stored_map(payload)
    tag = data.get("type") if data is not None else None
    return tag if isinstance(tag, str) else None


class _TagOnly(msgspec.Struct):
    type: str  # the event tag; every other field is skipped, not built


_tag_only_decoder = msgspec.msgpack.Decoder(_TagOnly)


def payload_tag(payload: bytes | memoryview) -> str:
    """The ``type`` of a stored payload, decoding nothing else (several times
    faster than decoding the body). Raises msgspec.DecodeError when the
    payload is not a msgpack map with a str ``type``."""
    try:
        return _tag_only_decoder.decode(payload).type
    except RecursionError as exc:
        raise too_deep(exc) from None


def as_unknown_event(payload: bytes | memoryview) -> UnknownEvent | None:
    """The :class:`UnknownEvent` of a stored payload whose tag this version
    does not know; None when the payload is not a map with a str tag, or its
    tag is known. Also for decoders of their own (projections) that meet a
    tag they cannot decode."""
    data = _stored_map(payload)
    if data is None:
        return None
    tag = data.pop("type", None)
    if not isinstance(tag, str) or tag in KNOWN_TAGS:
        return None
    return UnknownEvent(tag, data)


def describe_validation_error(exc: msgspec.ValidationError) -> tuple[str, str]:
    """Split msgspec's message into the field path and what was wrong:
    ``("metadata", "expected `object`, got `array`")``. The path is "" when
    the message has no location (a body check that names its own field)."""
    text = str(exc)
    m = _AT_PATH.search(text)
    if m is None:
        return "", text
    what = text[: m.start()]
    if what.startswith("Expected"):
        what = "e" + what[1:]
    return m.group(1).lstrip("."), what


def check_body(body: Any) -> tuple[bytes, Any]:
    """The write-path check of one schema event body: encode it and decode it
    back strictly, with every body check on. Returns ``(payload, decoded)``:
    the bytes to store and the body exactly as any reader will decode it.
    Raises EventValidationError naming the event type, the field and what was
    expected when a reader could not decode the body (msgspec Struct
    constructors do not check field types, so ``metadata=[1]`` gets this far).
    """
    try:
        payload = _body_encoder.encode(body)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        # UnicodeEncodeError (a lone surrogate), an int beyond 64 bits, an object msgpack cannot hold,
        # a value nested deeper than the encoder follows.
        raise EventValidationError(f"{event_tag(body)}: cannot be encoded: {exc}") from None
    try:
        return payload, _body_decoder.decode(payload)
    except RecursionError as exc:  # encoded, but nested too deep for a reader to decode
        raise EventValidationError(f"{event_tag(body)}: a reader could not decode it: {exc}") from None
    except msgspec.ValidationError as exc:
        field, what = describe_validation_error(exc)
        if not field:
            # A body check's own message already names the event and the field.
            raise EventValidationError(what) from None
        raise EventValidationError(f"{event_tag(body)}.{field}: {what}") from None
    except msgspec.DecodeError as exc:  # not msgpack at all: a msgspec.Raw value holding malformed bytes
        raise EventValidationError(f"{event_tag(body)}: a reader could not decode it: {exc}") from None

