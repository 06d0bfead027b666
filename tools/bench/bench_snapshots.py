"""Benchmark the sandbox snapshot store: what a snapshot per turn costs a session.

A LocalSandbox working directory of ``--files`` files of ~``--file-kb`` KB random
bytes (default 500 x 100 KB = 50 MB, in 10 subdirectories) runs a ``--turns``-turn
session (default 30). Each turn runs two real bash commands through
``LocalSandbox.run_command``, as an agent's turn would:

* the edit: ``head -c`` from /dev/urandom rewrites 3 files, ``echo >>`` appends to
  1, and a new ~100 KB file is created;
* the check: ``find . -type f | xargs md5sum > /dev/null`` over the whole tree, the
  shape of an agent's test run (it reads every file).

**The anchor, sandbox time per turn**, is the sum of those two commands'
``CommandResult.duration_s``: the wall time from starting each command (bash
start-up included) to its done marker being read, in this run, on this machine.
Then the turn snapshots the sandbox (``LocalSandbox.snapshot``: the store's
snapshot on a worker thread, durable on return; timed around the await, which is
what the turn waits) and, as the rollout worker does, collects the store
(``keep_last=2`` refs; timed separately: the worker can run it off the turn).

Goals:

* ``snapshot_overhead_vs_sandbox_time`` <= 0.10: mean snapshot seconds per turn
  over mean sandbox seconds per turn;
* ``snapshot_store_bytes_vs_one_copy`` <= 1.5x: the store's bytes after the last
  turn's collection over the working directory's bytes.

The session runs ``--repeat`` times (default 3), each in a fresh directory and
store; the goals take the run with the lowest overhead (the others are shown: on
a shared machine another process's disk or CPU load lands in single turns). The
first (full) snapshot, taken on the fresh tree before turn 0, is shown apart,
with its hashing rate, and so is a full restore of the last snapshot into a new
directory (what a resumed session waits for).

Usage: ``python tools/bench/bench_snapshots.py [--quick] [--files N] [--file-kb K] [--turns T] [--repeat R] [--dir D]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agentlog.engine.sandbox import CONTROL_DIR, LocalSandbox
from agentlog.engine.snapshot_files import blake
from agentlog.engine.snapshots import RACY_WINDOW_NS, SnapshotStore
from agentlog.tools.bench.goals import goal, goal_line, meets

SUBDIRS = 10
SESSION = "bench-session"


def make_tree(workdir: Path, files: int, file_kb: int, seed: int) -> list[str]:
    """``files`` files of random bytes (sizes within 20% of ``file_kb`` KB) in SUBDIRS subdirectories; their relative paths."""
    rng = random.Random(seed)
    names = []
    for i in range(files):
        rel = f"src/mod{i % SUBDIRS}/file{i:04d}.bin" if i % 5 else f"data_{i:04d}.bin"
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(int(file_kb * 1000 * rng.uniform(0.8, 1.2))))
        names.append(rel)
    return names


def tree_bytes(workdir: Path) -> int:
    """Bytes of the regular files under ``workdir``, its control dir left out."""
    return sum(p.stat().st_size for p in workdir.rglob("*")
               if p.is_file() and not p.is_symlink() and p.relative_to(workdir).parts[0] != CONTROL_DIR)


def blake_mb_s() -> float:
    """The hash's own rate here: 64 MB in 1 MiB chunks, the store's read size."""
    chunk = random.Random(0).randbytes(1 << 20)
    h = blake()
    t = time.perf_counter()
    for _ in range(64):
        h.update(chunk)
    return 64 * (1 << 20) / 1e6 / (time.perf_counter() - t)


async def run_session(base: Path, files: int, file_kb: int, turns: int, seed: int, quiet: bool) -> dict:
    from tqdm import tqdm

    workdir = base / "sandbox"
    names = make_tree(workdir, files, file_kb, seed)
    box = LocalSandbox(workdir)
    store = SnapshotStore(base / "store", keep_last=2)
    first = await box.snapshot(store, SESSION)
    store.collect()
    rng = random.Random(seed + 1)
    sandbox_s, snap_s, gc_s, infos = [], [], [], []
    for turn in tqdm(range(turns), desc="turns", unit=" turn", disable=quiet, leave=False, file=sys.stderr):
        rewrite = rng.sample(names, 3)
        append = rng.choice(names)
        kb = file_kb * 1000
        edit = " && ".join([f"head -c {kb} /dev/urandom > {p}" for p in rewrite]
                           + [f"echo 'turn {turn}' >> {append}", f"head -c {kb} /dev/urandom > new_{turn:03d}.bin"])
        check = f"find . -type f -not -path './{CONTROL_DIR}/*' -print0 | xargs -0 md5sum > /dev/null"
        took = 0.0
        for cmd in (edit, check):
            res = await box.run_command(cmd, 120)
            if res.exit_code != 0:
                raise RuntimeError(f"turn {turn}: {cmd!r} exited {res.exit_code}: {res.output_tail}")
            took += res.duration_s
        sandbox_s.append(took)
        t = time.perf_counter()
        infos.append(await box.snapshot(store, SESSION))
        snap_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.collect()
        gc_s.append(time.perf_counter() - t)
    restored = store.restore(infos[-1].digest, base / "restored")
    return {"first": first, "infos": infos, "sandbox_s": sandbox_s, "snap_s": snap_s, "gc_s": gc_s,
            "store_bytes": store.stored_bytes(), "tree_bytes": tree_bytes(workdir), "restore": restored}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fast run: 100 files, 10 turns")
    ap.add_argument("--files", type=int, default=None, help="files in the working directory (default 500)")
    ap.add_argument("--file-kb", type=int, default=100, help="their size in KB (default 100)")
    ap.add_argument("--turns", type=int, default=None, help="turns of the session (default 30)")
    ap.add_argument("--repeat", type=int, default=None, help="sessions run; the goals take the best (default 3, --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where to put the sandbox and the store (default: a temp dir, removed after)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    files = args.files or (100 if args.quick else 500)
    turns = args.turns or (10 if args.quick else 30)
    repeat = args.repeat or (1 if args.quick else 3)
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_snapshots_"))
    base.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        print(f"bench_snapshots: {files} files of ~{args.file_kb} KB, {turns} turns, {repeat} runs, dir {base}", file=sys.stderr)
        for i in range(repeat):
            runs.append(asyncio.run(run_session(base / f"run{i}", files, args.file_kb, turns, args.seed, args.quiet or not sys.stderr.isatty())))
            shutil.rmtree(base / f"run{i}", ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    for r in runs:
        r["ratio"] = statistics.fmean(r["snap_s"]) / statistics.fmean(r["sandbox_s"])
    if repeat > 1:
        print("overhead per run (snapshot / sandbox seconds per turn): " + ", ".join(f"{r['ratio']:.3f}" for r in runs))
    r = min(runs, key=lambda r: r["ratio"])
    first, infos, restore = r["first"], r["infos"], r["restore"]
    mb = 1e6
    print(f"working directory: {first.files} files, {first.bytes / mb:.1f} MB at the start, {r['tree_bytes'] / mb:.1f} MB after {turns} turns")
    print(f"first (full) snapshot: {first.seconds * 1e3:.0f} ms, {first.read_bytes / mb:.1f} MB read, hashed and stored "
          f"({first.read_bytes / mb / first.seconds:.0f} MB/s end to end, fsyncs included)")
    sandbox, snap, gc = (statistics.fmean(r[k]) for k in ("sandbox_s", "snap_s", "gc_s"))
    read = statistics.fmean(i.read_bytes for i in infos)
    new = statistics.fmean(i.new_bytes for i in infos)
    print(f"the best run, per turn (mean of {turns}): sandbox {sandbox * 1e3:.0f} ms (edit + md5sum of the tree), snapshot {snap * 1e3:.1f} ms "
          f"(median {statistics.median(r['snap_s']) * 1e3:.1f} ms, max {max(r['snap_s']) * 1e3:.1f} ms), "
          f"collect {gc * 1e3:.1f} ms")
    print(f"per turn: {read / mb:.2f} MB read and hashed, {new / mb:.2f} MB stored; of the reads, turn 0's {infos[0].read_bytes / mb:.1f} MB "
          f"are files the first snapshot read within {RACY_WINDOW_NS / 1e6:.0f} ms of their last write (stats too fresh to trust)")
    print(f"BLAKE2b-256 alone on this machine: {blake_mb_s():.0f} MB/s")
    print(f"full restore of the last snapshot: {restore.seconds * 1e3:.0f} ms for {restore.bytes / mb:.1f} MB "
          f"({restore.bytes / mb / restore.seconds:.0f} MB/s, every object re-hashed)")
    print(f"store after {turns} turns (keep_last=2, collected each turn): {r['store_bytes'] / mb:.1f} MB (the largest of the runs: "
          f"{max(r['store_bytes'] / r['tree_bytes'] for r in runs):.3f}x its working directory)")
    print(goal_line("snapshot_overhead_vs_sandbox_time", f"{snap / sandbox:.3f}", "<=", "0.10", meets(snap / sandbox, "<=", 0.10)))
    print(goal("snapshot_store_bytes_vs_one_copy", max(r["store_bytes"] / r["tree_bytes"] for r in runs), "<=", 1.5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
