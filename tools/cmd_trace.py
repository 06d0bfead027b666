"""`agentlog trace LOG -o trace.json`: the full per-session timeline as Chrome
Trace Event JSON, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One process ("agentlog sessions", pid 1) with one track (tid) per session,
numbered in the order sessions open and named by ``thread_name`` metadata
(session id and group). On each track:

* a ``session`` span ("X") from session_opened to its terminal event (to the
  end of the log while still in flight);
* a ``turn N`` span per recorded turn: it ends at the turn's record and
  lasts its ``generate_s``;
* a ``command`` span per command run: ends at its record, lasts ``duration_s``;
* a ``snapshot`` span per sandbox snapshot: ends at its record, lasts its
  ``seconds`` (the turn after it waited for it);
* an instant event ("i") at each resume: ``resumed (incarnation N)``, a new
  incarnation of the same session taking over on the same track;
* an instant event ("i") at the terminal event: ``finished`` (with the
  reward), ``aborted: REASON`` or ``dropped: REASON``.

Times are microseconds since the log's first event (``otherData.first_ts_ns``
holds that event's wall time). Written as the log is read, in one pass:
memory holds the sessions in flight only (the lifecycle fold's), whatever the
length of the log. Records the lifecycle fold refuses are left out (``agentlog
verify`` names them).

A partitioned log (a run folder whose ``rollout/`` holds ``p%04d``
partitions, or that ``rollout/`` itself) is read merged
(:func:`events.log.partitions.read_partitions`, time order), with one lifecycle
fold per partition (a session never spans partitions, and LSNs rise within
one only). Each session's track name ends with its partition (``... p0003``)
and its spans carry ``"partition": "p0003"`` and the LSN of the record as
``"at": "p0003:1234"``; ``otherData.partitions`` counts sessions and events per partition.
"""

from __future__ import annotations

from typing import IO, Any, Iterable

from agentlog.events.fs import atomic_file
from agentlog.tools.cli import EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import add_quiet, check_log_path, check_output_path, id_scans_of, json_text, read_records, read_tagged

#: The one process every session track belongs to.
TRACE_PID = 1


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("trace", help="export every session's timeline as Chrome Trace Event JSON (Perfetto)")
    p.add_argument("log", metavar="LOG", help="the log directory (or a run folder)")
    p.add_argument("-o", "--output", required=True, metavar="JSON", help="the trace file to write")
    add_quiet(p)
    p.set_defaults(func=run)


class _Track:
    __slots__ = ("tid", "opened_us", "name")

    def __init__(self, tid: int, opened_us: float, name: str) -> None:
        self.tid, self.opened_us, self.name = tid, opened_us, name


def _span(name: str, cat: str, track: _Track, end_us: float, seconds: float, args: dict[str, Any]) -> dict[str, Any]:
    """A complete event ending at ``end_us`` that lasted ``seconds``, clipped
    to start no earlier than its session (the record is written when the work ends)."""
    end = max(end_us, track.opened_us)
    start = max(track.opened_us, end - max(0.0, seconds) * 1e6)
    return {"ph": "X", "name": name, "cat": cat, "pid": TRACE_PID, "tid": track.tid, "ts": start, "dur": end - start, "args": args}


def write_trace(envelopes: Iterable[Any], out: IO[str], *, log: str = "", partitions: list[int] | None = None,
                confirm_for: Any = None) -> dict[str, int]:
    """Write the Trace Event JSON of ``envelopes`` (in LSN order) to ``out``,
    streaming. Returns counts: sessions, turns, commands, terminal (instant
    events), in_flight, skipped (records the lifecycle fold refused),
    policy_updates, snapshots, resumes.

    ``partitions``: the partition ids of a partitioned log, whose
    ``envelopes`` are then ``(partition id, Envelope)`` pairs in merged order
    (:func:`tools.cli_common.read_tagged`); one lifecycle fold per partition,
    and each track and span names its partition. ``confirm_for(pid)``: the ``confirm_used``
    of the fold of partition ``pid`` (None: the one log), :func:`tools.cli_common.id_scans_of`;
    None: the id filter alone says an opening reuses an id."""
    from agentlog.events.schema.types import CommandRan, PolicyUpdated, SandboxSnapshotted, SessionOpened, SessionResumed
    from agentlog.reducers.lifecycle import LifecycleState, SessionSummary, Violation, reduce_lifecycle

    # One fold per partition (None: the one log): LSNs rise within a partition only.
    states: dict[int | None, LifecycleState] = {}
    tracks: dict[tuple[int | None, str], _Track] = {}
    per_partition = None if partitions is None else {f"p{q:04d}": {"sessions": 0, "events": 0} for q in partitions}
    pairs = ((None, env) for env in envelopes) if partitions is None else envelopes
    counts = {"sessions": 0, "turns": 0, "commands": 0, "terminal": 0, "in_flight": 0, "skipped": 0, "policy_updates": 0,
              "snapshots": 0, "resumes": 0}
    t0: int | None = None
    last_us = 0.0
    first = True
    def dumps(obj: Any) -> str:  # strict JSON: a NaN generate_s or duration_s is written as "nan"
        return json_text(obj, compact=True)

    def emit(event: dict[str, Any]) -> None:
        nonlocal first
        out.write(("" if first else ",\n") + dumps(event))
        first = False

    out.write('{"displayTimeUnit":"ms","traceEvents":[\n')
    emit({"ph": "M", "name": "process_name", "pid": TRACE_PID, "tid": 0, "ts": 0, "args": {"name": "agentlog sessions"}})
    for pid, env in pairs:
        if t0 is None:
            t0 = env.ts_ns
        part = None if pid is None else f"p{pid:04d}"
        if part is not None:
            per_partition.setdefault(part, {"sessions": 0, "events": 0})["events"] += 1  # type: ignore[union-attr]
        now = (env.ts_ns - t0) / 1e3
        last_us = max(last_us, now)
        body = env.body
        if isinstance(body, PolicyUpdated):
            counts["policy_updates"] += 1
            emit({"ph": "i", "s": "p", "name": f"policy v{body.policy_version}", "pid": TRACE_PID, "tid": 0, "ts": now,
                  "args": {"step": body.step}})
            continue
        sid = env.session_id
        state = states.get(pid)
        if state is None:
            state = states[pid] = LifecycleState(tolerate_unknown=True, confirm_used=confirm_for and confirm_for(pid))
        state, produced = reduce_lifecycle(state, env)
        if any(isinstance(o, Violation) for o in produced):
            counts["skipped"] += 1
            continue
        if isinstance(body, SessionOpened):
            counts["sessions"] += 1
            tid = counts["sessions"]
            track = tracks[pid, sid] = _Track(tid, now, sid)
            name = f"{sid} (group {body.group_id} [{body.sample_index}])"
            if part is not None:
                per_partition[part]["sessions"] += 1  # type: ignore[index]
                name += f" {part}"
            emit({"ph": "M", "name": "thread_name", "pid": TRACE_PID, "tid": tid, "ts": 0, "args": {"name": name}})
            emit({"ph": "M", "name": "thread_sort_index", "pid": TRACE_PID, "tid": tid, "ts": 0, "args": {"sort_index": tid}})
            continue
        track = tracks.get((pid, sid))
        if track is None:
            continue  # an unknown event type outside any session in flight
        where = {} if part is None else {"partition": part, "at": f"{part}:{env.lsn}"}
        gen = getattr(body, "generate_s", None)
        if isinstance(body, CommandRan):
            counts["commands"] += 1
            emit(_span("command", "command", track, now, body.duration_s,
                       {"command": body.command[:200], "exit_code": body.exit_code, "budget_exceeded": body.budget_exceeded, **where}))
        elif isinstance(body, SandboxSnapshotted):
            counts["snapshots"] += 1
            emit(_span(f"snapshot before turn {body.turn_index}", "snapshot", track, now, body.seconds,
                       {"digest": body.digest, "files": body.files, "bytes": body.bytes, "new_bytes": body.new_bytes, **where}))
        elif isinstance(body, SessionResumed):
            counts["resumes"] += 1
            emit({"ph": "i", "s": "t", "name": f"resumed (incarnation {body.incarnation})", "cat": "resume", "pid": TRACE_PID,
                  "tid": track.tid, "ts": now, "args": {"incarnation": body.incarnation, "durable_turns": body.durable_turns,
                                                        "snapshot": body.snapshot, "snapshot_turn": body.snapshot_turn,
                                                        "worker": body.worker, **where}})
        elif gen is not None:  # a turn, whatever its encoding (full prompt or delta)
            counts["turns"] += 1
            emit(_span(f"turn {getattr(body, 'turn_index', '?')}", "turn", track, now, gen,
                       {"policy_version": getattr(body, "policy_version", None),
                        "finish_reason": getattr(body, "finish_reason", None), "generate_s": gen, **where}))
        for o in produced:
            if isinstance(o, SessionSummary):
                counts["terminal"] += 1
                del tracks[pid, sid]
                label = o.status if o.status == "finished" else f"{o.status}: {o.reason}"
                args: dict[str, Any] = {"status": o.status, "reason": o.reason, "turns": o.turns}
                if o.status == "finished":
                    args["reward"] = o.reward
                if o.error:
                    args["error"] = o.error[:500]
                if o.resumes:
                    args["resumes"] = o.resumes
                args.update(where)
                emit({"ph": "X", "name": "session", "cat": "session", "pid": TRACE_PID, "tid": track.tid, "ts": track.opened_us,
                      "dur": max(0.0, now - track.opened_us), "args": args})
                emit({"ph": "i", "s": "t", "name": label, "cat": "terminal", "pid": TRACE_PID, "tid": track.tid, "ts": now, "args": args})
    for (pid, _sid), track in tracks.items():  # still in flight at the end of the log
        counts["in_flight"] += 1
        emit({"ph": "X", "name": "session (in flight)", "cat": "session", "pid": TRACE_PID, "tid": track.tid, "ts": track.opened_us,
              "dur": max(0.0, last_us - track.opened_us),
              "args": {"status": "in flight"} if pid is None else {"status": "in flight", "partition": f"p{pid:04d}"}})
    other: dict[str, Any] = {"log": log, "first_ts_ns": t0, **counts}
    if per_partition is not None:
        other["partitions"] = dict(sorted(per_partition.items()))
    out.write('\n],"otherData":' + dumps(other) + "}\n")
    return counts


def run(args) -> int:
    """Stream the log into the trace file, written atomically."""
    path = check_log_path(args.log)
    check_output_path(path, args.output)
    try:
        # Not fsynced (durable=False): a trace is rebuilt from the log.
        with atomic_file(args.output, "w", encoding="utf-8", durable=False) as f:
            confirm_for = id_scans_of(path)
            if path.partitioned:
                counts = write_trace(read_tagged(path, quiet=args.quiet, desc="trace"), f, log=str(path), partitions=path.partitions(),
                                     confirm_for=confirm_for)
            else:
                counts = write_trace(read_records(path, quiet=args.quiet, desc="trace"), f, log=str(path), confirm_for=confirm_for)
    except OSError as exc:
        raise CliError(f"{args.output}: cannot write: {exc.strerror or exc}", EXIT_USAGE) from None
    print(f"{args.output}: {counts['sessions']} sessions ({counts['in_flight']} in flight), {counts['turns']} turns, "
          f"{counts['commands']} commands; open it in ui.perfetto.dev or chrome://tracing")
    return EXIT_OK
