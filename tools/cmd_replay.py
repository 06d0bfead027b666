"""`agentlog replay LOG [--session ID] [--group ID] [--status S] [--reason R]
[--flag F] [--from LSN] [--until LSN] [--json]`: the timeline, one line per event, with
the session's state before -> after (from the lifecycle reducer's replay
helper, :func:`reducers.lifecycle.replay`) and a short summary.

Lifecycle violations (a ``session_seq`` gap or repeat, an event after the
terminal one, an illegal move, a reused id, ...; the one check every fold
composes, :func:`reducers.lifecycle_step.evolve`) are shown in place, one
``!! VIOLATION`` line each naming the LSN, the session and the kind; the
replay carries on (the record is not applied; a gap resynchronises the
sequence), a closing note on stderr counts them, and the exit status stays 0:
showing them is this command's job (``verify`` and ``reconstruct`` exit 1).

``--status`` and ``--reason`` select sessions by how they ended (or ``open``
/ ``running`` for sessions still in flight at the end of the range), and
``--flag`` by a health flag they carry at the end of the range
(:mod:`reducers.health`, folded with the run's reduce settings), which
needs a first, cheap pass over the log. A filter value that matches no
session is an error naming the values that exist (:data:`FILTER_RULE`).

A partitioned log (a run folder whose ``rollout/`` holds ``p%04d``
partitions) is replayed merged, in the order of
:func:`events.log.partitions.read_partitions` (by timestamp, ties by partition
then LSN: the same files always give the same timeline); each event is
named by partition and LSN, ``p0003:1234`` (``--json``: ``"partition"`` and
``"lsn"``). ``--from``/``--until`` take one log's LSNs, so they are refused
there: name one partition (``run/rollout/p0003``) to use them.
"""

from __future__ import annotations

import sys
from typing import Any

from agentlog.reducers.health import ALL_FLAGS
from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import (
    add_quiet, check_log_path, fmt_ts, id_scans_of, merged_id_scans, nonneg_int, read_records, read_tagged, record_id,
)

STATUSES = ("open", "running", "finished", "aborted", "dropped")
#: The rule every selection filter follows (printed by --help).
FILTER_RULE = (
    "Filters: --session, --group, --status, --reason and --flag each name a value that must occur in the log "
    "(up to --until): a value that matches no session is an error (exit 2) whose one line names the filter "
    "and the values the log does hold. Filters that each match but select no event together print nothing "
    "(exit 0)."
)
#: How many existing values an unknown-filter error lists.
VALUES_SHOWN = 8
_TOKEN_FIELDS = ("prompt_ids", "output_ids", "new_prompt_ids")
_LOGPROB_FIELDS = ("output_log_probs",)
#: Hex digits of a snapshot digest shown in text lines (the JSON has all 64).
DIGEST_SHOWN = 8


def command_outcome(cmd: Any) -> str:
    """How a recorded command ended: ``exit 3``, or why it has no exit code
    (its budget ran out, or it left no done marker: it never reported one)."""
    if cmd.exit_code is not None:
        return f"exit {cmd.exit_code}" + ("  BUDGET EXCEEDED" if cmd.budget_exceeded else "")
    if cmd.budget_exceeded:
        return "no exit code (killed: BUDGET EXCEEDED)"
    return "no exit code (it left no done marker)"


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "replay",
        help="the timeline: one line per event with state before -> after; lifecycle violations shown in place (exit 0)",
        epilog=FILTER_RULE,
    )
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("--session", metavar="ID", help="only this session")
    p.add_argument("--group", metavar="ID", help="only sessions of this group")
    p.add_argument("--status", choices=STATUSES, help="only sessions that ended so (open/running: still in flight)")
    p.add_argument("--reason", metavar="R", help="only sessions aborted or dropped with this reason")
    p.add_argument("--flag", choices=ALL_FLAGS, metavar="F",
                   help=f"only sessions carrying this health flag at the end of the range ({', '.join(ALL_FLAGS)})")
    p.add_argument("--from", dest="from_lsn", type=nonneg_int, metavar="LSN", help="start printing at this LSN")
    p.add_argument("--until", dest="until_lsn", type=nonneg_int, metavar="LSN", help="stop after this LSN")
    p.add_argument("--json", action="store_true", help="one JSON object per event (token arrays as lists)")
    add_quiet(p)
    p.set_defaults(func=run)


# ---------------------------------------------------------------- formatting (shared with tail)


def _short(text: Any, n: int = 60) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[: n - 3] + "..."


def _reward(r: Any) -> str:
    if isinstance(r, float):
        return f"{r:g}"
    if isinstance(r, dict):
        return "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()) + "}"
    return str(r)


def event_summary(body: Any) -> str:
    """A short human summary of an event body."""
    from agentlog.events.schema.types import UnknownEvent, event_tag

    if type(body) is UnknownEvent:
        return f"UNKNOWN event type (written by a newer agentlog), fields: {', '.join(body.fields) or '-'}"
    tag = event_tag(body)
    if tag == "session_opened":
        return f"group {body.group_id} [{body.sample_index}/{body.group_size}] agent {body.agent or '-'} policy v{body.policy_version}"
    if tag == "session_started":
        return f"harness {body.harness or '-'} sandbox {body.sandbox or '-'}"
    if tag == "turn_recorded":
        extra = " ill-formed" if body.ill_formed else ""
        lp = "" if body.output_log_probs else " (no log-probs)"
        return (
            f"turn {body.turn_index}: in {len(body.prompt_ids) // 4} out {len(body.output_ids) // 4} tokens,"
            f" finish {body.finish_reason}{extra}{lp}"
        )
    if tag == "turn_delta":
        extra = " ill-formed" if body.ill_formed else ""
        lp = "" if body.output_log_probs else " (no log-probs)"
        return (
            f"turn {body.turn_index}: in {body.shared_tokens + len(body.new_prompt_ids) // 4}"
            f" ({len(body.new_prompt_ids) // 4} new) out {len(body.output_ids) // 4} tokens,"
            f" {len(body.new_messages)} new messages, finish {body.finish_reason}{extra}{lp}"
        )
    if tag == "turn_undelivered":
        return f"turn {body.turn_index} undelivered: {body.reason or '-'}"
    if tag == "command_ran":
        return f"$ {_short(body.command, 50)} -> {command_outcome(body)} in {body.duration_s:.2f}s"
    if tag == "sandbox_snapshotted":
        return snapshot_summary(body)
    if tag == "session_resumed":
        return resume_summary(body)
    if tag == "reward_assigned":
        return f"reward {_reward(body.reward)}" + (f" from {body.source}" if body.source else "")
    if tag == "session_finished":
        return "reward " + ("(last assigned)" if body.reward is None else _reward(body.reward))
    if tag == "session_aborted":
        return f"reason {body.reason}" + (f": {_short(body.error)}" if body.error else "")
    if tag == "session_dropped":
        return f"reason {body.reason}"
    if tag == "policy_updated":
        return f"step {body.step} -> policy v{body.policy_version}, {len(body.groups)} groups"
    return ""


def snapshot_summary(body: Any) -> str:
    """``snapshot before turn 3: 1b1b1b1b... 12 files, 4096 bytes (512 new) in 0.25s`` (a ``sandbox_snapshotted``)."""
    return (f"snapshot before turn {body.turn_index}: {body.digest[:DIGEST_SHOWN]}... {body.files} files, {body.bytes} bytes"
            f" ({body.new_bytes} new) in {body.seconds:.2f}s")


def resume_summary(body: Any) -> str:
    """What a ``session_resumed`` did, in one line: who took over, what it kept and restored."""
    worker = f" on {body.worker}" if body.worker else ""
    return (f"incarnation {body.incarnation}{worker}: keeps {body.durable_turns} durable turn(s), sandbox restored from"
            f" {body.snapshot[:DIGEST_SHOWN]}... (before turn {body.snapshot_turn})")


def _state(s: Any) -> str:
    return "-" if s is None else str(s)


def format_step(env: Any, before: Any, after: Any, violations: Any = (), label: str | None = None) -> list[str]:
    """The text lines of one replayed event (the event, then any violation);
    ``label`` names the event instead of its LSN (``p0003:1234`` in a merged replay)."""
    from agentlog.events.schema.types import event_tag

    tag = event_tag(env.body)
    if label is not None:
        return [f"{label:>12}  {fmt_ts(env.ts_ns)}  {env.session_id}  #{env.session_seq:<3} {tag:<19}"
                f" {_state(before):>8} -> {_state(after):<8}  {event_summary(env.body)}"] + [
            f"{label:>12}  !! VIOLATION {label} session {v.session_id!r}: {v.describe()}" for v in violations]
    lines = [
        f"{env.lsn:>8}  {fmt_ts(env.ts_ns)}  {env.session_id}  #{env.session_seq:<3} {tag:<19}"
        f" {_state(before):>8} -> {_state(after):<8}  {event_summary(env.body)}"
    ]
    for v in violations:
        lines.append(f"{env.lsn:>8}  !! VIOLATION lsn {v.lsn} session {v.session_id!r}: {v.describe()}")
    return lines


def event_fields(body: Any) -> dict[str, Any]:
    """An event body's fields as JSON-ready data (token arrays as lists; an
    unknown event's fields as stored, marked ``"unknown": true``)."""
    import msgspec

    from agentlog.events.schema.types import UnknownEvent, log_probs_view, tokens_view

    if type(body) is UnknownEvent:
        return {**body.fields, "unknown": True}
    d = {k: v for k, v in msgspec.structs.asdict(body).items() if v is not msgspec.UNSET}  # unset: not stored
    for f in _TOKEN_FIELDS:
        if f in d:
            d[f] = tokens_view(d[f]).tolist()
    for f in _LOGPROB_FIELDS:
        if f in d:
            d[f] = log_probs_view(d[f]).tolist()
    return d


def step_json(env: Any, before: Any, after: Any, violations: Any = ()) -> dict[str, Any]:
    """One replayed event as the ``--json`` object."""
    from agentlog.events.schema.types import event_tag

    out = {
        "lsn": env.lsn,
        "session_id": env.session_id,
        "session_seq": env.session_seq,
        "ts_ns": env.ts_ns,
        "type": event_tag(env.body),
        "state_before": None if before is None else str(before),
        "state_after": None if after is None else str(after),
    }
    fields = event_fields(env.body)
    shadowed = {k: fields.pop(k) for k in list(fields) if k in out}  # a newer writer's field named like a header
    out.update(fields)
    if shadowed:
        out["shadowed_fields"] = shadowed
    if violations:
        out["violations"] = [v.describe() for v in violations]
    return out


# ---------------------------------------------------------------- selection


class LogIndex:
    """What the selection filters can match, from one cheap pass (projections
    only) up to ``until``: every session in order of first event; for each
    opened one its group and its status at the end of the range (open /
    running / finished / aborted / dropped); the reason of each abort or drop;
    and, when asked for, each opened session's health flags."""

    def __init__(self) -> None:
        self.sessions: dict[str, None] = {}  # every session id with an event, in order (a dict keeps it)
        self.group: dict[str, str] = {}
        self.status: dict[str, str] = {}  # only sessions with a session_opened
        self.reason: dict[str, str] = {}
        self.flags: dict[str, tuple[str, ...]] = {}  # only when index_log was asked for them

    def select(self, status: str | None, reason: str | None, flag: str | None = None) -> set[str]:
        """The sessions whose outcome is ``status`` (any if None) with ``reason`` (any if None),
        carrying ``flag`` (any if None)."""
        return {
            sid for sid, st in self.status.items()
            if (status is None or st == status) and (reason is None or self.reason.get(sid) == reason)
            and (flag is None or flag in self.flags.get(sid, ()))
        }


def index_log(path: Any, until: int | None, quiet: bool, *, flags: bool = False) -> LogIndex:
    """The :class:`LogIndex` of the log at ``path`` up to ``until``; ``flags``: with each
    session's health flags (:class:`reducers.health.SessionHealth`, the run's reduce settings)."""
    import msgspec

    from agentlog.events.schema.lifecycle import State
    from agentlog.events.schema.types import event_tag
    from agentlog.reducers.fold import SessionFold, Tracked
    from agentlog.reducers.health import SessionHealth
    from agentlog.reducers.runstats import decode_projection
    from agentlog.tools.cli_common import reduce_config_of

    index = LogIndex()
    config = reduce_config_of(path) if flags else None
    health: dict[str, SessionHealth] = {}
    record: list[Any] = [None, ""]  # the record being folded: its stored bytes (a turn's projection needs them), its session

    def opened(lsn: int, sid: str, body: Any, life: Any) -> Tracked:
        index.group[sid] = body.group_id
        if config is not None:
            health[sid] = SessionHealth(sid, config, keep_turns=True)
        return Tracked(life)

    def applied(session: Tracked, lsn: int, tag: str, body: Any) -> None:
        if config is not None:
            health[record[1]].observe(tag, body, record[0])

    def ended(session: Tracked, lsn: int, sid: str, state: State, body: Any) -> None:
        if state is not State.FINISHED:
            index.reason[sid] = body.reason
        if config is not None:
            index.flags[sid] = health.pop(sid).flags()

    # The one fold driver: illegal records are left out here (the replay shows them), and
    # every session is kept after its terminal event (nothing may follow it).
    fold: SessionFold[Tracked] = SessionFold(opened=opened, applied=applied, ended=ended, refused=lambda violation: None,
                                             check_lsn=False, resync=False, evict=False)
    for rec in read_records(path, raw=True, quiet=quiet, desc="select"):
        if until is not None and rec.lsn > until:
            break
        try:
            body = decode_projection(rec.payload)
        except msgspec.DecodeError as exc:
            raise CliError(f"{path}: lsn {rec.lsn}, session {rec.session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA) from None
        tag = event_tag(body)  # an unknown (newer) event keeps its stored tag
        if tag != "policy_updated":  # a learner-log record is no session's
            index.sessions[rec.session_id] = None
        record[0], record[1] = rec.payload, rec.session_id
        fold.feed(rec.lsn, rec.session_id, rec.session_seq, tag, body)
    index.status = {sid: str(session.life.state) for sid, session in fold.live.items()}
    index.flags.update((sid, h.flags()) for sid, h in health.items())  # in flight: the flags so far
    return index


def _examples(values: list[str]) -> str:
    shown = ", ".join(values[:VALUES_SHOWN])
    return shown + (f" and {len(values) - VALUES_SHOWN} more" if len(values) > VALUES_SHOWN else "")


def _counted(values: Any) -> str:
    from collections import Counter

    return ", ".join(f"{v} ({n})" for v, n in sorted(Counter(values).items(), key=lambda kv: (-kv[1], kv[0])))


def unmatched_filter(args: Any, index: LogIndex) -> str | None:
    """The one-line complaint about the first filter of ``args`` whose value matches
    no session of ``index`` (naming the values that do occur), or None."""
    where = f" up to lsn {args.until_lsn}" if args.until_lsn is not None else ""
    at = f"at lsn {args.until_lsn}" if args.until_lsn is not None else "at the end of the log"
    if args.session is not None and args.session not in index.sessions:
        held = f"it holds {len(index.sessions)} sessions{where}: {_examples(list(index.sessions))}" if index.sessions else f"it holds no session{where}"
        return f"--session {args.session!r}: unknown session id (no event of it in the log{where}); {held}"
    if args.group is not None and args.group not in set(index.group.values()):
        groups = list(dict.fromkeys(index.group.values()))
        held = f"groups in the log{where}: {_examples(groups)}" if groups else f"no session_opened declares a group{where}"
        return f"--group {args.group!r}: unknown group id (no session_opened declares it); {held}"
    if args.status is not None and args.status not in index.status.values():
        held = _counted(index.status.values()) or "no session"
        return f"--status {args.status}: no session is {args.status} {at}; statuses {at}: {held}"
    if args.reason is not None and args.reason not in index.reason.values():
        held = _counted(index.reason.values()) or "none (no session was aborted or dropped)"
        return f"--reason {args.reason!r}: no session was aborted or dropped with this reason{where}; reasons in the log: {held}"
    flag = getattr(args, "flag", None)
    if flag is not None and not any(flag in f for f in index.flags.values()):
        held = _counted(f for fs in index.flags.values() for f in fs) or "none (no session carries a flag)"
        return f"--flag {flag}: no session carries this flag {at}; flags {at}: {held}"
    return None


def run(args) -> int:
    """Replay and print."""
    from agentlog.reducers.lifecycle import replay

    from agentlog.events.schema.types import SessionOpened

    path = check_log_path(args.log)
    merged = path.partitioned
    if merged and (args.from_lsn is not None or args.until_lsn is not None):
        raise CliError(
            f"{path}: --from/--until take one log's LSNs, and this log is partitioned (LSNs are per partition);"
            f" replay one partition, e.g. {path}/p0000, to use them", EXIT_USAGE)
    if args.from_lsn is not None and args.until_lsn is not None and args.from_lsn > args.until_lsn:
        raise CliError(f"replay: --from {args.from_lsn} is after --until {args.until_lsn}", EXIT_USAGE)
    chosen = None
    if args.status is not None or args.reason is not None or args.flag is not None:
        # The first pass these filters need also checks every filter before anything is printed.
        index = index_log(path, args.until_lsn, args.quiet, flags=args.flag is not None)
        complaint = unmatched_filter(args, index)
        if complaint is not None:
            raise CliError(f"{path}: {complaint}", EXIT_USAGE)
        chosen = index.select(args.status, args.reason, args.flag)
    current: list[Any] = [None, 0]  # (partition, LSN) of the record replay() last took: it takes one, yields one

    def merged_envs() -> Any:
        import msgspec

        # The lifecycle fold checks that LSNs rise: it is fed the merged position; the output names (partition, LSN).
        for pos, (pid, env) in enumerate(read_tagged(path, quiet=args.quiet, desc="replay")):
            current[0], current[1] = pid, env.lsn
            yield msgspec.structs.replace(env, lsn=pos)

    envs = merged_envs() if merged else read_records(path, quiet=args.quiet, desc="replay")
    out = sys.stdout
    encode = None
    if args.json:
        import msgspec

        encoder = msgspec.json.Encoder()
        encode = encoder.encode
    group_of: dict[str, str] = {}
    seen_session = args.session is None
    seen_group = args.group is None
    shown = 0
    first_violation = None
    n_violations = 0
    from_lsn = args.from_lsn or 0
    # A reused id the id filter alone reports is confirmed by a scan, as verify does (with --session
    # the fold sees one session's records, and its filter no other id's).
    confirm = merged_id_scans(path) if merged else id_scans_of(path)(None)
    for step in replay(envs, session_id=args.session, until_lsn=args.until_lsn, confirm_used=confirm):
        env = step.envelope
        sid = env.session_id
        seen_session = True
        if args.group is not None:
            if isinstance(env.body, SessionOpened):
                group_of[sid] = env.body.group_id
                if env.body.group_id == args.group:
                    seen_group = True
            gid = group_of.get(sid)
            if step.summary is not None:
                group_of.pop(sid, None)
            if gid != args.group:
                continue
        if chosen is not None and sid not in chosen:
            continue
        if env.lsn < from_lsn:
            continue
        if step.violations:
            n_violations += len(step.violations)
            if first_violation is None:
                first_violation = step.violations[0]
                first_at = record_id(*current) if merged else str(first_violation.lsn)
        if encode is not None:
            obj = step_json(env, step.state_before, step.state_after, step.violations)
            if merged:
                obj["partition"], obj["lsn"] = current
            out.write(encode(obj).decode())
            out.write("\n")
        else:
            label = record_id(*current) if merged else None
            out.write("\n".join(format_step(env, step.state_before, step.state_after, step.violations, label)) + "\n")
        shown += 1
    out.flush()
    if not (seen_session and seen_group):
        # Only now, on this rare path, the pass that lists the values the log does hold. No
        # complaint: --session and --group each exist but do not meet (the session is in another group).
        complaint = unmatched_filter(args, index_log(path, args.until_lsn, args.quiet, flags=args.flag is not None))
        if complaint is not None:
            raise CliError(f"{path}: {complaint}", EXIT_USAGE)
    if first_violation is not None:
        # Shown, not an error: a note after the timeline (stdout stays the timeline, JSON lines too).
        v = first_violation
        sys.stderr.write(
            f"agentlog: note: {path}: {n_violations} lifecycle violation(s) shown; first at lsn {first_at},"
            f" session {v.session_id!r}: {v.describe()}\n"
        )
    return EXIT_OK
