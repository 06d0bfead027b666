"""`agentlog stats LOG [--json]`: sessions by status, abort and drop reasons,
turns and tokens, reward statistics, groups complete/skipped, the ended
sessions per health flag (:mod:`reducers.health`), time span.

One pass over raw frames, decoding only the fields the statistics need
(:mod:`reducers.runstats`). Events of types this version does not know (a
newer writer's) are counted under "unknown events", per tag.

Lifecycle violations (a ``session_seq`` gap or repeat, an event after the
terminal one, an illegal move, a reused id, ...; the one check every fold
composes, :func:`reducers.lifecycle_step.evolve`) are counted, not applied:
the report shows their count by kind and the first few with LSN and session,
and the command then exits 1 (after printing).

A partitioned log (a run folder whose ``rollout/`` holds ``p%04d``
partitions) is aggregated over all partitions, read merged
(:func:`events.log.partitions.read_partitions`); the report adds each
partition's event count and LSN range, and names violations by
``pNNNN:LSN``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, CliError
from agentlog.tools.cli_common import (
    add_quiet, check_log_path, fmt_ts, id_scans_of, merged_id_scans, read_frame_batches, read_tagged, record_id,
    reduce_config_of,
)


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser(
        "stats",
        help="sessions by status, reasons, turns, tokens, rewards, groups, time span; counts lifecycle violations (exit 1 if any)",
    )
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_quiet(p)
    p.set_defaults(func=run)


def compute_stats(path: Any, *, quiet: bool = False) -> dict[str, Any]:
    """Statistics of the log at ``path`` (already checked) as plain data; groups and
    rewards are counted with the run folder's own reduce settings (:func:`reduce_config_of`)."""
    import msgspec

    from agentlog.events.log.api import SchemaError
    from agentlog.reducers.runstats import RunStats, decode_projection

    if path.partitioned:
        return _partitioned_stats(path, quiet)
    stats = RunStats.of(reduce_config_of(path), confirm_used=id_scans_of(path)(None))
    feed = stats.feed_record
    decode = decode_projection
    rec = None
    try:
        # The hot loop of `stats`: one projection decode and one fold step per
        # record, over frames the scanner builds in bulk (no per-record
        # generators or RawRecords between them and the fold).
        for batch in read_frame_batches(path, quiet=quiet, desc="stats"):
            for rec in batch:
                payload = rec.payload
                feed(rec.lsn, rec.session_id, rec.session_seq, rec.ts_ns, decode(payload), payload)
    except msgspec.DecodeError as exc:
        # Only decode() raises DecodeError, so a record was read: rec names it.
        schema = SchemaError.of_payload(exc, rec.payload, lsn=rec.lsn, session_id=rec.session_id)
        if schema is not None:
            raise CliError(f"{path}: {schema}", EXIT_DATA) from None
        raise CliError(
            f"{path}: lsn {rec.lsn}, session {rec.session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA
        ) from None
    out = stats.snapshot()
    out["log"] = str(path)
    return out


def _partitioned_stats(path: Any, quiet: bool) -> dict[str, Any]:
    """compute_stats over a partition root: one fold over the merged records.
    The fold checks that LSNs rise, which holds for a merged position, not
    for per-partition LSNs: it is fed the position, and violations are named
    back by ``pNNNN:LSN``."""
    import msgspec

    from agentlog.events.log.api import SchemaError
    from agentlog.reducers.runstats import RunStats, decode_projection

    stats = RunStats.of(reduce_config_of(path), confirm_used=merged_id_scans(path))  # positions, as the fold is fed
    # Every partition is listed, an empty one with 0 events.
    parts: dict[str, dict[str, Any]] = {f"p{q:04d}": {"events": 0, "lsn_first": None, "lsn_last": None} for q in path.partitions()}
    named: dict[int, str] = {}  # merged position -> pNNNN:LSN, for violations only
    pid = rec = None
    try:
        for pos, (pid, rec) in enumerate(read_tagged(path, raw=True, quiet=quiet, desc="stats")):
            before = stats.violation_count
            stats.feed_record(pos, rec.session_id, rec.session_seq, rec.ts_ns, decode_projection(rec.payload), rec.payload)
            if stats.violation_count != before:
                named[pos] = record_id(pid, rec.lsn)
            p = parts[f"p{pid:04d}"]
            if p["lsn_first"] is None:
                p["lsn_first"] = rec.lsn
            p["events"] += 1
            p["lsn_last"] = rec.lsn
    except msgspec.DecodeError as exc:
        where = f"{path}/p{pid:04d}"
        schema = SchemaError.of_payload(exc, rec.payload, lsn=rec.lsn, session_id=rec.session_id)
        if schema is not None:
            raise CliError(f"{where}: {schema}", EXIT_DATA) from None
        raise CliError(f"{where}: lsn {rec.lsn}, session {rec.session_id!r}: payload is not a schema-v1 event: {exc}", EXIT_DATA) from None
    out = stats.snapshot()
    out["log"] = str(path)
    out["lsn_first"] = out["lsn_last"] = None  # per partition, below
    out["partitions"] = dict(sorted(parts.items()))
    for v in out["violations"]["first"]:
        v["lsn"] = named.get(v["lsn"], v["lsn"])
    return out


def run(args) -> int:
    """Compute and print the statistics."""
    path = check_log_path(args.log)
    stats = compute_stats(path, quiet=args.quiet)
    if args.json:
        import msgspec

        sys.stdout.write(msgspec.json.encode(stats).decode() + "\n")  # NaN -> null
    else:
        sys.stdout.write(render_text(stats))
    v = stats["violations"]
    if v["count"]:
        first = v["first"][0]
        raise CliError(
            f"{path}: {v['count']} lifecycle violation(s) counted; first at lsn {first['lsn']},"
            f" session {first['session_id']!r}: {first['kind']}: {first['message']}",
            EXIT_DATA,
        )
    return EXIT_OK


def _num(x: Any, fmt: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} ({v})" for k, v in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def _flags(counts: dict[str, int]) -> str:
    """The health flags in their fixed order (:data:`reducers.health.ALL_FLAGS`), zeros included."""
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def render_text(s: dict[str, Any]) -> str:
    """The statistics as an aligned text report."""
    ses, turns, tok, rw, g = s["sessions"], s["turns"], s["tokens"], s["reward"], s["groups"]
    snap = s.get("snapshots", {})  # absent from statistics computed before snapshots were counted
    span = s["time_span"]
    lines = [
        f"log        {s['log']}",
    ]
    if "partitions" in s:
        lines.append(f"events     {s['events']} in {len(s['partitions'])} partitions")
        lines += [f"  {name}    {p['events']} (lsn {p['lsn_first']}..{p['lsn_last']})" for name, p in s["partitions"].items()]
    else:
        lines.append(f"events     {s['events']} (lsn {s['lsn_first']}..{s['lsn_last']})")
    if span:
        lines.append(f"time span  {fmt_ts(span['first_ts_ns'])} .. {fmt_ts(span['last_ts_ns'])} ({span['seconds']:.1f} s)")
    lines += [
        f"sessions   {ses['total']}: finished {ses['finished']}, aborted {ses['aborted']}, dropped {ses['dropped']},"
        f" open {ses['open']}, running {ses['running']}",
        f"duration   mean {_num(ses['duration_mean_s'], '.2f')} s, max {_num(ses['duration_max_s'], '.2f')} s",
        f"aborted by {_counts(s['abort_reasons'])}",
        f"dropped by {_counts(s['drop_reasons'])}",
        f"turns      {turns['total']} (mean {_num(turns['mean_per_session'], '.2f')} per session),"
        f" undelivered {turns['undelivered']}, interrupted by a weight update {turns['interrupted']},"
        f" finish {_counts(turns['finish_reasons'])}",
        f"tokens     prompt {tok['prompt']}, output {tok['output']}",
        f"commands   {s['commands']['total']}, failed {s['commands']['failed']}, over budget {s['commands']['over_budget']}",
        *([f"teacher    {s['teacher']['scored_turns']} turns scored, {s['teacher']['failed_turns']} failed"]
          if s["teacher"]["scored_turns"] or s["teacher"]["failed_turns"] else []),
        *([f"resumed    {ses['resumed']} session(s), {ses['resumes']} resume(s) (each a new incarnation from the last durable turn)"]
          if ses.get("resumes") else []),
        *([f"snapshots  {snap['count']}, {snap['bytes']} bytes ({snap['new_bytes']} new to the store), {snap['seconds']:.2f} s"]
          if snap.get("count") else []),
        f"reward     n {rw['count']}, mean {_num(rw['mean'])}, std {_num(rw['std'])}, min {_num(rw['min'])},"
        f" max {_num(rw['max'])}, unusable {rw['unusable']}",
        f"groups     released {g['released']}: complete {g['complete']}, skipped {g['skipped']}; pending {g['pending']}",
    ]
    if g["skip_reasons"]:
        lines.append(f"skipped by {_counts(g['skip_reasons'])}")
    if g["refills_owed"] or g["replacements"] or g["aborted_as_failures"]:
        lines.append(f"aborts     {g['refills_owed']} refilled ({g['replacements']} replacements opened), "
                     f"{g['aborted_as_failures']} counted as failures")
    lines.append(f"flags      {_flags(s['flags'])} (ended sessions)"
                 + (f"; {g['untrainable_by_flags']} made untrainable by them" if g["untrainable_by_flags"] else ""))
    if s["policy"]["updates"]:
        lines.append(f"policy     {s['policy']['updates']} updates, version {s['policy']['version']}")
    if s["unknown_events"]:
        lines.append(f"unknown events {_counts(s['unknown_events'])} (written by a newer agentlog; not interpreted)")
    if s["violations"]["count"]:
        lines.append(f"VIOLATIONS {s['violations']['count']}: {_counts(s['violations']['by_kind'])}")
        for v in s["violations"]["first"]:
            lines.append(f"  lsn {v['lsn']} session {v['session_id']!r}: {v['kind']}: {v['message']}")
    return "\n".join(lines) + "\n"
