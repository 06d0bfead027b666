"""Benchmark: `agentlog export-dataset` on a generated 100k-session log, against
`agentlog reconstruct` on the same log.

Generates a log of agent sessions (groups of 4, members interleaved; 1-3
turns, each a tool call answered by a tool message, stored as ``turn_delta``
as the engine stores turns; ~80% finished, ~15% aborted, ~5% dropped) with
``FileLog.append_batch``, then measures, in one run, in process:

* ``export-dataset LOG -o DIR --format hf`` (the Hugging Face dataset,
  ``save_to_disk`` included): wall and CPU seconds, the directory's size;
* the same with ``--format jsonl`` and with ``--format hf --tokens``;
* the anchor: ``reconstruct LOG -o samples.jsonl``, the same fold of the same
  log into samples (every sample's fields as JSON), without the messages.

Goal: ``export_dataset_100k_sessions_s`` <= 120 (the hf export, on 2 cores).

Each line of the table also names the rows written (the samples of reconstruct; an export's
rows and sessions from its ``export.json``): every export holds the whole log.

Usage: ``python tools/bench/bench_export.py [--quick] [--sessions N] [--dir D] [--keep]``
(``--quick``: 10k sessions, goal scaled to 12 s.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from agentlog.tools.bench.goals import goal_line, meets

GROUP = 4
SYSTEM = {"role": "system", "content": "You are a coding agent. Fix the bug so that the tests pass."}


def write_log(path: Path, n_sessions: int, seed: int = 0) -> int:
    """``n_sessions`` sessions as the engine records them (see the module docstring); returns the events written."""
    from agentlog.events import FileLog
    from agentlog.events.schema.turn_delta import TurnContext
    from agentlog.events.schema.types import (
        CommandRan, SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted, TurnRecorded,
    )

    rng = random.Random(seed)
    log = FileLog.open(path, fsync="never")
    batch: list[tuple] = []
    events = 0
    for g in range((n_sessions + GROUP - 1) // GROUP):
        version = g * 8 // max(1, n_sessions // GROUP)
        members = []
        for i in range(min(GROUP, n_sessions - g * GROUP)):
            sid = f"s{g * GROUP + i:07d}"
            user = {"role": "user", "content": f"Task {g}: the test test_{g % 97} fails; fix it."}
            bodies: list = [SessionOpened(group_id=f"g{g:06d}", group_size=GROUP, sample_index=i, prompt=[SYSTEM, user],
                                          policy_version=version), SessionStarted(harness="synthetic")]
            messages, prompt, context = [SYSTEM, user], [1 + (g + k) % 400 for k in range(48)], TurnContext()
            for t in range(rng.randint(1, 3)):
                out = [rng.randrange(500) for _ in range(24)]
                cmd = f"sed -n {t + 1},{t + 40}p src/mod_{g % 31}.py"
                call = {"role": "assistant", "content": f"Step {t}: read the code.",
                        "tool_calls": [{"id": f"call_{t}", "name": "bash", "arguments": {"command": cmd}}]}
                full = TurnRecorded(turn_index=t, messages=list(messages), prompt_ids=prompt, output_ids=out,
                                    output_log_probs=[-0.5] * len(out), response_message=call, policy_version=version,
                                    generate_s=rng.lognormvariate(0.0, 1.0))
                bodies.append(context.delta_of(full))
                context = TurnContext.after(full)
                result = f"def f_{g}():\n    return {t}\n"
                bodies.append(CommandRan(command=cmd, exit_code=0, duration_s=0.05, output_tail=result))
                messages = messages + [call, {"role": "tool", "tool_call_id": f"call_{t}", "content": result}]
                prompt = prompt + out + [7 + t] * 16
            fate = rng.random()
            if fate < 0.80:
                bodies.append(SessionFinished(reward=rng.choice((0.0, 0.5, 1.0))))
            elif fate < 0.95:
                bodies.append(SessionAborted(reason=rng.choice(("wall_clock_timeout", "exception:ValueError")), error="synthetic"))
            else:
                bodies = bodies[:2] + [SessionDropped(reason="cancelled")]
            members.append((sid, bodies))
        for k in range(max(len(b) for _, b in members)):  # interleaved, as a live run writes them
            batch.extend((sid, k, bodies[k]) for sid, bodies in members if k < len(bodies))
        if len(batch) >= 4096:
            log.append_batch(batch)
            events += len(batch)
            batch = []
    if batch:
        log.append_batch(batch)
        events += len(batch)
    log.close()
    return events


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _written(out: Path) -> str:
    """What an output holds: reconstruct's samples (lines), or an export's rows and sessions (its manifest)."""
    if out.is_file():
        with out.open("rb") as f:
            return f"{sum(1 for _ in f):,} samples"
    manifest = json.loads((out / "export.json").read_text())
    return f"{manifest['rows']:,} rows of {manifest['sessions']:,} sessions"


def _seconds(s: float) -> str:
    """Seconds as the GOAL line shows them: one decimal, three significant digits below 10 s (a tiny run's)."""
    return f"{s:.1f}" if s >= 10 else f"{s:.3g}"


def _command(*argv: str) -> tuple[float, float]:
    """``agentlog ARGV`` in process: (wall s, CPU s of this process)."""
    from agentlog.tools.cli import main

    t0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(list(argv))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if rc != 0:
        raise SystemExit(f"agentlog {' '.join(argv)}: exit {rc}\n{out.getvalue()}")
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k sessions (goal scaled to 12 s)")
    ap.add_argument("--sessions", type=int, default=None, help="sessions in the log (default 100,000)")
    ap.add_argument("--dir", default=None, help="where to write the log and the exports (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the log and the exports")
    args = ap.parse_args(argv)
    n = args.sessions or (10_000 if args.quick else 100_000)
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench_export_"))
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        log = tmp / "sessions.log"
        t0 = time.perf_counter()
        events = write_log(log, n, seed=1)
        print(f"log: {n:,} sessions, {events:,} events, {_size(log) / 1e6:.0f} MB, written in {time.perf_counter() - t0:.1f} s")
        rows = []
        for name, argv, out in (
            ("anchor: reconstruct -o samples.jsonl", ("reconstruct", str(log), "-o", str(tmp / "samples.jsonl"), "-q"), tmp / "samples.jsonl"),
            ("export-dataset --format jsonl", ("export-dataset", str(log), "-o", str(tmp / "jsonl"), "--format", "jsonl", "-q"), tmp / "jsonl"),
            ("export-dataset --format hf", ("export-dataset", str(log), "-o", str(tmp / "hf"), "-q"), tmp / "hf"),
            ("export-dataset --format hf --tokens", ("export-dataset", str(log), "-o", str(tmp / "hf_tokens"), "--tokens", "-q"), tmp / "hf_tokens"),
        ):
            wall, cpu = _command(*argv)
            rows.append((name, wall, cpu, _size(out)))
            print(f"{name:<40} {wall:8.1f} s wall {cpu:8.1f} s CPU {_size(out) / 1e6:8.1f} MB  {_written(out)}")
        anchor = rows[0][1]
        hf = rows[2][1]
        print(f"hf export / reconstruct on the same log: {hf / anchor:.2f}x")
        scale = f"{n // 1000}k" if n % 1000 == 0 else str(n)
        target = 120.0 * n / 100_000
        print(goal_line(f"export_dataset_{scale}_sessions_s", _seconds(hf), "<=", f"{target:g}", meets(hf, "<=", target)))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
