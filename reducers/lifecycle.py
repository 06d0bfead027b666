"""The lifecycle reducer: replays the session grammar over the log.

A pure, incremental fold ``reduce_lifecycle(state, envelope) -> (state,
outputs)``: hooks on the one fold driver (:class:`reducers.fold.SessionFold`),
which checks every record with the lifecycle and sequence step
(:func:`reducers.lifecycle_step.evolve`, over the same table the engine
decides with). It emits:

* :class:`Violation` for any illegal record (an event for a session that was
  never opened, an event after the terminal one, a second terminal event, a
  reused session id, a ``session_seq`` gap or repeat, an illegal move, an
  LSN that does not increase), with its kind. Illegal records are shown,
  never silently accepted, and not applied; the fold carries on from
  :func:`reducers.lifecycle_step.resync`.
* :class:`SessionSummary` once a session ends (status, reason, turns, tokens,
  reward, timestamps, duration, resumes: a resumed session is one session);
  the session is then evicted, so memory is bounded by the number of open
  sessions.

An event type this version does not know (a newer writer's
:class:`events.schema.types.UnknownEvent`) raises :class:`UnknownEventError` (upgrade
agentlog): its effect on the session cannot be known. A fold that only shows
the log (``replay``) passes ``tolerate_unknown=True``: the event is then
counted per tag and passed over, the session's state left as it was.

No clock, randomness or I/O. The fold mutates ``state`` in place and returns
it (copying per event would make a whole-log fold quadratic); feeding a log in
one call or in arbitrary chunks gives identical outputs.

Knowing "was this id ever used?" after sessions are evicted
------------------------------------------------------------
Exact knowledge needs memory that grows with every session ever opened. We
keep instead (a) an exact window of the most recently ended sessions
(``recent_window`` entries, default 4096, about 200 B each) and (b) a Bloom
filter over every id whose ``session_opened`` the fold accepted
(:class:`IdFilter`): 32 bits per id, 16 hashes, false-positive rate about 3.4e-7; it is preallocated (1 MiB for the first
262,144 ids) and grows by doubled layers beyond that (about 4 B per id).
The filter never gives a false negative. The reducer uses it to word its
messages (``after its terminal event`` versus ``never opened``) and to flag a
reused id whose first session ended outside the exact window (a false
positive would flag a fresh id with probability ~3e-7; the message says the
flag comes from the filter). The engine, which must be exact, confirms a
filter hit with a sparse scan of the log (see ``engine.core``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator, NamedTuple

import msgspec

from agentlog.events.log import framecodec
from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import (
    CommandRan,
    Envelope,
    RewardAssigned,
    SessionFinished,
    SessionOpened,
    SessionResumed,
    TurnDelta,
    TurnRecorded,
    TurnUndelivered,
)

from agentlog.events.schema.turn_delta import prompt_token_count

from .errors import UnknownEventError
from .fold import LEARNER_TAG, ConfirmUsed, SessionFold, Tracked
from .lifecycle_step import EndedWindow, EndedWindowSnapshot, SessionLife, Violation
from .samples import final_raw_reward

__all__ = [
    "IdFilter",
    "IdFilterSnapshot",
    "LifecycleCheck",
    "LifecycleCheckSnapshot",
    "LifecycleReducer",
    "LifecycleState",
    "ReplayStep",
    "SessionSummary",
    "Violation",
    "live_entry",
    "reduce_lifecycle",
    "reduce_lifecycle_many",
    "replay",
]


class SessionSummary(msgspec.Struct, frozen=True):
    """What one session did, emitted when its terminal event is reduced."""

    session_id: str
    group_id: str
    group_size: int
    sample_index: int
    status: str  # finished | aborted | dropped
    reason: str  # abort / drop reason; "" when finished
    error: str
    turns: int
    undelivered: int
    commands: int
    tokens_in: int  # prompt tokens over all turns
    tokens_out: int  # generated tokens over all turns
    reward: Any  # float | dict[str, float] | None (finished only)
    opened_lsn: int
    ended_lsn: int
    opened_ts_ns: int
    ended_ts_ns: int
    duration_s: float
    #: How often it was resumed (``session_resumed``): each a new incarnation of the same session.
    resumes: int = 0


def _probe(bits: bytearray, m: int, h1: int, h2: int, k: int, set_them: bool) -> bool:
    """Whether the ``k`` bits ``(h1 + i*h2) mod m`` of ``bits`` are all set; with
    ``set_them``, set them too. The compiled codec's ``bloom_probe`` when it is
    in use, else this loop: the same bits (a differential test holds them to it)."""
    native = framecodec.native
    if native is not None:
        return native.bloom_probe(bits, m, h1, h2, k, set_them)
    seen = True
    for i in range(k):
        idx = (h1 + i * h2) % m
        byte, mask = idx >> 3, 1 << (idx & 7)
        if not bits[byte] & mask:
            if not set_them:
                return False
            seen = False
            bits[byte] |= mask
    return seen


class IdFilter:
    """A Bloom filter over session ids: no false negatives, ~3.4e-7 false positives.

    Hashing is blake2b over the UTF-8 id, so the answer is identical in every
    process (Python's ``hash`` is salted per process). Capacity grows by
    adding layers of twice the previous size, so the false-positive rate
    stays put as the log grows. The bit probes run in the compiled codec
    (``bloom_probe``) when it is in use: the same bits, a tenth of the time.
    """

    BITS_PER_ID = 32
    HASHES = 16

    __slots__ = ("_layers", "_capacity", "_count", "_first_capacity")

    def __init__(self, capacity: int = 1 << 18) -> None:
        if capacity < 1:
            raise ValueError(f"IdFilter capacity: expected >= 1, found {capacity}")
        self._first_capacity = capacity
        self._layers: list[tuple[bytearray, int]] = [(bytearray(capacity * self.BITS_PER_ID // 8 + 1), capacity * self.BITS_PER_ID)]
        self._capacity = capacity
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Memory held by the bit arrays."""
        return sum(len(b) for b, _ in self._layers)

    @staticmethod
    def hashes(session_id: str) -> tuple[int, int]:
        """The id's two hashes, from which every probe of it is derived: a caller that asks
        twice about one id (:meth:`has_hashed`, then :meth:`add_hashed`) hashes it once."""
        d = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1

    def add(self, session_id: str) -> bool:
        """Insert an id; returns True if it may have been present already
        (a test-and-set: one hash for both questions)."""
        return self.add_hashed(self.hashes(session_id))

    def add_hashed(self, hashes: tuple[int, int]) -> bool:
        """:meth:`add` of the id whose :meth:`hashes` these are."""
        if self._count >= self._capacity:
            cap = self._layers[-1][1] // self.BITS_PER_ID * 2
            self._layers.append((bytearray(cap * self.BITS_PER_ID // 8 + 1), cap * self.BITS_PER_ID))
            self._capacity += cap
        bits, m = self._layers[-1]
        h1, h2 = hashes
        seen = _probe(bits, m, h1, h2, self.HASHES, True)
        if not seen and len(self._layers) > 1:
            seen = self._in_layers(h1, h2, self._layers[:-1])
        if not seen:
            self._count += 1
        return seen

    def _in_layers(self, h1: int, h2: int, layers: list[tuple[bytearray, int]]) -> bool:
        return any(_probe(bits, m, h1, h2, self.HASHES, False) for bits, m in layers)

    def __contains__(self, session_id: object) -> bool:
        if not isinstance(session_id, str):
            return False
        return self.has_hashed(self.hashes(session_id))

    def has_hashed(self, hashes: tuple[int, int]) -> bool:
        """``in`` for the id whose :meth:`hashes` these are."""
        return self._in_layers(hashes[0], hashes[1], self._layers)

    def to_snapshot(self) -> "IdFilterSnapshot":
        """The filter's bits and counters as plain data, for a checkpoint."""
        return IdFilterSnapshot(
            first_capacity=self._first_capacity, capacity=self._capacity, count=self._count,
            layers=[(bytes(bits), m) for bits, m in self._layers],
        )

    @classmethod
    def from_snapshot(cls, snap: "IdFilterSnapshot") -> "IdFilter":
        """The filter :meth:`to_snapshot` saw; raises ValueError naming the
        field when the layers do not have the sizes their bit counts need."""
        f = cls(1)
        if not snap.layers:
            raise ValueError("IdFilter snapshot: expected at least one layer, found none")
        for i, (bits, m) in enumerate(snap.layers):
            if m < 1 or len(bits) != m // 8 + 1:
                raise ValueError(f"IdFilter snapshot: layers[{i}] holds {len(bits)} bytes for {m} bits; expected {m // 8 + 1}")
        f._first_capacity, f._capacity, f._count = snap.first_capacity, snap.capacity, snap.count
        f._layers = [(bytearray(bits), m) for bits, m in snap.layers]
        return f


class IdFilterSnapshot(msgspec.Struct, frozen=True):
    """:class:`IdFilter` as plain data: its counters and each layer's ``(bits, bit count)``."""

    first_capacity: int
    capacity: int
    count: int
    layers: list[tuple[bytes, int]]


class _Track:
    """Per open session; evicted at its terminal event."""

    __slots__ = (
        "life", "group_id", "group_size", "sample_index", "turns", "undelivered", "commands",
        "tokens_in", "tokens_out", "reward", "opened_lsn", "opened_ts_ns", "resumes",
    )

    def __init__(self, life: SessionLife, env: Envelope, body: SessionOpened) -> None:
        self.life = life
        self.group_id = body.group_id
        self.group_size = body.group_size
        self.sample_index = body.sample_index
        self.turns = 0
        self.undelivered = 0
        self.commands = 0
        self.tokens_in = 0
        self.tokens_out = 0
        self.reward: Any = None
        self.opened_lsn = env.lsn
        self.opened_ts_ns = env.ts_ns
        self.resumes = 0


class _OnSessionFold:
    """What a fold over :class:`SessionFold` shows of the driver's state: the ended
    window, the id filter and the next LSN (both lifecycle folds expose them)."""

    fold: SessionFold[Any]

    @property
    def recent(self) -> EndedWindow:
        """session_id -> (terminal state, lsn of its terminal event); bounded (the restart resizes it)."""
        return self.fold.recent

    @recent.setter
    def recent(self, window: EndedWindow) -> None:
        self.fold.recent = window

    @property
    def ids(self) -> IdFilter:
        """Every id whose ``session_opened`` the fold accepted."""
        return self.fold.ids  # type: ignore[return-value]

    @property
    def next_lsn(self) -> int:
        """The smallest LSN the next record may carry."""
        return self.fold.next_lsn


class LifecycleState(_OnSessionFold):
    """The fold's state: open sessions, a window of recently ended ones, the id
    filter (all three kept by its :class:`reducers.fold.SessionFold`)."""

    __slots__ = ("fold", "events", "ended", "tolerate_unknown", "unknown_events", "_out")

    def __init__(self, *, recent_window: int = 4096, id_capacity: int = 1 << 18, tolerate_unknown: bool = False,
                 confirm_used: ConfirmUsed | None = None) -> None:
        self.fold: SessionFold[_Track] = SessionFold(
            opened=self._opened, applied=self._applied, ended=self._ended, refused=self._refused, unknown=self._unknown,
            ended_window=recent_window, ids=IdFilter(id_capacity), confirm_used=confirm_used,
        )
        self.events = 0
        self.ended = 0
        #: Pass over events of unknown types (counted below) instead of raising UnknownEventError.
        self.tolerate_unknown = tolerate_unknown
        #: Events of unknown types passed over, by tag.
        self.unknown_events: dict[str, int] = {}
        self._out: list[Violation | SessionSummary] = []

    @property
    def live(self) -> dict[str, _Track]:
        """Sessions without a terminal event, by id."""
        return self.fold.live

    def open_sessions(self) -> dict[str, tuple[State, int]]:
        """Sessions without a terminal event: ``{session_id: (state, next_session_seq)}``."""
        return {sid: (t.life.state, t.life.next_seq) for sid, t in self.fold.live.items()}

    def state_of(self, session_id: str) -> State | None:
        """A session's state: live, recently ended, or None (unknown or long ended)."""
        return self.fold.state_of(session_id)

    # -- the fold's hooks

    def _refused(self, violation: Violation) -> None:
        self._out.append(violation)

    def _unknown(self, lsn: int, session_id: str, tag: str) -> None:
        self.unknown_events[tag] = self.unknown_events.get(tag, 0) + 1

    def _opened(self, lsn: int, session_id: str, env: Envelope, life: SessionLife) -> _Track:
        return _Track(life, env, env.body)

    def _applied(self, t: _Track, lsn: int, tag: str, env: Envelope) -> None:
        # By tag: only the events whose fields are counted have their bodies built.
        if tag in _TURN_TAGS:
            body = env.body
            t.turns += 1
            t.tokens_in += prompt_token_count(body)
            t.tokens_out += len(body.output_ids) // 4
        elif tag == _UNDELIVERED:
            t.undelivered += 1
        elif tag == _COMMAND:
            t.commands += 1
        elif tag == _REWARD:
            t.reward = env.body.reward
        elif tag == _RESUMED:
            t.resumes += 1

    def _ended(self, t: _Track, lsn: int, session_id: str, state: State, env: Envelope) -> None:
        self.ended += 1
        self._out.append(_summary(session_id, t, env, state))


_TURN_TAGS = frozenset(b.__struct_config__.tag for b in (TurnRecorded, TurnDelta))
_UNDELIVERED, _COMMAND, _REWARD, _RESUMED = (b.__struct_config__.tag for b in (TurnUndelivered, CommandRan, RewardAssigned, SessionResumed))


def _summary(sid: str, t: _Track, env: Envelope, state: State) -> SessionSummary:
    body = env.body
    reason = getattr(body, "reason", "")
    error = getattr(body, "error", "")
    reward = None
    if isinstance(body, SessionFinished):
        reward = final_raw_reward(body.reward, t.reward)
    return SessionSummary(
        session_id=sid, group_id=t.group_id, group_size=t.group_size, sample_index=t.sample_index,
        status=state.value, reason=reason, error=error, turns=t.turns, undelivered=t.undelivered,
        commands=t.commands, tokens_in=t.tokens_in, tokens_out=t.tokens_out, reward=reward,
        opened_lsn=t.opened_lsn, ended_lsn=env.lsn, opened_ts_ns=t.opened_ts_ns, ended_ts_ns=env.ts_ns,
        duration_s=(env.ts_ns - t.opened_ts_ns) / 1e9, resumes=t.resumes,
    )


def reduce_lifecycle(state: LifecycleState, env: Envelope) -> tuple[LifecycleState, list[Violation | SessionSummary]]:
    """Fold one envelope. Returns the (same, mutated) state and its outputs.

    A record :func:`reducers.lifecycle_step.evolve` refuses produces its
    :class:`Violation` and is not applied; the session carries on from
    :func:`reducers.lifecycle_step.resync` (a gap moves the sequence past the
    record, a repeat never moves it back). An LSN that does not increase is
    reported and the record still checked. An event of an unknown type raises
    UnknownEventError (state untouched) unless ``state.tolerate_unknown``:
    then it is counted per tag and checked for sequence only.
    """
    # The tag, not the body: a log reader's envelope builds its body only if a hook uses it.
    tag = env.tag
    out: list[Violation | SessionSummary] = []
    if env.unknown:
        if not state.tolerate_unknown:
            raise UnknownEventError(env.lsn, env.session_id, tag)
        state.events += 1
        state._out = out
        state.fold.feed(env.lsn, env.session_id, env.session_seq, tag, env, True)
    else:
        state.events += 1
        state._out = out
        state.fold.feed(env.lsn, env.session_id, env.session_seq, tag, env)
    return state, out


def reduce_lifecycle_many(state: LifecycleState, envs: Iterable[Envelope]) -> tuple[LifecycleState, list[Violation | SessionSummary]]:
    """Fold a chunk of envelopes; identical to folding them one at a time."""
    out: list[Violation | SessionSummary] = []
    for env in envs:
        state, o = reduce_lifecycle(state, env)
        if o:
            out.extend(o)
    return state, out


class LifecycleReducer:
    """A small stateful wrapper: ``feed(env)`` / ``feed_many(envs)`` return outputs."""

    def __init__(self, *, recent_window: int = 4096, id_capacity: int = 1 << 18, tolerate_unknown: bool = False) -> None:
        self.state = LifecycleState(recent_window=recent_window, id_capacity=id_capacity, tolerate_unknown=tolerate_unknown)

    def feed(self, env: Envelope) -> list[Violation | SessionSummary]:
        """Fold one envelope."""
        self.state, out = reduce_lifecycle(self.state, env)
        return out

    def feed_many(self, envs: Iterable[Envelope]) -> list[Violation | SessionSummary]:
        """Fold many envelopes."""
        self.state, out = reduce_lifecycle_many(self.state, envs)
        return out

    def open_sessions(self) -> dict[str, tuple[State, int]]:
        """Sessions still open or running, with their next session_seq."""
        return self.state.open_sessions()


class LifecycleCheck(_OnSessionFold):
    """The lifecycle fold with nothing but the check, over the few fields the
    step needs: ``feed(lsn, session_id, session_seq, tag)`` returns the
    record's violations. Behind ``agentlog verify``, which reads tags only
    (no body is decoded). Memory: the sessions in flight, the recent window
    and the id filter, as :class:`LifecycleState`."""

    __slots__ = ("fold", "records", "_out")

    def __init__(self, *, recent_window: int = 4096, id_capacity: int = 1 << 18) -> None:
        self.fold: SessionFold[Tracked] = SessionFold(
            opened=_track, refused=self._refused, ended_window=recent_window, ids=IdFilter(id_capacity),
        )
        self.records = 0
        self._out: list[Violation] = []

    def _refused(self, violation: Violation) -> None:
        self._out.append(violation)

    def feed(self, lsn: int, session_id: str, session_seq: int, tag: str) -> list[Violation]:
        """Check one record (``tag``: its event type); returns its violations (usually none)."""
        self.records += 1
        out: list[Violation] = []
        self._out = out
        self.fold.feed(lsn, session_id, session_seq, tag, None)
        return out

    def open_sessions(self) -> dict[str, tuple[State, int]]:
        """Sessions without a terminal event: ``{session_id: (state, next_session_seq)}``."""
        return {sid: (t.life.state, t.life.next_seq) for sid, t in self.fold.live.items()}

    def to_snapshot(self) -> "LifecycleCheckSnapshot":
        """The check's whole state as plain data: resuming from it at
        ``next_lsn`` gives the same violations as checking from LSN 0."""
        return LifecycleCheckSnapshot(
            next_lsn=self.next_lsn, records=self.records,
            live=[live_entry(sid, t.life.state, t.life.next_seq) for sid, t in self.fold.live.items()],
            recent=self.recent.to_snapshot(), ids=self.ids.to_snapshot(),
        )

    @classmethod
    def from_snapshot(cls, snap: "LifecycleCheckSnapshot") -> "LifecycleCheck":
        """The check :meth:`to_snapshot` saw."""
        check = cls(recent_window=0, id_capacity=1)
        check.records = snap.records
        fold = check.fold
        fold.next_lsn = snap.next_lsn
        fold.live = {sid: Tracked(SessionLife(State(state), seq)) for sid, state, seq in snap.live}
        fold.recent = EndedWindow.from_snapshot(snap.recent)
        fold.ids = IdFilter.from_snapshot(snap.ids)
        return check


def _track(lsn: int, session_id: str, record: object, life: SessionLife) -> Tracked:
    return Tracked(life)


def live_entry(session_id: str, state: State, next_seq: int) -> tuple[str, State, int]:
    """A session in flight as a :class:`LifecycleCheckSnapshot` built in memory holds it: its state as
    the State's value (a str, equal to the State and encoded the same), so the first collection that
    sees the tuple untracks it (an enum member is tracked: 10,000 of these would reach the old generation)."""
    return (session_id, state._value_, next_seq)  # type: ignore[return-value]  # the State's value, as said


class LifecycleCheckSnapshot(msgspec.Struct, frozen=True):
    """:class:`LifecycleCheck` as plain data: the sessions in flight
    ``(session_id, state, next_seq)``, the recent window and the id filter. A
    snapshot built in memory holds each state as its value (:func:`live_entry`);
    one decoded holds the State."""

    next_lsn: int
    records: int
    live: list[tuple[str, State, int]]
    recent: EndedWindowSnapshot
    ids: IdFilterSnapshot



class ReplayStep(NamedTuple):
    """One event of a replayed timeline, with the session's state around it."""

    envelope: Envelope
    state_before: State | None
    state_after: State | None
    violations: tuple[Violation, ...]
    summary: SessionSummary | None

    @property
    def event(self) -> str:
        """The event's tag."""
        return self.envelope.tag


def replay(
    envs: Iterable[Envelope],
    *,
    session_id: str | None = None,
    until_lsn: int | None = None,
    recent_window: int = 4096,
    confirm_used: ConfirmUsed | None = None,
) -> Iterator[ReplayStep]:
    """Replay envelopes through the lifecycle, yielding each with the state
    before and after it (None: no such session), its violations and, on a
    terminal event, the session summary. ``session_id`` keeps one session;
    ``until_lsn`` stops after that LSN. Learner events (policy_updated) are
    yielded with both states None. Events of unknown types (a newer
    writer's) are shown, not interpreted: the state stays as it was.
    ``confirm_used``: see :class:`LifecycleState`."""
    state = LifecycleState(recent_window=recent_window, tolerate_unknown=True, confirm_used=confirm_used)
    for env in envs:
        if until_lsn is not None and env.lsn > until_lsn:
            break
        if session_id is not None and env.session_id != session_id:
            continue
        learner = env.tag == LEARNER_TAG
        before = None if learner else state.state_of(env.session_id)
        state, out = reduce_lifecycle(state, env)
        after = None if learner else state.state_of(env.session_id)
        viol = tuple(o for o in out if isinstance(o, Violation))
        summ = next((o for o in out if isinstance(o, SessionSummary)), None)
        yield ReplayStep(env, before, after, viol, summ)
