"""`agentlog tail LOG [--summary]`: follow a live log (written by any process).

Prints each event as it becomes durable, in the ``replay`` line format with
the session's state before -> after; or, with ``--summary``, a table of
sessions by state, groups released and reward so far, refreshed in place on
a terminal (one summary line per change otherwise). Runs until interrupted.
Only durable records are ever shown (:func:`events.log.follow_log`).

LOG may be a directory that does not hold a log yet (empty, or only a
writer's lock): tail then waits for the first record.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from tools.cli import EXIT_DATA, EXIT_OK, CliError
from tools.cli_common import check_log_path

REFRESH_S = 0.5


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("tail", help="follow a live log: events, or --summary for a refreshing table")
    p.add_argument("log", metavar="LOG", help="the log directory")
    p.add_argument("--summary", action="store_true", help="a refreshing table of sessions by state, groups, reward")
    p.set_defaults(func=run)


def _summary_table(snap: dict[str, Any]) -> Any:
    from rich.table import Table

    ses, g, rw = snap["sessions"], snap["groups"], snap["reward"]
    t = Table(title=f"agentlog tail: {snap['log']}  (lsn {snap['lsn_last']}, {snap['events']} events)")
    for col in ("open", "running", "finished", "aborted", "dropped", "groups released", "skipped", "reward mean", "rewards"):
        t.add_column(col, justify="right")
    mean = rw["mean"]
    t.add_row(
        str(ses["open"]), str(ses["running"]), str(ses["finished"]), str(ses["aborted"]), str(ses["dropped"]),
        str(g["released"]), str(g["skipped"]), "-" if mean != mean else f"{mean:.3f}", str(rw["count"]),
    )
    return t


def summary_line(snap: dict[str, Any]) -> str:
    """The summary as one line (for pipes and logs)."""
    ses, g, rw = snap["sessions"], snap["groups"], snap["reward"]
    mean = rw["mean"]
    return (
        f"lsn {snap['lsn_last']}: open {ses['open']} running {ses['running']} finished {ses['finished']}"
        f" aborted {ses['aborted']} dropped {ses['dropped']} | groups released {g['released']} skipped {g['skipped']}"
        f" | reward mean {'-' if mean != mean else f'{mean:.3f}'} n {rw['count']}"
    )


async def _tail_events(path: Path) -> None:
    from events.log import follow_log
    from reducers.lifecycle import LifecycleState, Violation, reduce_lifecycle

    from events.types import PolicyUpdated
    from tools.cmd_replay import format_step

    state = LifecycleState(tolerate_unknown=True)  # shown, not interpreted: a newer writer's event types
    out = sys.stdout
    async for env in follow_log(path):
        learner = isinstance(env.body, PolicyUpdated)
        before = None if learner else state.state_of(env.session_id)
        state, produced = reduce_lifecycle(state, env)
        after = None if learner else state.state_of(env.session_id)
        viol = [o for o in produced if isinstance(o, Violation)]
        out.write("\n".join(format_step(env, before, after, viol)) + "\n")
        out.flush()


async def _tail_summary(path: Path) -> None:
    from events.log import follow_log
    from reducers.runstats import RunStats, decode_projection

    stats = RunStats()
    changed = asyncio.Event()

    async def consume() -> None:
        async for rec in follow_log(path, raw=True):
            stats.feed_record(rec.lsn, rec.session_id, rec.ts_ns, decode_projection(rec.payload))
            changed.set()

    task = asyncio.ensure_future(consume())
    try:
        if sys.stdout.isatty():
            from rich.live import Live

            def snap() -> dict[str, Any]:
                return {**stats.snapshot(), "log": str(path)}

            with Live(_summary_table(snap()), refresh_per_second=4, transient=False) as live:
                while not task.done():
                    await asyncio.sleep(REFRESH_S)
                    if changed.is_set():
                        changed.clear()
                        live.update(_summary_table(snap()))
        else:
            last = None
            while not task.done():
                await asyncio.sleep(REFRESH_S)
                if changed.is_set():
                    changed.clear()
                    line = summary_line({**stats.snapshot(), "log": str(path)})
                    if line != last:
                        sys.stdout.write(line + "\n")
                        sys.stdout.flush()
                        last = line
        await task  # re-raise what ended the follower
    finally:
        task.cancel()


def run(args) -> int:
    """Follow until interrupted."""
    import msgspec

    from events.log_api import LogError

    path = check_log_path(args.log, allow_empty=True)
    try:
        asyncio.run(_tail_summary(path) if args.summary else _tail_events(path))
    except LogError as exc:
        raise CliError(f"{path}: {exc}", EXIT_DATA) from None
    except msgspec.DecodeError as exc:
        raise CliError(f"{path}: a payload is not a schema-v1 event: {exc}", EXIT_DATA) from None
    return EXIT_OK
