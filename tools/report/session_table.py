"""The report's bounded sessions table: :class:`SessionTable` keeps the
``worst`` finished sessions by reward, the first ``per_reason`` aborted
sessions of each reason and a seeded reservoir sample of the rest, as
:class:`SessionRow` rows; only those rows keep their samples, cut by
:func:`drill_sample` to what the drill-down shows (:class:`DrillSample`).
:func:`agentlog.tools.report.data.collect` fills it as sessions end.
"""

from __future__ import annotations

import heapq
import random
from typing import Any

import msgspec

#: Distinct abort / drop reasons counted by name; the rest go to "(other)".
MAX_REASONS = 40
#: Response tokens kept per drill-down row (and prompt tokens at each end).
DRILL_RESPONSE_TOKENS = 4000
DRILL_PROMPT_HEAD = 32
DRILL_PROMPT_TAIL = 16


class DrillSample(msgspec.Struct):
    """One sample, cut to what the drill-down shows."""

    row_index: int
    status: str
    remove_sample: bool
    reward: float
    response_length: int
    trained: int
    prompt_length: int
    prompt_head: list[int]
    prompt_tail: list[int]
    response: list[int]
    mask: list[int]
    #: Per shown response token: the rollout log-prob, and the teacher's (None where no teacher scored it).
    rollout_lp: list[float] = []
    teacher_lp: list[float | None] = []
    #: The lineage (conversation of a session with subagents) it is a row of; "" for a session without.
    lineage: str = ""


def drill_sample(s: Any) -> DrillSample:
    """Cut a :class:`reducers.samples.Sample` to a :class:`DrillSample`."""
    toks = s.token_ids
    n_prompt = s.prompt_length
    mask = s.mask
    prompt = toks[:n_prompt]
    if n_prompt > DRILL_PROMPT_HEAD + DRILL_PROMPT_TAIL * 3:
        head, tail = prompt[:DRILL_PROMPT_HEAD].tolist(), prompt[-DRILL_PROMPT_TAIL:].tolist()
    else:
        head, tail = prompt.tolist(), []
    return DrillSample(
        row_index=s.row_index, status=s.status, remove_sample=s.remove_sample, reward=float(s.reward),
        response_length=s.response_length, trained=int(mask.sum()), prompt_length=n_prompt,
        prompt_head=head, prompt_tail=tail,
        response=toks[n_prompt : n_prompt + DRILL_RESPONSE_TOKENS].tolist(), mask=mask[:DRILL_RESPONSE_TOKENS].tolist(),
        rollout_lp=[round(float(x), 4) for x in s.log_probs[:DRILL_RESPONSE_TOKENS]],
        teacher_lp=([round(float(x), 4) if ok else None for x, ok in zip(s.teacher_lp[:DRILL_RESPONSE_TOKENS], s.teacher_mask)]
                    if s.teacher_scored else []),
        lineage=s.metadata.get("lineage", ""),
    )


class SessionRow(msgspec.Struct):
    """One row of the sessions table."""

    session_id: str
    group_id: str
    sample_index: int
    status: str  # finished / aborted / dropped / open / running
    why: str  # worst / aborted / sample / in flight
    reason: str = ""
    error: str = ""
    opened_ns: int = 0
    ended_ns: int | None = None
    turns: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    reward: Any = None
    policy_version: int = 0
    samples: list[DrillSample] = []
    #: Its partition (``p0003``) in a partitioned log, else "".
    partition: str = ""
    #: Why it scored so, as ``agentlog show`` says it (:class:`tools.cmd_show.SessionWhy`): label, reward
    #: and its source, verifier detail, the test command's output, traceback.
    explain: list[str] = []
    #: Its health flags (:mod:`reducers.health`), sorted.
    flags: list[str] = []
    #: How often it was resumed (a new incarnation from its last durable turn; still one session).
    resumes: int = 0
    #: Its lineages when its agent spawned subagents (:meth:`tools.lineage_view.SessionLineages.to_json`), else [].
    lineages: list[dict] = []


class SessionTable:
    """The bounded sessions table, filled as sessions end.

    ``worst``: the finished sessions with the lowest reward (a max-heap of
    size ``worst``; a later session replaces a kept one only when strictly
    lower, so ties keep the first). ``per_reason``: the first aborted
    sessions of each abort reason (for at most MAX_REASONS reasons).
    ``sample``: a reservoir sample (Algorithm R, seeded) over every other
    ended session, so each is equally likely to be shown."""

    def __init__(self, *, worst: int = 20, per_reason: int = 3, sample: int = 30, seed: int = 0) -> None:
        self.worst_n, self.per_reason_n, self.sample_n = worst, per_reason, sample
        self._worst: list[tuple[float, int, SessionRow]] = []  # (-reward, -order, row)
        self._aborted: dict[str, list[SessionRow]] = {}
        self._sample: list[SessionRow] = []
        self._seen_for_sample = 0
        self._rng = random.Random(seed)
        #: The reservoir's draw for the next session offered to it: made by wants() or _offer_sample(), used once.
        self._peek: int | None = None
        self._order = 0

    def wants(self, status: str, reward: float | None, reason: str) -> bool:
        """Whether a session ending like this could enter the table now (so
        the caller cuts its samples only when they may be shown)."""
        if status == "finished" and reward is not None and self.worst_n:
            if len(self._worst) < self.worst_n or reward < -self._worst[0][0]:
                return True
        if status == "aborted" and self.per_reason_n:
            kept = self._aborted.get(reason)
            if kept is None and len(self._aborted) < MAX_REASONS or kept is not None and len(kept) < self.per_reason_n:
                return True
        return self.sample_n > 0 and (
            self._seen_for_sample < self.sample_n or self._rng_peek() < self.sample_n
        )

    def _rng_peek(self) -> int:
        if self._peek is None:
            self._peek = self._rng.randrange(self._seen_for_sample + 1)
        return self._peek

    def add(self, row: SessionRow, reward: float | None) -> None:
        """Offer an ended session to the table."""
        self._order += 1
        if row.status == "finished" and reward is not None and self.worst_n:
            item = (-reward, -self._order, row)
            if len(self._worst) < self.worst_n:
                heapq.heappush(self._worst, item)
                row.why = "worst"
                return
            if reward < -self._worst[0][0]:
                out = heapq.heapreplace(self._worst, item)[2]
                row.why = "worst"
                self._offer_sample(out)
                return
        if row.status == "aborted" and self.per_reason_n:
            kept = self._aborted.get(row.reason)
            if kept is None and len(self._aborted) < MAX_REASONS:
                kept = self._aborted[row.reason] = []
            if kept is not None and len(kept) < self.per_reason_n:
                row.why = "aborted"
                kept.append(row)
                return
        self._offer_sample(row)

    def _offer_sample(self, row: SessionRow) -> None:
        if not self.sample_n:
            return
        row.why = "sample"
        if self._seen_for_sample < self.sample_n:
            self._sample.append(row)
        else:
            j = self._rng_peek()
            if j < self.sample_n:
                self._sample[j] = row
        self._peek = None
        self._seen_for_sample += 1

    def rows(self) -> list[SessionRow]:
        """The table: worst first (lowest reward), then aborted by reason, then the sample."""
        worst = [r for _, _, r in sorted(self._worst, key=lambda t: (-t[0], -t[1]))]
        aborted = [r for reason in sorted(self._aborted) for r in self._aborted[reason]]
        sample = sorted(self._sample, key=lambda r: (r.opened_ns, r.session_id))
        return worst + aborted + sample
