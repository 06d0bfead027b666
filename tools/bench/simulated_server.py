"""A simulated SGLang server with continuous batching and a prefix cache, for ``bench_partial`` and ``bench_fleet``.

It speaks the routes agentlog's SGLang client and weight sync call
(``/generate``, ``/pause_generation``, ``/update_weights_from_disk``,
``/continue_generation``, ``/abort_request``), over real HTTP on loopback,
and spends simulated GPU time the way a continuous-batching server does:

* **Decode.** One scheduler step every ``token_s`` makes one token for every
  running request, whatever their number (decoding is memory-bound: a batch
  of 64 costs about what a batch of 1 does). A request that arrives joins the
  batch at the next step, and a finished one leaves it; nothing waits for the
  longest request in the batch.
* **Prefill.** A request's prompt tokens that the prefix cache does not hold
  cost ``prefill_token_s`` each, added to the step it joins in (the whole
  batch waits for it, as without chunked prefill). The cache holds whole
  ``BLOCK``-token blocks of prompts and outputs it has seen, and is flushed by
  a weight update (``flush_cache``): KV made by old weights is not reused.
* **Cache capacity.** ``cache_tokens`` (``--cache-tokens``; None or 0:
  unbounded) bounds the cache, in tokens (whole blocks): past it, the least
  recently used blocks are evicted. A request's hit and its finished prompt
  and output refresh their blocks, a prefix's first block last, so a
  prefix's tail goes before its head (as a radix cache evicts leaves first):
  what stays is always a usable prefix.
* **Weight updates.** ``/update_weights_from_disk`` takes ``update_s`` with no
  step running, and is refused (a violation, counted) while a request runs
  unless the server is paused. ``/pause_generation {"mode": "abort"}`` ends
  every request it holds with ``finish_reason`` ``abort`` and its partial
  output, and holds new requests until ``/continue_generation``.

Every output token is ``TOKEN`` with log-prob -0.5, and the answer's
``meta_info.weight_version`` is the version that generated it (a request
never spans versions: updates run with nothing in flight).

It runs in a process of its own (``python -m
agentlog.tools.bench.simulated_server``, or :func:`spawn`), as a real server
does, so the clients' JSON work does not delay its steps; ``GET /stats``
answers its counters (prompt tokens served from the cache and prefilled,
output tokens, evicted blocks) and busy intervals (``time.perf_counter``, which is
``CLOCK_MONOTONIC`` and so comparable across processes on Linux); ``GET
/health`` answers 200 while it serves (a fleet's probe).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

TOKEN = 5
#: Prefix-cache granularity, in tokens (SGLang's radix cache matches per token; pages of this size are close enough).
BLOCK = 64


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    done: asyncio.Future
    out: list[int] = field(default_factory=list)
    version: int = 0


class SimulatedSGLang:
    """See the module docstring. ``busy``: the (start, end) of every run of
    consecutive scheduler steps (prefill and decode), for the idle fraction."""

    def __init__(self, token_s: float, prefill_token_s: float, update_s: float, cache_tokens: int | None = None) -> None:
        if cache_tokens is not None and cache_tokens < 0:
            raise ValueError(f"simulated server: cache_tokens: expected a number of tokens >= 0 (0: unbounded), "
                             f"found {cache_tokens!r}")
        self.token_s = token_s
        self.prefill_token_s = prefill_token_s
        self.update_s = update_s
        self.version = 0
        self.paused = False
        self.waiting: list[_Request] = []  # arrived, not yet in the batch
        self.running: list[_Request] = []
        #: Block hashes, least recently used first (see :meth:`_touch`).
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: Blocks the cache holds at most (None: unbounded); a partial block's room is never used.
        self.cache_blocks = cache_tokens // BLOCK if cache_tokens else None
        self.evicted_blocks = 0
        self.output_tokens = 0
        self.requests = 0
        self.busy: list[tuple[float, float]] = []
        self.violations: list[str] = []
        self.prefill_tokens = 0
        self.cached_tokens = 0
        self.steps = 0
        self.updating_s = 0.0
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "SimulatedSGLang":
        """Serve on 127.0.0.1 at a free port (``self.url``) and start the scheduler."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/update_weights_from_disk", self.update)
        app.router.add_post("/continue_generation", self.go_on)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._loop_task = asyncio.create_task(self._schedule())
        return self

    async def stop(self) -> None:
        """Stop the scheduler (re-raising anything it died of) and the HTTP server."""
        assert self._loop_task is not None and self.runner is not None
        self._loop_task.cancel()
        try:
            await self._loop_task
        except asyncio.CancelledError:
            pass
        await self.runner.cleanup()

    # ------------------------------------------------------------ scheduler

    def _blocks(self, tokens: list[int]) -> list[int]:
        """Hashes of ``tokens``' whole-block prefixes, shortest first, each chained from the one
        before (linear in the length, as a radix tree's walk is)."""
        out, h = [], 0
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            h = hash((h, tuple(tokens[end - BLOCK:end])))
            out.append(h)
        return out

    def _touch(self, blocks: list[int]) -> None:
        """Make a prefix's ``blocks`` (shortest first) the most recently used, its first block
        last, inserting those not held; then evict least recently used blocks past the capacity.
        A prefix's later blocks are thus always older than its earlier ones: eviction shortens
        a cached prefix from its end, and never leaves a tail cached behind a lost head."""
        cache = self.cache
        for h in reversed(blocks):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        if self.cache_blocks is not None:
            while len(cache) > self.cache_blocks:
                cache.popitem(last=False)
                self.evicted_blocks += 1

    def _prefill_s(self, req: _Request) -> float:
        blocks = self._blocks(req.prompt)
        held = 0
        for h in blocks:
            if h not in self.cache:
                break
            held += 1
        self._touch(blocks[:held])  # a hit refreshes what it used
        hit = held * BLOCK
        self.cached_tokens += hit
        self.prefill_tokens += len(req.prompt) - hit
        return (len(req.prompt) - hit) * self.prefill_token_s

    def _finish(self, req: _Request, kind: str) -> None:
        self._touch(self._blocks(req.prompt + req.out))
        self.output_tokens += len(req.out)
        if not req.done.done():
            req.done.set_result(kind)

    async def _schedule(self) -> None:
        """One decode step every ``token_s`` while anything runs; joins and leaves between steps."""
        run_start = None
        deadline = time.perf_counter()
        while True:
            if self.paused or not (self.running or self.waiting):
                if run_start is not None:
                    self.busy.append((run_start, time.perf_counter()))
                    run_start = None
                self._wake.clear()
                await self._wake.wait()
                deadline = time.perf_counter()
                continue
            if run_start is None:
                run_start = time.perf_counter()
            step_s = self.token_s
            for req in self.waiting:
                req.version = self.version
                step_s += self._prefill_s(req)
                self.running.append(req)
            self.waiting.clear()
            deadline += step_s
            await asyncio.sleep(max(0.0, deadline - time.perf_counter()))
            if self.paused:  # aborted during the step: its tokens are not handed out
                continue
            self.steps += 1
            still = []
            for req in self.running:
                req.out.append(TOKEN)
                if len(req.out) >= req.max_new_tokens:
                    self._finish(req, "length")
                else:
                    still.append(req)
            self.running = still

    # ------------------------------------------------------------ routes

    async def generate(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        req = _Request(body.get("rid", ""), body["input_ids"], body["sampling_params"]["max_new_tokens"],
                       asyncio.get_running_loop().create_future())
        self.waiting.append(req)
        self.requests += 1
        self._wake.set()
        kind = await req.done
        finish = {"type": "abort", "message": "paused"} if kind == "abort" else {"type": "length", "length": len(req.out)}
        return web.Response(body=msgspec.json.encode({"text": "", "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in req.out], "finish_reason": finish,
            "weight_version": str(req.version)}}), content_type="application/json")

    async def pause(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body != {"mode": "abort"}:
            self.violations.append(f"pause body {body}")
        self.paused = True
        for req in self.running + self.waiting:
            req.version = self.version  # one still waiting was made by nothing: no tokens
            self._finish(req, "abort")
        self.running, self.waiting = [], []
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.paused and (self.running or self.waiting):
            self.violations.append(f"update with {len(self.running) + len(self.waiting)} request(s) in flight, not paused")
        t0 = time.perf_counter()
        await asyncio.sleep(self.update_s)
        self.updating_s += time.perf_counter() - t0
        self.version = int(body["weight_version"])
        if body.get("flush_cache", True):
            self.cache.clear()
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    async def go_on(self, request: web.Request) -> web.Response:
        self.paused = False
        self._wake.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        for req in self.running + self.waiting:
            if req.rid == body.get("rid"):
                self._finish(req, "abort")
        self.waiting = [r for r in self.waiting if not r.done.done()]
        self.running = [r for r in self.running if not r.done.done()]
        return web.json_response({"rid": body.get("rid"), "status": "ok"})

    async def stats(self, request: web.Request) -> web.Response:
        busy = list(self.busy)
        if self.running or self.waiting:
            busy.append((busy[-1][1] if busy else time.perf_counter(), time.perf_counter()))
        return web.json_response({"busy": busy, "violations": self.violations, "steps": self.steps,
                                  "prefill_tokens": self.prefill_tokens, "cached_tokens": self.cached_tokens,
                                  "updating_s": self.updating_s, "requests": self.requests,
                                  "output_tokens": self.output_tokens, "cache_blocks": len(self.cache),
                                  "cache_capacity_blocks": self.cache_blocks, "evicted_blocks": self.evicted_blocks})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})


def _start(token_s: float, prefill_token_s: float, update_s: float, cache_tokens: int | None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentlog.tools.bench.simulated_server", "--token-s", repr(token_s),
                             "--prefill-token-s", repr(prefill_token_s), "--update-s", repr(update_s),
                             "--cache-tokens", str(cache_tokens or 0)],
                            stdout=subprocess.PIPE, text=True)


def _url_of(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"simulated server: expected its URL on the first line of its output, found {line!r} "
                           f"(exit status {proc.wait()})")
    return line


def spawn(token_s: float, prefill_token_s: float, update_s: float,
          cache_tokens: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start a server process; returns it (``terminate()`` it when done) and its base URL."""
    return spawn_many(1, token_s, prefill_token_s, update_s, cache_tokens)[0]


def spawn_many(n: int, token_s: float, prefill_token_s: float, update_s: float,
               cache_tokens: int | None = None) -> list[tuple[subprocess.Popen, str]]:
    """Start ``n`` server processes at once (a fleet); returns each with its base URL.
    If one fails to start, every one started is killed."""
    procs = [_start(token_s, prefill_token_s, update_s, cache_tokens) for _ in range(n)]
    out = []
    try:
        for proc in procs:
            out.append((proc, _url_of(proc)))
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise
    return out


async def _serve(args: argparse.Namespace) -> None:
    server = await SimulatedSGLang(args.token_s, args.prefill_token_s, args.update_s, args.cache_tokens or None).start()
    print(server.url, flush=True)
    try:
        await asyncio.Event().wait()  # until terminated
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    """Serve until terminated; the first line of output is the base URL."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--token-s", type=float, required=True, help="time of one decode step")
    p.add_argument("--prefill-token-s", type=float, default=0.0, help="time per uncached prompt token")
    p.add_argument("--update-s", type=float, default=0.0, help="time of one weight update")
    p.add_argument("--cache-tokens", type=int, default=0,
                   help=f"prefix cache capacity in tokens (whole {BLOCK}-token blocks, least recently used evicted "
                        "first); 0: unbounded")
    args = p.parse_args(argv)
    if args.cache_tokens < 0:
        p.error(f"--cache-tokens: expected a number of tokens >= 0 (0: unbounded), found {args.cache_tokens}")
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
