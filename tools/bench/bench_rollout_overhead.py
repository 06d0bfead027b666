"""Benchmark what the gateway and the engine add per turn of the Python agent.

The path under test is a text task's rollout in the loop: the engine opens
and starts a session (durable FileLog, fsync ``batch``), the gateway issues
its key, the built-in Python agent (the ``openai`` client over HTTP on
loopback) asks for a turn with the ``bash`` tool, the gateway renders the
chat template, calls the in-process TorchBackend, parses tool calls, records
the turn durably and answers, and the session finishes. The anchor is the
same backend, same model, called directly with the exact prompt ids the
gateway recorded (read back from the log), at the same concurrency and with
the same output allowance. The model is the built-in GPT with random
weights, so it answers without a tool call: one turn per session, which is
what early RL on a text task looks like; the per-session work (open, start,
key, finish) is therefore charged to that turn.

At 1 and 32 concurrent sessions (each a stream of back-to-back sessions),
from the two walls of the same turns:

* added time per turn = (wall through the gateway - wall direct) / turns:
  what the path costs the run per turn (at 32 sessions the sessions' turns
  overlap, so this is its throughput cost);
* added latency per turn = that x concurrency: what one session sees added
  to each of its turns (at 32 sessions it includes waiting behind the other
  31 sessions' gateway work on the one event loop);
* and the ratio of the two walls.

Goals. At 1 session the path must add <= 25 ms per turn: a turn of a real
model costs hundreds of ms to seconds, so that keeps the recording path
under a few percent of it (the built-in GPT answers in a few ms, which makes
the ratio look worse than it is in practice). At 32 sessions its cost per
turn must be <= 10 ms: the work is per turn, and must not grow with the
number of sessions in flight (the Python agent shares one HTTP client
across its sessions for that reason; a fresh ``AsyncOpenAI`` per session
cost ~20 ms of CPU each).

    python tools/bench/bench_rollout_overhead.py [--quick] [--max-tokens N] [--streams S] [--sessions ONE MANY] [--repeats R] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402

#: The goals on the added time per turn (ms), one session alone and many at once (32 by default): see the module docstring.
GOAL_ONE_MS, GOAL_MANY_MS = 25.0, 10.0


async def _through_gateway(concurrency: int, sessions_each: int, max_tokens: int, log_dir: Path, seed: int):
    """Wall time of ``concurrency`` streams of ``sessions_each`` Python-agent sessions; and the recorded prompts."""
    from agentlog.engine import LocalSandbox, SessionEngine
    from agentlog.events import FileLog
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded
    from agentlog.gateway import Gateway, TorchBackend
    from agentlog.gateway.python_agent import PythonAgent
    from agentlog.tools.cmd_serve import default_gateway_model

    log = FileLog.open(log_dir, fsync="batch")
    engine = await SessionEngine.open(log)
    backend = TorchBackend(default_gateway_model(seed), seed=seed)
    gw = Gateway(engine, backend)
    await gw.start("127.0.0.1", 0)
    sandbox = LocalSandbox(log_dir.parent / "sandbox")
    agent = PythonAgent(gw.url, max_turns=1, max_tokens=max_tokens)

    async def stream(c: int) -> None:
        for k in range(sessions_each):
            sid = f"c{c}-k{k}"
            h = await engine.open_session(sid, group_id=sid, group_size=1, prompt=[], agent="python-agent")
            await h.start(harness="python-agent")
            await agent.run(h, sandbox, f"session {sid}: write the word into answer.txt", gw.session_key(sid))
            await h.finish(reward=0.0)

    try:
        await stream(-1)  # warm-up: imports, the first client, the model's first batch
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(c) for c in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        await agent.close()
        await gw.stop()
        await engine.close()
        await backend.close()
    prompts = {}
    for env in full_turns(log.read(0)):
        if isinstance(env.body, TurnRecorded) and not env.session_id.startswith("c-1"):
            prompts[env.session_id] = (list(env.body.prompt_tokens), len(env.body.output_tokens))
    log.close()
    return wall, prompts


async def _direct(concurrency: int, sessions_each: int, prompts: dict, max_tokens: int, seed: int) -> float:
    """Wall time of the same prompts sent straight to the same backend, same concurrency."""
    from agentlog.gateway import ByteChatTemplate, SamplingParams, TorchBackend
    from agentlog.tools.cmd_serve import default_gateway_model

    backend = TorchBackend(default_gateway_model(seed), seed=seed)
    params = SamplingParams(max_new_tokens=max_tokens, stop_ids=ByteChatTemplate.stop_ids)

    async def stream(c: int) -> None:
        for k in range(sessions_each):
            ids, _n = prompts[f"c{c}-k{k}"]
            await backend.generate(ids, params)

    try:
        await backend.generate(next(iter(prompts.values()))[0], params)  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(c) for c in range(concurrency)))
        return time.perf_counter() - t0
    finally:
        await backend.close()


def measure(concurrency: int, sessions_each: int, max_tokens: int, repeats: int, parent: str | None = None) -> dict:
    """Median over ``repeats`` of both walls, and the added ms per turn (each repeat's log and sandbox in a
    temporary folder under ``parent``, the system's by default, removed after it)."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for r in range(repeats):
        with tempfile.TemporaryDirectory(prefix="bench-rollout-", dir=parent) as tmp:
            wall_g, prompts = asyncio.run(_through_gateway(concurrency, sessions_each, max_tokens, Path(tmp) / "log", seed=r))
        assert len(prompts) == concurrency * sessions_each, f"expected one turn per session, found {len(prompts)} turns"
        wall_d = asyncio.run(_direct(concurrency, sessions_each, prompts, max_tokens, seed=r))
        rows.append((wall_g, wall_d))
    wall_g = statistics.median(g for g, _ in rows)
    wall_d = statistics.median(d for _, d in rows)
    turns = concurrency * sessions_each
    added_ms = (wall_g - wall_d) / turns * 1e3
    return {"concurrency": concurrency, "turns": turns, "wall_gateway_s": wall_g, "wall_direct_s": wall_d,
            "added_ms_per_turn": added_ms, "added_latency_ms": added_ms * concurrency, "ratio": wall_g / wall_d}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print GOAL lines (exit 0 even on MISS)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sessions and one repeat (a smoke run)")
    p.add_argument("--max-tokens", type=int, default=16, help="output allowance per turn (default 16)")
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the many-sessions arm (default 32)")
    p.add_argument("--sessions", nargs=2, type=int, default=None, metavar=("ONE", "MANY"),
                   help="sessions per stream at 1 stream and at --streams streams (default 40 6; 8 2 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="runs of both walls per arm (default 3; 1 with --quick)")
    p.add_argument("--dir", default=None, help="where each run's temporary folder goes (default: the system's; removed after)")
    args = p.parse_args(argv)
    one, many = args.sessions if args.sessions is not None else ((8, 2) if args.quick else (40, 6))
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    # (concurrency, sessions per stream, goal in ms): one session alone, then many at once.
    arms = [(1, one, GOAL_ONE_MS), (args.streams, many, GOAL_MANY_MS)]
    results = []
    for c, sessions_each, goal in arms:
        res = measure(c, sessions_each, args.max_tokens, repeats, args.dir)
        results.append((res, goal))
        print(f"{c:>3} session(s): {res['turns']} turns, through gateway {res['wall_gateway_s']:.3f}s, direct {res['wall_direct_s']:.3f}s, "
              f"added {res['added_ms_per_turn']:.2f} ms/turn (latency per session-turn +{res['added_latency_ms']:.1f} ms), "
              f"ratio {res['ratio']:.2f}x", flush=True)
    for res, goal in results:
        added = res["added_ms_per_turn"]
        print(goal_line(f"rollout_added_ms_per_turn_{res['concurrency']}", f"{added:.2f} ms", "<=", f"{goal:.0f} ms",
                        meets(added, "<=", goal)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
