"""The turn schema: one generation of the model, as the log stores it.

A turn is stored as one of two bodies that differ only in how they hold the
prompt: :class:`TurnRecorded` holds it inline, :class:`TurnDelta` as a delta
against the session's previous turn (:mod:`.turn_delta` converts between
them). Everything else a turn carries (what the model produced and how) is
declared once, in :class:`TurnBody`, which both inherit.

**A new turn field is a one-place change**: add it at the end of
:class:`TurnBody`, with a default. Both bodies then carry it, last on the
wire (``TurnBody`` is ``kw_only``, and msgspec orders keyword-only fields
after every positional one, so each body's stored layout stays ``turn_index``,
its prompt fields, then the shared fields); the delta conversions copy it
(they iterate over :data:`TURN_BODY_FIELDS`); the engine's ``record_turn``
takes it by name; the statistics projection declares it (delimited, not
decoded). Old records, which lack it, decode with its default.

**Version spans.** A generation interrupted by a weight update (a partial
rollout) is made by more than one policy version. ``version_spans`` then
says which: ``((first output token, version), ...)``, from token 0, first
tokens and versions strictly increasing, every span non-empty, and
``policy_version`` the first (oldest) span's version, so a reader that knows
only ``policy_version`` judges the turn by its oldest tokens. A turn made by
one version leaves the field unset (``msgspec.UNSET``): it is then not
encoded at all, so such a turn is stored byte for byte as before the field
existed. :func:`canonical_version_spans` builds the field from where each
version started; :func:`turn_version_spans` reads it back for any turn.
How the generation met the update is recorded beside its sampling settings,
``sampling["weight_update"]``: one of :data:`PARTIAL_MODES`.

**Servers.** Behind a fleet of inference servers, a turn records the server
that generated it beside its sampling settings too, ``sampling["server"]``
(its ``policy_version`` is that server's), and, when the session's previous
turn went to another server, ``sampling["server_moved_from"]``: the move,
recorded where it happened. Not new fields: a sixteenth field would change
the stored bytes of every turn_delta (msgpack's map header grows past 15
entries), and a turn behind one backend records neither.

**Lineages.** A session whose agent spawns subagents holds several
conversations; ``sampling["lineage"]`` (:mod:`.lineage`; read it as the
``lineage`` property) says which one a turn belongs to, absent on the
session's first lineage: for the same reason, and so a turn of a session
without subagents keeps its stored bytes.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from .lineage import LINEAGE_KEY, Lineage, check_lineage, lineage_of
from .packing import all_finite, log_probs_view, pack_log_probs, pack_tokens, packed_field, tokens_view
from .validation import DEFERRED_FINITE_SCANS, READING_STORED, check_count, fail

FINISH_REASONS = ("stop", "length", "abort")
#: How a weight update meets a generation in flight: ``drain`` waits for it to
#: finish; the partial modes apply the update at a token boundary and either
#: keep the KV cache (``continue``) or resubmit prompt + partial output (``resubmit``).
WEIGHT_UPDATE_MODES = ("drain", "continue", "resubmit")
PARTIAL_MODES = WEIGHT_UPDATE_MODES[1:]


class _Indexed(msgspec.Struct, frozen=True, gc=False):
    # Its own class so that ``turn_index`` is positional and first on the
    # wire, ahead of the subclass's prompt fields (TurnBody's are kw_only).
    turn_index: int


class TurnBody(_Indexed, frozen=True, kw_only=True):
    """What every turn carries besides its prompt: its index, what the model
    produced and how. Never stored itself: :class:`TurnRecorded` and
    :class:`TurnDelta` inherit these fields and add the prompt. New fields go
    at the end and carry a default (see the module docstring)."""

    output_ids: bytes = b""
    output_log_probs: bytes = b""
    finish_reason: str = "stop"
    response_message: dict[str, Any] | None = None
    ill_formed: bool = False
    policy_version: int = 0
    generate_s: float = 0.0
    sampling: dict[str, Any] = {}
    version_spans: tuple[tuple[int, int], ...] | UnsetType = UNSET

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        event = str(self.__struct_config__.tag)  # every turn body is tagged with its event name
        # Each check below has a fast path for what passes it (an exact int
        # >= 0, exact bytes of whole items) and hands anything else to the
        # full check: a turn's checks run on every body of every write.
        index = self.turn_index
        if type(index) is not int or index < 0:
            check_count(event, "turn_index", index)
        self._check_prompt(event)
        if self.finish_reason not in FINISH_REASONS:
            fail(event, "finish_reason", "one of stop/length/abort", self.finish_reason)
        out = self.output_ids
        if type(out) is not bytes or len(out) % 4:
            out = packed_field(self, "output_ids", pack_tokens)
        lp = self.output_log_probs
        if type(lp) is not bytes or len(lp) % 4:
            lp = packed_field(self, "output_log_probs", pack_log_probs)
        if lp and len(lp) != len(out):
            fail(event, "output_log_probs", f"{len(out) // 4} log-probs (one per output token) or none", f"{len(lp) // 4} log-probs")
        if lp:
            # A NaN or infinite log-prob would surface much later as a NaN loss
            # with no trace of which turn carried it. (This runs on every
            # append: one reduction, and the position only when one is bad.)
            deferred = DEFERRED_FINITE_SCANS.get()
            if deferred is not None:
                deferred.append(lp)  # scanned with the rest of its batch (see DEFERRED_FINITE_SCANS)
            else:
                if not all_finite(lp):
                    i = int(np.argmin(np.isfinite(log_probs_view(lp))))
                    fail(event, f"output_log_probs[{i}]", "a finite float", float(log_probs_view(lp)[i]))
        if self.version_spans is not UNSET:
            _check_version_spans(event, self.version_spans, len(out) // 4, self.policy_version)
        sampling = self.sampling
        if type(sampling) is dict and LINEAGE_KEY in sampling:  # another type is refused when the body is decoded
            check_lineage(event, sampling[LINEAGE_KEY])

    def _check_prompt(self, event: str) -> None:
        """The write-time checks of the subclass's prompt fields."""
        raise NotImplementedError(f"{type(self).__name__}: a turn body without a prompt encoding is never built")

    @property
    def lineage(self) -> Lineage | UnsetType:
        """The lineage the turn belongs to (``sampling["lineage"]``, see :mod:`.lineage`),
        UNSET on the session's first lineage."""
        return lineage_of(self.sampling)

    @property
    def output_tokens(self) -> np.ndarray:
        """Output token ids as an int32 view."""
        return tokens_view(self.output_ids)

    @property
    def log_probs(self) -> np.ndarray:
        """Output log-probs as a float32 view (empty when not recorded)."""
        return log_probs_view(self.output_log_probs)


#: The fields a turn carries besides its prompt, in stored order, ``turn_index``
#: first: what a conversion between the two encodings copies unchanged.
TURN_BODY_FIELDS: tuple[str, ...] = TurnBody.__struct_fields__


class TurnRecorded(TurnBody, frozen=True, tag="turn_recorded"):
    """One generation with its prompt inline: the messages and token ids the
    model saw, then what it produced and how (:class:`TurnBody`)."""

    messages: list[dict[str, Any]] = []
    prompt_ids: bytes = b""

    def _check_prompt(self, event: str) -> None:
        prompt = self.prompt_ids
        if type(prompt) is not bytes or len(prompt) % 4:  # else it passes packed_field as is
            packed_field(self, "prompt_ids", pack_tokens)

    @property
    def prompt_tokens(self) -> np.ndarray:
        """Prompt token ids as an int32 view."""
        return tokens_view(self.prompt_ids)


class TurnDelta(TurnBody, frozen=True, tag="turn_delta"):
    """One generation, stored as a delta against the session's previous turn.

    The full turn (what a :class:`TurnRecorded` would hold) is: prompt ids =
    the first ``shared_tokens`` tokens of the previous turn's prompt + output
    ids, then ``new_prompt_ids``; messages = the first ``shared_messages`` of
    the previous turn's messages + its response message (when it had one),
    then ``new_messages``. The first turn of a session has an empty previous
    turn. A new tag (not a reinterpreted ``turn_recorded``), so a reader that
    predates it sees an unknown event and stops instead of taking the suffix
    for the whole prompt. :mod:`agentlog.events.schema.turn_delta` encodes and
    expands it."""

    shared_tokens: int = 0
    new_prompt_ids: bytes = b""
    shared_messages: int = 0
    new_messages: list[dict[str, Any]] = []

    def _check_prompt(self, event: str) -> None:
        # The fast paths of TurnBody.__post_init__: what passes goes no further.
        shared = self.shared_tokens
        if type(shared) is not int or shared < 0:
            check_count(event, "shared_tokens", shared)
        shared = self.shared_messages
        if type(shared) is not int or shared < 0:
            check_count(event, "shared_messages", shared)
        prompt = self.new_prompt_ids
        if type(prompt) is not bytes or len(prompt) % 4:  # else it passes packed_field as is
            packed_field(self, "new_prompt_ids", pack_tokens)


def _check_version_spans(event: str, spans: Any, n_out: int, policy_version: int) -> None:
    """The canonical form of a multi-version turn's spans (see the module docstring)."""
    expected = (f"two or more (first output token, version) pairs of ints >= 0, from token 0, both strictly "
                f"increasing, every first token < the turn's {n_out} output tokens")
    if not isinstance(spans, (tuple, list)) or len(spans) < 2:
        fail(event, "version_spans", expected + " (a turn made by one version leaves the field unset)", spans)
    prev_first, prev_version = -1, -1
    for i, span in enumerate(spans):
        if not isinstance(span, (tuple, list)) or len(span) != 2:
            fail(event, f"version_spans[{i}]", "a (first output token, version) pair", span)
        first, version = span
        check_count(event, f"version_spans[{i}][0]", first)
        check_count(event, f"version_spans[{i}][1]", version)
        if (i == 0 and first != 0) or first <= prev_first or first >= n_out or version <= prev_version:
            fail(event, f"version_spans[{i}]", expected, spans)
        prev_first, prev_version = first, version
    if spans[0][1] != policy_version:
        fail(event, "policy_version", f"the first (oldest) span's version {spans[0][1]} (version_spans)", policy_version)


def canonical_version_spans(starts: Any, n_out: int) -> tuple[int, tuple[tuple[int, int], ...] | UnsetType]:
    """``(policy_version, version_spans)`` of a turn of ``n_out`` output tokens
    whose generation ran under each ``(first output token, version)`` of
    ``starts`` in order (an interrupt at token 0 or after the last token, and
    two updates between the same two tokens, leave empty spans: dropped, the
    later version kept). ``version_spans`` is UNSET when one version made
    every token (also when ``n_out`` is 0: the last version stands)."""
    kept: list[tuple[int, int]] = []
    for first, version in starts:
        first = min(int(first), n_out)
        if kept and version < kept[-1][1]:
            raise ValueError(f"version spans: version {version} at token {first} after version {kept[-1][1]} "
                             "(versions only increase within a turn)")
        while kept and kept[-1][0] >= first:
            kept.pop()  # the span it started is empty
        if first < n_out or not kept:
            kept.append((first if kept else 0, int(version)))
    merged: list[tuple[int, int]] = []
    for first, version in kept:
        if not merged or merged[-1][1] != version:
            merged.append((first, version))
    if len(merged) == 1:
        return merged[0][1], UNSET
    return merged[0][1], tuple(merged)


def turn_version_spans(body: Any) -> tuple[tuple[int, int], ...]:
    """The (first output token, version) spans of a turn body: its
    ``version_spans``, or one span from token 0 at its ``policy_version``."""
    spans = getattr(body, "version_spans", UNSET)
    if spans is UNSET:
        return ((0, body.policy_version),)
    return spans


def turn_temperature(sampling: Any) -> float | None:
    """The temperature a turn was sampled at, from its recorded ``sampling``
    dict: 1.0 when absent or listed under ``ignored`` (the backend did not
    apply it); None when it is not a number > 0."""
    if not isinstance(sampling, dict):
        return None
    ignored = sampling.get("ignored") or ()
    # A set is stored as an array: read as stored, whether before or after the log has it.
    value = 1.0 if isinstance(ignored, (list, tuple, set, frozenset)) and "temperature" in ignored else sampling.get("temperature", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < math.inf:
        return None
    return float(value)


def scored_against(body: Any) -> tuple[int, float]:
    """What a teacher's scores of a recorded turn are checked against: its output token count
    and its sampling temperature (:func:`turn_temperature`; NaN when not a number > 0)."""
    # Most turns carry no sampling settings, which means temperature 1.0: no call.
    temperature = turn_temperature(body.sampling) if body.sampling else 1.0
    return len(body.output_ids) // 4, math.nan if temperature is None else temperature


#: The sampling-dict keys that place a turn on a fleet's server (see the module docstring).
SERVER_KEY, SERVER_MOVED_FROM_KEY = "server", "server_moved_from"


def turn_server(body: Any) -> tuple[str, str]:
    """``(server, moved_from)`` of a recorded turn: the fleet server that generated it and the
    previous turn's server when the session moved, each "" when not recorded."""
    sampling = getattr(body, "sampling", None)
    if not isinstance(sampling, dict):
        return "", ""
    return str(sampling.get(SERVER_KEY, "")), str(sampling.get(SERVER_MOVED_FROM_KEY, ""))
