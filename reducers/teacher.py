"""Teacher scores of a session's turns, aligned to its training rows (on-policy distillation).

A ``teacher_scored`` event holds one teacher's log-probs of a span of one
turn's output tokens (and optionally its top-K tokens there). A session
collects them per turn (:class:`TeacherScores`); when a row is built, each of
its trained spans (:attr:`Row.trained_spans`) takes the scores of the turn
it came from, so a sample's teacher log-probs line up with its response
tokens exactly as its rollout log-probs do. Tokens that carry no loss have
none. Several teachers: the mean of their log-probs per token; top-K only
when exactly one teacher sent it, with one K, for every token of the row it
scored: a row where it sent top-K for some of them only (another span, another
turn) or with different K gets none, and says why in
``metadata["teacher_top_k_dropped"]`` (never a top-K of token 0 where none was sent).

A teacher that failed on a turn (``error``), or scored it at a temperature
other than the one the turn was sampled at, leaves that turn unscored and
says why in the sample's ``metadata["teacher_error"]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentlog.events.errors import AgentlogError
from agentlog.events.schema.types import TeacherScored, log_probs_view, turn_temperature


class TeacherScoreError(AgentlogError, ValueError):
    """A ``teacher_scored`` event that cannot belong to its session (unknown
    turn, tokens past the turn's output, the same tokens scored twice)."""


class _TurnScores:
    __slots__ = ("n_out", "by_teacher", "errors")

    def __init__(self, n_out: int) -> None:
        self.n_out = n_out
        # teacher id -> (log-probs, NaN where unscored; top ids (n_out, k) or None; top log-probs or None;
        # which tokens came with top-K, or None)
        self.by_teacher: dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]] = {}
        self.errors: list[str] = []


class TeacherScores:
    """The teacher scores one session received, by turn."""

    __slots__ = ("session_id", "_turns")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._turns: dict[int, _TurnScores] = {}

    def __bool__(self) -> bool:
        return bool(self._turns)

    def record(self, body: TeacherScored, lsn: int, n_out: int | None, sampling: Any) -> None:
        """Add one event; ``n_out`` / ``sampling``: the scored turn's output
        length and recorded sampling dict (``n_out`` None: no such turn)."""
        where = f"session {self.session_id!r}, lsn {lsn}: teacher_scored of turn {body.turn_index} by {body.teacher}@{body.teacher_version}"
        if n_out is None:
            raise TeacherScoreError(f"{where}: the session recorded no such turn")
        turn = self._turns.setdefault(body.turn_index, _TurnScores(n_out))
        teacher = f"{body.teacher}@{body.teacher_version}"
        if body.error:
            turn.errors.append(f"{teacher}: {body.error}")
            return
        sampled_at = turn_temperature(sampling)
        if sampled_at is None or body.temperature != sampled_at:
            turn.errors.append(f"{teacher}: scored at temperature {body.temperature}, the turn was sampled at {sampled_at}")
            return
        scores = log_probs_view(body.log_probs)
        end = body.start + len(scores)
        if end > n_out:
            raise TeacherScoreError(f"{where}: tokens {body.start}..{end - 1} run past the turn's {n_out} output tokens")
        lp, ids, tlp, has_top = turn.by_teacher.get(teacher, (None, None, None, None))
        if lp is None:
            lp = np.full(n_out, np.nan, dtype=np.float32)
        elif not np.isnan(lp[body.start:end]).all():
            raise TeacherScoreError(f"{where}: tokens {body.start}..{end - 1} were already scored by this teacher")
        lp[body.start:end] = scores
        top = body.top()
        if top is not None:
            k = body.top_k
            if ids is None:
                ids = np.zeros((n_out, k), dtype=np.int32)
                tlp = np.zeros((n_out, k), dtype=np.float32)
                has_top = np.zeros(n_out, dtype=bool)
            if ids.shape[1] != k:
                raise TeacherScoreError(f"{where}: top_k {k}, but earlier scores of this turn sent {ids.shape[1]}")
            ids[body.start:end] = top[0]
            tlp[body.start:end] = top[1]
            has_top[body.start:end] = True
        turn.by_teacher[teacher] = (lp, ids, tlp, has_top)

    def row_fields(self, row: Any) -> dict[str, Any]:
        """The Sample fields (and ``metadata``) of ``row``'s teacher scores;
        empty when no teacher scored or failed on any of its trained turns."""
        trained = {turn for _, _, turn, _ in row.trained_spans}
        turns = {t: self._turns[t] for t in trained if t in self._turns}
        if not turns:
            return {}
        metadata: dict[str, Any] = {}
        errors = [e for t in sorted(turns) for e in turns[t].errors]
        if errors:
            metadata["teacher_error"] = "; ".join(errors)
        teachers = sorted({name for ts in turns.values() for name in ts.by_teacher})
        if teachers:
            metadata["teachers"] = teachers
        if not teachers:
            return {"metadata": metadata}
        n = row.response_length
        total = np.zeros(n, dtype=np.float64)
        count = np.zeros(n, dtype=np.int32)
        widths = sorted({ids.shape[1] for ts in turns.values() for _, ids, _, _ in ts.by_teacher.values() if ids is not None})
        top_k = widths[0] if len(teachers) == 1 and widths else 0
        if len(widths) > 1 and len(teachers) == 1:
            metadata["teacher_top_k_dropped"] = f"{teachers[0]} sent top_k {' and '.join(map(str, widths))} on different turns"
            top_k = 0
        top_ids = np.zeros((n, top_k), dtype=np.int32)
        top_lp = np.zeros((n, top_k), dtype=np.float32)
        with_top = np.zeros(n, dtype=bool)
        for r_off, k, turn, o_off in row.trained_spans:
            ts = turns.get(turn)
            if ts is None:
                continue
            for lp, ids, tlp, has_top in ts.by_teacher.values():
                part = lp[o_off:o_off + k].astype(np.float64)
                ok = ~np.isnan(part)
                total[r_off:r_off + k][ok] += part[ok]
                count[r_off:r_off + k][ok] += 1
                if top_k and ids is not None:
                    top_ids[r_off:r_off + k][ok] = ids[o_off:o_off + k][ok]
                    top_lp[r_off:r_off + k][ok] = tlp[o_off:o_off + k][ok]
                    with_top[r_off:r_off + k] |= ok & has_top[o_off:o_off + k]
        scored = count > 0
        if top_k and not with_top[scored].all():
            metadata["teacher_top_k_dropped"] = (f"{teachers[0]} sent top-K for {int(with_top[scored].sum())} of the "
                                                 f"{int(scored.sum())} tokens it scored in this row")
            top_k = 0
        mean = np.zeros(n, dtype=np.float32)
        mean[scored] = (total[scored] / count[scored]).astype(np.float32)
        fields: dict[str, Any] = {
            "teacher_log_probs": mean.astype("<f4").tobytes(),
            "teacher_scored": scored.astype(np.uint8).tobytes(),
            "metadata": metadata,
        }
        if top_k:
            fields.update(teacher_top_k=top_k, teacher_top_ids=top_ids.astype("<i4").tobytes(),
                          teacher_top_log_probs=top_lp.astype("<f4").tobytes())
        return fields
