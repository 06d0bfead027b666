"""The capture path's cost counted in instructions instead of seconds.

``capture_cpu_us_per_turn_100k_ctx`` (``bench_capture.py``) is CPU time, and on a
shared VM its rounds spread by more than most changes to the capture path: two
runs of the same code, minutes apart, have given 67 and 90 µs a turn.
Instructions executed do not depend on the neighbours. This runs the goal's arm
(``capture_cpu.cpu_concurrent``: sessions grown to a context, then rounds in
which every session records a turn at once) in a child under valgrind's
callgrind, with instrumentation off except inside each timed round's capture
(staging, the acknowledgement, the prompt cache's update: the window the goal
times), every thread counted. The window is bracketed by callgrind's client
requests, from a two-function C helper compiled here (a C compiler and
``valgrind/callgrind.h``, which Debian's ``valgrind`` package installs); outside
valgrind they do nothing.

What it counts is what the CPU time measures, the garbage collector's walks
included, but not what they cost in cache misses: a change that halves the
collections moves the seconds more than the instructions.

Information beside that goal, which stays on time: no GOAL line of its own.
About a minute on 2 cores (the child runs ~50x slower than natively, but only
inside the windows).

Usage: ``python tools/bench/bench_capture_instructions.py [--context N] [--sessions N] [--rounds N]``
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from agentlog.tools.bench.bench_engine_instructions import callgrind_count

#: The helper's source: start counting (instrument and collect), stop counting.
_WINDOW_C = """
#include <valgrind/callgrind.h>
void window_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void window_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""


class Window:
    """Callgrind's counting, on between :meth:`start` and :meth:`stop` (``library``: the compiled helper)."""

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self.windows = 0

    def start(self) -> None:
        """Count from here."""
        self._lib.window_start()

    def stop(self) -> None:
        """Stop counting."""
        self._lib.window_stop()
        self.windows += 1


def build_window(folder: Path) -> Path:
    """Compile the window helper into ``folder``; raises RuntimeError saying what is missing."""
    cc = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler on PATH (the helper that brackets the counted window is compiled here)")
    source, library = folder / "window.c", folder / "libwindow.so"
    source.write_text(_WINDOW_C)
    done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the window helper with {cc} failed (needs valgrind/callgrind.h: apt-get install "
                           f"valgrind): {done.stderr.strip()[-400:]}")
    return library


def run_child(library: Path, context: int, sessions: int, rounds: int) -> int:
    """In the child: the goal's arm, each timed round's capture inside the window. Returns the windows counted."""
    from agentlog.tools.bench.capture_cpu import cpu_concurrent

    window = Window(library)
    args = argparse.Namespace(cpu_turns=rounds)
    asyncio.run(cpu_concurrent(args, context, sessions, window=window))
    if window.windows != rounds:
        raise RuntimeError(f"expected {rounds} counted windows, found {window.windows}")
    return window.windows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=100_000, help="tokens each session's context grows to")
    ap.add_argument("--sessions", type=int, default=64, help="sessions recording a turn at once (the goal's arm: 64)")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds counted")
    ap.add_argument("--child", metavar="LIBRARY", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(Path(args.child), args.context, args.sessions, args.rounds)
        return 0
    if shutil.which("valgrind") is None:
        print("bench_capture_instructions: valgrind is not on PATH (apt-get install valgrind)", file=sys.stderr)
        return 2
    if min(args.context, args.sessions, args.rounds) <= 0:
        ap.error(f"--context, --sessions and --rounds: expected positive numbers, found {args.context}, {args.sessions}, {args.rounds}")
    with tempfile.TemporaryDirectory(prefix="bench_capture_ir_") as tmp:
        try:
            library = build_window(Path(tmp))
        except RuntimeError as exc:
            print(f"bench_capture_instructions: {exc}", file=sys.stderr)
            return 2
        print(f"bench_capture_instructions: {args.sessions} sessions at {args.context:,} tokens, "
              f"{args.rounds} rounds counted under callgrind")
        counted = callgrind_count(
            [__file__, "--child", str(library), "--context", str(args.context), "--sessions", str(args.sessions),
             "--rounds", str(args.rounds)],
            f"the capture of {args.sessions} sessions at {args.context:,} tokens",
            ("--instr-atstart=no", "--collect-atstart=no"))
    turns = args.rounds * args.sessions
    print(f"instructions a captured turn (all threads, inside the timed window): {counted / turns:,.0f} "
          f"({counted:,} over {turns:,} turns)")
    print("information: the goal, capture_cpu_us_per_turn_100k_ctx <= 50, is on CPU time: bench_capture.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
