"""`agentlog tail LOG [--summary]`: follow a live log (written by any process).

Prints each event as it becomes durable, in the ``replay`` line format with
the session's state before -> after; or, with ``--summary``, a table of
sessions by state, groups released and reward so far, refreshed in place on
a terminal (one summary line per change otherwise). Runs until interrupted.
Only durable records are ever shown (:func:`agentlog.events.log.read.follow_log`).

LOG may be a directory that does not hold a log yet (empty, or only a
writer's lock): tail then waits for the first record.

A partitioned log (a run folder whose ``rollout/`` holds ``p%04d``
partitions, or that ``rollout/`` itself) is followed in every partition,
including partitions created after tail started (a new worker's; looked for
every ``DISCOVER_S``), and a run folder whose ``rollout/`` is still empty
waits to see whether one log or partitions appear. Lines are printed as each
partition's records become durable, so lines of different partitions
interleave in arrival order (a live merge cannot wait for the slowest
partition; ``agentlog replay`` gives the time-ordered merge), each named
``p0003:1234`` (partition:LSN), with one lifecycle fold per partition.
``--summary`` counts over all partitions, its position the last LSN of each.

A run's stream on JetStream (``nats://host:port/stream``) is followed the
same way, every partition subject of it, one found later included (the
stream's subjects are listed every ``DISCOVER_S``); ``.../stream/p0003``
follows one. Only acknowledged messages exist there, so every record shown
is durable. A stream not created yet is waited for, as a log directory is.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.events.log.source import LogSource
from agentlog.tools.cli_common import check_log_path, id_scans_of, record_id, reduce_config_of

REFRESH_S = 0.5
#: How often a partitioned log (or a folder holding no log yet) is looked at for new partitions.
DISCOVER_S = 0.5


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("tail", help="follow a live log: events, or --summary for a refreshing table")
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("--summary", action="store_true", help="a refreshing table of sessions by state, groups, reward")
    p.set_defaults(func=run)


#: Columns of the terminal table: (header, how to read the cell from a snapshot).
_COLUMNS = (
    ("open", lambda s: s["sessions"]["open"]),
    ("running", lambda s: s["sessions"]["running"]),
    ("finished", lambda s: s["sessions"]["finished"]),
    ("aborted", lambda s: s["sessions"]["aborted"]),
    ("dropped", lambda s: s["sessions"]["dropped"]),
    ("groups released", lambda s: s["groups"]["released"]),
    ("skipped", lambda s: s["groups"]["skipped"]),
    ("reward mean", lambda s: "-" if s["reward"]["mean"] != s["reward"]["mean"] else f"{s['reward']['mean']:.3f}"),
    ("rewards", lambda s: s["reward"]["count"]),
)


def summary_table(snap: dict[str, Any], width: int = 1 << 16) -> list[str]:
    """The summary for a terminal ``width`` columns wide: a small right-aligned
    text table (title, header, rule, row), or, when that is wider than the
    terminal, one ``column  value`` line per column. Plain text: it needs
    nothing beyond the standard library. No line is longer than ``width``
    (a wrapped line would throw the in-place redraw off)."""
    title = f"agentlog tail: {snap['log']}  (lsn {snap['lsn_last']}, {snap['events']} events)"
    cells = [str(read(snap)) for _, read in _COLUMNS]
    widths = [max(len(h), len(c)) for (h, _), c in zip(_COLUMNS, cells)]
    if sum(widths) + 2 * (len(widths) - 1) <= width:
        lines = [
            title,
            "  ".join(h.rjust(w) for (h, _), w in zip(_COLUMNS, widths)),
            "  ".join("-" * w for w in widths),
            "  ".join(c.rjust(w) for c, w in zip(cells, widths)),
        ]
    else:
        name_w = max(len(h) for h, _ in _COLUMNS)
        lines = [title] + [f"{h:<{name_w}}  {c}" for (h, _), c in zip(_COLUMNS, cells)]
    return [line[:width] for line in lines]


def _redraw(out: Any, lines: list[str], drawn: int) -> int:
    """Draw ``lines`` over the ``drawn`` lines drawn before (ANSI: cursor up, clear to end)."""
    up = f"\x1b[{drawn}F" if drawn else ""
    out.write(up + "\x1b[J" + "\n".join(lines) + "\n")
    out.flush()
    return len(lines)


def summary_line(snap: dict[str, Any]) -> str:
    """The summary as one line (for pipes and logs)."""
    ses, g, rw = snap["sessions"], snap["groups"], snap["reward"]
    mean = rw["mean"]
    return (
        f"lsn {snap['lsn_last']}: open {ses['open']} running {ses['running']} finished {ses['finished']}"
        f" aborted {ses['aborted']} dropped {ses['dropped']} | groups released {g['released']} skipped {g['skipped']}"
        f" | reward mean {'-' if mean != mean else f'{mean:.3f}'} n {rw['count']}"
    )


def follow_tagged(source: LogSource, *, batches: bool = False) -> Any:
    """Follow ``source`` forever (:meth:`~agentlog.events.log.source.LogSource.follow_tagged`):
    ``(None, record)`` for one log, ``(partition id, envelope)`` for a partitioned
    one (looked at for new partitions every DISCOVER_S); waits for a log not created yet."""
    return source.follow_tagged(batches=batches, discover_s=DISCOVER_S)


async def _tail_events(path: LogSource) -> None:
    from agentlog.reducers.lifecycle import LifecycleState, Violation, reduce_lifecycle

    from agentlog.events.schema.types import PolicyUpdated
    from agentlog.tools.cmd_replay import format_step

    # One fold per partition (None: the one log): LSNs rise, and sessions live, within a partition.
    states: dict[int | None, LifecycleState] = {}
    confirm_for = id_scans_of(path)
    out = sys.stdout
    async for pid, env in follow_tagged(path):
        state = states.get(pid)
        if state is None:
            # Unknown event types shown, not interpreted (a newer writer's); a reused id confirmed by a scan.
            state = states[pid] = LifecycleState(tolerate_unknown=True, confirm_used=confirm_for(pid))
        learner = isinstance(env.body, PolicyUpdated)
        before = None if learner else state.state_of(env.session_id)
        state, produced = reduce_lifecycle(state, env)
        after = None if learner else state.state_of(env.session_id)
        viol = [o for o in produced if isinstance(o, Violation)]
        out.write("\n".join(format_step(env, before, after, viol, None if pid is None else record_id(pid, env.lsn))) + "\n")
        out.flush()


async def _tail_summary(path: LogSource) -> None:
    from agentlog.reducers.runstats import RunStats, decode_projection

    stats = RunStats.of(reduce_config_of(path))
    changed = asyncio.Event()
    last_lsn: dict[int, int] = {}  # a partitioned log's last LSN per partition

    async def consume() -> None:
        pos = 0
        async for pid, rec in follow_tagged(path, batches=True):
            if pid is None:
                # One log: frames the scanner builds in bulk, no RawRecord per record.
                for fr in rec:
                    stats.feed_record(fr.lsn, fr.session_id, fr.session_seq, fr.ts_ns, decode_projection(fr.payload), fr.payload)
            else:
                # An envelope. The fold checks that LSNs rise: it is fed the arrival position; the title names each partition's LSN.
                stats.feed_record(pos, rec.session_id, rec.session_seq, rec.ts_ns, rec.body)
                pos += 1
                last_lsn[pid] = rec.lsn
            changed.set()

    def snapshot() -> dict[str, Any]:
        snap = {**stats.snapshot(), "log": str(path)}
        if last_lsn:
            snap["lsn_last"] = " ".join(record_id(pid, lsn) for pid, lsn in sorted(last_lsn.items()))
        return snap

    task = asyncio.ensure_future(consume())
    try:
        if sys.stdout.isatty():
            import shutil

            def frame() -> list[str]:
                width = max(20, shutil.get_terminal_size().columns - 1)
                return summary_table(snapshot(), width)

            # Refreshed in place; the first frame is drawn at once, even for an empty log.
            drawn = _redraw(sys.stdout, frame(), 0)
            while not task.done():
                await asyncio.sleep(REFRESH_S)
                if changed.is_set():
                    changed.clear()
                    drawn = _redraw(sys.stdout, frame(), drawn)
        else:
            last = None
            while not task.done():
                await asyncio.sleep(REFRESH_S)
                if changed.is_set():
                    changed.clear()
                    line = summary_line(snapshot())
                    if line != last:
                        sys.stdout.write(line + "\n")
                        sys.stdout.flush()
                        last = line
        await task  # re-raise what ended the follower
    finally:
        task.cancel()


def _wait_for_stream(arg: str) -> Any:
    """:func:`check_log_path` for tail: a stream on JetStream that does not
    exist yet (a run about to start) is waited for, as a log directory is."""
    from agentlog.tools.cli_common import StreamMissing

    while True:
        try:
            return check_log_path(arg, allow_empty=True)
        except StreamMissing:
            time.sleep(DISCOVER_S)


def run(args) -> int:
    """Follow until interrupted."""
    import msgspec

    from agentlog.events.log.api import LogError, NotALog

    path = _wait_for_stream(args.log)
    try:
        asyncio.run(_tail_summary(path) if args.summary else _tail_events(path))
    except NotALog as exc:  # e.g. a stray entry appeared beside the partitions: list_partitions names it
        raise CliError(str(exc), EXIT_USAGE) from None
    except LogError as exc:
        raise CliError(f"{path}: {exc}", EXIT_DATA) from None
    except msgspec.DecodeError as exc:
        raise CliError(f"{path}: a payload is not a schema-v1 event: {exc}", EXIT_DATA) from None
    return EXIT_OK
