"""Record-health flags: what a session's record says about how far it can be trusted for training.

This module is the one owner of the flag names and their rules. Every fold
that shows or counts them computes them here: the sample pipeline
(:class:`reducers.pipeline.Reducer`, which ``show``, ``report`` and
``reconstruct`` fold with), the run statistics (:class:`reducers.runstats.RunStats`,
``stats``) and ``replay --flag``'s selection. The flags of a session are a
pure function of its events and the :class:`~agentlog.reducers.config.ReduceConfig`:

* ``undelivered``: a turn was acknowledged but its response may never have
  reached the agent (a ``turn_undelivered`` event). The turn is not trained
  either way (the trajectory's rule); the flag says the session holds one.
* ``truncated``: a turn finished with ``finish_reason`` ``"length"``.
* ``drift``: retokenization drift, the agent's next prompt does not extend
  the tokens it was sent: the trajectory (:mod:`reducers.trajectory`)
  classifies some turn REALIGN or FORK against the turn it follows in the
  message tree. A message-level branch (a sub-agent, a side query) and a
  rewritten response message are routed by the tree, not drift; a turn
  that cannot be placed in the tree at all (a ``turn_delta`` that does not
  expand) counts as drift in the folds that do not stop on it.
* ``version_span``: the policy versions that generated the session's
  tokens (every turn's ``version_spans``, or its ``policy_version``) span
  more than ``ReduceConfig.max_version_span``: newest minus oldest. A run's
  bound is its ``max_staleness`` (:meth:`agentlog.loop.config.LoopConfig.reduce_config`):
  a session spanning more versions than that is stale whenever it is trained.
* ``teacher_missing``: a turn with output tokens has no teacher scores
  (no ``teacher_scored`` event for it without an error) while the session
  expects them: it holds a ``teacher_scored`` event for some turn (a scored
  or a failed one), or it finished in a run that distills
  (``ReduceConfig.expect_teacher_scores``, set by a run with ``[distill]``
  teachers).
* ``no_reward``: the session finished without a usable reward: never
  rewarded (no reward on ``session_finished`` and no ``reward_assigned``), or
  rewarded with something :func:`reducers.samples.resolve_reward` refuses
  (NaN, a dict without the ``reward_key``, ...).
* ``complete``: the session finished, and carries none of the flags above
  (so it has a usable reward and every turn was delivered).

``undelivered``, ``truncated``, ``drift`` and ``version_span`` are known as the
turns arrive (a session in flight carries those seen so far); ``no_reward``,
``teacher_missing`` and ``complete`` are decided by the terminal event.

**Untrainable by configuration.** ``ReduceConfig.untrainable_flags`` names
problem flags (never ``complete``) that make a session untrainable: a
finished member carrying one, or an aborted member its abort class counts as
a failure, is then treated like an excluded abort: one zero-masked
placeholder sample (:func:`reducers.samples.aborted_placeholder`, its
metadata naming the flags under ``untrainable_flags``), out of its group's
baseline (the rule's one owner: :func:`reducers.outcome.session_outcome`).
The default, no flag, changes nothing: undelivered turns are
already left untrained turn by turn.

**Public API** (what an exporter needs to put the flags in a column):

* :data:`ALL_FLAGS` (sorted), :data:`PROBLEM_FLAGS`, one constant per flag;
* :class:`SessionHealth`: the per-session state, fed each event of the
  session (:meth:`SessionHealth.observe`); :meth:`SessionHealth.flags`
  returns the session's flags as a sorted tuple of strings;
* :meth:`reducers.pipeline.Reducer.session_flags` (a session in flight) and
  ``Outputs.flags`` (``session id -> flags`` of every session that ended in
  the envelopes fed) give them from the sample pipeline;
* :func:`untrainable_by` (which of a session's flags make it untrainable),
  :func:`check_flag_names` (the check ``ReduceConfig`` runs) and
  :func:`flag_counts` (a zero-filled count per flag).

Pure: no clock, randomness, I/O or torch.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable

import msgspec
from msgspec import UNSET

from agentlog.events.schema.turn import TurnDelta, TurnRecorded
from agentlog.events.schema.turn_delta import EncodingContext
from agentlog.events.schema.types import decode_body, encode_body

from .samples import final_raw_reward, resolve_reward
from .trajectory import FORK, REALIGN, SessionTrajectory, Trajectory, TrajectoryError

if TYPE_CHECKING:
    from .config import ReduceConfig

COMPLETE = "complete"
DRIFT = "drift"
NO_REWARD = "no_reward"
TEACHER_MISSING = "teacher_missing"
TRUNCATED = "truncated"
UNDELIVERED = "undelivered"
VERSION_SPAN = "version_span"

#: Every flag, sorted: the order flags are listed in everywhere.
ALL_FLAGS: tuple[str, ...] = tuple(sorted((COMPLETE, DRIFT, NO_REWARD, TEACHER_MISSING, TRUNCATED, UNDELIVERED, VERSION_SPAN)))
#: The flags that say something is wrong (what ``untrainable_flags`` may name).
PROBLEM_FLAGS: frozenset[str] = frozenset(ALL_FLAGS) - {COMPLETE}
#: The head of a group member's reason when its flags made it untrainable.
UNTRAINABLE = "untrainable"

_TURN_TAGS = frozenset(("turn_recorded", "turn_delta"))

# A kept turn_recorded re-encoded as a turn_delta: its fields delimited, never decoded (their
# msgpack copied as it is), its messages one Raw each, compared as bytes.
_encode = msgspec.msgpack.Encoder().encode
_raw_fields = msgspec.msgpack.Decoder(dict[str, msgspec.Raw]).decode
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode
_TAG_FIELD = str(TurnDelta.__struct_config__.tag_field)
_DELTA_TAG = str(TurnDelta.__struct_config__.tag)
_NIL = msgspec.Raw(b"\xc0")  # msgpack nil: a turn without a response message


def check_flag_names(names: Any, where: str) -> str:
    """Why ``names`` is not a list of problem flags ("" when it is); ``where`` names the setting."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple)):
        return f"{where}: expected a list of flag names, found {names!r}"
    for name in names:
        if not isinstance(name, str) or name not in PROBLEM_FLAGS:
            what = "names no problem (it cannot make a session untrainable)" if name == COMPLETE else "is not a flag"
            return f"{where}: {name!r} {what}; expected some of {sorted(PROBLEM_FLAGS)}"
    return ""


def untrainable_by(flags: Iterable[str], config: "ReduceConfig") -> tuple[str, ...]:
    """The flags among ``flags`` that ``config.untrainable_flags`` makes untrainable (sorted)."""
    bad = config.untrainable_flags
    return tuple(f for f in flags if f in bad) if bad else ()


def untrainable_reason(flags: Iterable[str]) -> str:
    """A group member's reason when ``flags`` made it untrainable: ``untrainable: drift, truncated``."""
    return f"{UNTRAINABLE}: {', '.join(flags)}"


def flag_counts(counter: Counter[str]) -> dict[str, int]:
    """Every flag with its count in ``counter`` (0 when absent), in :data:`ALL_FLAGS` order."""
    return {f: counter.get(f, 0) for f in ALL_FLAGS}


def trajectory_drift(trajectory: Trajectory) -> bool:
    """Whether a linearised trajectory shows retokenization drift (a turn REALIGN or FORK)."""
    return any(d.drift == REALIGN or d.drift == FORK for d in trajectory.decisions)


class SessionHealth:
    """One session's health, folded one event at a time (pure, deterministic).

    ``observe(tag, body, payload)`` takes each event of the session in log
    order: a full event body, or the statistics projection of it
    (:func:`reducers.runstats.decode_projection`), whose fields it reads
    (``turn_index``, ``output_ids``, ``finish_reason``, ``policy_version``,
    ``version_spans``, the prompt fields, a teacher event's ``error``, a
    reward, the terminal event).

    Drift is checked cheaply as the turns arrive: a turn whose prompt tokens
    extend the previous turn's prompt + output (in log order; for a
    ``turn_delta``, it shares all of them) cannot drift against any earlier
    turn, so a session whose every turn does so has no drift, whatever the
    tree. Only a session where some turn does not is linearised by the
    trajectory, whose decisions then decide. A fold that holds the session's
    :class:`~agentlog.reducers.trajectory.SessionTrajectory` (the pipeline)
    passes it to :meth:`flags`; one that does not (``keep_turns``: the
    statistics, ``replay --flag``) keeps the session's turns here until it
    ends, each as a stored ``turn_delta`` (:meth:`_recorded_as_delta`): a delta as it
    was stored, a ``turn_recorded`` re-encoded as the delta on the turn
    before it (its prompt tokens and messages past what that turn held), so
    a session costs its new tokens and messages, not a whole prompt a turn.
    A projected turn needs its stored bytes (``payload``); a full body is
    encoded. Only a session some turn of which does not extend the turn
    before decodes them, once it ends."""

    __slots__ = ("session_id", "config", "undelivered", "truncated", "v_lo", "v_hi", "outputs", "scored",
                 "teacher_events", "last_reward", "ended", "usable_reward", "suspect", "_n_turns",
                 "_prev_prompt", "_prev_output", "_prev_held", "_keeps", "_kept", "_messages", "_drift")

    def __init__(self, session_id: str, config: "ReduceConfig", *, keep_turns: bool = False) -> None:
        self.session_id = session_id
        self.config = config
        self.undelivered = False
        self.truncated = False
        self.v_lo: int | None = None  # oldest and newest policy version of any output token
        self.v_hi: int | None = None
        self.outputs: set[int] = set()  # turns with output tokens (what a teacher scores)
        self.scored: set[int] = set()  # turns with a teacher_scored event without error
        self.teacher_events = False
        self.last_reward: Any = None
        self.ended = ""  # the terminal event's tag
        self.usable_reward = False
        #: Some turn does not extend the previous one: the trajectory must decide drift.
        self.suspect = False
        self._n_turns = 0
        self._prev_prompt: bytes | None = None  # the previous turn's prompt ids (None: a delta's, not held)
        self._prev_output = b""
        self._prev_held = 0  # the previous turn's prompt + output, in bytes
        self._keeps = keep_turns
        #: The turns kept (stored turn_delta payloads); None once a turn could not be read (it cannot be placed).
        self._kept: list[bytes] | None = [] if keep_turns else None
        #: The previous turn_recorded's messages + response, as their stored msgpack (None after a delta).
        self._messages: list[msgspec.Raw] | None = [] if keep_turns else None
        self._drift: bool | None = None  # decided once the session ended

    def observe(self, tag: str, body: Any, payload: bytes | memoryview | None = None) -> None:
        """Fold one of the session's events (``tag``: its event name). ``payload``: the stored
        bytes of a turn event given as a projection, which a health that keeps turns needs
        (TypeError naming the session and turn without it)."""
        if tag in _TURN_TAGS:
            self._turn(tag, body, payload)
        elif tag == "turn_undelivered":
            self.undelivered = True
        elif tag == "teacher_scored":
            self.teacher_events = True
            if not body.error:
                self.scored.add(body.turn_index)
        elif tag == "reward_assigned":
            self.last_reward = body.reward
        elif tag == "session_finished":
            self.ended = tag
            reward, _ = resolve_reward(final_raw_reward(body.reward, self.last_reward), self.config.reward_key)
            self.usable_reward = reward is not None
        elif tag in ("session_aborted", "session_dropped"):
            self.ended = tag

    def _turn(self, tag: str, body: Any, payload: bytes | memoryview | None) -> None:
        out = body.output_ids
        if out:
            self.outputs.add(body.turn_index)
        if body.finish_reason == "length":
            self.truncated = True
        spans = body.version_spans
        if spans is UNSET:  # one version made the turn (the common case)
            lo = hi = body.policy_version
        else:
            lo, hi = min(v for _, v in spans), max(v for _, v in spans)
        if self.v_lo is None or lo < self.v_lo:
            self.v_lo = lo
        if self.v_hi is None or hi > self.v_hi:
            self.v_hi = hi
        if self._keeps:
            self._keep(tag, body, payload)  # before the previous turn's tokens are replaced: it is encoded on them
        if tag == "turn_delta":
            # Its prompt is the previous turn's first shared_tokens tokens, then new ones.
            extends = body.shared_tokens * 4 == self._prev_held
            held = body.shared_tokens * 4 + len(body.new_prompt_ids) + len(out)
            self._prev_prompt = None
        else:
            prompt = body.prompt_ids
            before = self._prev_prompt
            extends = before is not None and prompt.startswith(before) and prompt.startswith(self._prev_output, len(before))
            held = len(prompt) + len(out)
            self._prev_prompt = prompt
        if self._n_turns and not extends:
            self.suspect = True
        self._n_turns += 1
        self._prev_output = out
        self._prev_held = held

    def _keep(self, tag: str, body: Any, payload: bytes | memoryview | None) -> None:
        """Keep a turn for a later linearisation, as a stored turn_delta (see the class docstring)."""
        if payload is None:
            if not isinstance(body, (TurnRecorded, TurnDelta)):
                raise TypeError(f"session {self.session_id!r}: turn {body.turn_index} was given as a projection without its "
                                "stored bytes; a health that keeps turns (for its drift flag) needs them: the payload argument")
            payload = encode_body(body)
        if self._kept is None:
            return  # a turn before could not be read: the session will count as drift if it must be linearised
        try:
            if tag == "turn_delta":
                self._kept.append(bytes(payload))  # copied: a view into a read buffer that is reused
                self._messages = None
            else:
                self._kept.append(self._recorded_as_delta(body.prompt_ids, payload))
        except msgspec.DecodeError:
            self._kept = self._messages = None

    def _recorded_as_delta(self, prompt: bytes, payload: bytes | memoryview) -> bytes:
        """A stored turn_recorded as the stored turn_delta that stands for it on the previous turn
        (what :meth:`agentlog.events.schema.turn_delta.TurnContext.expand` turns back into it): messages
        compared as their stored msgpack, so none is decoded. After a delta, whose context is not held, the
        turn is kept whole (shares nothing): exact either way."""
        fields = _raw_fields(payload)
        messages = _raw_list(fields.pop("messages")) if "messages" in fields else []
        fields.pop("prompt_ids", None)
        fields.pop(_TAG_FIELD, None)
        held = self._messages or ()
        shared = 0
        for a, b in zip(held, messages):
            if a != b:
                break
            shared += 1
        before = self._prev_prompt
        tokens = 0 if before is None else EncodingContext(before, self._prev_output).shared_tokens(prompt)
        delta: dict[str, Any] = {_TAG_FIELD: _DELTA_TAG}  # the tag first: the decoder reads it first
        delta.update(fields)
        delta.update(shared_tokens=tokens, new_prompt_ids=prompt[tokens * 4:], shared_messages=shared, new_messages=messages[shared:])
        response = fields.get("response_message")
        tail = [response.copy()] if response is not None and response != _NIL else []
        # What the next turn_recorded is compared with; copies, so no payload is held.
        self._messages = list(held[:shared]) + [m.copy() for m in messages[shared:]] + tail
        return _encode(delta)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the turns kept for a later linearisation (0 when none are kept)."""
        return sum(map(len, self._kept or ())) + sum(map(len, self._messages or ()))

    # ---------------------------------------------------------------- flags

    def drift(self, trajectory: SessionTrajectory | Trajectory | None = None) -> bool:
        """Whether the session shows retokenization drift (see the module docstring).
        ``trajectory``: the session's, when the fold holds it (a linearised one is used as it is)."""
        if not self.suspect:
            return False
        if self._drift is not None:
            return self._drift
        if isinstance(trajectory, Trajectory):
            drift = trajectory_drift(trajectory)
        elif trajectory is not None:
            drift = trajectory_drift(trajectory.linearise(self.config.max_context_tokens, self.config.allow_repeated_targets))
        else:
            drift = self._kept_drift()
        if self.ended:
            self._drift = drift
            self._kept = self._messages = None
        return drift

    def _kept_drift(self) -> bool:
        if not self._keeps:
            raise TypeError(f"session {self.session_id!r}: SessionHealth.drift needs the session's trajectory (it keeps no turns)")
        if self._kept is None:
            return True  # a turn whose stored bytes do not read: the record does not hold together
        traj = SessionTrajectory(self.session_id, self.config.fork_threshold)
        try:
            for i, turn in enumerate(self._kept):
                traj.record_turn(decode_body(turn), i)
        except (TrajectoryError, ValueError):
            return True  # a turn that cannot be placed: the record does not hold together
        return trajectory_drift(traj.linearise(0, False))

    def flags(self, trajectory: SessionTrajectory | Trajectory | None = None) -> tuple[str, ...]:
        """The session's flags, sorted (:data:`ALL_FLAGS` order). ``trajectory``: see :meth:`drift`."""
        config = self.config
        out = []
        if self.drift(trajectory):
            out.append(DRIFT)
        finished = self.ended == "session_finished"
        if finished and not self.usable_reward:
            out.append(NO_REWARD)
        if self.ended and (self.teacher_events or (finished and config.expect_teacher_scores)):
            if not self.outputs <= self.scored:
                out.append(TEACHER_MISSING)
        if self.truncated:
            out.append(TRUNCATED)
        if self.undelivered:
            out.append(UNDELIVERED)
        if self.v_lo is not None and self.v_hi - self.v_lo > config.max_version_span:  # type: ignore[operator]
            out.append(VERSION_SPAN)
        if finished and not out:
            out.append(COMPLETE)
        return tuple(sorted(out))
