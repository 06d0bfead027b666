"""``agentlog verify-tokens``: prove a log's recorded tokens against an inference engine.

Each recorded turn (``turn_recorded``, or a ``turn_delta`` expanded to the turn it stands
for) is re-fed to a :class:`~agentlog.gateway.scoring.Scorer` and checked three ways:

1. **Retokenization.** Where the turn recorded its messages and the scorer can tokenize a
   conversation (vLLM's ``/tokenize``, or the run's own chat template in process), the
   engine's tokenization of the messages must equal the recorded prompt ids. A difference
   names the first differing token and the message it falls in. Tool definitions are not
   recorded with a turn: a request that declared tools rendered them into its prompt, so
   its turns differ where they begin (the report says so).
2. **Log-probs.** The engine's log-prob of every recorded output token against the recorded
   behaviour log-prob: max and mean absolute difference per turn and overall, and the first
   token past the tolerance.
3. **Reproduction.** A greedy turn (recorded temperature 0, or ``top_k`` 1) must come back
   token for token.

The negative control (``corrupt``) replaces the recorded output token at one position
(counted over the checked turns' output tokens, in order) by a neighbouring id before the
checks: the report must then name that very position as the first mismatch.

Turns are taken in version order, so an in-process scorer loads each version's policy once;
a turn whose version has no checkpoint is skipped, and counted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import msgspec
import numpy as np

from agentlog.events.schema.turn import turn_version_spans
from agentlog.events.schema.turn_delta import common_prefix_tokens, full_turns
from agentlog.events.schema.types import Envelope, TurnRecorded
from agentlog.events.schema.validation import is_number
from agentlog.gateway.scoring import Scorer

from .model_scorer import ModelScorer, TokenCheckError

__all__ = ["CheckedTurn", "TokenReport", "Turn", "collect_turns", "verify_turns"]

#: Default bound on |engine log-prob - recorded log-prob| per token.
DEFAULT_TOLERANCE = 1e-2
#: Requests in flight at once against a server.
SERVER_CONCURRENCY = 16
#: Turns scored per in-process batch.
IN_PROCESS_TURNS_PER_BATCH = 64


@dataclass
class Turn:
    """One recorded turn to check (its full prompt, whatever its encoding in the log)."""

    session_id: str
    turn_index: int
    lsn: int
    version: int
    prompt: np.ndarray  # int32 (read-only views of the record: 4 bytes a token)
    output: np.ndarray  # int32
    log_probs: np.ndarray  # float32
    temperature: float
    greedy: bool
    stop_ids: tuple[int, ...]
    messages: list[dict[str, Any]] = field(default_factory=list)
    #: ((first output position, version), ...): the versions that generated the output (one
    #: entry unless a weight update landed mid-turn, a partial rollout).
    spans: tuple[tuple[int, int], ...] = ()

    def parts(self) -> list[tuple[int, int, int]]:
        """``(lo, hi, version)``: the output positions each version generated."""
        spans = self.spans or ((0, self.version),)
        ends = [first for first, _ in spans[1:]] + [len(self.output)]
        return [(first, end, version) for (first, version), end in zip(spans, ends)]


class CheckedTurn(msgspec.Struct):
    """What the checks found for one turn (``--json`` lists them)."""

    session_id: str
    turn_index: int
    lsn: int
    policy_version: int
    #: Output tokens whose log-probs were compared.
    tokens: int = 0
    #: "" when checked, else why not (no checkpoint for its version, ...).
    skipped: str = ""
    #: Output tokens not compared: no recorded log-probs, or made by a version not checked
    #: (a partial rollout's other part, against a server that holds one version).
    unchecked_tokens: int = 0
    lp_max_abs_diff: float = 0.0
    lp_mean_abs_diff: float = 0.0
    #: Output position of the first token whose log-prob differs past the tolerance (-1: none).
    lp_first_mismatch: int = -1
    #: "ok", "mismatch", or why it was not checked ("no messages", "engine has no tokenize route").
    retokenization: str = ""
    retok_first_diff: int = -1  # prompt position of the first differing token
    retok_message: int = -1  # index of the message that token falls in
    #: "ok", "mismatch" or "" (not a greedy turn).
    reproduction: str = ""
    repro_first_diff: int = -1


class TokenReport(msgspec.Struct):
    """The whole verification: totals, the first mismatch, and every turn."""

    engine: str
    tolerance: float
    turns_checked: int = 0
    turns_skipped: int = 0
    tokens: int = 0
    #: Output tokens of checked turns whose log-probs were not compared (none recorded, another version).
    unchecked_tokens: int = 0
    lp_max_abs_diff: float = 0.0
    lp_mean_abs_diff: float = 0.0
    lp_mismatched_turns: int = 0
    retok_checked: int = 0
    retok_mismatched: int = 0
    greedy_checked: int = 0
    greedy_mismatched: int = 0
    #: The first mismatch in log order: {"session", "turn", "lsn", "check", "position", "global_position"}.
    first_mismatch: dict[str, Any] | None = None
    #: With the negative control: {"position", "session", "turn", "offset", "caught"}.
    corrupt: dict[str, Any] | None = None
    seconds: float = 0.0
    turns: list[CheckedTurn] = []

    @property
    def ok(self) -> bool:
        """No check failed (the negative control: its corruption was caught exactly where made)."""
        if self.corrupt is not None:
            return bool(self.corrupt["caught"])
        return self.first_mismatch is None


def _is_greedy(sampling: dict[str, Any]) -> bool:
    t, k = sampling.get("temperature"), sampling.get("top_k")
    return (isinstance(t, (int, float)) and t == 0) or k == 1


def collect_turns(envelopes: Iterable[Envelope], *, sessions: int | None = None,
                  version: int | None = None) -> list[Turn]:
    """The turns to check, in log order: those of the first ``sessions`` sessions that
    recorded a turn (all with None), at policy ``version`` only when given."""
    chosen: set[str] = set()
    turns: list[Turn] = []
    for env in full_turns(envelopes):
        body = env.body
        if type(body) is not TurnRecorded:
            continue
        sid = env.session_id
        if sid not in chosen:
            if sessions is not None and len(chosen) >= sessions:
                continue
            chosen.add(sid)
        spans = turn_version_spans(body)
        if version is not None and all(v != version for _, v in spans):
            continue
        sampling = body.sampling or {}
        # A greedy turn (temperature 0) is scored at temperature 1: the log-probs engines report for it.
        t = sampling.get("temperature", 1.0)
        temperature = float(t) if isinstance(t, (int, float)) and t > 0 else 1.0
        stops = sampling.get("stop_ids") or ()
        turns.append(Turn(
            session_id=sid, turn_index=body.turn_index, lsn=env.lsn, version=body.policy_version,
            prompt=np.frombuffer(body.prompt_ids, "<i4"), output=body.output_tokens,
            log_probs=body.log_probs, temperature=temperature,
            greedy=_is_greedy(sampling), stop_ids=tuple(int(s) for s in stops), messages=list(body.messages),
            spans=tuple((int(a), int(b)) for a, b in spans),
        ))
    return turns


def _compared(turn: Turn, only_version: int | None) -> list[tuple[int, int]]:
    """The output ranges ``(lo, hi)`` of ``turn`` whose log-probs are compared: none without recorded
    log-probs; with ``only_version``, only the parts that version generated."""
    if not len(turn.log_probs):
        return []
    return [(lo, hi) for lo, hi, v in turn.parts() if only_version is None or v == only_version]


def comparable_offsets(turns: list[Turn], only_version: int | None = None) -> tuple[list[int], int]:
    """Where each turn's first compared output token sits among the output positions whose
    log-probs can be compared (those of turns that recorded log-probs, made by ``only_version``
    when given; what ``--corrupt`` counts), and how many there are."""
    offsets, total = [], 0
    for t in turns:
        offsets.append(total)
        total += sum(hi - lo for lo, hi in _compared(t, only_version))
    return offsets, total


def corruptible_tokens(turns: list[Turn], only_version: int | None = None) -> int:
    """How many output positions ``--corrupt`` can name."""
    return comparable_offsets(turns, only_version)[1]


def corrupt_turns(turns: list[Turn], position: int, only_version: int | None = None) -> dict[str, Any]:
    """The negative control: replace the recorded output token at ``position`` (counted as
    :func:`comparable_offsets` counts) by a neighbouring id; returns where it landed. ValueError
    past the last one."""
    offsets, total = comparable_offsets(turns, only_version)
    if not 0 <= position < total:
        raise ValueError(f"--corrupt {position}: the checked turns hold {total} output tokens (positions 0..{total - 1})")
    for turn, first in zip(turns, offsets):
        k = position - first
        for lo, hi in _compared(turn, only_version):
            if 0 <= k < hi - lo:
                at = lo + k
                old = int(turn.output[at])
                turn.output = turn.output.copy()  # the record's own tokens stay as stored
                turn.output[at] = old - 1 if old > 0 else old + 1
                return {"position": position, "session": turn.session_id, "turn": turn.turn_index, "offset": at,
                        "from": old, "to": int(turn.output[at]), "caught": False}
            k -= hi - lo
    raise AssertionError("unreachable: position < total lies in some turn")


def _global_position(ranges: list[tuple[int, int]], offset: int, pos: int) -> int:
    """Output position ``pos`` of a turn counted as :func:`comparable_offsets` counts (-1 when not compared)."""
    before = 0
    for lo, hi in ranges:
        if lo <= pos < hi:
            return offset + before + pos - lo
        before += hi - lo
    return -1


def _lp_compare(result: CheckedTurn, recorded: np.ndarray, scored: Sequence[float], lo: int, hi: int,
                tolerance: float) -> None:
    """Fold the comparison of output positions ``lo..hi`` into ``result`` (max, running mean,
    first position past the tolerance)."""
    diff = np.abs(np.asarray(scored, np.float64)[lo:hi] - np.asarray(recorded, np.float64)[lo:hi])
    if not diff.size:
        return
    diff[np.isnan(diff)] = np.inf  # a NaN log-prob never matches (nor hides from the max and mean)
    n_before = result.tokens
    result.tokens += diff.size
    result.lp_max_abs_diff = max(result.lp_max_abs_diff, float(diff.max()))
    result.lp_mean_abs_diff = (result.lp_mean_abs_diff * n_before + float(diff.sum())) / result.tokens
    over = np.flatnonzero(~(diff <= tolerance))
    if over.size:
        at = lo + int(over[0])
        result.lp_first_mismatch = at if result.lp_first_mismatch < 0 else min(result.lp_first_mismatch, at)


def _first_diff(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """First position where token ids ``a`` and ``b`` differ (-1 when equal): the prefix check
    the delta encoding owns (:func:`~agentlog.events.schema.turn_delta.common_prefix_tokens`)."""
    x, y = np.asarray(a, "<i4").tobytes(), np.asarray(b, "<i4").tobytes()
    shared = common_prefix_tokens(x, y)
    return -1 if len(x) == len(y) == 4 * shared else shared


async def _message_at(scorer: Scorer, messages: list[dict[str, Any]], full: list[int], position: int) -> int:
    """The index of the message whose rendering holds prompt ``position``: the first message
    whose conversation prefix, rendered alone, agrees with the whole rendering ``full`` past that
    position (the last one when none does). A longer prefix agrees at least as far, so the
    search halves: O(log messages) renderings."""
    lo, hi = 1, len(messages)  # the answer prefix length lies in lo..hi
    while lo < hi:
        mid = (lo + hi) // 2
        ids = await scorer.tokenize_chat(messages[:mid])
        agree = -1 if ids is None else _first_diff(ids, full)
        if ids is not None and (agree < 0 or agree > position):
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


async def _retokenize(scorer: Scorer, turn: Turn, result: CheckedTurn, skip: str) -> None:
    if skip or not turn.messages:
        result.retokenization = skip or "no messages"
        return
    ids = await scorer.tokenize_chat(turn.messages)
    if ids is None:
        result.retokenization = scorer.no_tokenize
        return
    at = _first_diff(ids, turn.prompt)
    if at < 0:
        result.retokenization = "ok"
        return
    result.retokenization = "mismatch"
    result.retok_first_diff = at
    result.retok_message = await _message_at(scorer, turn.messages, ids, at)


async def _reproduce(scorer: Scorer, turn: Turn, result: CheckedTurn) -> None:
    if isinstance(scorer, ModelScorer):
        tokens = scorer.argmax_batch([(turn.prompt, turn.output)])[0]
    else:
        tokens = await scorer.greedy(turn.prompt, len(turn.output), turn.stop_ids)
    at = _first_diff(tokens, turn.output)
    result.reproduction = "ok" if at < 0 else "mismatch"
    result.repro_first_diff = at


@dataclass
class _Part:
    """The output positions ``lo..hi`` of turn ``index`` that ``version`` generated; the turn's
    retokenization and greedy reproduction run with its first part."""

    index: int
    version: int
    lo: int
    hi: int
    first: bool


async def _check_parts(scorer: Scorer, turns: list[Turn], parts: list[_Part], results: list[CheckedTurn],
                       tolerance: float, skip_retok: str) -> None:
    """The checks of the parts one scorer (one version) answers, folded into ``results``."""
    if isinstance(scorer, ModelScorer):
        for p in parts:
            turn = turns[p.index]
            why = scorer.out_of_vocabulary(turn.prompt, turn.output)
            if why:
                raise TokenCheckError(f"session {turn.session_id!r} turn {turn.turn_index} (lsn {turn.lsn}): {why}")
    scoreable = [p for p in parts if len(turns[p.index].log_probs)]
    # By length: an in-process batch then pads little.
    scoreable.sort(key=lambda p: len(turns[p.index].prompt) + len(turns[p.index].output))
    items = [(turns[p.index].prompt, turns[p.index].output, turns[p.index].temperature) for p in scoreable]
    if isinstance(scorer, ModelScorer):
        scored: list[list[float]] = []
        for lo in range(0, len(items), IN_PROCESS_TURNS_PER_BATCH):
            scored += await asyncio.to_thread(scorer.score_batch, items[lo : lo + IN_PROCESS_TURNS_PER_BATCH])
    else:
        gate = asyncio.Semaphore(SERVER_CONCURRENCY)

        async def one(item: tuple[Any, Any, float]) -> list[float]:
            async with gate:
                return await scorer.score(*item)

        scored = list(await asyncio.gather(*(one(item) for item in items)))
    for part, got in zip(scoreable, scored):
        _lp_compare(results[part.index], turns[part.index].log_probs, got, part.lo, part.hi, tolerance)
    for part in parts:
        turn, result = turns[part.index], results[part.index]
        if not len(turn.log_probs):
            result.unchecked_tokens += part.hi - part.lo
        if part.first:
            await _retokenize(scorer, turn, result, skip_retok)
            if turn.greedy and len(turn.output) and len(turn.parts()) == 1:
                await _reproduce(scorer, turn, result)


def _first_mismatch(turn: CheckedTurn, offset: int, ranges: list[tuple[int, int]]) -> dict[str, Any] | None:
    """The turn's earliest failed check (``offset``: its first compared output token's global
    position; ``ranges``: its compared output ranges)."""
    where = {"session": turn.session_id, "turn": turn.turn_index, "lsn": turn.lsn}
    if turn.retokenization == "mismatch":
        return {**where, "check": "retokenization", "position": turn.retok_first_diff, "message": turn.retok_message,
                "global_position": -1}
    found = [p for p in (turn.lp_first_mismatch, turn.repro_first_diff) if p >= 0]
    if not found:
        return None
    pos = min(found)
    check = "log_prob" if pos == turn.lp_first_mismatch else "reproduction"
    return {**where, "check": check, "position": pos, "global_position": _global_position(ranges, offset, pos)}


async def verify_turns(turns: list[Turn], scorer_at: Callable[[int], Scorer | None], *, engine: str,
                       tolerance: float = DEFAULT_TOLERANCE, corrupt: int | None = None, skip_retokenization: str = "",
                       only_version: int | None = None, progress: Callable[[int], None] | None = None) -> TokenReport:
    """Check ``turns`` (from :func:`collect_turns`) against ``scorer_at(version)``, the scorer of
    each recorded version (None: that version cannot be checked). Each version's part of a turn
    (a partial rollout has several) is scored by its own version's scorer; ``only_version``: only
    that version's parts are compared (an engine that holds one version). With ``corrupt``, run
    the negative control at that output position (ValueError past the last one);
    ``skip_retokenization``: why not to retokenize (a token-level task's messages are for display).
    ``progress(n)`` is told of each n parts done."""
    if not is_number(tolerance, at_least=0):
        raise ValueError(f"verify_turns: tolerance must be a finite number >= 0, found {tolerance!r}")
    t0 = time.perf_counter()
    report = TokenReport(engine=engine, tolerance=tolerance)
    if corrupt is not None:
        report.corrupt = corrupt_turns(turns, corrupt, only_version)
    offsets, _ = comparable_offsets(turns, only_version)
    results = [CheckedTurn(t.session_id, t.turn_index, t.lsn, t.version) for t in turns]
    parts: list[_Part] = []
    for i, t in enumerate(turns):
        checked = [(lo, hi, v) for lo, hi, v in t.parts() if only_version is None or v == only_version]
        results[i].unchecked_tokens = len(t.output) - sum(hi - lo for lo, hi, _ in checked)
        parts += [_Part(i, v, lo, hi, k == 0) for k, (lo, hi, v) in enumerate(checked)]
    parts.sort(key=lambda p: (p.version, p.index))
    lo = 0
    while lo < len(parts):
        version = parts[lo].version
        hi = lo
        while hi < len(parts) and parts[hi].version == version:
            hi += 1
        group = parts[lo:hi]
        scorer = scorer_at(version)
        if scorer is None:
            for part in group:
                results[part.index].unchecked_tokens += part.hi - part.lo
                results[part.index].skipped = f"no policy for version {version}"
        else:
            await _check_parts(scorer, turns, group, results, tolerance, skip_retokenization)
        if progress is not None:
            progress(len(group))
        lo = hi
    for result in results:
        if result.tokens or result.retokenization or result.reproduction:
            result.skipped = ""  # some part was checked
    report.turns = results
    _summarise(report, offsets, [_compared(t, only_version) for t in turns])
    report.seconds = time.perf_counter() - t0
    return report


def _summarise(report: TokenReport, offsets: list[int], ranges: list[list[tuple[int, int]]]) -> None:
    diffs_sum = 0.0
    for turn, offset, compared in zip(report.turns, offsets, ranges):
        if turn.skipped:
            report.turns_skipped += 1
            continue
        report.turns_checked += 1
        report.tokens += turn.tokens
        report.unchecked_tokens += turn.unchecked_tokens
        report.lp_max_abs_diff = max(report.lp_max_abs_diff, turn.lp_max_abs_diff)
        diffs_sum += turn.lp_mean_abs_diff * turn.tokens
        report.lp_mismatched_turns += turn.lp_first_mismatch >= 0
        if turn.retokenization in ("ok", "mismatch"):
            report.retok_checked += 1
            report.retok_mismatched += turn.retokenization == "mismatch"
        if turn.reproduction:
            report.greedy_checked += 1
            report.greedy_mismatched += turn.reproduction == "mismatch"
        if report.first_mismatch is None:
            report.first_mismatch = _first_mismatch(turn, offset, compared)
    report.lp_mean_abs_diff = diffs_sum / report.tokens if report.tokens else 0.0
    if report.corrupt is not None:
        first = report.first_mismatch
        report.corrupt["caught"] = first is not None and first["global_position"] == report.corrupt["position"]
