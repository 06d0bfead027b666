"""Benchmark the recording gateway against its anchor: the same backend called directly.

In one run, on the built-in torch policy (TorchBackend) with a durable
FileLog (fsync policy ``batch``):

1. Latency the gateway adds per turn, at one session, over calling the
   backend directly: for every turn, the client-measured round trip (HTTP,
   JSON, chat template, tool parsing, ``record_turn`` made durable, response)
   minus the backend's compute for that turn (``generate_s``, recorded in the
   log), minus what a direct in-process call on the same prompt spends beyond
   its own compute (the hand-off to the backend's worker thread and back).
   p50 and p99, with the gateway's own time split by phase.
2. Turns/s at 1, 16 and 128 concurrent sessions, each session a multi-turn
   conversation, through the gateway; and the backend alone replaying the
   exact same prompts at the same concurrency.

The HTTP load generator runs in its own process so its cost is not charged
to the gateway's event loop. Goals: added p50 <= 2 ms; gateway turns/s at
128 sessions >= 0.9x the backend alone.

    python tools/bench/bench_gateway.py [--quick] [--max-tokens N] [--sessions N ...] [--turns T]
        [--repeats R] [--latency-turns T] [--dir D]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agentlog.tools.bench.goals import goal_line, meets  # noqa: E402


# ---------------------------------------------------------------- client process


def _client_run(url: str, sids: list[str], turns: int, max_tokens: int, keys: dict[str, str]) -> dict:
    """Drive ``len(sids)`` concurrent sessions of ``turns`` chat turns each
    (``keys``: each session's API key); returns latencies."""
    import aiohttp

    async def session(http, sid, out):
        msgs = [{"role": "system", "content": "You are a benchmark agent."}, {"role": "user", "content": f"task for {sid}"}]
        for k in range(turns):
            body = {"model": "m", "messages": msgs, "max_tokens": max_tokens, "temperature": 1.0}
            t0 = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {keys[sid]}"}) as r:
                data = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"session {sid} turn {k}: HTTP {r.status}: {data}")
            out.append((sid, k, time.perf_counter() - t0))
            msgs = msgs + [data["choices"][0]["message"], {"role": "user", "content": f"step {k}"}]
            if k % 8 == 7:  # a new episode now and then keeps prompts inside the context
                msgs = msgs[:2]

    async def main():
        out: list = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            t0 = time.perf_counter()
            await asyncio.gather(*(session(http, s, out) for s in sids))
            wall = time.perf_counter() - t0
        return {"latencies": out, "wall": wall}

    return asyncio.run(main())


# ---------------------------------------------------------------- server side


async def _run(args) -> list[str]:
    import torch

    from agentlog.engine import SessionEngine
    from agentlog.gateway import ByteChatTemplate, Gateway, GatewayConfig, SamplingParams, TorchBackend
    from agentlog.events import FileLog
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded
    from agentlog.learner.model import GPT, GPTConfig

    torch.set_num_threads(1)  # leave the other core to the gateway and the client
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=ByteChatTemplate.VOCAB_SIZE, max_seq_len=2048, d_model=64, n_layer=2, n_head=4))
    backend = TorchBackend(model, max_batch=128)
    tmp = tempfile.mkdtemp(prefix="bench-gateway-", dir=args.dir)
    log = FileLog.open(Path(tmp) / "log", fsync="batch")
    engine = await SessionEngine.open(log)
    gw = Gateway(engine, backend, config=GatewayConfig(max_turns=10_000))
    url = await gw.start("127.0.0.1", 0)
    pool = cf.ProcessPoolExecutor(1)
    loop = asyncio.get_running_loop()
    counter = [0]

    async def through_gateway(n: int, turns: int) -> tuple[float, list, dict]:
        sids = []
        handles = []
        gid = f"g{counter[0] + 1}"  # a fresh group per call: a released group takes no new member
        for _ in range(n):
            counter[0] += 1
            sid = f"b{counter[0]}"
            h = await engine.open_session(sid, group_id=gid, group_size=n)
            await h.start(harness="bench")
            sids.append(sid)
            handles.append(h)
        keys = {sid: gw.session_key(sid) for sid in sids}
        res = await loop.run_in_executor(pool, _client_run, url, sids, turns, args.max_tokens, keys)
        for h in handles:
            await h.finish(reward=0.0)
        return res["wall"], res["latencies"], {s: i for i, s in enumerate(sids)}

    def recorded(sids: set[str]) -> dict:
        out = {}
        for env in full_turns(log.read(0)):  # the engine stores deltas: compare whole prompts
            if env.session_id in sids and isinstance(env.body, TurnRecorded):
                out[(env.session_id, env.body.turn_index)] = env.body
        return out

    async def backend_alone(prompts_by_session: list[list[list[int]]]) -> float:
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, stop_ids=(ByteChatTemplate.EOS,))

        async def one(prompts):
            for p in prompts:
                await backend.generate(p, params)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts_by_session))
        return time.perf_counter() - t0

    lines = []
    try:
        # warm-up: imports, allocator, first HTTP connections
        await through_gateway(4, 2)

        # 1. added latency at one session
        gw.timings = []
        wall, lats, _ = await through_gateway(1, args.latency_turns)
        split = np.array(gw.timings) * 1e3
        gw.timings = None
        rec = recorded({s for s, _, _ in lats})
        added = np.array([lat - rec[(s, k)].generate_s for s, k, lat in lats]) * 1e3
        gen = np.array([rec[(s, k)].generate_s for s, k, _ in lats]) * 1e3
        # The anchor: the same prompts through backend.generate() in-process.
        # Its wall time minus its compute is what any caller pays to reach the
        # backend (the hand-off to and from its worker thread); the gateway's
        # added latency per turn is its own (round trip - compute) minus that.
        direct, handoff = [], []
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, stop_ids=(ByteChatTemplate.EOS,))
        for s, k, _ in lats:
            t0 = time.perf_counter()
            g = await backend.generate(rec[(s, k)].prompt_tokens.tolist(), params)
            wall_ms = (time.perf_counter() - t0) * 1e3
            direct.append(wall_ms)
            handoff.append(wall_ms - g.generate_s * 1e3)
        over_direct = added - np.array(handoff)
        p50, p99 = float(np.percentile(over_direct, 50)), float(np.percentile(over_direct, 99))

        # 2. throughput at 1, 16, 128 sessions: gateway, then the backend alone on the same prompts
        # Each pair (gateway run, then the backend alone on its prompts) runs
        # back to back, `repeats` times; the medians damp the load swings of
        # a shared machine.
        rows = []
        for n in args.sessions:
            be_rates, gw_rates, ratios = [], [], []
            for _ in range(args.repeats):
                wall_gw, lats, _ = await through_gateway(n, args.turns)
                rec = recorded({s for s, _, _ in lats})
                by_session: dict[str, list] = {}
                for (s, _k), body in sorted(rec.items(), key=lambda kv: (kv[0][0], kv[0][1])):
                    by_session.setdefault(s, []).append(body.prompt_tokens.tolist())
                wall_be = await backend_alone(list(by_session.values()))
                total = n * args.turns
                be_rates.append(total / wall_be)
                gw_rates.append(total / wall_gw)
                ratios.append(wall_be / wall_gw)
            rows.append((n, statistics.median(be_rates), statistics.median(gw_rates), statistics.median(ratios)))

        import os

        lines.append(f"bench_gateway: built-in GPT (d_model 64, 2 layers), max_tokens {args.max_tokens}, FileLog fsync=batch, "
                     f"client in its own process; load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        lines.append("")
        lines.append(f"{'per turn (1 session)':<28}{'p50 ms':>10}{'p99 ms':>10}")
        lines.append(f"{'backend called directly':<28}{statistics.median(direct):>10.2f}{float(np.percentile(direct, 99)):>10.2f}")
        lines.append(f"{'backend inside gateway':<28}{float(np.percentile(gen, 50)):>10.2f}{float(np.percentile(gen, 99)):>10.2f}")
        pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
        lines.append(f"{'direct call minus compute':<28}{pct(handoff, 50):>10.2f}{pct(handoff, 99):>10.2f}")
        lines.append(f"{'gateway turn minus compute':<28}{pct(added, 50):>10.2f}{pct(added, 99):>10.2f}")
        for i, what in enumerate(["  template, parse, handoff", "  record_turn (durable)", "  response write"]):
            lines.append(f"{what:<28}{pct(split[:, i], 50):>10.2f}{pct(split[:, i], 99):>10.2f}")
        lines.append(f"{'  HTTP + client (the rest)':<28}{pct(added, 50) - pct(split.sum(1), 50):>10.2f}{'':>10}")
        lines.append(f"{'added over a direct call':<28}{p50:>10.2f}{p99:>10.2f}")
        lines.append("")
        lines.append(f"{'sessions':>9}{'backend turns/s':>18}{'gateway turns/s':>18}{'ratio':>8}")
        for n, be, g, r in rows:
            lines.append(f"{n:>9}{be:>18.1f}{g:>18.1f}{r:>8.2f}")
        lines.append(f"(medians of {args.repeats} back-to-back pairs; ratio = median of per-pair ratios)")
        lines.append("")
        ratio = rows[-1][3]
        lines.append(goal_line("gateway_added_latency_p50_ms", f"{p50:.2f}", "<=", "2.0", meets(p50, "<=", 2.0)))
        lines.append(goal_line(f"gateway_vs_backend_turns_per_s_at_{rows[-1][0]}_sessions", f"{ratio:.2f}x", ">=", "0.9x",
                               meets(ratio, ">=", 0.9)))
    finally:
        pool.shutdown()
        await gw.stop()
        await engine.close()
        await backend.close()
        log.close()
        shutil.rmtree(tmp)  # a run leaves no log behind
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table and GOAL lines (exit 0 even on MISS)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small run (fewer turns)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn")
    p.add_argument("--sessions", nargs="+", type=int, default=[1, 16, 128],
                   help="concurrent sessions of the throughput runs (the GOAL line is the last's)")
    p.add_argument("--turns", type=int, default=None, help="turns per session in the throughput runs (default 6; 2 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="gateway/backend pairs per throughput run (default 3; 1 with --quick)")
    p.add_argument("--latency-turns", type=int, default=None, help="turns of the one-session latency run (default 200; 30 with --quick)")
    p.add_argument("--dir", default=None, help="where the log's temporary folder goes (default: the system's; removed after)")
    args = p.parse_args(argv)
    if args.turns is None:
        args.turns = 2 if args.quick else 6
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.latency_turns is None:
        args.latency_turns = 30 if args.quick else 200
    for line in asyncio.run(_run(args)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
