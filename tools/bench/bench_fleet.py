"""Benchmark a fleet of inference servers behind one gateway: session affinity against round robin, and failover.

Workload. Fake inference servers (``tools/bench/simulated_server.py``, each
in its own process) batch continuously (one decode step every ``--token-ms``
for the whole batch) and model a prefix cache: an LRU over ``BLOCK``-token
(64) prompt prefixes, bounded in tokens, where every uncached prompt token
costs ``--prefill-us`` of the step it joins (the whole batch waits for it).
The default, 30 ms a step and 15 us an uncached token, is an 8B model on
one H100 (a 64-way decode step in 20 ms, 100k prefill tokens/s) run 1.5x
slower, so that the gateway, the agents and the four servers sharing a
2-core machine keep up with the fleet's turns.

The sessions are replayed from a recorded run:

1. Record. 256 sessions of 30 turns (``--sessions``, ``--turns``) through a
   real :class:`~agentlog.gateway.Gateway` + ``SessionEngine`` + ``FileLog``
   (fsync ``batch``) on a temporary directory, backed by one simulated
   server. The agent is synthetic and deterministic: a system message and a
   task of seeded sizes, then each turn asks for a seeded 16 to 64 tokens
   and answers with a seeded tool result (20 to 600 characters, median 120),
   so with the byte chat template a context reaches about 8,000 tokens at
   turn 30 (the longest about 10,400).
2. Replay, once per arm. The recorded sessions are read back from the log
   on disk (``events.schema.turn_delta.full_turns``), and each session's
   recorded request messages and ``max_tokens`` are sent again, in order,
   to a fresh gateway (and log) whose backend is a
   :class:`~agentlog.gateway.fleet.Fleet` of 4 fresh simulated servers
   (``GatedBackend(SGLangBackend)``). All sessions run at once, each one
   turn after the other; the agents run in a process of their own (their
   JSON work is not charged to the gateway).

   * affinity: ``Fleet(policy="affinity")``, the gateway routing on the session id;
   * round_robin: ``Fleet(policy="round_robin")``, the anchor;
   * failover: affinity, and once half the turns are recorded the server
     holding the most sessions is killed (SIGKILL).

Cache capacity. Each server holds ``--cache-share`` (1.3) times its share
of the sessions' contexts at their last recorded turn: at the full size,
1.3 x 64 sessions x about 8,100 tokens (the mean), about 670k tokens,
while the 256 sessions' contexts take 2.1M at the end. Under affinity a
server's cache holds its own sessions (up to 1.25 x its share: the fleet's
load bound), and each turn prefills only what the session added since its
last turn. Under round robin
every server sees every session, whose context it last saw a few turns
ago, and it serves about 256 other turns in between: once the sessions'
contexts together outgrow one cache, LRU has evicted a session's context
before it comes back, as in a real fleet without affinity.

Figures per arm: output tokens per second of wall time across the fleet
(and prompt tokens/s), the prefix cache hit (cached prompt tokens over
prompt tokens, summed over the servers' ``/stats``; the killed server's as
of just before it died), the gateway's own time per turn (``gw.timings``:
preparing, recording, sending, excluding generation; p50 and p99 of their
sum, with every session in flight on one event loop), turns lost (a
recorded turn whose replay the agent did not get, or that the replay's log
lacks or holds twice: each session must hold turns 0..N-1 once), and the
sessions that moved server (turns recorded with ``server_moved_from``;
under round robin, every session at almost every turn).

Usage: ``python -m agentlog.tools.bench.bench_fleet [--quick] [--sessions N] [--turns N] [--token-ms MS]
[--prefill-us US] [--cache-share X] [--seed N]``. ``--quick`` is 32 sessions of 10 turns, at 5 ms a
step (a smoke run: its turns are too few and its batches too small for the GOALs' figures).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures as cf
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from agentlog.tools.bench import simulated_server
from agentlog.tools.bench.goals import goal_line, meets

SERVERS = 4
ARMS = ("affinity", "round_robin", "failover")
#: Output tokens a turn asks for, drawn uniformly per turn.
OUTPUT_TOKENS = (16, 64)
#: Tool result characters per turn: lognormal, this median, clamped to TOOL_RANGE.
TOOL_MEDIAN, TOOL_SIGMA, TOOL_RANGE = 120, 0.8, (20, 600)
_WORDS = ("alpha beta gamma delta kernel vector buffer socket stream parser cache token tensor batch epoch "
          "shard queue lease commit index frame header segment offset replica leader quorum").split()


# ---------------------------------------------------------------- the agents (their own process)


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def _tool_chars(rng: random.Random) -> int:
    return int(min(max(rng.lognormvariate(math.log(TOOL_MEDIAN), TOOL_SIGMA), TOOL_RANGE[0]), TOOL_RANGE[1]))


async def _post(http: Any, url: str, key: str, body: bytes, where: str, out: dict) -> dict | None:
    """One chat turn; its answer, or None after counting the error in ``out``."""
    import aiohttp

    try:
        async with http.post(url + "/v1/chat/completions", data=body,
                             headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
            raw = await r.read()
            status = r.status
    except aiohttp.ClientError as exc:
        out["errors"].append(f"{where}: {type(exc).__name__}: {exc}")
        return None
    if status != 200:
        out["errors"].append(f"{where}: HTTP {status}: {raw[:300]!r}")
        return None
    data = msgspec.json.decode(raw)
    out["output_tokens"] += data["usage"]["completion_tokens"]
    out["prompt_tokens"] += data["usage"]["prompt_tokens"]
    out["ok"][where.split(" turn ")[0]] += 1
    return data


def _drive(url: str, keys: dict[str, str], play: Any) -> dict:
    """Run ``play(http, sid, out)`` for every session at once; the agents' totals and wall time."""
    import aiohttp

    async def main() -> dict:
        out: dict = {"errors": [], "output_tokens": 0, "prompt_tokens": 0, "ok": collections.Counter()}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=None)) as http:
            t0 = time.perf_counter()
            await asyncio.gather(*(play(http, sid, out) for sid in keys))
            out["wall_s"] = time.perf_counter() - t0
        out["ok"] = dict(out["ok"])
        return out

    return asyncio.run(main())


def record_agents(url: str, keys: dict[str, str], turns: int, seed: int) -> dict:
    """The synthetic agents of the recorded run: session ``sid`` plays ``turns`` turns, its
    sizes drawn from a generator seeded by (seed, sid); each turn's answer goes back into
    the conversation, then a tool result."""
    async def play(http: Any, sid: str, out: dict) -> None:
        rng = random.Random(f"{seed}/{sid}")
        msgs = [{"role": "system", "content": f"You are agent {sid}. " + _text(rng, rng.randint(600, 1000))},
                {"role": "user", "content": "Task: " + _text(rng, rng.randint(200, 600))}]
        for t in range(turns):
            body = msgspec.json.encode({"model": "sim", "messages": msgs, "max_tokens": rng.randint(*OUTPUT_TOKENS)})
            data = await _post(http, url, keys[sid], body, f"{sid} turn {t}", out)
            if data is None:
                raise RuntimeError(f"recording: session {sid} turn {t} failed: {out['errors'][-1]}")
            msgs = msgs + [data["choices"][0]["message"],
                           {"role": "user", "content": f"Tool result {t}: " + _text(rng, _tool_chars(rng))}]

    return _drive(url, keys, play)


def replay_agents(url: str, keys: dict[str, str], plan_path: str) -> dict:
    """Each session sends its recorded request bodies (``plan_path``: msgpack of session id ->
    JSON bodies), in order; a failed turn is counted and the session goes on to the next."""
    plan: dict[str, list[bytes]] = msgspec.msgpack.decode(Path(plan_path).read_bytes())
    missing = sorted(set(keys) - set(plan))
    if missing:
        raise ValueError(f"replay: sessions {missing[:5]} have a key but no recorded turns in {plan_path}")

    async def play(http: Any, sid: str, out: dict) -> None:
        for t, body in enumerate(plan[sid]):
            await _post(http, url, keys[sid], body, f"{sid} turn {t}", out)

    return _drive(url, keys, play)


def _warm() -> int:
    return os.getpid()


# ---------------------------------------------------------------- the gateway side


@dataclass
class ArmResult:
    name: str
    wall_s: float = 0.0
    turns: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    #: The gateway's own time per turn (prepare + record + send, ``gw.timings``), ms.
    gateway_ms: list[float] = field(default_factory=list)
    #: p50 of each of the three, ms.
    gateway_split_p50: tuple[float, ...] = ()
    errors: list[str] = field(default_factory=list)
    missing: int = 0
    duplicated: int = 0
    lost: int = 0
    prompt_mismatches: int = 0
    moved_sessions: int = 0
    moved_turns: int = 0
    killed: str = ""
    #: Turns recorded when the server was killed.
    killed_after: int = 0
    servers: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def cache_hit(self) -> float:
        return self.cached_tokens / max(1, self.cached_tokens + self.prefill_tokens)


@dataclass
class Recorded:
    """The recorded run, read back from its log: each session's request bodies and prompt lengths."""

    plan_path: Path
    prompt_lens: dict[str, list[int]]
    #: The mean of the sessions' last contexts (last prompt and output), in tokens.
    mean_context: float
    wall_s: float


async def _gateway(log_dir: Path, backend: Any, sids: list[str], turns: int) -> tuple[Any, Any, Any, dict[str, str]]:
    """A gateway on 127.0.0.1 over a fresh FileLog, with every session opened and started."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.gateway import Gateway, GatewayConfig

    log = FileLog.open(log_dir, fsync="batch")
    engine = await SessionEngine.open(log)
    gw = Gateway(engine, backend, config=GatewayConfig(max_turns=turns + 1))
    await gw.start("127.0.0.1", 0)
    for sid in sids:
        h = await engine.open_session(sid, group_id=sid, group_size=1)
        await h.start(harness="bench_fleet")
    return gw, engine, log, {sid: gw.session_key(sid) for sid in sids}


async def _close(gw: Any, engine: Any, log: Any, sids: list[str]) -> None:
    for sid in sids:
        await engine.get(sid).finish(reward=0.0)
    await gw.stop()
    await engine.close()
    await gw.backend.close()
    log.close()


def _read_turns(log_dir: Path) -> dict[str, list[Any]]:
    """Every session's full turns (deltas expanded), in log order, read back from the log on disk."""
    from agentlog.events.log.source import open_source
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded

    out: dict[str, list[Any]] = collections.defaultdict(list)
    for env in full_turns(open_source(log_dir).read()):
        if isinstance(env.body, TurnRecorded):
            out[env.session_id].append(env.body)
    return out


async def _progress(gw: Any, total: int, desc: str) -> None:
    """A bar of the turns the gateway recorded."""
    from agentlog.tools.progress import new_bar

    with new_bar(total, desc, unit="turn") as bar:
        while True:
            bar.update(gw.stats["turns"] - bar.n)
            await asyncio.sleep(0.2)


async def record(args: argparse.Namespace, tmp: Path, pool: cf.Executor) -> Recorded:
    """Play the synthetic agents through a gateway on one simulated server; read the run back."""
    from agentlog.gateway import SGLangBackend

    sids = [f"sess-{i:04d}" for i in range(args.sessions)]
    proc, url = simulated_server.spawn(0.0005, 0.0, 0.0)
    try:
        gw, engine, log, keys = await _gateway(tmp / "recorded", SGLangBackend(url), sids, args.turns)
        bar = asyncio.ensure_future(_progress(gw, len(sids) * args.turns, "record"))
        try:
            res = await asyncio.get_running_loop().run_in_executor(pool, record_agents, gw.url, keys, args.turns, args.seed)
        finally:
            bar.cancel()
        await _close(gw, engine, log, sids)
    finally:
        proc.kill()
        proc.wait()
    turns = _read_turns(tmp / "recorded")
    plan: dict[str, list[bytes]] = {}
    lens: dict[str, list[int]] = {}
    for sid in sids:
        bodies = turns.get(sid, [])
        if [b.turn_index for b in bodies] != list(range(args.turns)):
            raise RuntimeError(f"recording: session {sid} recorded turns {[b.turn_index for b in bodies]}, "
                               f"expected 0..{args.turns - 1}")
        plan[sid] = [msgspec.json.encode({"model": "sim", "messages": b.messages,
                                          "max_tokens": b.sampling["client"]["max_tokens"]}) for b in bodies]
        lens[sid] = [len(b.prompt_tokens) for b in bodies]
    mean_context = statistics.fmean(len(b[-1].prompt_tokens) + len(b[-1].output_tokens) for b in turns.values())
    path = tmp / "plan.msgpack"
    path.write_bytes(msgspec.msgpack.encode(plan))
    return Recorded(path, lens, mean_context, res["wall_s"])


async def _server_stats(http: Any, url: str) -> dict:
    async with http.get(url + "/stats") as r:
        if r.status != 200:
            raise RuntimeError(f"GET {url}/stats: HTTP {r.status}: {(await r.text())[:200]}")
        return await r.json()


async def replay_arm(arm: str, rec: Recorded, args: argparse.Namespace, tmp: Path, pool: cf.Executor) -> ArmResult:
    """Replay the recorded sessions through a gateway on a fleet of fresh simulated servers."""
    import aiohttp

    from agentlog.events.schema.turn import turn_server
    from agentlog.gateway import SGLangBackend
    from agentlog.gateway.fleet import Fleet, FleetMember
    from agentlog.gateway.weight_sync import GatedBackend

    res = ArmResult(arm)
    sids = sorted(rec.prompt_lens)
    total = sum(len(v) for v in rec.prompt_lens.values())
    servers = simulated_server.spawn_many(args.servers, args.token_ms / 1e3, args.prefill_us / 1e6, 0.0, args.cache_tokens)
    urls = {f"s{i}": url for i, (_, url) in enumerate(servers)}
    procs = {f"s{i}": proc for i, (proc, _) in enumerate(servers)}
    fleet = Fleet([FleetMember(name, GatedBackend(SGLangBackend(url))) for name, url in urls.items()],
                  policy="round_robin" if arm == "round_robin" else "affinity")
    stats: dict[str, dict] = {}
    try:
        async with aiohttp.ClientSession() as http:
            gw, engine, log, keys = await _gateway(tmp / arm, fleet, sids, args.turns)

            async def kill_mid_run() -> None:
                """Kill the server holding the most sessions once ``kill_at`` of the turns are recorded."""
                while gw.stats["turns"] < total * args.kill_at:
                    await asyncio.sleep(0.005)
                victim = max(fleet.members, key=lambda m: m.keys)
                stats[victim.name] = await _server_stats(http, urls[victim.name])
                procs[victim.name].kill()  # SIGKILL: no goodbye to its clients
                res.killed, res.killed_after = victim.name, gw.stats["turns"]

            gw.timings = []
            watchers = [asyncio.ensure_future(_progress(gw, total, arm))]
            if arm == "failover":
                watchers.append(asyncio.ensure_future(kill_mid_run()))
            try:
                out = await asyncio.get_running_loop().run_in_executor(pool, replay_agents, gw.url, keys, str(rec.plan_path))
            finally:
                for w in watchers:
                    w.cancel()
                for w in await asyncio.gather(*watchers, return_exceptions=True):
                    if isinstance(w, Exception):  # the bar, or the kill (a server's /stats) failed
                        raise RuntimeError(f"{arm}: a watcher of the replay failed: {type(w).__name__}: {w}") from w
            if arm == "failover" and not res.killed:
                raise RuntimeError(f"failover: the replay ended before {args.kill_at:.0%} of its {total} turns were "
                                   f"recorded ({gw.stats['turns']}); no server was killed")
            res.gateway_ms = [sum(t) * 1e3 for t in gw.timings]
            res.gateway_split_p50 = tuple(statistics.median(t[i] for t in gw.timings) * 1e3 for i in range(3))
            res.servers = fleet.describe()
            for name, url in urls.items():
                if name != res.killed:
                    if procs[name].poll() is not None:
                        raise RuntimeError(f"{arm}: simulated server {name} ({url}) exited during the replay, "
                                           f"status {procs[name].returncode}")
                    stats[name] = await _server_stats(http, url)
            await _close(gw, engine, log, sids)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    res.wall_s, res.errors = out["wall_s"], out["errors"]
    res.output_tokens, res.prompt_tokens = out["output_tokens"], out["prompt_tokens"]
    res.cached_tokens = sum(s["cached_tokens"] for s in stats.values())
    res.prefill_tokens = sum(s["prefill_tokens"] for s in stats.values())
    for name, s in stats.items():
        next(m for m in res.servers if m["name"] == name)["cache_hit"] = s["cached_tokens"] / max(1, s["cached_tokens"] + s["prefill_tokens"])
    turns = _read_turns(tmp / arm)
    for sid in sids:
        want = len(rec.prompt_lens[sid])
        bodies = turns.get(sid, [])
        index = collections.Counter(b.turn_index for b in bodies)
        held = sum(1 for i in range(want) if index[i] >= 1)
        extra = sum(c - 1 for c in index.values() if c > 1) + sum(c for i, c in index.items() if i >= want)
        res.missing += want - held
        res.duplicated += extra
        # A turn is lost when the agent did not get it or the log does not hold it exactly once.
        res.lost += want - min(out["ok"].get(sid, 0), held) + extra
        res.prompt_mismatches += sum(1 for b in bodies if b.turn_index < want and len(b.prompt_tokens) != rec.prompt_lens[sid][b.turn_index])
        moves = [b for b in bodies if turn_server(b)[1]]
        res.moved_turns += len(moves)
        res.moved_sessions += bool(moves)
        res.turns += len(bodies)
    return res


# ---------------------------------------------------------------- report


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [math.nan])[0]


def table(arms: dict[str, ArmResult]) -> list[str]:
    """One row per arm, then each arm's servers."""
    lines = [f"{'arm':<12}{'wall s':>8}{'turns':>7}{'out tok/s':>11}{'prompt tok/s':>14}{'cache hit':>11}"
             f"{'gw p50 ms':>11}{'gw p99 ms':>11}{'lost':>6}{'errors':>8}{'moved':>7}"]
    for r in arms.values():
        lines.append(f"{r.name:<12}{r.wall_s:>8.1f}{r.turns:>7}{r.tokens_per_s:>11,.0f}{r.prompt_tokens / r.wall_s:>14,.0f}"
                     f"{r.cache_hit:>11.3f}{_p(r.gateway_ms, 50):>11.2f}{_p(r.gateway_ms, 99):>11.2f}{r.lost:>6}"
                     f"{len(r.errors):>8}{r.moved_sessions:>7}")
    lines.append("")
    for r in arms.values():
        prepare, recording, sending = r.gateway_split_p50
        lines.append(f"{r.name}: gateway p50 by phase: prepare {prepare:.2f} ms (template, routing, parse), "
                     f"record {recording:.2f} ms (durable), send {sending:.2f} ms")
    for r in arms.values():
        per = ", ".join(f"{m['name']} {m['keys']} sessions {m['served']} turns hit "
                        + (f"{m['cache_hit']:.2f}" if "cache_hit" in m else "n/a")
                        + ("" if m["in_routing"] else " (out)") for m in r.servers)
        lines.append(f"{r.name}: {per}")
    return lines


async def run(args: argparse.Namespace) -> dict[str, ArmResult]:
    """Record, then replay every arm; the arms' results."""
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as pool, tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        await asyncio.get_running_loop().run_in_executor(pool, _warm)
        rec = await record(args, Path(tmp), pool)
        share = math.ceil(args.sessions / args.servers)
        args.cache_tokens = math.ceil(args.cache_share * share * rec.mean_context / simulated_server.BLOCK) * simulated_server.BLOCK
        print(f"recorded {args.sessions} sessions x {args.turns} turns in {rec.wall_s:.1f} s; mean last context "
              f"{rec.mean_context:,.0f} tokens; each server's cache: {args.cache_tokens:,} tokens "
              f"({args.cache_share:g} x {share} sessions x {rec.mean_context:,.0f}), all sessions' last contexts: "
              f"{rec.mean_context * args.sessions:,.0f} tokens", flush=True)
        return {arm: await replay_arm(arm, rec, args, Path(tmp), pool) for arm in ARMS}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and the GOAL lines (exit 0 even on MISS)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="32 sessions of 10 turns, 5 ms a step, 2.5 us a prefill token")
    p.add_argument("--sessions", type=int, help="sessions (default 256; --quick 32)")
    p.add_argument("--turns", type=int, help="turns per session (default 30; --quick 10)")
    p.add_argument("--servers", type=int, default=SERVERS, help="servers in the fleet (default 4)")
    p.add_argument("--token-ms", type=float, help="one decode step of a server's batch (default 30)")
    p.add_argument("--prefill-us", type=float, help="prefill time per uncached prompt token (default 15)")
    p.add_argument("--cache-share", type=float, default=1.3,
                   help="each server's cache, in its share of the sessions' largest context (default 1.3)")
    p.add_argument("--kill-at", type=float, default=0.5, help="failover arm: kill a server after this fraction of the turns")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.sessions = args.sessions or (32 if args.quick else 256)
    args.turns = args.turns or (10 if args.quick else 30)
    args.token_ms = args.token_ms if args.token_ms is not None else (5.0 if args.quick else 30.0)
    # By default an uncached prompt token costs 1/2000 of a decode step (15 us at 30 ms).
    args.prefill_us = args.prefill_us if args.prefill_us is not None else args.token_ms / 2
    for name in ("sessions", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected at least 1, found {getattr(args, name)}")
    if args.servers < 2:
        p.error(f"--servers: expected at least 2 (a fleet that can lose one), found {args.servers}")
    if not 0 < args.kill_at < 1:
        p.error(f"--kill-at: expected a fraction between 0 and 1, found {args.kill_at}")
    if args.cache_share <= 0 or args.token_ms <= 0 or args.prefill_us < 0:
        p.error("--cache-share and --token-ms: expected > 0; --prefill-us: expected >= 0")
    load = os.getloadavg()[0]
    arms = asyncio.run(run(args))
    print(f"bench_fleet: {args.servers} simulated servers ({args.token_ms:g} ms a decode step, {args.prefill_us:g} us an "
          f"uncached prompt token, {args.cache_tokens:,}-token LRU prefix cache), {args.sessions} sessions x {args.turns} "
          f"turns replayed from a recorded run, FileLog fsync=batch; load average at start {load:.1f} on {os.cpu_count()} CPUs")
    print()
    for line in table(arms):
        print(line)
    aff, rr, fo = arms["affinity"], arms["round_robin"], arms["failover"]
    print()
    print(f"failover: killed {fo.killed} after {fo.killed_after} of {fo.turns} turns; {fo.moved_sessions} sessions "
          f"moved ({fo.moved_turns} turns recorded with server_moved_from); turns missing from the log {fo.missing}, "
          f"recorded twice {fo.duplicated}, HTTP errors seen by the agents {len(fo.errors)}; replayed prompts whose "
          f"length differs from the recording: {sum(r.prompt_mismatches for r in arms.values())}")
    for err in fo.errors[:5]:
        print(f"  {err}")
    print(f"prefix_cache_hit_round_robin: {rr.cache_hit:.3f}")
    ratio = aff.tokens_per_s / rr.tokens_per_s
    p50 = _p(aff.gateway_ms, 50)
    print(goal_line("prefix_cache_hit_affinity", f"{aff.cache_hit:.3f} (round robin {rr.cache_hit:.3f})", ">=", "0.9",
                    meets(aff.cache_hit, ">=", 0.9)))
    print(goal_line("fleet_tokens_per_s_affinity_vs_round_robin", f"{ratio:.2f}x", ">=", "1.5x", meets(ratio, ">=", 1.5)))
    print(goal_line("failover_turns_lost", str(fo.lost), "==", "0", meets(fo.lost, "==", 0)))
    print(goal_line(f"gateway_added_p50_ms_{args.servers}_servers", f"{p50:.2f}", "<=", "2", meets(p50, "<=", 2.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
