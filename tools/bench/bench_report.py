"""Benchmark: `agentlog report` on a generated 100k-session log, against the
report it replaced.

Generates a log of small sessions (groups of 4, members interleaved; 1-3
turns with a command each; ~80% finished, ~15% aborted, ~5% dropped) with
``FileLog.append_batch`` (tools/bench/synthetic_log.py: write_many_sessions),
then measures, in one run:

* the report (``agentlog report LOG -o OUT``, in process): wall and CPU
  seconds, page size, the process's max RSS;
* the anchor: the previous report (one bar and one row per session; its
  ``tools/report`` read from git at ANCHOR_COMMIT) on a smaller log
  (``--anchor-sessions``, default 5,000), and the new report on that log;
* whether the 100k page renders in headless Chromium (when installed): every
  chart drawn, no console message, no chart taller than 1,200 px.

Goals: ``report_100k_size_mb`` <= 10 and ``report_100k_seconds`` <= 60 (on 2 cores),
``report_100k_renders`` == 1.

Usage: ``python tools/bench/bench_report.py [--quick] [--sessions N] [--anchor-sessions N] [--dir D] [--keep]
[--no-render]`` (``--quick``: 10k sessions, anchor on 1k; ``--no-render``: no Chromium, the render goal reads 0.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_file_module(name: str, path: Path, **spec_kw):
    """The module at ``path`` of this checkout, loaded under ``name`` (not an installed package)."""
    spec = importlib.util.spec_from_file_location(name, path, **spec_kw)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


from agentlog.tools.bench.synthetic_log import write_many_sessions  # noqa: E402  (the report tests' log builder)
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402

#: The commit whose tools/report is the anchor (the report before it became one bounded streaming pass).
ANCHOR_COMMIT = "5b1e66f"
CHARTS = ("over-time", "by-version", "per-session", "latency", "sizes", "reasons", "staleness")
MAX_CHART_PX = 1200


def _report(log: Path, out: Path) -> tuple[float, float, int]:
    """The new report of ``log``: (wall s, CPU s, page bytes)."""
    from agentlog.tools.cli import main

    t0, c0 = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["report", str(log), "-o", str(out), "-q"])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if rc != 0:
        raise SystemExit(f"agentlog report {log}: exit {rc}")
    return wall, cpu, out.stat().st_size


def _load_anchor(tmp: Path):
    """The previous report's modules (collect, render), from git; None when git cannot give them."""
    pkg = tmp / "anchor_report"
    pkg.mkdir(exist_ok=True)
    for name in ("__init__.py", "data.py", "render.py"):
        res = subprocess.run(["git", "-C", str(ROOT), "show", f"{ANCHOR_COMMIT}:tools/report/{name}"], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"anchor: git show {ANCHOR_COMMIT}:tools/report/{name} failed: {res.stderr.strip()}")
            return None
        # The event types moved into events/schema/ after the anchor was written; the
        # anchor's algorithm is what is measured, so only its import path is updated.
        (pkg / name).write_text(res.stdout.replace("agentlog.events.types", "agentlog.events.schema.types"))
    _load_file_module("anchor_report", pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    # Submodules of the package written above (not installed anywhere): import them by name.
    data = importlib.import_module("anchor_report.data")
    render = importlib.import_module("anchor_report.render")
    return data.collect, render.render


def _anchor(collect, render, log: Path) -> tuple[float, int]:
    from agentlog.events.log.source import open_source
    from agentlog.tools.cli_common import read_records

    t0 = time.perf_counter()
    page = render(collect(read_records(open_source(log), quiet=True), str(log), max_drill=300))
    return time.perf_counter() - t0, len(page.encode("utf-8"))


def _renders(page: Path, tmp: Path) -> tuple[bool, str]:
    """Whether headless Chromium draws every chart of ``page`` with no console message."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        return False, "chromium not installed"
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp / 'chromium'}",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=10000", "--enable-logging=stderr", "--v=0",
           "--dump-dom", page.as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    console = [line for line in res.stderr.splitlines() if ":CONSOLE" in line]
    if res.returncode != 0 or console:
        return False, f"exit {res.returncode}; console: {console[:3]}"
    dom = res.stdout
    for chart in CHARTS:
        m = re.search(rf'<div id="{chart}" class="[^"]*plotly-graph-div.*?(?=<div id="|<h2>|$)', dom, re.S)
        if m is None or 'class="main-svg"' not in m.group(0):
            return False, f"chart {chart} not drawn"
        heights = [float(h) for h in re.findall(r'class="main-svg"[^>]*height="([\d.]+)"', m.group(0))]
        if not heights or max(heights) > MAX_CHART_PX:
            return False, f"chart {chart}: svg heights {heights}"
    return True, "every chart drawn, no console message"


def _goal(name: str, value: float, op: str, target: float) -> None:
    print(goal_line(name, f"{value:.3g}", op, f"{target:g}", meets(value, op, target)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10k sessions, anchor on 1k")
    ap.add_argument("--sessions", type=int, default=None, help="sessions in the big log (default 100,000)")
    ap.add_argument("--anchor-sessions", type=int, default=None, help="sessions in the anchor's log (default 5,000)")
    ap.add_argument("--dir", default=None, help="where to write the logs (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the logs and pages")
    ap.add_argument("--no-render", action="store_true",
                    help="skip the Chromium check (seconds of a browser's start): its goal then reads 0, a MISS")
    args = ap.parse_args(argv)
    n = args.sessions or (10_000 if args.quick else 100_000)
    n_anchor = args.anchor_sessions or (1_000 if args.quick else 5_000)
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="bench_report_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        big, small = tmp / "big.log", tmp / "small.log"
        t0 = time.perf_counter()
        write_many_sessions(big, n, seed=1)
        write_many_sessions(small, n_anchor, seed=2)
        print(f"logs: {n} and {n_anchor} sessions written in {time.perf_counter() - t0:.1f} s")

        anchor = _load_anchor(tmp)
        small_new = _report(small, tmp / "small.html")
        print(f"new report, {n_anchor} sessions: {small_new[0]:.2f} s wall, {small_new[2] / 1e6:.2f} MB")
        if anchor is not None:
            a_s, a_bytes = _anchor(*anchor, small)
            per = (a_bytes - small_new[2]) / n_anchor  # beyond what both pages share (plotly.js, mostly)
            print(f"anchor (previous report, {ANCHOR_COMMIT}), {n_anchor} sessions: {a_s:.2f} s wall, {a_bytes / 1e6:.2f} MB"
                  f" ({per / 1e3:+.2f} kB a session: ~{(small_new[2] + per * n) / 1e6:.0f} MB at {n} sessions)")

        wall, cpu, size = _report(big, tmp / "big.html")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"new report, {n} sessions: {wall:.2f} s wall, {cpu:.2f} s CPU, {size / 1e6:.2f} MB "
              f"(the bench process's max RSS, log writing included: {rss / 1024:.0f} MB)")
        ok, why = (False, "not run (--no-render)") if args.no_render else _renders(tmp / "big.html", tmp)
        print(f"chromium: {why}")
        scale = f"{n // 1000}k" if n % 1000 == 0 else str(n)  # 100k, 10k (--quick); a small test's log by its count
        _goal(f"report_{scale}_size_mb", size / 1e6, "<=", 10)
        _goal(f"report_{scale}_seconds", wall, "<=", 60)
        _goal(f"report_{scale}_renders", 1.0 if ok else 0.0, "==", 1)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
