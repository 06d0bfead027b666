"""The in-process torch backend: a policy such as the learner's GPT on a worker thread.

See :class:`TorchBackend`. Weight updates come in three modes
(``weight_update``): ``"drain"`` swaps the weights between batches, so a
generation in flight finishes under the weights it started with;
``"continue"`` and ``"resubmit"`` apply an update at the next token boundary
of the batch in flight (a partial rollout: the turn records which tokens
each version generated, :mod:`agentlog.events.schema.turn`).
``"continue"`` keeps the batch's KV cache, computed by the old weights, as
SGLang's ``pause_generation`` with ``mode="in_place"`` does; ``"resubmit"``
stops the batch and resubmits each unfinished row with its partial output
appended to its prompt, so the new weights recompute the cache (AReaL's
interruptible generation). Either way the caller gets one
:class:`~.backends.Generation` for the whole turn.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from typing import Any, Callable, Sequence

from agentlog._logging import get_logger
from agentlog.events.schema.turn import WEIGHT_UPDATE_MODES, canonical_version_spans

from .backends import Backend, BackendError, Generation, SamplingParams, id_list

_log = get_logger("agentlog.gateway")

class _Pending:
    __slots__ = ("prompt", "params", "future", "loop")

    def __init__(self, prompt: list[int], params: SamplingParams, future: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.prompt = prompt
        self.params = params
        self.future = future
        self.loop = loop


class _Swap:
    """A requested weight update: ``apply()`` changes the weights in place."""

    __slots__ = ("apply", "version", "done", "error", "t0", "pause_s")

    def __init__(self, apply: Callable[[], None], version: int) -> None:
        self.apply = apply
        self.version = version
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.t0 = time.perf_counter()
        self.pause_s = 0.0


class TorchBackend(Backend):
    """The built-in policy in-process: ``GPT.sample`` on a worker thread.

    Calls that arrive while the model is busy are batched together (same
    temperature, and only while the longest prompt plus the largest output
    allowance fits the context), which is what keeps many concurrent sessions
    cheap. A cancelled call is dropped from the queue if it has not started;
    a batch already running finishes and its result is discarded.
    ``weight_update``: how a weight update meets a batch in flight (see the
    module docstring).
    """

    name = "torch"
    context_length: int  # always known in-process (the model's max_seq_len)

    def __init__(self, model: Any, *, max_batch: int = 64, seed: int = 0, policy_version: int = 0,
                 batch_window_s: float = 0.02, max_gather_s: float = 0.25, gil_switch_s: float | None = 0.0005,
                 weight_update: str = "drain") -> None:
        # ``model`` is any module with ``config.max_seq_len``, ``config.vocab_size``
        # and ``sample(...)`` (the learner's GPT fits). The engine never builds
        # one itself: the engine and the learner do not know each other, so
        # the tools layer (``agentlog serve``) constructs the model.
        import torch

        self.model = model
        # The learner's GPT keeps its sizes in ``config``; an HF adapter
        # (learner.hf_model.HFCausalLM) has them as attributes.
        self.context_length = int(getattr(model, "max_seq_len", None) or model.config.max_seq_len)
        self.vocab_size = int(getattr(model, "vocab_size", None) or model.config.vocab_size)
        self.max_batch = max_batch
        # After a batch of n, wait up to this long for n calls to gather
        # before starting the next one: agents send their next turn a few ms
        # after their answer, and without the wait they trickle into batches
        # of one. A lone session (last batch of 1) never waits.
        self.batch_window_s = batch_window_s
        self.max_gather_s = max_gather_s
        self._last_batch = 1
        self._last_gen_s = 0.0
        self.policy_version = policy_version
        # The model's Python-level decode loop shares the GIL with the event
        # loop that serves HTTP and records turns. At the default 5 ms switch
        # interval the loop waits up to 5 ms for the GIL at every wake-up
        # while a batch runs (bench_gateway: 2x the added latency, 0.77x the
        # throughput at 128 sessions); 0.5 ms keeps it responsive. Restored
        # on close().
        self._old_switch = sys.getswitchinterval()
        if gil_switch_s is not None:
            sys.setswitchinterval(min(self._old_switch, gil_switch_s))
        self._generator = torch.Generator().manual_seed(seed)
        if weight_update not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"TorchBackend: weight_update: expected one of {WEIGHT_UPDATE_MODES}, found {weight_update!r}")
        self.weight_update = weight_update
        # Held while a batch runs: in "drain" mode a weight update waits for it;
        # otherwise the batch applies requested updates at its token boundaries.
        self._model_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self._swaps: list[_Swap] = []
        #: Seconds each weight update waited to be applied, in order (the pause it cost).
        self.update_pauses_s: list[float] = []
        self._queue: list[_Pending] = []
        self._cv = threading.Condition()
        self._closed = False
        #: Why the worker thread died (None while it runs); see _run_worker.
        self._crashed: str | None = None
        self._thread = threading.Thread(target=self._run_worker, name="agentlog-torch-backend", daemon=True)
        self._thread.start()
        self.batches = 0  # how many sample() calls ran (for tests and the benchmark)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        prompt = id_list(prompt_ids)
        # The request's own faults answer as a server's 400 would: a fleet raises them instead of
        # taking every replica out as if it had not answered (status 0).
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise BackendError(self.name, f"prompt token ids {bad[:5]} outside the model's vocabulary [0, {self.vocab_size})", 400)
        if len(prompt) + params.max_new_tokens > self.context_length:
            raise BackendError(
                self.name, f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the context ({self.context_length})",
                400)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        item = _Pending(prompt, params, fut, loop)
        with self._cv:
            if self._crashed is not None:
                raise BackendError(self.name, self._crashed)
            if self._closed:
                raise BackendError(self.name, "backend closed")
            self._queue.append(item)
            self._cv.notify()
        try:
            return await fut
        except asyncio.CancelledError:
            with self._cv:
                if item in self._queue:
                    self._queue.remove(item)
                    # The worker may be gathering a batch around this call:
                    # wake it so it sees the queue as it now is.
                    self._cv.notify()
            raise

    @property
    def fatal_reason(self) -> str | None:
        return self._crashed

    def ignored_sampling(self, params: SamplingParams) -> list[str]:
        # GPT.sample draws from softmax(logits / temperature) only.
        out = []
        if params.top_p < 1.0:
            out.append("top_p")
        if params.top_k > 0:
            out.append("top_k")
        if params.seed is not None:
            out.append("seed")
        return out

    def _take_batch(self, batch: list[_Pending]) -> None:
        """Move the next batch off the queue into ``batch`` (caller holds _cv;
        the queue is not empty). Calls are in ``batch`` before anything that
        can fail, so a crash here still answers them."""
        first = self._queue.pop(0)
        batch.append(first)
        longest, most = len(first.prompt), first.params.max_new_tokens
        keep = []
        for item in self._queue:
            p = item.params
            fits = max(longest, len(item.prompt)) + max(most, p.max_new_tokens) <= self.context_length
            if len(batch) < self.max_batch and p.temperature == first.params.temperature and fits:
                batch.append(item)
                longest, most = max(longest, len(item.prompt)), max(most, p.max_new_tokens)
            else:
                keep.append(item)
        self._queue[:] = keep

    def _run_worker(self) -> None:
        """The worker thread: ``_serve_batches`` under a guard, so that the thread
        can never die silently. A crash fails every queued call and every
        later one with the reason, logs it loudly, and shows in
        ``fatal_reason`` (which the gateway's ``/health`` reports)."""
        batch: list[_Pending] = []
        try:
            self._serve_batches(batch)
        except BaseException as exc:
            reason = f"worker thread crashed: {type(exc).__name__}: {exc}; restart the gateway"
            _log.critical("gateway.backend_worker_crashed", backend=self.name, error=reason, exc_info=exc)
            with self._cv:
                self._crashed = reason
                pending, self._queue = self._queue, []
            err = BackendError(self.name, reason)
            # The batch being taken or run when the loop broke, and the queue:
            # every one of those calls would otherwise wait forever.
            for b in batch + pending:
                _deliver(b, None, err)
            if not isinstance(exc, Exception):
                raise

    def _serve_batches(self, batch: list[_Pending]) -> None:
        """Gather and run batches until closed; ``batch`` holds the current one."""
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                # Keep gathering while calls keep arriving (each arrival
                # extends the wait by batch_window_s), but never idle the
                # model for more than a tenth of a batch's generation time:
                # the callers of a large batch come back spread over the
                # time the gateway takes to answer and re-submit them, and
                # starting with part of them lets the rest's round trip
                # overlap that part's generation (two half batches pipeline).
                target = min(self._last_batch, self.max_batch)
                cap = time.monotonic() + min(self.max_gather_s, 0.1 * self._last_gen_s)
                while len(self._queue) < target and not self._closed:
                    seen = len(self._queue)
                    remaining = min(self.batch_window_s, cap - time.monotonic())
                    if remaining <= 0:
                        break
                    self._cv.wait(remaining)
                    if not self._queue:
                        break  # every call gathered so far was cancelled
                    if len(self._queue) == seen:
                        break  # a quiet gap: nobody else is coming soon
                if self._closed:
                    return
                if not self._queue:
                    continue  # nothing left to run: wait for the next call
                self._take_batch(batch)
                self._last_batch = len(batch)
            t0 = time.perf_counter()
            try:
                with self._model_lock:
                    outputs = self._generate_batch(batch)
                self.batches += 1
                dt = time.perf_counter() - t0
                self._last_gen_s = dt
                for b, (toks, lps, starts) in zip(batch, outputs):
                    own_stops = set(b.params.stop_ids)
                    cut = b.params.max_new_tokens
                    # Stop at this call's own stop ids and allowance (the batch
                    # shared the union of stops and the largest allowance).
                    end = next((j + 1 for j, t in enumerate(toks[:cut]) if t in own_stops), None)
                    fr = "stop" if end is not None else "length"
                    end = end if end is not None else min(cut, len(toks))
                    version, spans = canonical_version_spans(starts, end)
                    _deliver(b, Generation(toks[:end], lps[:end], fr, version, dt, spans, self.weight_update), None)
            except Exception as exc:  # surfaced to every caller of the batch, never swallowed
                err = BackendError(self.name, f"sample() failed: {type(exc).__name__}: {exc}")
                for b in batch:
                    _deliver(b, None, err)
            batch.clear()

    def _generate_batch(self, batch: list[_Pending]) -> list[tuple[list[int], list[float], list[tuple[int, int]]]]:
        """Run ``batch`` (caller holds the model lock): see :func:`sample_through_updates`."""
        stops = sorted({s for b in batch for s in b.params.stop_ids})
        temperature = batch[0].params.temperature
        if self.weight_update == "drain":
            gen = self.model.sample([b.prompt for b in batch], max(b.params.max_new_tokens for b in batch),
                                    temperature=temperature, stop_ids=stops, generator=self._generator)
            return [(gen.tokens[i].tolist(), gen.log_probs[i].tolist(), [(0, self.policy_version)])
                    for i in range(len(batch))]

        def pending() -> list[int]:
            # A list read under the GIL: between tokens with nothing requested, this is all it costs.
            return self._apply_swaps() if self._swaps else []

        return sample_through_updates(
            self.model, [b.prompt for b in batch], [b.params.max_new_tokens for b in batch], stops=stops,
            temperature=temperature, generator=self._generator, mode=self.weight_update,
            version=self.policy_version, updates=pending)

    def _apply_swaps(self) -> list[int]:
        """Apply every requested weight update in order (caller holds the
        model lock); returns the versions now served, oldest first. An update
        that fails leaves the weights unknown: the backend is then failed
        (``fatal_reason``), loudly, and the requester gets the error."""
        with self._swap_lock:
            swaps, self._swaps = self._swaps, []
        applied = []
        for req in swaps:
            try:
                if self._crashed is None:
                    req.apply()
                    self.policy_version = req.version
                    applied.append(req.version)
                else:
                    req.error = BackendError(self.name, f"weight update to version {req.version} not applied: {self._crashed}")
            except BaseException as exc:
                reason = (f"weight update to version {req.version} failed midway ({type(exc).__name__}: {exc}); the served "
                          "weights are unknown; restart the gateway")
                _log.critical("gateway.weight_update_failed", backend=self.name, error=reason, exc_info=exc)
                self._crashed = reason
                req.error = BackendError(self.name, reason)
            finally:
                req.pause_s = time.perf_counter() - req.t0
                self.update_pauses_s.append(req.pause_s)
                req.done.set()
        return applied

    async def _update(self, apply: Callable[[], None], version: int) -> float:
        """Make ``apply()`` (which changes the weights in place) and ``version``
        current; returns how long the update waited, in seconds. ``"drain"``:
        once the batch in flight is done. Otherwise at its next token boundary,
        or at once when no batch runs."""
        if self.weight_update == "drain":
            t0 = time.perf_counter()

            def swap() -> None:
                with self._model_lock:
                    apply()
                    self.policy_version = version

            await asyncio.to_thread(swap)
            self.update_pauses_s.append(time.perf_counter() - t0)
            return self.update_pauses_s[-1]
        req = _Swap(apply, version)
        with self._swap_lock:
            self._swaps.append(req)
        await asyncio.to_thread(self._wait_applied, req)
        if req.error is not None:
            raise req.error
        return req.pause_s

    def _wait_applied(self, req: "_Swap") -> None:
        """Until ``req`` is applied: by the batch in flight at a token boundary,
        or here when no batch holds the model."""
        while not req.done.wait(0.002):
            if self._model_lock.acquire(blocking=False):
                try:
                    self._apply_swaps()
                finally:
                    self._model_lock.release()

    async def load_weights(self, state_dict: Any, policy_version: int) -> None:
        """Swap in new weights (see ``weight_update``); later tokens record ``policy_version``."""
        await self._update(lambda: self.model.load_state_dict(state_dict), policy_version)

    async def reload_weights(self, path: Any, policy_version: int) -> None:
        """Load published weights from disk (applied as ``weight_update`` says); later tokens record ``policy_version``.

        ``path`` is either an HF checkpoint directory (safetensors; the model
        must have ``load_hf_weights``, as learner.hf_model.HFCausalLM does) or a
        ``torch.save`` file: a learner checkpoint or weights file (its
        ``"model"`` entry) or a bare state dict, read with ``weights_only=True``.
        A file that cannot be loaded raises BackendError naming it, and the
        weights and version being served stay as they were."""
        import os

        import torch

        where = os.fspath(path)

        def prepare() -> Callable[[], None]:
            """Read and check the new weights (no lock held: generation goes on); return what applies them."""
            if os.path.isdir(where):
                loader = getattr(self.model, "load_hf_weights", None)
                if loader is None:
                    raise BackendError(self.name, f"reload_weights {where}: a directory (HF checkpoint), but the served "
                                                  f"model {type(self.model).__name__} has no load_hf_weights")
                reader, applier = getattr(self.model, "read_hf_weights", None), getattr(self.model, "apply_hf_weights", None)
                if reader is not None and applier is not None:
                    # Read and checked here, while generation goes on; the swap only copies.
                    hf_state = reader(where)
                    return lambda: applier(hf_state)
                return lambda: loader(where)
            try:
                state = torch.load(where, map_location="cpu", weights_only=True)
            except (OSError, RuntimeError, ValueError) as exc:
                raise BackendError(self.name, f"reload_weights {where}: cannot read it as a weights file: {exc}") from exc
            if isinstance(state, dict) and isinstance(state.get("model"), dict):
                state = state["model"]
            own = self.model.state_dict()
            if not isinstance(state, dict) or set(state) != set(own) or any(
                    getattr(state[k], "shape", None) != v.shape for k, v in own.items()):
                found = sorted(state)[:5] if isinstance(state, dict) else type(state).__name__
                raise BackendError(self.name, f"reload_weights {where}: expected the served model's "
                                              f"{len(own)} tensors with their shapes, found {found}")
            return lambda: self.model.load_state_dict(state)

        pause_s = await self._update(await asyncio.to_thread(prepare), policy_version)
        _log.info("gateway.weights_reloaded", backend=self.name, path=where, policy_version=policy_version,
                  mode=self.weight_update, pause_ms=round(pause_s * 1e3, 3))

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify_all()
        for b in pending:
            _deliver(b, None, BackendError(self.name, "backend closed"))
        await asyncio.to_thread(self._thread.join, 5.0)
        sys.setswitchinterval(self._old_switch)


def _deliver(item: _Pending, result: Any, exc: BaseException | None) -> None:
    """Hand a result to the caller's event loop from the worker thread. A
    caller whose loop has closed meanwhile has nobody left to answer; that
    is logged, and must not take the worker (and every other caller) down."""
    try:
        item.loop.call_soon_threadsafe(_settle, item.future, result, exc)
    except RuntimeError as err:  # the caller's event loop is closed
        _log.warning("gateway.backend_result_undeliverable", error=str(err))


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def sample_through_updates(model: Any, prompts: list[list[int]], allowances: list[int], *, stops: Sequence[int],
                           temperature: float, generator: Any, mode: str, version: int,
                           updates: Callable[[], list[int]]) -> list[tuple[list[int], list[float], list[tuple[int, int]]]]:
    """Sample a batch while weight updates land at its token boundaries: per
    prompt, its tokens and log-probs (under the batch's shared ``stops`` and
    largest allowance, as one ``sample()`` call would give them) and where each
    version started generating them, ``[(first token, version), ...]``.

    ``updates()`` runs at every token boundary: it applies the updates
    requested since (changing ``model``'s weights in place) and returns the
    versions now served, oldest first. ``mode`` ``"continue"`` goes on in the
    same call, with the KV cache the old weights computed; ``"resubmit"``
    stops the call and samples the unfinished rows again, each prompt
    followed by its output so far, so the new weights recompute the cache.
    Every live row has generated the same number of tokens when a call
    stops, so a resubmitted batch still fits the context whenever the first
    did (longest prompt + largest allowance). ``version``: the version
    served when the batch starts."""
    toks: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    starts: list[list[tuple[int, int]]] = [[(0, version)] for _ in prompts]
    live = list(range(len(prompts)))
    switched: list[tuple[int, int]] = []  # (tokens generated in the current call, version), in order

    def between_steps(generated: int) -> bool:
        versions = updates()
        switched.extend((generated, v) for v in versions)
        return bool(versions) and mode == "resubmit"

    while live:
        switched.clear()
        before = {i: len(toks[i]) for i in live}
        most = max(allowances[i] - before[i] for i in live)
        gen = model.sample([prompts[i] + toks[i] for i in live], most, temperature=temperature, stop_ids=stops,
                           generator=generator, between_steps=between_steps)
        again = []
        for j, i in enumerate(live):
            toks[i] += gen.tokens[j].tolist()
            lps[i] += gen.log_probs[j].tolist()
            starts[i] += [(before[i] + n, v) for n, v in switched]
            if gen.finish_reasons[j] == "abort" and len(toks[i]) < allowances[i]:
                again.append(i)
        live = again
    return [(toks[i], lps[i], starts[i]) for i in range(len(prompts))]
