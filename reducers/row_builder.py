"""One training row built from a chain of turns: the tokens, loss mask and
log-probs of a linear trajectory (see :mod:`.trajectory` for which chains
become rows, and the drift kinds CLEAN, REALIGN and FORK)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from agentlog.events.schema.lineage import ROOT_LINEAGE
from agentlog.events.schema.turn import turn_version_spans
from agentlog.events.schema.turn_delta import common_prefix_tokens
from agentlog.events.schema.types import TurnDelta, TurnRecorded

if TYPE_CHECKING:
    from .trajectory import _Turn

CLEAN = "clean"
REALIGN = "realign"
FORK = "fork"


class Row(msgspec.Struct, frozen=True):
    """One linearised training row, before it becomes a Sample."""

    tokens: bytes  # int32 LE: prompt + response
    response_length: int
    loss_mask: bytes  # uint8 per response token
    rollout_log_probs: bytes  # float32 LE per response token
    turn_indices: tuple[int, ...]
    leaf: int
    truncated: bool  # the leaf's last generated turn finished with "length"
    use_tool: bool
    ill_formed: bool
    policy_version: int  # oldest policy version among the row's trained turns
    cut: bool = False  # shortened to max_context_tokens
    trained_turns: tuple[int, ...] = ()  # turns with mask-1 tokens in this row
    #: Where each trained turn's tokens sit: (response offset, tokens, turn
    #: index, offset in that turn's output), in row order (teacher scores
    #: are aligned through these).
    trained_spans: tuple[tuple[int, int, int, int], ...] = ()
    #: The policy version of each of ``trained_spans``.
    span_versions: tuple[int, ...] = ()
    #: A turn of the row was made by more than one version (a partial rollout).
    partial: bool = False
    #: The lineage (conversation thread of the session) the row is a trajectory of.
    lineage: str = ROOT_LINEAGE


_zeros = bytes(1 << 16)


def _zero_view(nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` zero bytes, without allocating them each time."""
    global _zeros
    if nbytes > len(_zeros):
        # A cache of constant zeros, grown on demand: no state that affects outputs.
        _zeros = bytes(max(nbytes, 2 * len(_zeros)))
    return memoryview(_zeros)[:nbytes]


class RowBuilder:
    """Accumulates one chain of turns into one row's tokens, mask and log-probs.

    After every append the held tokens are exactly the last turn's prompt
    followed by its output: CLEAN appends the prompt's tail to tokens the
    prompt starts with, and REALIGN overwrites from the last response on
    with the prompt, which agrees with the held tokens before that point.
    So the builder keeps them in one buffer, extended in place by a CLEAN
    turn (a delta that repeats all of them costs only its new tokens), and
    mask and log-probs as spans, ``(n_tokens, log_probs or None, policy version,
    turn index, offset in the turn's output)``, one per version of a turn,
    materialised once per emitted row."""

    __slots__ = ("fork_threshold", "held", "spans", "spanned", "last_start", "last_turn", "lead", "turns")

    def __init__(self, fork_threshold: int) -> None:
        self.fork_threshold = fork_threshold
        self.held = bytearray()  # the last turn's prompt + output
        self.spans: list[tuple[int, bytes | memoryview | None, int, int, int]] = []
        self.spanned = 0  # tokens covered by spans (== held tokens)
        self.last_start: int | None = None  # token index where the last response starts
        self.last_turn: _Turn | None = None
        self.lead = 0  # the first turn's prompt length: the row's prompt
        self.turns: list[int] = []

    def prompt_of(self, turn: _Turn, cache: dict[int, bytes]) -> bytes | None:
        """The turn's full prompt, or None when it is a delta on the row's
        last turn that repeats all the held tokens (CLEAN: only its new
        tokens are needed)."""
        body = turn.body
        if type(body) is TurnDelta and turn.base is not None and turn.base is self.last_turn:
            shared = body.shared_tokens * 4
            if shared == len(self.held):
                return None
            if shared < len(self.held):
                return bytes(self.held[:shared]) + body.new_prompt_ids
        return turn.prompt(cache)

    def classify(self, turn: _Turn, prompt: bytes | None) -> str:
        if prompt is None or prompt.startswith(self.held):
            return CLEAN
        agree = common_prefix_tokens(self.held, prompt)
        if self.last_start is not None and agree >= self.last_start and len(turn.body.output_ids) // 4 < self.fork_threshold:
            return REALIGN
        return FORK

    def _span(self, n: int, log_probs: bytes | memoryview | None, version: int = 0, turn: int = -1, offset: int = 0) -> None:
        if n:
            self.spans.append((n, log_probs, version, turn, offset))
            self.spanned += n

    def _output_spans(self, body: TurnRecorded | TurnDelta, train: bool, turn: int) -> None:
        """The turn's output as spans, one per policy version that generated it."""
        n_out = len(body.output_ids) // 4
        lp = body.output_log_probs if train else None
        version_spans = turn_version_spans(body)
        if len(version_spans) == 1:
            self._span(n_out, lp, body.policy_version, turn)
            return
        view = memoryview(lp) if lp is not None else None
        ends = [first for first, _ in version_spans[1:]] + [n_out]
        for (first, version), end in zip(version_spans, ends):
            self._span(end - first, view[first * 4 : end * 4] if view is not None else None, version, turn, first)

    def append(self, turn: _Turn, prompt: bytes | None, kind: str, train: bool) -> None:
        """Add a turn; ``prompt`` None: a delta that repeats all the held tokens (see prompt_of)."""
        body = turn.body
        if prompt is None:
            assert type(body) is TurnDelta  # prompt_of gives None for a delta only
            new = body.new_prompt_ids
            n_prompt = len(self.held) // 4 + len(new) // 4
        else:
            n_prompt = len(prompt) // 4
        if kind == REALIGN:
            # The drifted span carries no signal: overwrite it from the prompt
            # as context (mask 0, log-prob 0); earlier turns stay untouched.
            # last_start is always a span boundary (a response starts there).
            start = self.last_start
            assert start is not None
            while self.spanned > start:
                n = self.spans.pop()[0]
                self.spanned -= n
        self._span(n_prompt - self.spanned, None)
        if self.last_start is None:
            self.lead = n_prompt
        if prompt is None:
            self.held += new
        elif kind == CLEAN:
            self.held += memoryview(prompt)[len(self.held) :]  # the prompt starts with the held tokens
        else:
            self.held = bytearray(prompt)
        self.held += body.output_ids
        self.last_start = n_prompt
        self.last_turn = turn
        self._output_spans(body, train, turn.index)
        self.turns.append(turn.index)

    def to_row(self, leaf: int, truncated: bool, use_tool: bool, ill_formed: bool, max_tokens: int, lineage: str = ROOT_LINEAGE) -> Row | None:
        """The row, or None when it holds no trainable token (after any cut)."""
        n_tok = self.spanned
        cut = bool(max_tokens) and n_tok > max_tokens
        if cut:
            n_tok = max_tokens
        lead = self.lead
        response_length = n_tok - lead
        if response_length < 1:
            return None
        mask_parts: list[bytes | memoryview] = []
        lp_parts: list[bytes | memoryview] = []
        versions: list[int] = []
        trained: list[int] = []
        spans: list[tuple[int, int, int, int]] = []
        pos = 0
        for n, log_probs, version, turn, offset in self.spans:
            lo, hi = max(pos, lead), min(pos + n, n_tok)
            pos += n
            if lo >= hi:
                if pos >= n_tok:
                    break
                continue
            k = hi - lo
            if log_probs is None:
                mask_parts.append(_zero_view(k))
                lp_parts.append(_zero_view(4 * k))
            else:
                mask_parts.append(b"\x01" * k)
                lp_parts.append(log_probs[(lo - pos + n) * 4 : (hi - pos + n) * 4])
                spans.append((lo - lead, k, turn, offset + lo - pos + n))
                versions.append(version)
                if turn not in trained:
                    trained.append(turn)
        if not versions:
            return None  # nothing trainable survives (or ever was)
        return Row(
            tokens=bytes(self.held[: n_tok * 4]) if cut else bytes(self.held),
            response_length=response_length,
            loss_mask=b"".join(mask_parts),
            rollout_log_probs=b"".join(lp_parts),
            turn_indices=tuple(self.turns),
            leaf=leaf,
            truncated=truncated,
            use_tool=use_tool,
            ill_formed=ill_formed,
            policy_version=min(versions),
            cut=cut,
            trained_turns=tuple(trained),
            trained_spans=tuple(spans),
            span_versions=tuple(versions),
            partial=any(offset and turn in trained for _, _, _, turn, offset in self.spans),
            lineage=lineage,
        )
