"""Benchmark: the `agentlog` commands on a big generated log, against a raw read.

Generates a log (default 1 GB; ``--quick``: 64 MB) of SWE-agent-like
sessions in groups of 4, written with ``agentlog.events.FileLog``: each turn's
prompt carries the whole conversation so far (chat messages with text and
its token ids, which extend the previous turn's prompt and output, as a real
agent's do: no session drifts), 60-400 generated tokens with log-probs, a command run per
turn, a reward; ~10% of sessions abort, ~5% are dropped. Sessions of a
group interleave, as they do in a live run.

Then, in one run, it measures (each over the same files, page cache warm):

* raw read: every segment file read into memory with ``readinto`` (the anchor);
* the log reader alone: ``read_log(raw=True)``, frames CRC-checked, nothing
  decoded (the floor under every command);
* ``agentlog stats LOG`` (in process, output discarded);
* ``agentlog replay LOG --json > /dev/null``;
* ``agentlog reconstruct LOG -o OUT --format msgpack``.

The log reader and the commands run under both frame codecs
(events.log.framecodec), side by side: the compiled one when it is built, and
the pure-Python fallback; the goal is judged on the compiled one.

Throughput is log bytes / wall seconds; each figure is the minimum of a few
runs, in wall and in CPU seconds. The goal, ``stats`` >= 0.3x raw read, is
judged on throughput (wall time, min of runs); the CPU-time ratio is printed
too (on a shared machine load inflates wall time unevenly).

Usage: ``python tools/bench/bench_cli.py [--quick] [--size-mb N] [--groups N] [--reps N] [--dir D] [--keep]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentlog.events import FileLog  # noqa: E402
from agentlog.events.schema.types import (  # noqa: E402
    CommandRan,
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TurnRecorded,
)
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402

GROUP = 4
WORDS = ("def", "return", "self", "import", "error", "test", "file", "line", "value", "class", "assert", "fix")


def _session_bodies(rng: np.random.Generator, pool: np.ndarray, group: int, index: int) -> list:
    """One session's event bodies, in order."""
    text = " ".join(rng.choice(WORDS, 200))
    msgs = [
        {"role": "system", "content": "You are a coding agent. " + text[:400]},
        {"role": "user", "content": f"Fix issue {group}: " + text},
    ]
    ctx_len = int(rng.integers(300, 1200))
    bodies: list = [
        SessionOpened(group_id=f"g{group}", group_size=GROUP, sample_index=index, prompt=msgs, agent="bench"),
        SessionStarted(harness="bench", sandbox="local"),
    ]
    fate = rng.random()
    n_turns = int(rng.integers(3, 16))
    if fate < 0.15:
        n_turns = int(rng.integers(1, n_turns + 1))
    prompt = out = pool[:0]
    for t in range(n_turns):
        n_out = int(rng.integers(60, 400))
        start = int(rng.integers(0, len(pool) - ctx_len - n_out))
        if t == 0:
            prompt = pool[start : start + ctx_len]
        else:  # the conversation so far, as an agent sends it: the previous prompt and output, then the tool's result
            prompt = np.concatenate([prompt, out, pool[start : start + ctx_len - len(prompt) - len(out)]])
        out = pool[start + ctx_len : start + ctx_len + n_out]
        lp = -rng.random(n_out, dtype=np.float32)
        reply = {"role": "assistant", "content": " ".join(rng.choice(WORDS, n_out // 2))}
        bodies.append(
            TurnRecorded(
                turn_index=t, messages=list(msgs), prompt_ids=prompt, output_ids=out, output_log_probs=lp,
                finish_reason="stop", response_message=reply, generate_s=0.5,
            )
        )
        tool_out = " ".join(rng.choice(WORDS, int(rng.integers(50, 300))))
        bodies.append(CommandRan(command=f"pytest -x tests/test_{t}.py", exit_code=int(t % 3 == 0), duration_s=1.5, output_tail=tool_out[-2000:]))
        msgs = msgs + [reply, {"role": "tool", "content": tool_out}]
        ctx_len += n_out + len(tool_out) // 5
    if fate < 0.10:
        bodies.append(SessionAborted(reason="wall_clock_timeout", error="budget exhausted"))
    elif fate < 0.15:
        bodies.append(SessionDropped(reason="cancelled"))
    else:
        bodies.append(RewardAssigned(reward=float(rng.random() < 0.4), source="tests"))
        bodies.append(SessionFinished())
    return bodies


def generate_log(path: Path, target_bytes: int, seed: int = 0, quiet: bool = False, max_groups: int | None = None) -> int:
    """Write a log of about ``target_bytes`` at ``path`` (or of ``max_groups`` groups, when that comes
    first); returns its size in bytes."""
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 150_000, 1 << 20, dtype=np.int32)
    log = FileLog.open(path, fsync="never", segment_bytes=64 << 20)
    group = 0
    size = 0
    # The bar counts what stops the generation: the groups when a count is given (it may come first), else the bytes.
    by_groups = max_groups is not None
    bar = (tqdm(total=max_groups, unit="group", desc="generate", disable=quiet, leave=False) if by_groups
           else tqdm(total=target_bytes, unit="B", unit_scale=True, desc="generate", disable=quiet, leave=False))
    try:
        while size < target_bytes and (max_groups is None or group < max_groups):
            sessions = [(f"s{group}-{i}", _session_bodies(rng, pool, group, i)) for i in range(GROUP)]
            seqs = [0] * GROUP
            batch = []
            # Interleave the group's sessions round-robin, as concurrent agents do.
            while any(seqs[i] < len(b) for i, (_, b) in enumerate(sessions)):
                for i, (sid, bodies) in enumerate(sessions):
                    if seqs[i] < len(bodies):
                        batch.append((sid, seqs[i], bodies[seqs[i]]))
                        seqs[i] += 1
            log.append_batch(batch)
            group += 1
            if by_groups:
                bar.update(1)
            if group % 16 == 0:
                new = _log_bytes(path)
                if not by_groups:
                    bar.update(new - size)
                size = new
    finally:
        log.close()
        bar.close()
    return _log_bytes(path)


def _log_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.seg"))


def raw_read(path: Path) -> int:
    """Read every segment file into one reused buffer; returns bytes read."""
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    total = 0
    for seg in sorted(Path(path).glob("*.seg")):
        with open(seg, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def _run_cli(argv: list[str]) -> tuple[int, str]:
    from agentlog.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def _run_cli_devnull(argv: list[str]) -> int:
    """Run a command with stdout going to /dev/null (at the fd level, as a shell redirect does)."""
    from agentlog.tools.cli import main

    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(fd, 1)
        with open(1, "w", closefd=False) as devnull, contextlib.redirect_stdout(devnull):
            code = main(argv)
            devnull.flush()
    finally:
        os.dup2(saved, 1)
        os.close(fd)
        os.close(saved)
    return code


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table and the GOAL line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 64 MB log instead of 1 GB")
    ap.add_argument("--size-mb", type=int, default=None, help="log size in MB (overrides --quick)")
    ap.add_argument("--dir", default=None, help="where to write the log (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated log")
    ap.add_argument("--groups", type=int, default=None,
                    help=f"stop each generated log (and the warm-up's) after N groups of {GROUP} sessions (default: by size only)")
    ap.add_argument("--reps", type=int, default=None, help="runs of each repeated measure, min kept (default 3; 2 over 256 MB)")
    args = ap.parse_args(argv)
    import logging

    import structlog

    # The writer's info lines would drown the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    size_mb = args.size_mb or (64 if args.quick else 1024)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_cli_"))
    log_dir = base / "log"
    out_file = base / "samples.msgpack"
    try:
        if not log_dir.exists():
            t, nbytes = _timed(lambda: generate_log(log_dir, size_mb << 20, max_groups=args.groups))
            print(f"generated {nbytes / 1e6:.0f} MB in {t:.1f} s at {log_dir}", file=sys.stderr)
        nbytes = _log_bytes(log_dir)
        # Warm-up on a tiny log: module imports are start-up cost, not throughput.
        tiny = base / "tiny"
        if not tiny.exists():
            generate_log(tiny, 1 << 20, seed=1, quiet=True, max_groups=args.groups)
        _run_cli(["stats", str(tiny), "--quiet"])
        _run_cli_devnull(["replay", str(tiny), "--json", "--quiet"])
        _run_cli(["reconstruct", str(tiny), "-o", str(out_file), "--format", "msgpack", "--quiet"])
        raw_read(log_dir)  # warm the page cache
        reps = args.reps or (3 if size_mb <= 256 else 2)
        rows = []

        def measure(name: str, fn, repeats: int = reps) -> tuple[float, float]:
            """Min wall and min CPU seconds over ``repeats`` runs (interleaved
            with the others' by the caller's order; a shared machine's load
            inflates wall time, the CPU time of one process much less)."""
            walls, cpus = [], []
            for _ in range(repeats):
                c0, w0 = time.process_time(), time.perf_counter()
                res = fn()
                walls.append(time.perf_counter() - w0)
                cpus.append(time.process_time() - c0)
                # Every measured callable returns an exit status (the readers 0): a command that failed
                # must stop the benchmark, not be timed. (The names start with the codec, "[compiled] agentlog ...".)
                if isinstance(res, int) and res != 0:
                    raise SystemExit(f"{name} exited {res}")
            rows.append((name, min(walls), min(cpus)))
            return min(walls), min(cpus)

        from agentlog.events import read_log
        from agentlog.events.log import framecodec

        stats_argv = ["stats", str(log_dir), "--quiet"]
        w_raw, c_raw = measure("raw read (anchor)", lambda: raw_read(log_dir) and 0)
        # Both frame codecs side by side: the compiled one (when built) and the pure-Python fallback.
        codecs = ["compiled", "pure"] if framecodec.available() else ["pure"]
        stats_of: dict[str, tuple[float, float]] = {}
        saved = framecodec.native
        try:
            for codec in codecs:
                framecodec.use_native(codec == "compiled")
                # The floor every command pays: frames located and CRC-checked by the log reader, nothing decoded.
                measure(f"[{codec}] log reader alone (read_log raw=True)", lambda: sum(1 for _ in read_log(log_dir, raw=True)) and 0)
                stats_of[codec] = measure(f"[{codec}] agentlog stats", lambda: _run_cli(stats_argv)[0])
                measure(f"[{codec}] agentlog replay --json > /dev/null", lambda: _run_cli_devnull(["replay", str(log_dir), "--json", "--quiet"]), 1)
                measure(
                    f"[{codec}] agentlog reconstruct --format msgpack",
                    lambda: _run_cli(["reconstruct", str(log_dir), "-o", str(out_file), "--format", "msgpack", "--quiet"])[0],
                    1,
                )
        finally:
            framecodec.native = saved
        mb = nbytes / 1e6
        print(f"log: {mb:.0f} MB in {len(list(log_dir.glob('*.seg')))} segments; min of {reps} runs (1 for replay/reconstruct)")
        print(f"{'what':50s} {'wall s':>8s} {'cpu s':>8s} {'MB/s':>7s} {'x raw':>6s} {'x raw cpu':>9s}")
        for name, w, c in rows:
            print(f"{name:50s} {w:8.2f} {c:8.2f} {mb / w:7.0f} {w_raw / w:6.3f} {c_raw / c:9.3f}")
        for codec in codecs[1:]:
            w, c = stats_of[codec]
            print(f"[{codec}] stats vs raw read (not judged): {w_raw / w:.2f}x wall, {c_raw / c:.2f}x CPU")
        # The goal is judged on the first codec: the compiled one when it is built.
        w_stats, c_stats = stats_of[codecs[0]]
        print(f"[{codecs[0]}] stats vs raw read, CPU time: {c_raw / c_stats:.2f}x")
        ratio = w_raw / w_stats
        print(goal_line("stats_vs_raw_read", f"{ratio:.2f}x", ">=", "0.3x", meets(ratio, ">=", 0.3)))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
