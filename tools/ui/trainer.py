"""The trainer's per-token log-probs for the ``agentlog ui`` token view, scored on demand.

The learner records no per-token log-prob, so the trainer ribbon is computed when asked
(``GET /api/session/{id}/trainer``): each recorded turn of the session is scored by the
run's own policy at the version that generated it, loaded from the run folder's
checkpoints and run through the learner's numeric path
(:class:`loop.model_scorer.ModelScorer`, as ``agentlog verify-tokens`` scores turns). A
partial rollout's turn (a weight update landed mid-turn: several version spans,
:func:`events.schema.turn.turn_version_spans`) is scored once per version, and each output
token takes the log-prob of the version that generated it. Each turn is scored at its
recorded temperature (:func:`events.schema.turn.turn_temperature`: a backend's ignored
temperature counts as 1.0; a greedy turn is scored at 1.0, the log-probs engines report
for it).

The per-turn log-probs are placed in each training row exactly where the rollout
log-probs are (:func:`.views.row_output_spans`): null on a token no turn of the row
generated, and on a token whose version has no checkpoint (pruned by ``keep_checkpoints``,
or never written); the answer says which versions and why.

The JSON (one object per session)::

    {"session_id", "engine", "cached", "seconds", "problem" (the reducers' refusal or null),
     "rows": [{"row", "trainer_logprob": [float | null per token]}],
     "turns": [{"turn", "temperature", "parts": [{"from", "to", "version", "scored", "why"}]}],
     "missing": [{"version", "turns", "tokens", "why"}],
     "scored_tokens" (output tokens given a log-prob), "forward_tokens" (tokens run through a policy)}

Bounded: a session needing more than :data:`MAX_TURNS` turns or :data:`MAX_FORWARD_TOKENS`
tokens through a policy is refused (:class:`TooMuchToScore`, a 413), sized on the stored
turns before any is expanded or any model loads. Scoring is serialised (one lock) and runs in
the caller's thread: the server calls it in a thread of its own, off its event loop and off
the worker threads its other routes and its log follower use. Results are kept per session (the last
:data:`MAX_CACHED_SESSIONS`), keyed by the session's last record, so a live session that
grew is scored again; the policies of the last :data:`MAX_LOADED_VERSIONS` versions stay loaded.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentlog._logging import get_logger
from agentlog.events.errors import AgentlogError

log = get_logger("agentlog.tools.ui.trainer")

#: Turns one request may score.
MAX_TURNS = 256
#: Tokens (prompt + output, once per version part) one request may run through a policy.
MAX_FORWARD_TOKENS = 200_000
#: Sessions whose scores are kept.
MAX_CACHED_SESSIONS = 64
#: Policy versions kept loaded between requests.
MAX_LOADED_VERSIONS = 2
#: Turns per forward batch (the scorer pads within a batch; turns are sorted by length).
TURNS_PER_BATCH = 64
ENGINE = "in-process (the run's checkpoints)"


class ScoringUnavailable(AgentlogError):
    """The source cannot be scored: no run folder, or no checkpoints in it (the message says which)."""


class TooMuchToScore(AgentlogError):
    """A session past the per-request bounds (the message names its size and the bounds)."""


#: What torch and the models raise for an input they cannot take (a position past the context, say).
_MODEL_REFUSALS = (ValueError, RuntimeError, IndexError)


class TurnNotScorable(AgentlogError):
    """The policy of a version cannot score a turn alone (one longer than the model's context,
    say): the message names the turns, the version and the model's error."""


@dataclass
class _Turn:
    """One recorded turn to score: its full prompt and output, and who generated which output tokens."""

    index: int
    prompt: np.ndarray  # int32
    output: np.ndarray  # int32
    temperature: float
    parts: list[tuple[int, int, int]]  # (first output position, end, version)
    log_probs: list[float | None] = field(default_factory=list)  # per output token, filled by scoring


class TrainerScores:
    """Trainer log-probs of the sessions of one source (``run_dir``: its run folder or None;
    ``reduce_config``: what its rows are reduced with)."""

    def __init__(self, run_dir: Any, reduce_config: Any, *, max_turns: int = MAX_TURNS,
                 max_forward_tokens: int = MAX_FORWARD_TOKENS) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.reduce_config = reduce_config
        self.max_turns, self.max_forward_tokens = max_turns, max_forward_tokens
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, tuple[tuple, dict]] = collections.OrderedDict()
        self._models: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._loop_config: Any = None

    @property
    def checkpoints(self) -> Path | None:
        """The run folder's checkpoints folder (None without a run folder)."""
        from agentlog.loop.run_folder import RUN_CHECKPOINTS

        return None if self.run_dir is None else self.run_dir / RUN_CHECKPOINTS

    def unavailable(self) -> str | None:
        """Why this source's sessions cannot be scored, or None when they can (cheap: a config
        file and a folder listing; checkpoints that appear later make it available)."""
        from agentlog.loop.run_folder import Run

        if self.run_dir is None:
            return ("scoring the trainer's log-probs needs a run folder with checkpoints (config.json and"
                    " checkpoints/policy-vNNNNN.pt): this source is a bare log; open its run folder with agentlog ui RUN")
        if not Run.has_config(self.run_dir):
            return (f"scoring the trainer's log-probs needs the run's config: {Run.config_file(self.run_dir)} is missing")
        ckpts = self.checkpoints
        assert ckpts is not None
        if not ckpts.is_dir() or not any(ckpts.glob("policy-v*")):
            return (f"scoring the trainer's log-probs needs the run's policy checkpoints: {ckpts} holds none"
                    " (policy-vNNNNN.pt)")
        return None

    # ------------------------------------------------------------------ one session

    def session(self, session_id: str, envs: list) -> dict[str, Any]:
        """The trainer log-probs of one session (its envelopes ``envs``; see the module docstring).
        Raises ScoringUnavailable, TooMuchToScore (both before any model loads), or a
        ``loop.config.ConfigError`` naming a run config that does not load."""
        why = self.unavailable()
        if why is not None:
            raise ScoringUnavailable(why)
        key = (len(envs), envs[-1].lsn if envs else -1)
        # Sized on the stored turns, before any is expanded: a long session's full prompts add up to
        # far more memory than its turn deltas do, and the bounds are there to keep that off the server.
        self._check_bounds(session_id, envs)
        with self._lock:
            hit = self._cache.get(session_id)
            if hit is not None and hit[0] == key:
                self._cache.move_to_end(session_id)
                return {**hit[1], "cached": True}
            turns = session_turns(envs)
            t0 = time.perf_counter()
            missing = self._score(turns)
            out = self._rows(session_id, envs, turns, missing)
            out["seconds"] = round(time.perf_counter() - t0, 4)
            self._cache[session_id] = (key, out)
            while len(self._cache) > MAX_CACHED_SESSIONS:
                self._cache.popitem(last=False)
        log.info("ui.trainer.scored", session=session_id, turns=len(turns), forward_tokens=out["forward_tokens"],
                 missing_versions=[m["version"] for m in out["missing"]], seconds=out["seconds"])
        return {**out, "cached": False}

    def _check_bounds(self, session_id: str, envs: list) -> None:
        n_turns, forward = scoring_size(envs)
        if n_turns > self.max_turns or forward > self.max_forward_tokens:
            raise TooMuchToScore(
                f"session {session_id!r}: {n_turns} turns and {forward:,} tokens to run through the policy"
                f" (prompt + output, once per version part); the ui scores at most {self.max_turns} turns and"
                f" {self.max_forward_tokens:,} tokens per session: agentlog verify-tokens RUN scores whole runs")

    def _score(self, turns: list[_Turn]) -> dict[int, str]:
        """Fill each turn's ``log_probs``, version by version (each version's policy loaded once);
        returns why each version that could not be scored was not."""
        by_version: dict[int, list[tuple[_Turn, int, int]]] = {}
        for t in turns:
            t.log_probs = [None] * len(t.output)
            for lo, hi, version in t.parts:
                if hi > lo:
                    by_version.setdefault(version, []).append((t, lo, hi))
        missing: dict[int, str] = {}
        for version in sorted(by_version):
            scorer, why = self._scorer(version)
            if scorer is None:
                missing[version] = why
                continue
            parts = sorted(by_version[version], key=lambda p: len(p[0].prompt) + len(p[0].output))
            for k in range(0, len(parts), TURNS_PER_BATCH):
                chunk = parts[k:k + TURNS_PER_BATCH]
                try:
                    scored = scorer.score_batch([(t.prompt, t.output, t.temperature) for t, _, _ in chunk])
                except _MODEL_REFUSALS:
                    scored = self._one_by_one(scorer, version, [t for t, _, _ in chunk])
                for (t, lo, hi), got in zip(chunk, scored):
                    t.log_probs[lo:hi] = [float(x) for x in got[lo:hi]]
        return missing

    @staticmethod
    def _one_by_one(scorer: Any, version: int, chunk: list[_Turn]) -> list:
        """The scores of ``chunk``'s turns, each scored alone after their batch failed
        (a batch's failure does not say which turn caused it; a batch too big for memory passes
        turn by turn, and its scores are kept). Raises TurnNotScorable naming the turns the
        policy refuses alone, with the error of the first."""
        scored, bad = [], []
        for t in chunk:
            try:
                scored.extend(scorer.score_batch([(t.prompt, t.output, t.temperature)]))
            except _MODEL_REFUSALS as one:
                bad.append((t, one))
        if not bad:
            return scored
        first = bad[0][1]
        longest = max(len(t.prompt) + len(t.output) for t, _ in bad)
        raise TurnNotScorable(f"turns {sorted(t.index for t, _ in bad)} ({longest:,} tokens at most, prompt + output): "
                              f"policy version {version} cannot score them: {type(first).__name__}: {str(first)[:300]}") from first

    def _scorer(self, version: int) -> tuple[Any, str]:
        """(the ModelScorer of ``version``, "") or (None, why not)."""
        from agentlog.loop.model_scorer import ModelScorer, PolicyLoadError, load_policy
        from agentlog.loop.publish import checkpoint_path
        from agentlog.loop.run_folder import Run

        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version], ""
        if self._loop_config is None:
            self._loop_config = Run.load_config(self.run_dir)  # type: ignore[arg-type]
        try:
            model = load_policy(self.run_dir, self._loop_config, version)  # type: ignore[arg-type]
        except PolicyLoadError as exc:
            log.warning("ui.trainer.policy_unloadable", version=version, error=str(exc))
            return None, str(exc)
        if model is None:
            assert self.checkpoints is not None
            return None, (f"no checkpoint of policy version {version}: {checkpoint_path(self.checkpoints, version)}"
                          " is not there (pruned by keep_checkpoints, or never written)")
        self._models[version] = ModelScorer(model)
        while len(self._models) > MAX_LOADED_VERSIONS:
            self._models.popitem(last=False)
        return self._models[version], ""

    def _rows(self, session_id: str, envs: list, turns: list[_Turn], missing: dict[int, str]) -> dict[str, Any]:
        """The answer: each row's ribbon placed as the rollout ribbon is, and what was scored."""
        from .views import row_output_spans, session_rows, trajectory_row

        by_index = {t.index: t for t in turns}
        outputs = {t.index: (len(t.prompt), t.output.astype("<i4").tobytes()) for t in turns}
        traj, samples, problem = session_rows(envs, session_id, self.reduce_config)
        rows = []
        for s in samples:
            ribbon: list[float | None] = [None] * (s.prompt_length + s.response_length)
            for span in row_output_spans(s, trajectory_row(traj, s), outputs):
                ribbon[span.start:span.start + span.length] = by_index[span.turn].log_probs[:span.length]
            rows.append({"row": s.row_index, "trainer_logprob": ribbon})
        lost: dict[int, dict[str, Any]] = {}
        for t in turns:
            for lo, hi, version in t.parts:
                if version in missing and hi > lo:
                    entry = lost.setdefault(version, {"version": version, "turns": [], "tokens": 0, "why": missing[version]})
                    entry["turns"].append(t.index)
                    entry["tokens"] += hi - lo
        return {
            "session_id": session_id, "engine": ENGINE, "problem": problem, "rows": rows,
            "turns": [{"turn": t.index, "temperature": t.temperature,
                       "parts": [{"from": lo, "to": hi, "version": v, "scored": v not in missing, "why": missing.get(v)}
                                 for lo, hi, v in t.parts]} for t in turns],
            "missing": [lost[v] for v in sorted(lost)],
            "scored_tokens": sum(hi - lo for t in turns for lo, hi, v in t.parts if v not in missing),
            "forward_tokens": forward_tokens(turns, missing),
        }


def session_turns(envs: list) -> list[_Turn]:
    """The session's recorded turns (turn deltas expanded), in log order, ready to score."""
    from agentlog.events.schema.turn import turn_temperature
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded

    turns = []
    for env in full_turns(envs):
        body = env.body
        if type(body) is not TurnRecorded:
            continue
        output = np.asarray(body.output_tokens, np.int32)
        # A greedy turn (temperature 0: None here) is scored at 1.0, the log-probs engines report for it.
        temperature = turn_temperature(body.sampling) or 1.0
        turns.append(_Turn(index=body.turn_index, prompt=np.frombuffer(body.prompt_ids, "<i4"), output=output,
                           temperature=temperature, parts=turn_parts(body, len(output))))
    return turns


def turn_parts(body: Any, n_output: int) -> list[tuple[int, int, int]]:
    """(first output position, end, version) of each version part of a turn (either encoding)."""
    from agentlog.events.schema.turn import turn_version_spans

    spans = turn_version_spans(body)
    ends = [first for first, _ in spans[1:]] + [n_output]
    return [(int(first), int(end), int(v)) for (first, v), end in zip(spans, ends)]


def scoring_size(envs: list) -> tuple[int, int]:
    """(turns, tokens through a policy) that scoring the session's envelopes takes, as
    :func:`forward_tokens` counts them, read off the stored turns without expanding a turn_delta."""
    from agentlog.events.schema.turn_delta import prompt_token_count
    from agentlog.events.schema.types import TurnDelta, TurnRecorded

    n_turns = forward = 0
    for env in envs:
        body = env.body
        if type(body) is not TurnRecorded and type(body) is not TurnDelta:
            continue
        n_turns += 1
        n_output = len(body.output_ids) // 4
        parts = sum(1 for lo, hi, _ in turn_parts(body, n_output) if hi > lo)
        forward += parts * (prompt_token_count(body) + n_output)
    return n_turns, forward


def forward_tokens(turns: list[_Turn], skip: Any = ()) -> int:
    """Tokens run through a policy to score ``turns``: prompt + output once per version part
    (parts of the versions in ``skip`` are not run)."""
    return sum(len(t.prompt) + len(t.output) for t in turns for lo, hi, v in t.parts if hi > lo and v not in skip)
