"""Benchmark: how the log and the reducer grow with the number of turns.

The SWE-agent session shape that motivated ``turn_delta``: a 2,000-token system prompt, then
per turn 200 generated tokens (with log-probs and an assistant message) and
400 tokens of tool output (a tool message); every turn's prompt is the whole
context so far. Sessions of 10, 25, 50, 100 and 200 turns, plus one of 100
turns whose agent compacts its history every 10 turns (the prompt keeps the
system prompt and the last two turns: a FORK in the reducer).

Each session is recorded twice in the same run:

* **delta**: through the engine (``SessionHandle.record_turn`` with full
  prompts, as the gateway calls it), which stores ``turn_delta`` events;
* **full** (the anchor): the same turns as ``turn_recorded`` events holding
  the whole prompt, today's encoding before the change.

Reported per session: log bytes (event payloads), the final trajectory's
bytes (token ids + log-probs + each message's text once), reducer CPU per
token of the final context (``reduce_log``, process time, best of a few
runs), and the reducer's peak traced memory while the session is live (all
its events but the terminal one fed).

Usage: ``python tools/bench/bench_growth.py [--quick] [--turns 10,25,50,100,200] [--goal-turns 100]
[--compact-every 10]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import structlog

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentlog.engine import SessionEngine  # noqa: E402
from agentlog.events.log.api import MemoryLog  # noqa: E402
from agentlog.events.schema.types import Envelope, TurnDelta, TurnRecorded, decode_body, encode_body  # noqa: E402
from agentlog.reducers.config import ReduceConfig  # noqa: E402
from agentlog.reducers.pipeline import Reducer, reduce_log  # noqa: E402
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402

SYSTEM_TOKENS = 2000
GENERATED = 200
TOOL_OUTPUT = 400
CHARS_PER_TOKEN = 4
CONFIG = ReduceConfig(min_valid=1)


def _text(tag: str, n_tokens: int) -> str:
    return (tag + " ").ljust(n_tokens * CHARS_PER_TOKEN, "x")


def session_turns(n_turns: int, compact_every: int = 0) -> list[dict[str, Any]]:
    """The record_turn arguments of one session (full prompts)."""
    prompt = list(range(1, SYSTEM_TOKENS + 1))
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text("system", SYSTEM_TOKENS)}]
    turns = []
    next_id = 10_000
    for t in range(n_turns):
        if compact_every and t and t % compact_every == 0:
            # The agent compacts its history: system prompt + the last two turns.
            keep = 2 * (GENERATED + TOOL_OUTPUT)
            prompt = prompt[:SYSTEM_TOKENS] + [7] + prompt[-keep:]
            messages = messages[:1] + [{"role": "user", "content": f"summary of turns before {t}"}] + messages[-4:]
        output = list(range(next_id, next_id + GENERATED))
        next_id += GENERATED
        response = {"role": "assistant", "content": _text(f"turn {t}", GENERATED)}
        turns.append(dict(messages=messages, prompt_ids=prompt, output_ids=output,
                          output_log_probs=[-0.5] * GENERATED, response_message=response))
        tool = list(range(next_id, next_id + TOOL_OUTPUT))
        next_id += TOOL_OUTPUT
        prompt = prompt + output + tool
        messages = messages + [response, {"role": "tool", "content": _text(f"tool {t}", TOOL_OUTPUT)}]
    return turns


def trajectory_bytes(turns: list[dict[str, Any]]) -> int:
    """Token ids + log-probs of the final context, and each distinct message's text once."""
    last = turns[-1]
    tokens = len(last["prompt_ids"]) + len(last["output_ids"])
    log_probs = sum(len(t["output_ids"]) for t in turns)
    seen: dict[str, None] = {}
    for t in turns:
        for m in t["messages"] + [t["response_message"]]:
            seen.setdefault(m["content"], None)
    return 4 * tokens + 4 * log_probs + sum(len(c.encode()) for c in seen)


def engine_sampling(log: MemoryLog) -> list[dict[str, Any]]:
    """Each turn's ``sampling`` as the engine recorded it in ``log``: the lineage it placed the turn in
    (a compacted history starts a new lineage, since its first user message changed)."""
    return [e.body.sampling for e in log.read(0) if isinstance(e.body, TurnDelta)]


def record(turns: list[dict[str, Any]], encoding: str, sampling: list[dict[str, Any]] | None = None) -> MemoryLog:
    """One session in a MemoryLog: through the engine (delta) or as full turn_recorded events, each
    with its ``sampling`` given (the engine's, so that both logs hold the same turns and reduce alike)."""

    async def go() -> MemoryLog:
        log = MemoryLog(clock=lambda: 0)
        if encoding == "delta":
            eng = await SessionEngine.open(log)
            h = await eng.open_session("s", group_id="g", group_size=1)
            await h.start()
            for kw in turns:
                await h.record_turn(**kw)
            await h.finish(reward=1.0)
            await eng.close()
            return log
        from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted

        records: list[Any] = [SessionOpened(group_id="g", group_size=1), SessionStarted()]
        records += [TurnRecorded(turn_index=i, **kw, **({"sampling": sampling[i]} if sampling else {}))
                    for i, kw in enumerate(turns)]
        records.append(SessionFinished(reward=1.0))
        log.append_batch([("s", i, b) for i, b in enumerate(records)])
        return log

    return asyncio.run(go())


def log_bytes(log: MemoryLog) -> int:
    return sum(len(encode_body(e.body)) for e in log.read(0))


def reducer_cpu_s(log: MemoryLog, repeats: int) -> tuple[float, str]:
    envs = list(log.read(0))
    best, digest = float("inf"), ""
    for _ in range(repeats):
        gc.collect()
        t0 = time.process_time()
        digest = reduce_log(iter(envs), CONFIG).digest
        best = min(best, time.process_time() - t0)
    return best, digest


def reducer_live_peak(log: MemoryLog) -> int:
    """Peak traced bytes while decoding and feeding the session's events up
    to its end (not including it): what a reader of a log file holds for one
    live session (bodies are decoded from their stored bytes, as from a file)."""
    stored = [(e.lsn, e.session_id, e.session_seq, e.ts_ns, encode_body(e.body)) for e in list(log.read(0))[:-1]]
    gc.collect()
    tracemalloc.start()
    reducer = Reducer(CONFIG)
    for lsn, sid, seq, ts, payload in stored:
        reducer.feed(Envelope(lsn, sid, seq, ts, decode_body(payload)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del reducer
    return peak


def _turn_counts(text: str) -> list[int]:
    counts = [int(n) for n in text.split(",")]
    if len(counts) < 2 or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: two or more positive turn counts, comma-separated")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (same session shapes)")
    parser.add_argument("--turns", type=_turn_counts, default=[10, 25, 50, 100, 200],
                        help="the sessions' turn counts, comma-separated (default 10,25,50,100,200); the CPU goal "
                             "compares the longest with the shortest")
    parser.add_argument("--goal-turns", type=int, default=100,
                        help="the session (one of --turns) whose bytes the log goal measures; the compacting "
                             "session has as many turns (default 100)")
    parser.add_argument("--compact-every", type=int, default=10,
                        help="the compacting session's agent compacts its history every N turns (default 10)")
    args = parser.parse_args(argv)
    if args.goal_turns not in args.turns:
        parser.error(f"--goal-turns {args.goal_turns} is not one of --turns {args.turns}")
    logging.disable(logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    repeats = 1 if args.quick else 3
    shortest, longest = min(args.turns), max(args.turns)
    shapes = [(n, 0) for n in args.turns] + [(args.goal_turns, args.compact_every)]
    print(f"{'session':>18} {'traj MB':>8} {'full MB':>9} {'delta MB':>9} {'full x':>7} {'delta x':>8}"
          f" {'full us/tok':>11} {'delta us/tok':>12} {'full peak MB':>12} {'delta peak MB':>13}")
    per_token: dict[tuple[int, int], float] = {}
    ratio: dict[tuple[int, int], float] = {}
    for n, every in shapes:
        turns = session_turns(n, every)
        traj = trajectory_bytes(turns)
        final_tokens = len(turns[-1]["prompt_ids"]) + len(turns[-1]["output_ids"])
        row = {}
        digests = {}
        sampling: list[dict[str, Any]] = []
        for encoding in ("delta", "full"):  # the delta first: the full turns carry the lineages the engine gave them
            log = record(turns, encoding, sampling)
            if encoding == "delta":
                sampling = engine_sampling(log)
            kinds = {type(e.body) for e in log.read(0)}
            assert (TurnDelta in kinds) == (encoding == "delta"), kinds
            cpu, digests[encoding] = reducer_cpu_s(log, repeats)
            row[encoding] = (log_bytes(log), cpu / final_tokens * 1e6, reducer_live_peak(log))
            del log
        if digests["full"] != digests["delta"]:
            raise SystemExit(f"{n} turns: the delta log reduced to digest {digests['delta']}, the full one to {digests['full']}")
        name = f"{n} turns" + (f", fork/{every}" if every else "")
        (fb, fc, fp), (db, dc, dp) = row["full"], row["delta"]
        print(f"{name:>18} {traj / 1e6:8.2f} {fb / 1e6:9.2f} {db / 1e6:9.2f} {fb / traj:6.1f}x {db / traj:7.2f}x"
              f" {fc:11.3f} {dc:12.3f} {fp / 1e6:12.1f} {dp / 1e6:13.1f}")
        per_token[(n, every)] = dc
        ratio[(n, every)] = db / traj
    r = ratio[(args.goal_turns, 0)]
    print(goal_line(f"log_bytes_vs_final_trajectory_{args.goal_turns}_turns", f"{r:.2f}x", "<=", "1.5x", meets(r, "<=", 1.5)))
    g = per_token[(longest, 0)] / per_token[(shortest, 0)]
    print(goal_line(f"reducer_cpu_per_token_{longest}_vs_{shortest}_turns", f"{g:.2f}x", "<=", "1.5x", meets(g, "<=", 1.5)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
