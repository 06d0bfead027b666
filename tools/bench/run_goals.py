"""Run the benchmark scripts one after another and gather every GOAL line into one table.

Each script runs in a process of its own, with this interpreter, one at a time (they time
themselves: two at once would charge each other's load to both). ``--quick`` is passed to the
scripts that take it. The table lists each goal as its script printed it, with PASS or MISS;
a script that exits non-zero, times out or prints no GOAL line is an ERROR, with the end of its
output, and makes this script exit 1 (a MISS is information and does not). ``--json`` writes
the same results; ``--against`` an earlier run's file lists the goals whose verdict changed since.
``--history DIR`` keeps every run in ``DIR`` (one file a run, named by its UTC start, with its
machine) and compares each with the newest earlier run there of the same kind (full or ``--quick``)
that ran every script this one runs: what ``make bench`` does, so a run at any time, nightly say,
says what drifted since the last one.

Usage: ``python tools/bench/run_goals.py [--quick] [--only NAME ...] [--skip NAME ...]
[--timeout S] [--json PATH] [--against PATH] [--history DIR]`` (NAME: a script's file name, with or
without ``.py``)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from agentlog.events.fs import write_atomic
from agentlog.tools.bench.goals import GoalLine, parse_goal_line, verdict

HERE = Path(__file__).resolve().parent

#: Scripts that print no GOAL line of their own (information only): left out unless named with --only,
#: and then no GOAL line is expected of them.
INFORMATION_ONLY = {"bench_engine_instructions.py", "bench_capture_instructions.py"}


def scripts_in(folder: Path) -> list[Path]:
    """The benchmark scripts of ``folder`` (``bench_*.py``), by name."""
    return sorted(folder.glob("bench_*.py"))


def takes_quick(script: Path) -> bool:
    """Whether ``script`` has a ``--quick`` option (its argument parser names it)."""
    return '"--quick"' in script.read_text()


def run_script(script: Path, quick: bool, timeout_s: float) -> dict:
    """Run ``script`` and read its GOAL lines: ``{"script", "seconds", "goals", "error"}``, where
    ``goals`` are :class:`GoalLine` dicts and ``error`` is None or what went wrong, with the end of
    the script's output."""
    argv = [sys.executable, str(script)] + (["--quick"] if quick and takes_quick(script) else [])
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        # What the script printed before it was killed: bytes, whatever text= says.
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"script": script.name, "seconds": time.perf_counter() - t0, "goals": [],
                "error": f"timed out after {timeout_s:g} s; last output: {_tail(out)}"}
    seconds = time.perf_counter() - t0
    goals = [g._asdict() for g in map(parse_goal_line, done.stdout.splitlines()) if g is not None]
    error = None
    if done.returncode != 0:
        error = f"exit status {done.returncode}; last output: {_tail(done.stderr or done.stdout)}"
    elif not goals and script.name not in INFORMATION_ONLY:
        error = f"no GOAL line in its output; last output: {_tail(done.stdout)}"
    return {"script": script.name, "seconds": seconds, "goals": goals, "error": error}


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:]) or "(none)"


def table(results: list[dict]) -> list[str]:
    """The results as aligned rows: each goal (script, name, verdict, target, measured: the longest
    text last, unpadded), then each ERROR."""
    rows = [("script", "goal", "", "target", "measured")]
    for r in results:
        for g in map(lambda d: GoalLine(**d), r["goals"]):
            rows.append((r["script"], g.name, verdict(g.passed), f"{g.op} {g.target}", g.measured))
    width = [max(len(row[i]) for row in rows) for i in range(4)]
    out = ["  ".join(c.ljust(width[i]) if i < 4 else c for i, c in enumerate(row)).rstrip() for row in rows]
    out += [f"ERROR {r['script']}: {r['error']}" for r in results if r["error"]]
    return out


def changes(before: dict, after: list[dict]) -> list[str]:
    """What changed from an earlier run's results (``before``: a ``--json`` file's content) to
    ``after``: each goal whose verdict flipped, each goal only one run has. A figure that moved
    without changing its verdict is not listed: this VM's runs spread by about 10%."""
    def verdicts(results: list[dict]) -> dict[tuple[str, str], dict]:
        return {(r["script"], g["name"]): g for r in results for g in r["goals"]}

    ran = {r["script"] for r in after}
    old = {k: g for k, g in verdicts(before["results"]).items() if k[0] in ran}  # scripts not run now: no news
    new = verdicts(after)
    out = []
    for key in sorted(old.keys() | new.keys()):
        script, name = key
        was, now = old.get(key), new.get(key)
        if was is None:
            out.append(f"NEW {script} {name}: {verdict(now['passed'])} ({now['measured']})")
        elif now is None:
            out.append(f"GONE {script} {name}: printed no longer (was {verdict(was['passed'])}, {was['measured']})")
        elif was["passed"] != now["passed"]:
            out.append(f"CHANGED {script} {name}: {verdict(was['passed'])} -> {verdict(now['passed'])} ({was['measured']} -> {now['measured']}, goal {now['op']} {now['target']})")
    return out


#: A run ``--history`` kept: ``goals-<UTC start to the microsecond>[-quick].json``.
_HISTORY_NAME = re.compile(r"goals-\d{8}-\d{6}\.\d{6}(-quick)?\.json")


def history_file(folder: Path, started: datetime, quick: bool) -> Path:
    """Where ``--history`` keeps a run that started at ``started`` (UTC, to the microsecond: two runs
    never share a name): the names sort by start."""
    return folder / f"goals-{started.strftime('%Y%m%d-%H%M%S.%f')}{'-quick' if quick else ''}.json"


def read_run(path: Path) -> dict:
    """An earlier run's results (a ``--json`` file); ValueError saying why a file is not one."""
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read it as JSON ({exc})") from None
    if not isinstance(before, dict) or not isinstance(before.get("results"), list):
        raise ValueError("expected the --json file of an earlier run (an object with a \"results\" list)")
    return before


def last_run_in(folder: Path, quick: bool, scripts: set[str]) -> tuple[Path, dict] | None:
    """The newest run of this kind (full or ``--quick``) ``--history`` kept in ``folder`` that ran every
    one of ``scripts`` (a run of a few scripts is no measure of the others), and its results. A
    file that cannot be read is skipped with a warning: one torn file does not stop every later run."""
    if not folder.is_dir():
        return None
    kept = [p for p in folder.iterdir() if _HISTORY_NAME.fullmatch(p.name) and p.stem.endswith("-quick") == quick]
    for path in sorted(kept, key=lambda p: p.name, reverse=True):
        try:
            run = read_run(path)
        except ValueError as exc:
            print(f"run_goals: --history {folder}: skipping {path.name}: {exc}", file=sys.stderr)
            continue
        if scripts <= {r.get("script") for r in run["results"] if isinstance(r, dict)}:
            return path, run
    return None


def _kind(quick: bool) -> str:
    return "--quick" if quick else "full"


def earlier_run(against: str | None, history: Path | None, quick: bool, scripts: set[str]) -> tuple[Path | None, dict | None]:
    """The run this one is compared with, and its results: the file ``against`` names (ValueError when
    it is not an earlier run), else the newest fitting run ``history`` kept (:func:`last_run_in`),
    else none."""
    if against is not None:
        return Path(against), read_run(Path(against))
    if history is None:
        return None, None
    found = last_run_in(history, quick, scripts)
    if found is None:
        print(f"run_goals: no earlier {_kind(quick)} run of these scripts in {history}: nothing to compare with", file=sys.stderr)
        return None, None
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to the scripts that take it")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run these scripts only")
    ap.add_argument("--skip", nargs="+", default=[], metavar="NAME", help="leave these scripts out")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a script may run (default 3600)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--against", default=None, metavar="JSON",
                    help="an earlier run's --json file: list the goals whose verdict changed since (information)")
    ap.add_argument("--history", default=None, metavar="DIR",
                    help="keep this run in DIR and, unless --against is given, compare it with DIR's newest earlier "
                         "run of the same kind")
    ap.add_argument("--dir", default=str(HERE), help=argparse.SUPPRESS)  # the tests' own scripts
    args = ap.parse_args(argv)

    def named(names: list[str]) -> set[str]:
        return {n if n.endswith(".py") else f"{n}.py" for n in names}

    found = scripts_in(Path(args.dir))
    if args.only is not None:
        wanted = named(args.only)
        unknown = wanted - {s.name for s in found}
        if unknown:
            print(f"run_goals: no such script in {args.dir}: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        chosen = [s for s in found if s.name in wanted]
    else:
        chosen = [s for s in found if s.name not in INFORMATION_ONLY]
    chosen = [s for s in chosen if s.name not in named(args.skip)]

    started = datetime.now(timezone.utc)
    history = Path(args.history) if args.history else None
    if history is not None:  # a folder that cannot take the run is refused now, not after hours of benchmarks
        try:
            history.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"run_goals: --history {history}: cannot use it as a folder ({exc})", file=sys.stderr)
            return 2
        if not os.access(history, os.W_OK | os.X_OK):
            print(f"run_goals: --history {history}: this user cannot write there", file=sys.stderr)
            return 2
    try:
        against, before = earlier_run(args.against, history, args.quick, {s.name for s in chosen})
    except ValueError as exc:
        print(f"run_goals: --against {args.against}: {exc}", file=sys.stderr)
        return 2
    machine = f"{platform.node()}, {os.cpu_count()} cores, {platform.platform()}"
    if before is not None:
        if bool(before.get("quick")) != args.quick:
            print(f"run_goals: --against {against} was a {_kind(bool(before.get('quick')))} run and this one is "
                  f"{_kind(args.quick)}: its verdicts came at other sizes", file=sys.stderr)
        if before.get("machine", machine) != machine:
            print(f"run_goals: {against} ran on another machine ({before['machine']}): its verdicts are not this one's",
                  file=sys.stderr)

    from tqdm import tqdm

    results = []
    with tqdm(chosen, unit="script", desc="benchmarks", file=sys.stderr) as bar:
        for script in bar:
            bar.set_postfix_str(script.name)
            results.append(run_script(script, args.quick, args.timeout))
    for line in table(results):
        print(line)
    if before is not None:
        diff = changes(before, results)
        print(f"since {against}: " + (f"{len(diff)} change(s)" if diff else "no verdict changed"))
        for line in diff:
            print(line)
    run = json.dumps({"quick": args.quick, "started": started.isoformat(), "machine": machine, "results": results}, indent=1)
    if args.json:
        Path(args.json).write_text(run)
    if history is not None:
        kept = history_file(history, started, args.quick)
        write_atomic(history, kept.name, run.encode())  # renamed in whole: a torn write is never a kept run
        print(f"kept in {kept}")
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
