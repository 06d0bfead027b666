"""Benchmark partial rollouts: generation that carries on through a weight update, against draining.

Workload (the throughput arms). The real in-process ``TorchBackend`` serves a
simulated inference server: a model whose ``sample()`` sleeps a fixed time
per decode step for the whole batch (``--token-ms``, default 2 ms), calls
``between_steps`` at each token boundary as ``learner.model.decode`` does
(stopping the batch when it returns True, the rows still generating finishing
``"abort"``) and emits one fixed token per step. 64 sessions run at once,
each playing ``--turns`` turns (default 10) one after the other; each turn's
length (its ``max_new_tokens``) is drawn from a lognormal, the same draws in
every arm. Before the clock starts, the sessions play untimed one-token
rounds until one is served as a single batch (a cold backend starts its
first batch with whatever has arrived). A publisher hands the backend a new version every period through
``backend.load_weights(...)`` (a one-tensor state dict the fake model takes).

Scale: the target workload is turns of median 2 s and p99 60 s of generation
with a new version every 10 s. Here time runs 25x faster: at 2 ms per token,
turns of median 40 tokens (80 ms) and p99 1200 tokens (2.4 s; lognormal
sigma ln(30)/2.326 = 1.46, capped at 4000 tokens), a version every 400 ms.

Arms, same workload and seed, one after the other in one run:

* in-process, on ``TorchBackend`` (static batching), each session playing
  ``--turns`` turns:

  * drain: ``weight_update="drain"``: an update waits for the batch in flight;
  * continue: applied at the next token boundary, the batch goes on;
  * resubmit: applied at the next token boundary, unfinished rows resubmitted;

* server, for ``--server-s`` seconds each (a steady state: sessions play turn
  after turn, and the turns in flight at the end are not counted), through
  agentlog's SGLang client and weight sync (``GatedBackend(SGLangBackend)``,
  ``SGLangWeightSync``) over HTTP against a simulated SGLang server with
  continuous batching (``tools/bench/simulated_server.py``, in a process of
  its own). Each session's context starts at 1,000 tokens and grows by its
  output and a 50-token tool result every turn:

  * server drain: a reload holds new requests until those in flight finish;
  * server resubmit: pause (abort), update, continue, each aborted request
    resubmitted with its partial output (the GOAL's partial arm);
  * the same pair as "server+prefill", where each uncached prompt token costs
    ``--prefill-us``: an update flushes the prefix cache, so every session
    re-prefills its whole context after it, in both modes.

Figures, as a user sees them: generated tokens per second over the arm's
wall time (tokens the sessions received), the server's idle fraction (time
the model is not inside ``sample()`` while at least one session waits for a
generation, over the arm), each update's pause (``backend.update_pauses_s``:
request to applied), the turn latency, and the version lag of the tokens
(newest published version minus the version that generated them, when the
turn returns).

Learning (the demo arms): the loop's demo (``loop.run.run_loop``, default
lookup task) with ``[rollout] weight_update = "continue"`` and ``"drain"``,
same seed, both from the same warm-up (version 0, built once per seed, as
``bench_distill`` does; ``--demo-seeds N`` runs N seeds and compares the
medians: one seed's figure varies by a few steps from run to run); the figure is the policy version at which the mean
reward of the last 10 trained steps first reaches 0.9 (the demo's stop rule;
never within ``--demo-steps``: that + 1).
``--quick`` runs 1 step per arm from no warm-up (it cannot reach 0.9: it
shows both modes train, and its GOAL reads n/a, MISS).

What to expect. ``TorchBackend`` batches statically (a batch runs for its
longest row's allowance; the shorter rows wait in it), so the time a drained
update waits for the batch in flight is time the model generates anyway:
drain delays the update (and serves staler tokens) but leaves the model
busy, and tokens/s stays the same in every in-process arm. The throughput
that partial rollouts win belongs to servers that batch continuously: while
a drain waits for its longest turn, the sessions that finished wait at the
gate and the server runs a shrinking batch. That is the GOAL's figure
(server resubmit over server drain; the issue's workload charges generated
tokens only). With prefill charged, resubmit applies every update and so
re-prefills every context once per update, where drain skips the updates
published during its drains: at long contexts and frequent updates that cost
can outweigh the win; the server+prefill line shows by how much.

Usage: ``python tools/bench/bench_partial.py [--quick] [--turns N] [--server-s S] [--prefill-us U] [--update-ms M]
[--demo-steps N] [--demo-seeds N] [--no-demo]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import structlog
import torch
from tqdm import tqdm

from agentlog.gateway import SamplingParams, SGLangBackend, TorchBackend
from agentlog.gateway.weight_sync import GatedBackend, SGLangWeightSync
from agentlog.tools.bench.goals import goal_line, meets
from agentlog.tools.bench.bench_loop import percentile
from agentlog.tools.bench import simulated_server

#: 25x faster than the target workload (median 2 s, p99 60 s, a version every 10 s).
TIME_SCALE = 25.0
MEDIAN_TOKENS = 40
P99_TOKENS = 1200
MAX_TOKENS = 4000
SESSIONS = 64
PROMPT = [1, 2, 3, 4]
TOKEN = 5
MODES = ("drain", "continue", "resubmit")
SERVER_MODES = ("drain", "resubmit")
#: Server arms: each session's context starts at CONTEXT_TOKENS and grows by its output and a
#: TOOL_RESULT_TOKENS-token tool result every turn.
CONTEXT_TOKENS = 1000
TOOL_RESULT_TOKENS = 50
TOOL_TOKEN = 7
#: Server arms run for a time, not a number of turns; no session gets near this many.
SERVER_TURNS_CAP = 10_000


class _Config:
    max_seq_len = 8192
    vocab_size = 64


class SleepyModel:
    """A simulated inference server's model: ``sample()`` takes ``token_s`` per decode step whatever the
    batch, emits ``TOKEN`` at every step (no stop), and records when it was inside ``sample()``."""

    config = _Config()

    def __init__(self, token_s: float) -> None:
        self.token_s = token_s
        self.version_loaded = 0
        self.busy: list[tuple[float, float]] = []  # (start, end) of every sample() call

    def load_state_dict(self, state: dict) -> None:
        self.version_loaded = int(state["version"].item())

    def state_dict(self) -> dict:
        return {"version": torch.tensor(self.version_loaded)}

    def sample(self, prompts, max_new_tokens, temperature=1.0, stop_ids=(), generator=None, between_steps=None):
        t0 = time.perf_counter()
        n = max_new_tokens
        aborted = False
        for step in range(max_new_tokens):
            time.sleep(self.token_s)  # the whole batch's decode step
            if step == max_new_tokens - 1:
                break
            if between_steps is not None and between_steps(step + 1):
                n, aborted = step + 1, True
                break
        self.busy.append((t0, time.perf_counter()))
        rows = len(prompts)
        return _Generation([np.full(n, TOKEN, dtype=np.int32) for _ in range(rows)],
                           [np.full(n, -1.0, dtype=np.float32) for _ in range(rows)],
                           ["abort" if aborted else "length"] * rows)


@dataclass
class _Generation:
    tokens: list
    log_probs: list
    finish_reasons: list


@dataclass
class ArmResult:
    mode: str
    wall_s: float
    tokens: int = 0
    turns: int = 0
    partial_turns: int = 0
    latencies_s: list[float] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)  # per token: newest published version - its version
    pauses_s: list[float] = field(default_factory=list)
    idle_frac: float = 0.0
    versions: int = 0
    batches: int = 0  # in-process: batches; server: decode steps
    prefill_tokens: int = 0
    update_s: float = 0.0  # server arms: time spent loading weights
    cached_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def turn_lengths(seed: int, n: int) -> list[int]:
    """``n`` lognormal turn lengths (median MEDIAN_TOKENS, p99 P99_TOKENS, capped at MAX_TOKENS)."""
    rng = random.Random(seed)
    sigma = math.log(P99_TOKENS / MEDIAN_TOKENS) / 2.326
    return [max(1, min(MAX_TOKENS, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), sigma)))) for _ in range(n)]


class _Waiting:
    """How many sessions wait for a generation, and the intervals during which at least one does."""

    def __init__(self) -> None:
        self.n = 0
        self.since = 0.0
        self.spans: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            if self.n == 0:
                self.since = time.perf_counter()
            self.n += 1

    def leave(self) -> None:
        with self.lock:
            self.n -= 1
            if self.n == 0:
                self.spans.append((self.since, time.perf_counter()))


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


async def _play(res: ArmResult, lengths: list[list[int]], generate, load, *, period_s: float, bar: tqdm,
                waiting: _Waiting, until_s: float | None = None) -> None:
    """The sessions play their turns (``generate(session, max_new_tokens)``) while a publisher puts
    out a new version every ``period_s`` and an updater applies the newest (``load(version)``).
    ``until_s``: stop after that long (the turns in flight then are cancelled and not counted), the
    arm's wall time; else when every session has played all its turns."""
    t0 = time.perf_counter()
    playing = len(lengths)
    published = 0

    async def session(s: int) -> None:
        nonlocal playing
        for length in lengths[s]:
            waiting.enter()
            start = time.perf_counter()
            try:
                gen = await generate(s, length)
            finally:
                waiting.leave()
            res.latencies_s.append(time.perf_counter() - start)
            res.turns += 1
            res.tokens += len(gen.output_ids)
            spans = [(0, gen.policy_version)] if gen.version_spans is msgspec.UNSET else list(gen.version_spans)
            res.partial_turns += len(spans) > 1
            bounds = [a for a, _ in spans[1:]] + [len(gen.output_ids)]
            for (a, v), b in zip(spans, bounds):
                res.lags.extend([published - v] * (b - a))
            bar.update(len(gen.output_ids))
        playing -= 1

    published_event = asyncio.Event()

    async def publisher() -> None:
        # The learner's side: a new version every period, whether or not the last one was applied yet.
        nonlocal published
        tick = t0
        while playing:
            tick += period_s
            await asyncio.sleep(max(0.0, tick - time.perf_counter()))
            published += 1
            published_event.set()
        published_event.set()

    async def updater() -> None:
        # The worker's side: load the newest published version; one that arrives while an update
        # waits is applied after it (a drained backend skips the versions published meanwhile).
        applied = 0
        while playing:
            await published_event.wait()
            published_event.clear()
            if playing and published > applied:
                applied = published
                await load(applied)
                res.versions += 1

    sessions = [asyncio.create_task(session(s)) for s in range(len(lengths))]
    control = [asyncio.create_task(publisher()), asyncio.create_task(updater())]
    if until_s is None:
        await asyncio.gather(*sessions, *control)
        res.wall_s = time.perf_counter() - t0
        return
    done, _ = await asyncio.wait(sessions, timeout=until_s)
    res.wall_s = time.perf_counter() - t0
    for task in done:
        task.result()  # a session that failed fails the arm
    playing = 0  # the publisher and the updater stop after what they are doing
    for task in sessions:
        task.cancel()
    await asyncio.gather(*sessions, return_exceptions=True)
    published_event.set()
    await asyncio.gather(*control)


def _idle_frac(waiting: _Waiting, busy: list[tuple[float, float]], wall_s: float) -> float:
    """Time some session waited while the server ran no step, over the arm's wall time."""
    return (sum(b - a for a, b in waiting.spans) - _overlap(waiting.spans, busy)) / wall_s


async def run_arm(mode: str, *, turns: int, token_s: float, period_s: float, seed: int, bar: tqdm) -> ArmResult:
    """In-process arm: every session plays its ``turns`` turns on a ``TorchBackend`` under ``mode``."""
    model = SleepyModel(token_s)
    backend = TorchBackend(model, max_batch=SESSIONS, seed=seed, weight_update=mode)
    res = ArmResult(mode, 0.0)
    waiting = _Waiting()
    # Untimed one-token rounds until one is served as a single batch: the backend gathers its
    # first batch from whatever has arrived (it last saw a batch of 1), which would otherwise
    # split the first round at random in any arm.
    for _ in range(10):
        before = backend.batches
        await asyncio.gather(*(backend.generate(PROMPT, SamplingParams(max_new_tokens=1)) for _ in range(SESSIONS)))
        if backend.batches - before == 1:
            break
    primed_batches = backend.batches
    model.busy.clear()

    def generate(s: int, length: int):
        return backend.generate(PROMPT, SamplingParams(max_new_tokens=length, temperature=1.0))

    async def load(version: int) -> None:
        await backend.load_weights({"version": torch.tensor(version)}, version)

    try:
        await _play(res, [turn_lengths(seed * 1000 + s, turns) for s in range(SESSIONS)], generate, load,
                    period_s=period_s, bar=bar, waiting=waiting)
    finally:
        await backend.close()
    res.pauses_s = list(backend.update_pauses_s)
    res.batches = backend.batches - primed_batches
    res.idle_frac = _idle_frac(waiting, model.busy, res.wall_s)
    return res


async def run_server_arm(mode: str, *, duration_s: float, token_s: float, period_s: float, seed: int, bar: tqdm,
                         prefill_token_s: float, update_s: float, ckpt: Path) -> ArmResult:
    """Server arm: for ``duration_s``, every session plays turn after turn through
    ``GatedBackend(SGLangBackend)`` (``weight_update`` drain or resubmit) against a continuous-batching
    :class:`SimulatedSGLang`, reloaded by ``SGLangWeightSync``. Each session's context grows by its
    output and a tool result every turn. A steady state, so tokens/s is the server's throughput, not
    the longest session's chain of turns."""
    proc, url = simulated_server.spawn(token_s, prefill_token_s, update_s)
    backend = GatedBackend(SGLangBackend(url), weight_update=mode)
    sync = SGLangWeightSync(url, gate=backend.gate)
    res = ArmResult(f"server {mode}", 0.0)
    waiting = _Waiting()
    contexts = [[1000 + s] + [TOOL_TOKEN] * (CONTEXT_TOKENS - 1) for s in range(SESSIONS)]

    async def generate(s: int, length: int):
        gen = await backend.generate(contexts[s], SamplingParams(max_new_tokens=length, temperature=1.0))
        contexts[s] += gen.output_ids + [TOOL_TOKEN] * TOOL_RESULT_TOKENS
        return gen

    async def load(version: int) -> None:
        d = ckpt / f"{mode}-v{version:05d}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        await sync.reload(d, version)

    try:
        await _play(res, [turn_lengths(seed * 1000 + s, SERVER_TURNS_CAP) for s in range(SESSIONS)], generate, load,
                    period_s=period_s, bar=bar, waiting=waiting, until_s=duration_s)
        async with aiohttp.ClientSession() as http, http.get(url + "/stats") as answer:
            stats = await answer.json()
    finally:
        await sync.close()
        await backend.close()
        proc.terminate()
        proc.wait()
    if stats["violations"]:
        raise RuntimeError(f"server arm {mode}: the simulated server saw protocol violations: {stats['violations'][:5]}")
    res.idle_frac = _idle_frac(waiting, [tuple(b) for b in stats["busy"]], res.wall_s)
    res.update_s = stats["updating_s"]
    res.batches = stats["steps"]
    res.prefill_tokens, res.cached_tokens = stats["prefill_tokens"], stats["cached_tokens"]
    return res


def workload(turns: int, token_s: float, seed: int, *, server_s: float, prefill_token_s: float,
             update_s: float) -> dict[str, ArmResult]:
    """Every arm on the same workload (the same turns, the same lengths) and seed: the in-process
    arms by mode, then the server arms (keys ``server drain``, ``server resubmit``)."""
    period_s = 10.0 / TIME_SCALE
    total = sum(sum(turn_lengths(seed * 1000 + s, turns)) for s in range(SESSIONS))
    out = {}
    for mode in MODES:
        with tqdm(desc=f"{mode} tokens", total=total, unit="tok", leave=False) as bar:
            out[mode] = asyncio.run(run_arm(mode, turns=turns, token_s=token_s, period_s=period_s, seed=seed, bar=bar))
    # The GOAL's server arms spend time on generated tokens only, as the workload says;
    # the "+prefill" pair also charges uncached prompt tokens (0: not run).
    pairs = [("server", 0.0)] + ([("server+prefill", prefill_token_s)] if prefill_token_s > 0 else [])
    with tempfile.TemporaryDirectory(prefix="bench_partial_ckpt_") as ckpt:
        for name, prefill in pairs:
            for mode in SERVER_MODES:
                with tqdm(desc=f"{name} {mode} tokens", unit="tok", leave=False) as bar:
                    out[f"{name} {mode}"] = asyncio.run(run_server_arm(
                        mode, duration_s=server_s, token_s=token_s, period_s=period_s, seed=seed, bar=bar,
                        prefill_token_s=prefill, update_s=update_s, ckpt=Path(ckpt) / name))
    return out


def demo_arm(base: Path, mode: str, *, seed: int, steps: int, quick: bool) -> dict:
    """One run of the loop's demo under ``[rollout] weight_update = mode``; steps to a 10-step mean
    reward of 0.9 (None: never), trained steps, last reward, interrupted turns and wall time."""
    from agentlog.tools.bench.bench_distill import TARGET, WINDOW, start_from, steps_to_target, warmed_up

    from agentlog.events import read_log
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded
    from agentlog.loop.config import LoopConfig
    from agentlog.loop.learner_records import read_learner_records
    from agentlog.loop.run import reward_curve, run_loop

    run_dir = base / f"demo-{mode}-s{seed}"
    if quick:
        cfg = LoopConfig(seed=seed, steps=steps, warmup_steps=0, stop_reward=0, time_budget_s=0, rollout={"weight_update": mode})
    else:
        cfg = LoopConfig(seed=seed, steps=steps, stop_reward=TARGET, stop_window=WINDOW, time_budget_s=0, warmup_threads=1,
                         rollout={"weight_update": mode})
        start_from(run_dir, cfg, warmed_up(base, cfg))
    t0 = time.perf_counter()
    run_loop(cfg, run_dir)
    wall = time.perf_counter() - t0
    records = read_learner_records(run_dir / "learner")
    curve = reward_curve(records)
    turns = [e.body for e in full_turns(list(read_log(run_dir / "rollout", 0))) if isinstance(e.body, TurnRecorded)]
    partial = sum(t.version_spans is not msgspec.UNSET for t in turns)
    return {"steps": steps_to_target(records), "trained": len(curve), "last_reward": curve[-1][1] if curve else float("nan"),
            "turns": len(turns), "partial": partial, "wall_s": wall}


def _print_goal(name: str, measured: str, op: str, target: str, ok: bool) -> None:
    print(goal_line(name, measured, op, target, ok))


def main(argv: list[str] | None = None) -> int:
    """Run the workload arms and the demo arms, print the tables and the GOAL lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 turns per session; 1 demo step per arm, no warm-up")
    p.add_argument("--turns", type=int, default=None, help="turns per session in each workload arm (default 10; --quick 2)")
    p.add_argument("--token-ms", type=float, default=2.0, help="simulated time per decode step (default 2 ms)")
    p.add_argument("--server-s", type=float, default=None,
                   help="seconds each server arm runs (default 20, 500 s at full scale; --quick 5)")
    p.add_argument("--prefill-us", type=float, default=4.0,
                   help="the server+prefill arms: simulated time per uncached prompt token (default 4 us: a "
                        "2,000-token prefill costs 4 decode steps; 0: skip those arms)")
    p.add_argument("--update-ms", type=float, default=20.0,
                   help="server arms: simulated time of one weight update (default 20 ms: 0.5 s at full scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo-steps", type=int, default=None, help="most RL steps per demo arm (default 60; --quick 1)")
    p.add_argument("--demo-seeds", type=int, default=1,
                   help="demo seeds seed..seed+N-1, each with its own warm-up; the GOAL compares medians (default 1)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo arms (no learning GOAL line)")
    p.add_argument("--keep", type=Path, default=None, help="keep the demo run folders under this directory")
    args = p.parse_args(argv)
    turns = args.turns if args.turns is not None else (2 if args.quick else 10)
    demo_steps = args.demo_steps if args.demo_steps is not None else (1 if args.quick else 60)
    torch.set_num_threads(1)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    server_s = args.server_s if args.server_s is not None else (5.0 if args.quick else 20.0)
    arms = workload(turns, args.token_ms / 1e3, args.seed, server_s=server_s, prefill_token_s=args.prefill_us / 1e6,
                    update_s=args.update_ms / 1e3)
    print(f"simulated server: {args.token_ms:g} ms per decode step (any batch), {SESSIONS} sessions turn after turn, "
          f"turn lengths lognormal median {MEDIAN_TOKENS} / p99 {P99_TOKENS} tokens (cap {MAX_TOKENS}), a version every "
          f"{10.0 / TIME_SCALE * 1e3:.0f} ms ({TIME_SCALE:g}x faster than median 2 s / p99 60 s / 10 s), {turns} turns per session, seed {args.seed}")
    print(f"server arms: SGLang's routes over HTTP, continuous batching (a request joins at the next step), "
          f"prompt tokens free (server+prefill: {args.prefill_us:g} us per uncached one; the prefix cache is flushed by "
          f"each update), an update takes {args.update_ms:g} ms, "
          f"contexts from {CONTEXT_TOKENS} tokens growing by the output + {TOOL_RESULT_TOKENS} tool tokens a turn, "
          f"{server_s:g} s per arm (turns in flight at the end not counted)")
    print(f"{'arm':<24} {'tokens/s':>9} {'wall s':>7} {'turns':>6} {'partial':>8} {'batches':>8} {'versions':>9} {'idle':>6} "
          f"{'pause p50 ms':>13} {'p99 ms':>8} {'turn p50 ms':>12} {'p99 ms':>8} {'lag mean':>9}")
    for mode, r in arms.items():
        print(f"{mode:<24} {r.tokens_per_s:>9.0f} {r.wall_s:>7.1f} {r.turns:>6} {r.partial_turns:>8} {r.batches:>8} {r.versions:>9} {r.idle_frac:>6.1%} "
              f"{percentile(r.pauses_s, 50) * 1e3:>13.1f} {percentile(r.pauses_s, 99) * 1e3:>8.1f} "
              f"{percentile(r.latencies_s, 50) * 1e3:>12.0f} {percentile(r.latencies_s, 99) * 1e3:>8.0f} "
              f"{statistics.mean(r.lags) if r.lags else float('nan'):>9.2f}")
    print("(idle: the model outside sample() (server: no step running) while a session waits, over the arm's wall time; "
          "batches: server arms count decode steps; lag: per token, the newest published version minus the version that "
          "generated it, when its turn returns)")
    for name in [k for k in arms if k.startswith("server")]:
        r = arms[name]
        print(f"{name}: prefill {r.prefill_tokens} tokens, {r.cached_tokens} from the prefix cache; loading "
              f"weights {r.update_s / r.wall_s:.1%} of the arm; idle outside loading {r.idle_frac - r.update_s / r.wall_s:.1%}")

    demo: dict[str, list[dict]] = {"drain": [], "continue": []}
    seeds = range(args.seed, args.seed + args.demo_seeds)
    if not args.no_demo:
        base = Path(tempfile.mkdtemp(prefix="bench_partial_")) if args.keep is None else args.keep
        base.mkdir(parents=True, exist_ok=True)
        try:
            for seed, mode in tqdm([(s, m) for s in seeds for m in demo], desc="demo arms", leave=False):
                demo[mode].append(demo_arm(base, mode, seed=seed, steps=demo_steps, quick=args.quick))
        finally:
            if args.keep is None:
                shutil.rmtree(base, ignore_errors=True)
        print()
        print(f"lookup demo, seeds {seeds.start}..{seeds.stop - 1}, at most {demo_steps} RL steps"
              + (", no warm-up (--quick: cannot reach 0.9)" if args.quick else ", one shared warm-up (version 0)"))
        print(f"{'seed':>4} {'arm':<9} {'steps to 0.9':>13} {'trained':>8} {'last reward':>12} {'turns':>6} {'partial':>8} {'wall s':>7}")
        for seed, mode in [(s, m) for s in seeds for m in demo]:
            d = demo[mode][seed - seeds.start]
            print(f"{seed:>4} {mode:<9} {d['steps'] if d['steps'] is not None else f'>{demo_steps}':>13} {d['trained']:>8} "
                  f"{d['last_reward']:>12.2f} {d['turns']:>6} {d['partial']:>8} {d['wall_s']:>7.0f}")

    print()
    drain, cont, resub = arms["drain"], arms["continue"], arms["resubmit"]
    s_drain, s_resub = arms["server drain"], arms["server resubmit"]
    ratio = s_resub.tokens_per_s / s_drain.tokens_per_s
    print(f"in-process (static batching) tokens/s over drain: continue {cont.tokens_per_s / drain.tokens_per_s:.2f}x, "
          f"resubmit {resub.tokens_per_s / drain.tokens_per_s:.2f}x; idle: drain {drain.idle_frac:.1%}, resubmit "
          f"{resub.idle_frac:.1%}; update pause p99: drain {percentile(drain.pauses_s, 99) * 1e3:.0f} ms, resubmit "
          f"{percentile(resub.pauses_s, 99) * 1e3:.1f} ms")
    print(f"server (continuous batching) tokens/s: resubmit {ratio:.2f}x drain; idle: drain {s_drain.idle_frac:.1%}, "
          f"resubmit {s_resub.idle_frac:.1%}")
    if "server+prefill drain" in arms:
        p_drain, p_resub = arms["server+prefill drain"], arms["server+prefill resubmit"]
        print(f"server+prefill ({args.prefill_us:g} us per uncached prompt token): resubmit "
              f"{p_resub.tokens_per_s / p_drain.tokens_per_s:.2f}x drain (each applied update flushes the prefix cache, "
              f"so every session re-prefills its context; resubmit applies {p_resub.versions} updates, drain {p_drain.versions})")
    _print_goal("partial_vs_drain_tokens_per_s", f"{ratio:.2f}x", ">=", "2.0x", meets(ratio, ">=", 2.0))
    _print_goal("server_idle_during_updates", f"{cont.idle_frac:.1%}", "<=", "5%", meets(cont.idle_frac, "<=", 0.05))
    p99 = percentile(cont.pauses_s, 99) * 1e3
    _print_goal("update_pause_p99_ms", f"{p99:.1f}", "<=", "200", meets(p99, "<=", 200))
    if not args.no_demo:
        if args.quick:
            print(f"steps to 0.9 (in {demo_steps} steps): not measured in --quick")
            _print_goal("demo_steps_to_0.9_partial_vs_drain", "n/a", "<=", "1.1x", False)
        else:
            # As bench_distill: a run that never gets there counts as demo_steps + 1; medians over the seeds.
            med = {m: statistics.median(r["steps"] if r["steps"] is not None else demo_steps + 1 for r in rs)
                   for m, rs in demo.items()}
            ratio = med["continue"] / med["drain"]
            print(f"steps to 0.9, median over {len(seeds)} seed(s): drain {med['drain']:g}, continue {med['continue']:g}")
            _print_goal("demo_steps_to_0.9_partial_vs_drain", f"{ratio:.2f}x", "<=", "1.1x", meets(ratio, "<=", 1.1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
