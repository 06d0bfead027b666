"""The engine against plain appends, counted in instructions instead of seconds.

``bench_engine.py`` times the two arms; on a shared VM their rounds can spread
by more than the change being measured (in one run of 2026-12-06 the anchor's
rounds took 0.14–0.24 s). Instructions executed do not depend on the
neighbours: each arm of ``bench_engine`` (the same sessions: open, start, 3
turns of 512 tokens, finish, 1,000 in flight, a FileLog with fsync ``batch``)
runs in a child under valgrind's callgrind (``Ir``, instructions executed),
once with ``--small`` sessions and once with ``--large``; the difference over
the records between them is the cost of a record, with the interpreter's
start, the imports and the set-up cancelled out. Repeat runs agree to within
about 2%.

The arms: the raw appends (the anchor), the engine, the engine with no
periodic checkpoint written (its checkpointer still keeps the frontier of the
records applied), and the engine with no checkpointer at all
(``checkpoint_every=0``): the last two split the checkpoint's cost into its
per-record bookkeeping and its snapshots. valgrind runs without the
CPU's SHA extensions, so the checkpoint file's SHA-256 counts for more here
than it costs natively (a few ms a run, in a worker thread).

Information beside ``engine_vs_raw_append``, which stays a goal on time: no
GOAL line of its own. Needs valgrind (``apt-get install valgrind``); about
four minutes on 2 cores (each child runs ~50x slower than natively).

Usage: ``python tools/bench/bench_engine_instructions.py [--small N] [--large N] [--jobs J]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECORDS_PER_SESSION = 6  # open, start, 3 turns, finish
ARMS = ("raw", "engine", "engine_no_snapshots", "engine_no_checkpointer")
_COLLECTED = re.compile(r"Collected : (\d+)")


def run_arm(arm: str, sessions: int) -> None:
    """In the child: one arm of bench_engine over ``sessions`` sessions, in a fresh directory."""
    from agentlog.tools.bench import bench_engine as be

    if arm not in ARMS:
        raise ValueError(f"arm: expected one of {', '.join(ARMS)}, found {arm!r}")
    options = {"engine_no_snapshots": {"checkpoint_every": 10**12}, "engine_no_checkpointer": {"checkpoint_every": 0}}
    toks, lps = be._payload(512)
    d = Path(tempfile.mkdtemp(prefix="bench_engine_ir_"))
    try:
        if arm == "raw":
            asyncio.run(be.run_raw(d / "log", sessions, 1000, 3, toks, lps))
        else:
            asyncio.run(be.run_engine(d / "log", sessions, 1000, 3, toks, lps, **options.get(arm, {})))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def instructions(arm: str, sessions: int) -> int:
    """Instructions the child running ``arm`` over ``sessions`` sessions executed (callgrind's Ir)."""
    return callgrind_count([__file__, "--child", arm, str(sessions)], f"{arm} over {sessions} sessions")


def callgrind_count(script_args: list[str], what: str, valgrind_options: tuple[str, ...] = ()) -> int:
    """Instructions (callgrind's Ir) that ``python *script_args`` executed under callgrind, every
    thread, where it collected (everywhere, unless ``valgrind_options`` say otherwise). Raises
    RuntimeError naming ``what`` when the child failed or callgrind counted nothing."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *valgrind_options, sys.executable, *script_args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{what} under callgrind: exit {done.returncode}, "
                           f"expected a 'Collected : N' line; stderr ends: {done.stderr[-800:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=1000, help="sessions in the smaller run of each arm")
    ap.add_argument("--large", type=int, default=3000, help="sessions in the larger run of each arm")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="children at once")
    ap.add_argument("--child", nargs=2, metavar=("ARM", "SESSIONS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_arm(args.child[0], int(args.child[1]))
        return 0
    if shutil.which("valgrind") is None:
        print("bench_engine_instructions: valgrind is not on PATH (apt-get install valgrind)", file=sys.stderr)
        return 2
    if not 0 < args.small < args.large:
        ap.error(f"--small and --large: expected 0 < small < large, found {args.small} and {args.large}")
    from agentlog.tools.progress import new_bar

    runs = [(arm, n) for arm in ARMS for n in (args.small, args.large)]
    print(f"bench_engine_instructions: {len(ARMS)} arms x ({args.small:,}, {args.large:,}) sessions under callgrind, "
          f"{args.jobs} at once")
    counted: dict[tuple[str, int], int] = {}
    with ThreadPoolExecutor(args.jobs) as pool, new_bar(len(runs), "callgrind runs", leave=False) as bar:
        futures = {pool.submit(instructions, arm, n): (arm, n) for arm, n in runs}
        for fut, key in futures.items():
            counted[key] = fut.result()
            bar.update(1)
    records = (args.large - args.small) * RECORDS_PER_SESSION
    per = {arm: (counted[(arm, args.large)] - counted[(arm, args.small)]) / records for arm in ARMS}
    print(f"{'arm':<58}{'instructions a record':>24}{'vs raw':>10}")
    for arm in ARMS:
        print(f"{arm:<58}{per[arm]:>24,.0f}{per[arm] / per['raw']:>9.2f}x")
    print(f"frontier kept (engine_no_snapshots - engine_no_checkpointer) {per['engine_no_snapshots'] - per['engine_no_checkpointer']:>20,.0f}")
    print(f"periodic snapshots (engine - engine_no_snapshots)            {per['engine'] - per['engine_no_snapshots']:>20,.0f}")
    print(f"information: engine_vs_raw_append in instructions {per['engine'] / per['raw']:.2f}x "
          f"(the goal, <= 1.5x, is on time: bench_engine.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
