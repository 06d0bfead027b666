"""Resident memory per live session of the SessionEngine, against context size.

Each context size runs in a fresh process (so one size's freed memory does not
hide the next one's): it opens a FileLog (fsync ``batch``) and a
SessionEngine, warms them up with a wave of sessions that end, takes the process's
resident set (``/proc/self/statm``, after ``gc.collect()`` and glibc's
``malloc_trim``) as the baseline,
then opens N sessions and leaves them live after two turns each, whose last
prompt + output reaches C tokens, and measures the resident set again. The
figure is (after - baseline) / N: everything the process keeps for a live
session, the engine's and the log's, plus the allocator's fragmentation.

Every session gets fresh objects, as the gateway gets them from each HTTP
request: its own token ids, its own message strings (about 4 characters of
text per token, split over a system prompt, a task, the model's answer and a
tool's reply), and the second turn's messages decoded anew from JSON, so no
two sessions (and no two turns) share a string the engine might keep.

Usage: ``python tools/bench/bench_engine_memory.py [--quick] [--sessions N] [--contexts 1024,8192,32768] [--wave N] [--dir D]``.
``tools/bench/bench_engine.py`` runs the 8k row too, so its two GOAL lines come from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from agentlog.tools.bench.child import json_from_child
from agentlog.tools.bench.goals import goal_line, meets

#: The goal: resident kB per live session at an 8k-token context.
GOAL_KB = 64
GOAL_CONTEXT = 8192
#: Output tokens of each turn.
OUTPUT_TOKENS = 256
#: Characters of message text per token (English text and code run at about 4).
CHARS_PER_TOKEN = 4
#: Sessions set up at once (the log group-commits their appends); the warm-up is one such wave.
WAVE = 500


def resident_bytes() -> int:
    """The process's resident set size, in bytes (Linux), after a full
    collection and after handing the allocator's free pages back to the
    system (glibc's ``malloc_trim``), so that what a wave of sessions left
    free, and may reuse, is not counted as held."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the figure then includes the allocator's free pages
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _text(tokens: int) -> str:
    # Fresh, incompressible text of about CHARS_PER_TOKEN characters a token.
    return os.urandom(tokens * CHARS_PER_TOKEN // 2).hex()


def _tokens(n: int) -> bytes:
    import numpy as np

    return np.random.randint(0, 150_000, size=n, dtype=np.int32).tobytes()


async def _live_session(eng, sid: str, context: int) -> object:
    """Open ``sid`` and record two turns whose second prompt + output is ``context`` tokens; leave it live."""
    import msgspec
    import numpy as np

    lps = np.full(OUTPUT_TOKENS, -0.5, dtype=np.float32)
    first_prompt = max(16, context // 2 - OUTPUT_TOKENS)
    tool = max(16, context - first_prompt - 2 * OUTPUT_TOKENS)
    system = {"role": "system", "content": _text(8)}
    task = {"role": "user", "content": _text(first_prompt - 8)}
    answer = {"role": "assistant", "content": _text(OUTPUT_TOKENS)}
    h = await eng.open_session(sid, group_id=f"g-{sid}", group_size=1, budget_s=3600)
    await h.start(harness="bench")
    prompt, out = _tokens(first_prompt), _tokens(OUTPUT_TOKENS)
    await h.record_turn(messages=[system, task], prompt_ids=prompt, output_ids=out, output_log_probs=lps.tobytes(),
                        response_message=answer, sampling={"temperature": 1.0})
    # The next request, as the gateway sees it: the whole conversation again, parsed anew.
    messages = msgspec.json.decode(msgspec.json.encode([system, task, answer, {"role": "tool", "content": _text(tool)}]))
    prompt = prompt + out + _tokens(tool)
    del system, task, answer
    await h.record_turn(messages=messages, prompt_ids=prompt, output_ids=_tokens(OUTPUT_TOKENS), output_log_probs=lps.tobytes(),
                        response_message={"role": "assistant", "content": _text(OUTPUT_TOKENS)}, sampling={"temperature": 1.0})
    return h


async def _measure(n: int, context: int, directory: Path, wave: int = WAVE) -> dict[str, float]:
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    log = FileLog.open(directory, fsync="batch")
    eng = await SessionEngine.open(log)
    # Warm-up, one wave of sessions that then end: every code path runs, and the
    # heap reaches the peak a wave's temporaries need, so the baseline holds it.
    hs = await asyncio.gather(*(_live_session(eng, f"w{j}", context) for j in range(wave)))
    await asyncio.gather(*(h.finish(reward=0.0) for h in hs))
    del hs
    before = resident_bytes()
    handles: list = []
    for i in range(0, n, wave):
        handles += await asyncio.gather(*(_live_session(eng, f"s{j}", context) for j in range(i, min(n, i + wave))))
    after = resident_bytes()
    assert eng.live_count == n
    return {"context": context, "sessions": n, "kb_per_session": (after - before) / n / 1024,
            "baseline_mb": before / 2**20, "after_mb": after / 2**20}


def measure_in_child(n: int, context: int, wave: int = WAVE, directory: Path | None = None) -> dict[str, float]:
    """Run one context size in a fresh interpreter (its log in a temp dir under ``directory``,
    removed after); returns its figures."""
    where = ["--dir", str(directory)] if directory is not None else []
    return json_from_child([__file__, "--one", str(context), "--sessions", str(n), "--wave", str(wave), *where])


def rss_goal_line(kb: float) -> str:
    """The GOAL line for the 8k-token context."""
    return goal_line(f"rss_per_live_session_{GOAL_CONTEXT // 1024}k_ctx_kb", f"{kb:.1f}", "<=", f"{GOAL_KB}",
                     meets(kb, "<=", GOAL_KB))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,000 live sessions per context size (default 10,000)")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--contexts", default="1024,8192,32768", help="context sizes in tokens, comma-separated")
    ap.add_argument("--wave", type=int, default=WAVE, help=f"sessions set up at once, and in the warm-up (default {WAVE})")
    ap.add_argument("--dir", type=Path, default=None, help="where each context size's log goes (a temp dir in it, removed after)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child: one context size
    args = ap.parse_args(argv)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.one is not None:
        base = Path(tempfile.mkdtemp(prefix="bench_engine_memory_", dir=args.dir))
        try:
            res = asyncio.run(_measure(args.sessions, args.one, base / "log", args.wave))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(json.dumps(res), flush=True)
        os._exit(0)  # the live sessions are the point: no need to end them one by one
    n = args.sessions or (1_000 if args.quick else 10_000)
    rows = []
    for c in (int(x) for x in args.contexts.split(",")):
        # 32k-token contexts at 10,000 sessions would take several GiB before the engine's memory is bounded.
        k = n if c <= GOAL_CONTEXT else max(1, n // 4)
        rows.append(measure_in_child(k, c, args.wave, args.dir))
    print(f"{'context (tokens)':>16}  {'live sessions':>13}  {'RSS per session':>15}  {'context as int32':>16}")
    for r in rows:
        print(f"{r['context']:>16,}  {r['sessions']:>13,}  {r['kb_per_session']:>12.1f} kB  {r['context'] * 4 / 1024:>13.1f} kB")
    at_goal = [r for r in rows if r["context"] == GOAL_CONTEXT]
    if at_goal:
        print(rss_goal_line(at_goal[0]["kb_per_session"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
