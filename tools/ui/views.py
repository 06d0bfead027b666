"""The JSON of each `agentlog ui` view, built from the log with the project's reducers.

* a session (:meth:`RunViews.session`): the lines ``agentlog show`` prints for
  "why" (:func:`tools.cmd_show.why_lines`), its turns as recorded (turn
  deltas expanded, :class:`events.schema.turn_delta.TurnContext`), commands,
  sandbox snapshots and resumes (each with the marker ``show`` prints, and
  the records a resume made void marked ``undone``: :func:`tools.cmd_show.resume_marks`),
  and its training rows exactly as the sample reducer makes them
  (:class:`reducers.pipeline.Reducer`, the rows ``agentlog reconstruct``
  writes), each token labelled by kind from the row's mask and the turns it
  is made of (:func:`token_layout`); for a session whose agent spawned
  subagents, its ``lineages`` (:meth:`tools.lineage_view.SessionLineages.to_json`:
  each with its turns, rows, parent and spawning call) and each turn's, row's
  and fork branch's ``lineage`` (a session without subagents has the one
  lineage ``main``);
* a session's trainer log-probs, on demand (:mod:`.trainer`): its turns scored
  by the run's policy at the versions that generated them, placed in the rows
  as the rollout log-probs are (:func:`row_output_spans`);
* a group and a learner step: from the learner log
  (:func:`loop.learner_records.read_learner_records`) and the groups the
  partitions release (:func:`reducers.partitioned.reduce_partitions`), with
  the learner's advantages (:func:`tools.dataset_rows.group_advantages`);
* the reconstruct check of one step: the check of :func:`loop.check.check_run`
  for that step's record (:func:`reducers.partitioned.rebuild_batches`, the
  digest :func:`loop.learner_records.step_digest`).

The released groups are folded incrementally: one partition fold kept across
requests reads only the records appended since the previous request.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Any

from agentlog.events.log.source import LogSource

#: Kinds of token in a row (the token view's overlay).
KINDS = ("prompt", "trained", "generated_untrained", "tool", "given")
#: Reconstruct checks kept (RunViews._checks).
MAX_CACHED_CHECKS = 64


def _num(x: Any) -> float | None:
    return None if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else float(x)


def token_text(ids: list[int]) -> list[str]:
    """Each token's text: a byte-level vocabulary (every id below 256) as its byte, else the id in angle brackets."""
    if all(0 <= t < 256 for t in ids):
        return [chr(t) if 32 <= t < 127 or t in (9, 10) else f"\\x{t:02x}" for t in ids]
    return [f"<{t}>" for t in ids]


def token_layout(sample: Any, turns: dict[int, "_TurnInfo"], row: Any | None) -> tuple[list[str], list, list]:
    """(kinds, rollout log-probs, versions) per token of ``sample``, in one pass over the row.

    Kinds: ``prompt`` (before the response); in the response, ``trained`` where the loss mask
    is 1; a token a turn of the row generated (its output where the row holds it,
    :func:`reducers.row_layout.turn_output_spans`) and mask 0 is ``generated_untrained``; any
    other response token came from outside the policy: ``tool`` when the turn after it holds a
    tool message, else ``given``. Log-probs and versions: those each turn recorded for its own
    output tokens, None wherever the log holds none."""
    n_prompt, n = sample.prompt_length, sample.prompt_length + sample.response_length
    kinds = ["prompt"] * n_prompt + ["given"] * sample.response_length
    logprob: list[float | None] = [None] * n
    version: list[int | None] = [None] * n
    spans = row_output_spans(sample, row, {t: (info.prompt_tokens, info.output_ids) for t, info in turns.items()})
    after: dict[int, int] = {}  # turn index -> the next turn of the row
    if row is not None:
        order = list(row.turn_indices)
        after = {t: order[k + 1] for k, t in enumerate(order[:-1])}
    for k, span in enumerate(spans):
        info = turns[span.turn]
        end = span.start + span.length
        for i in range(max(span.start, n_prompt), end):
            kinds[i] = "generated_untrained"
        lps = info.log_probs
        if lps is not None:
            logprob[span.start:end] = [_num(x) for x in lps[:span.length]]
        for (first, v), last in zip(info.version_spans, [f for f, _ in info.version_spans[1:]] + [span.length]):
            version[span.start + first:span.start + min(last, span.length)] = [v] * max(0, min(last, span.length) - first)
        nxt = turns.get(after.get(span.turn, -1))
        filler = "tool" if nxt is not None and nxt.has_tool_message else "given"
        stop = spans[k + 1].start if k + 1 < len(spans) else n
        for i in range(max(end, n_prompt), stop):
            kinds[i] = filler
    for i, m in enumerate(sample.mask.tolist()):
        if m:
            kinds[n_prompt + i] = "trained"
    return kinds, logprob, version


def row_output_spans(sample: Any, row: Any | None, outputs: dict[int, tuple[int, bytes]]) -> list:
    """Where each turn of ``row`` (the trajectory row ``sample`` was made from; None: none known)
    put its output in the sample's tokens (:func:`reducers.row_layout.turn_output_spans`);
    ``outputs``: turn index -> (prompt token count, output ids as int32 LE bytes). The one
    placement every per-token ribbon of a row follows (rollout here, the trainer's in :mod:`.trainer`)."""
    from agentlog.reducers.row_layout import turn_output_spans

    if row is None:
        return []
    order = list(row.turn_indices)
    return turn_output_spans(sample.tokens, order, {t: outputs[t] for t in order if t in outputs})


def session_rows(envs: list, session_id: str, config: Any) -> tuple[Any, list, str | None]:
    """(trajectory, samples, problem) of one session's envelopes: its training rows exactly as the
    sample reducer makes them (:class:`reducers.pipeline.Reducer`) beside the trajectory rows they
    come from; (None, [], why) when the reducers refuse the session."""
    from agentlog.reducers.pipeline import ReduceError, Reducer, session_trajectory

    try:
        traj = session_trajectory(envs, session_id, config)
        samples = [s for s in Reducer(config).feed_many(envs).samples if s.session_id == session_id]
    except (ReduceError, KeyError) as exc:
        return None, [], str(exc).strip("'\"")
    return traj, samples, None


def trajectory_row(traj: Any, sample: Any) -> Any | None:
    """The trajectory row ``sample`` was made from (None when the trajectory has no such row)."""
    return traj.rows[sample.row_index] if traj is not None and sample.row_index < len(traj.rows) else None


class _TurnInfo:
    """What a row's token view needs of one recorded turn."""

    __slots__ = ("prompt_tokens", "output_ids", "log_probs", "version_spans", "has_tool_message")

    def __init__(self, body: Any, has_tool_message: bool) -> None:
        from agentlog.events.schema.turn import turn_version_spans

        self.prompt_tokens = len(body.prompt_ids) // 4
        self.output_ids = bytes(body.output_ids)
        n_out = len(self.output_ids) // 4
        lps = body.output_log_probs
        # A turn recorded without one log-prob per output token has none to show.
        self.log_probs = memoryview(bytes(lps)).cast("f").tolist() if lps and len(lps) // 4 == n_out else None
        self.version_spans = [tuple(s) for s in turn_version_spans(body)]
        self.has_tool_message = has_tool_message


class RunViews:
    """The views of one source (``source`` a rollout :class:`LogSource`; ``learner`` its
    learner log or None; ``run_dir`` the run folder or None), folded with ``config``."""

    def __init__(self, source: LogSource, learner: LogSource | None, config: Any, run_dir: Any = None) -> None:
        self.source, self.learner, self.config, self.run_dir = source, learner, config, run_dir
        self._lock = threading.Lock()
        self._fold: Any = None  # the PartitionFold of released(), fed incrementally
        self._released: dict[int, dict[str, Any]] = {}  # partition -> group id -> ReleasedGroup
        #: Reconstruct checks by (index position, step), the most recent last; bounded, since on a
        #: live run the position moves every poll and old entries are never asked again.
        self._checks: collections.OrderedDict[tuple[Any, int], dict] = collections.OrderedDict()

    # ------------------------------------------------------------------ session

    def session_envelopes(self, session_id: str, pkey: int, first_lsn: int) -> list:
        """The session's envelopes from its first record (the index says where), up to its terminal one."""
        from agentlog.tools.ui.index import SINGLE

        log = self.source if pkey == SINGLE else self.source.partition(pkey)
        envs = []
        for rec in log.read(first_lsn, raw=True):
            if rec.session_id == session_id:
                envs.append(rec.decode())
                if rec.terminal:
                    break
        return envs

    def session(self, row: dict, envs: list) -> dict[str, Any]:
        """The session view (see the contract) of the session whose index row is ``row``."""
        from agentlog.events.schema.turn import turn_server, turn_version_spans
        from agentlog.events.schema.turn_delta import full_turns
        from agentlog.events.schema.types import (
            CommandRan, SandboxSnapshotted, SessionAborted, SessionFinished, SessionResumed, TurnRecorded, TurnUndelivered,
        )
        from agentlog.tools.cmd_show import new_messages, resume_marks, why_lines
        from agentlog.tools.cmd_replay import command_outcome
        from agentlog.events.schema.lineage import turn_lineage
        from agentlog.tools.lineage_view import session_lineages

        sid = row["session_id"]
        lineages = session_lineages(envs)
        undelivered = {e.body.turn_index for e in envs if type(e.body) is TurnUndelivered}
        turns: list[dict] = []
        infos: dict[int, _TurnInfo] = {}
        commands: list[dict] = []
        snapshots: list[dict] = []
        resumes: list[dict] = []
        marks = resume_marks(envs)  # the resume markers and the records each made void, as `agentlog show` marks them

        def undone(lsn: int) -> dict | None:
            got = marks.undone.get(lsn)
            return None if got is None else {"resume_lsn": str(got[0]), "incarnation": got[1]}

        verdict = error = traceback = None
        helds: dict[str, list] = {}  # per lineage, its previous turn's messages and response (as `agentlog show` reads them)
        last_turn: int | None = None
        for e in full_turns(envs):  # each turn_delta as the turn_recorded it stands for
            b = e.body
            if isinstance(b, TurnRecorded):
                msgs = list(b.messages)
                lineage = turn_lineage(b)
                new, _rewritten = new_messages(helds.get(lineage, []), msgs)
                server, moved = turn_server(b)
                spans = [list(s) for s in turn_version_spans(b)]
                turns.append({"turn": b.turn_index, "lsn": str(e.lsn), "new_messages": new, "response": b.response_message,
                              "finish_reason": b.finish_reason, "policy_version": b.policy_version, "version_spans": spans,
                              "server": server or None, "server_moved_from": moved or None,
                              "undelivered": b.turn_index in undelivered, "lineage": lineage})
                infos[b.turn_index] = _TurnInfo(b, any(isinstance(m, dict) and m.get("role") == "tool" for m in new))
                helds[lineage] = msgs + ([b.response_message] if b.response_message is not None else [])
                last_turn = b.turn_index
            elif isinstance(b, CommandRan):
                commands.append({"turn": last_turn, "lsn": str(e.lsn), "command": b.command, "exit_code": b.exit_code,
                                 "outcome": command_outcome(b), "output": b.output_tail, "undone": undone(e.lsn)})
            elif type(b) is SandboxSnapshotted:
                snapshots.append({"turn": last_turn, "lsn": str(e.lsn), "turn_index": b.turn_index, "digest": b.digest,
                                  "files": b.files, "bytes": b.bytes, "new_bytes": b.new_bytes, "seconds": b.seconds,
                                  "undone": undone(e.lsn)})
            elif type(b) is SessionResumed:
                resumes.append({"turn": last_turn, "lsn": str(e.lsn), "incarnation": b.incarnation, "worker": b.worker,
                                "durable_turns": b.durable_turns, "snapshot": b.snapshot, "snapshot_turn": b.snapshot_turn,
                                "line": marks.lines[e.lsn]})
            elif isinstance(b, SessionFinished):
                verdict = dict(b.metadata) if b.metadata else None
            elif isinstance(b, SessionAborted):
                error, traceback = b.error or None, b.traceback or None
        rows: list[dict] = []
        branches: list[dict] = []
        traj, samples, problem = session_rows(envs, sid, self.config)
        for s in samples:
            trow = trajectory_row(traj, s)
            row_lineage = trow.lineage if trow is not None else s.metadata.get("lineage")
            rows.append({**self._row_json(s, infos, trow), "lineage": row_lineage})
            branches.append({"row": s.row_index, "turns": list(trow.turn_indices) if trow is not None else [], "lineage": row_lineage})
        shown_rows: dict[str, list[int]] = {}
        for r in rows:
            if r["lineage"]:
                shown_rows.setdefault(r["lineage"], []).append(r["row"])
        return {**row, "why": why_lines(envs, True), "verdict": verdict, "error": error, "traceback": traceback,
                "turns": turns, "commands": commands, "snapshots": snapshots, "resumes": resumes, "rows": rows,
                # Each lineage's rows as the view shows them (an aborted session's one placeholder, not its trajectory's rows).
                "lineages": lineages.to_json(shown_rows),
                "forks": {"branches": branches, "train_once": _train_once(traj)}, "problem": problem}

    @staticmethod
    def _row_json(s: Any, turns: dict[int, _TurnInfo], trow: Any) -> dict[str, Any]:
        ids = s.token_ids.tolist()
        n_prompt = s.prompt_length
        mask = s.mask.tolist()
        teacher = s.teacher_lp.tolist() if s.teacher_scored else []
        scored = s.teacher_mask.tolist() if s.teacher_scored else []
        kinds, rollout, versions = token_layout(s, turns, trow)
        return {
            "row": s.row_index, "trained": bool(sum(mask)) and not s.remove_sample, "advantage": None,
            "status": s.status, "reward": _num(s.reward), "remove_sample": s.remove_sample,
            "tokens": ids, "text": token_text(ids), "kinds": kinds,
            "mask": [0] * n_prompt + mask,
            # Only what the turns recorded: an untrained or realigned token has no made-up 0.0 / version 0.
            "rollout_logprob": rollout,
            # The learner records no per-token log-prob (only step metrics): /api/session/{id}/trainer
            # scores the turns with the run's checkpoints on demand (:mod:`.trainer`).
            "trainer_logprob": [None] * len(ids),
            "teacher_logprob": [None] * n_prompt + [_num(teacher[i]) if scored and scored[i] else None
                                                    for i in range(s.response_length)],
            "version": versions,
        }

    # ------------------------------------------------------------------ groups and steps

    def records(self) -> list:
        """The learner's ``policy_updated`` records ([] without a learner log)."""
        return [body for _ts, body in self._timed_records()]

    def _timed_records(self) -> list[tuple[float, Any]]:
        """(timestamp in seconds, record) of every ``policy_updated`` of the learner log
        (:func:`loop.learner_records.read_learner_records` with the records' times)."""
        from agentlog.events.schema.types import PolicyUpdated

        if self.learner is None or not self.learner.exists():
            return []
        return [(env.ts_ns / 1e9, env.body) for env in self.learner.read() if isinstance(env.body, PolicyUpdated)]

    def step_summaries(self) -> list[dict[str, Any]]:
        """One entry per learner step (the run view's ``steps``)."""
        out = []
        for ts, r in self._timed_records():
            m = r.metrics
            out.append({"step": r.step, "policy_version": r.policy_version,
                        "reward_mean": _num(m.get("rollout/reward_mean")), "loss": _num(m.get("loss/policy")),
                        "trained_groups": len(r.groups), "skipped_groups": len(r.skipped),
                        "tokens_per_s": _num(m.get("perf/tokens_per_s", m.get("tokens_per_s"))), "ts": ts})
        return out

    def released(self, position: Any = None) -> dict:
        """Every partition's released groups (as :func:`reducers.partitioned.reduce_partitions`
        gives them), folded incrementally: one :class:`reducers.partitioned.PartitionFold` kept
        across calls is fed only the records appended since the last call (``position`` is not
        needed: each partition's read frontier says where to go on)."""
        from agentlog.reducers.partitioned import PartitionFold

        with self._lock:
            if self._fold is None:
                self._fold = PartitionFold(self.config)
            fold = self._fold
            if self.source.partitioned:
                parts = {pid: self.source.partition(pid) for pid in self.source.partitions()}
            else:
                parts = {0: self.source}
            for pid, log in parts.items():
                released = self._released.setdefault(pid, {})
                try:
                    for env in log.read(fold.frontier.get(pid, 0)):
                        for r in fold.feed(pid, env):
                            released[r.group.group_id] = r
                except Exception:
                    # The fold moved past the record it refused: start over next time, so every
                    # call raises the same error instead of one call raising and the rest skipping it.
                    self._fold, self._released = None, {}
                    raise
            return {pid: dict(groups) for pid, groups in self._released.items()}

    def _advantages(self, group: Any) -> list[float]:
        from agentlog.tools.dataset_rows import group_advantages, member_advantages

        lc = self._learner_config()
        return member_advantages([group], group_advantages(lc.estimator, lc.adv_eps))[0]

    def _learner_config(self) -> Any:
        from agentlog.learner.config import LearnerConfig

        if self.run_dir is not None:
            from agentlog.loop.run_folder import Run

            run = Run.at(self.run_dir)
            if run is not None:
                return run.config.learner_config()
        return LearnerConfig()

    def group(self, group_id: str, position: Any) -> dict[str, Any] | None:
        """The group view, or None when no partition released ``group_id`` (yet)."""
        released = self.released(position)
        found = next(((pid, g[group_id]) for pid, g in released.items() if group_id in g), None)
        if found is None:
            return None
        pid, r = found
        g = r.group
        step, skip = None, g.skip_reason or None
        for rec in self.records():
            if group_id in rec.groups or group_id in rec.skipped:
                step, skip = rec.step, rec.skipped.get(group_id) or skip
                break
        adv = self._advantages(g)
        refill_of = {new: old for new, old in g.replaced}
        refilled_by = {old: new for new, old in g.replaced}
        members = [{"session_id": m.session_id, "status": m.status, "reason": m.reason or None, "reward": _num(m.reward),
                    "advantage": _num(a) if m.valid else None, "in_baseline": m.valid,
                    "excluded_why": None if m.valid else (m.reason or m.status),
                    "refill_of": refill_of.get(m.session_id), "refilled_by": refilled_by.get(m.session_id)}
                   for m, a in zip(g.members, adv)]
        members += [{"session_id": sid, "status": "dropped", "reason": why or None, "reward": None, "advantage": None,
                     "in_baseline": False, "excluded_why": f"dropped: {why}" if why else "dropped",
                     "refill_of": None, "refilled_by": refilled_by.get(sid)}
                    for sid, why in zip(g.dropped, g.drop_reasons or [""] * len(g.dropped))]
        return {"group_id": group_id, "partition": pid, "step": step, "skip_reason": skip, "members": members}

    def step(self, n: int, position: Any) -> dict[str, Any] | None:
        """The learner-step view, or None when the learner log has no step ``n``."""
        rec = next((r for r in self.records() if r.step == n), None)
        if rec is None:
            return None
        released = self.released(position)
        groups = []
        from agentlog.loop.check import with_batch

        from agentlog.loop.staleness import group_version

        for ref in with_batch(rec, released).batch:
            gid = ref.group_id
            r = released.get(ref.partition, {}).get(gid)
            trained = gid in rec.groups
            members = []
            if r is not None:
                adv = self._advantages(r.group)
                members = [{"session_id": m.session_id, "advantage": _num(a) if m.valid else None,
                            "trained": trained and m.valid} for m, a in zip(r.group.members, adv)]
            groups.append({"group_id": gid, "trained": trained, "skip_reason": rec.skipped.get(gid) or None,
                           # As the learner judged it: its version before this update minus the group's.
                           "staleness": rec.policy_version - 1 - group_version(r.group)
                           if r is not None and r.group.samples else None,
                           "members": members})
        return {"step": rec.step, "policy_version": rec.policy_version,
                "metrics": {k: _num(v) for k, v in rec.metrics.items()}, "groups": groups}

    def reconstruct(self, n: int, position: Any) -> dict[str, Any] | None:
        """The offline check of step ``n`` (as :func:`loop.check.check_run` runs it), cached per position."""
        from agentlog.loop.check import check_step

        key = (position, n)
        if key in self._checks:
            return self._checks[key]
        rec = next((r for r in self.records() if r.step == n), None)
        if rec is None:
            return None
        offline, problems = check_step(rec, self.released(position))
        equal = offline == rec.sample_digest and not problems
        detail = "; ".join(problems) or ("the samples rebuilt from the rollout log hash to the recorded digest"
                                                  if equal else "the digests differ")
        out = {"step": n, "equal": equal, "online_digest": rec.sample_digest, "offline_digest": offline, "detail": detail}
        self._checks[key] = out
        while len(self._checks) > MAX_CACHED_CHECKS:
            self._checks.popitem(last=False)
        return out


def _train_once(traj: Any) -> dict[str, Any]:
    """Whether every trained turn is trained in exactly one row (the fork rows' check)."""
    if traj is None:
        return {"ok": False, "detail": "the reducers refused the session (no trajectory)"}
    seen: dict[int, int] = {}
    twice = []
    for i, row in enumerate(traj.rows):
        for t in row.trained_turns:
            if t in seen:
                twice.append(f"turn {t} trained in rows {seen[t]} and {i}")
            seen[t] = i
    if twice:
        return {"ok": False, "detail": "; ".join(twice)}
    return {"ok": True, "detail": f"{len(seen)} trained turn(s) over {len(traj.rows)} row(s), each trained once"}
