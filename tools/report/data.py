"""The report's data: one pass over the log through the lifecycle reducer and
the sample pipeline, kept as plain per-session records.

Memory: every session keeps a small record (times, turn times, outcome);
the token-level drill-down keeps samples for the first ``max_drill``
sessions only.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec


class SessionRecord(msgspec.Struct):
    """What the report shows of one session."""

    session_id: str
    group_id: str
    sample_index: int
    status: str  # open / running / finished / aborted / dropped
    reason: str = ""
    error: str = ""
    opened_ns: int = 0
    ended_ns: int | None = None  # None: still in flight at the end of the log
    turn_ns: list[int] = []
    turns: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    reward: Any = None
    samples: list[Any] = []  # reducers.samples.Sample, drill-down sessions only


class ReportData(msgspec.Struct):
    """Everything the page draws."""

    log: str
    events: int
    first_ns: int
    last_ns: int
    sessions: list[SessionRecord]
    groups: dict[str, dict[str, Any]]  # group_id -> {size, released, skipped, skip_reason}
    violations: list[str]
    reduce_problem: str
    sample_digest: str
    drill_limit: int


def collect(envelopes: Iterable[Any], log: str, *, max_drill: int = 300) -> ReportData:
    """Fold the envelopes (in LSN order) into :class:`ReportData`."""
    from agentlog.events.turn_delta import prompt_token_count
    from agentlog.events.types import PolicyUpdated, SessionOpened, TurnDelta, TurnRecorded
    from agentlog.reducers.lifecycle import LifecycleState, SessionSummary, Violation, reduce_lifecycle
    from agentlog.reducers.pipeline import ReduceError, Reducer

    state = LifecycleState(tolerate_unknown=True)  # shown, not interpreted: a newer writer's event types
    reducer: Reducer | None = Reducer()
    records: dict[str, SessionRecord] = {}
    order: list[str] = []
    drill: set[str] = set()  # sessions whose samples the drill-down keeps
    groups: dict[str, dict[str, Any]] = {}
    violations: list[str] = []
    problem = ""
    events = 0
    first_ns = last_ns = 0
    for env in envelopes:
        if events == 0:
            first_ns = env.ts_ns
        events += 1
        last_ns = env.ts_ns
        body = env.body
        if isinstance(body, PolicyUpdated):
            continue
        sid = env.session_id
        state, out = reduce_lifecycle(state, env)
        bad = False
        for o in out:
            if isinstance(o, Violation):
                bad = True
                if len(violations) < 50:
                    violations.append(f"lsn {o.lsn}, session {o.session_id!r}: {o.message}")
            elif isinstance(o, SessionSummary):
                r = records.get(sid)
                if r is not None:
                    r.status, r.reason, r.error = o.status, o.reason, o.error
                    r.ended_ns, r.turns, r.tokens_in, r.tokens_out, r.reward = (
                        o.ended_ts_ns, o.turns, o.tokens_in, o.tokens_out, o.reward,
                    )
        if not bad:
            if isinstance(body, SessionOpened) and sid not in records:
                records[sid] = SessionRecord(sid, body.group_id, body.sample_index, "open", opened_ns=env.ts_ns)
                order.append(sid)
                if len(drill) < max_drill:
                    drill.add(sid)
                groups.setdefault(body.group_id, {"size": body.group_size, "released": False, "skipped": False, "skip_reason": ""})
            elif isinstance(body, (TurnRecorded, TurnDelta)) and sid in records:
                records[sid].turn_ns.append(env.ts_ns)
                records[sid].turns += 1
                records[sid].tokens_in += prompt_token_count(body)
                records[sid].tokens_out += len(body.output_ids) // 4
            elif sid in records and records[sid].status == "open" and body.__struct_config__.tag == "session_started":
                records[sid].status = "running"
        if reducer is not None:
            try:
                res = reducer.feed(env)
            except ReduceError as exc:
                problem = str(exc)
                reducer = None
                continue
            for s in res.samples:
                if s.session_id in drill:
                    records[s.session_id].samples.append(s)
            for g in res.groups:
                info = groups.setdefault(g.group_id, {"size": g.group_size})
                info.update(released=True, skipped=g.skipped, skip_reason=g.skip_reason)
    return ReportData(
        log=log,
        events=events,
        first_ns=first_ns,
        last_ns=last_ns,
        sessions=[records[s] for s in order],
        groups=groups,
        violations=violations,
        reduce_problem=problem,
        sample_digest=reducer.digest.hexdigest() if reducer is not None else "",
        drill_limit=max_drill,
    )
