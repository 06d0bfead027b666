"""Inference backends behind one interface: prompt ids in, output ids and log-probs out.

* :class:`SGLangBackend`: SGLang's native ``POST /generate`` with
  ``input_ids`` and ``return_logprob``; a cancelled call posts
  ``/abort_request`` with its ``rid`` so the server stops generating.
* :class:`OpenAICompletionsBackend`: an OpenAI-compatible ``/v1/completions``
  server that returns token log-probs for token-id prompts (vLLM, with
  ``return_tokens_as_token_ids``); a cancelled call closes its connection,
  which makes vLLM abort the request.
* :class:`TorchBackend`: a torch policy such as the learner's GPT (built by ``agentlog serve``)
  in-process, with simple dynamic batching in a worker thread.

Every backend returns a :class:`Generation` or raises :class:`BackendError`
(naming the backend, the URL and the upstream status); the gateway turns that
into a 502 and records nothing.
"""

from __future__ import annotations

import abc
import asyncio
import sys
import threading
import time
import uuid
from typing import Any, Sequence

import msgspec
import numpy as np

from agentlog.events.errors import AgentlogError
from agentlog._logging import get_logger

from .http_json import HTTPJSONError, JSONClient

_log = get_logger("agentlog.gateway")


class SamplingParams(msgspec.Struct, frozen=True):
    """What the backend samples with (session defaults plus client overrides)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, recorded with the turn."""
        return msgspec.structs.asdict(self) | {"stop_ids": list(self.stop_ids)}


class Generation(msgspec.Struct):
    """One backend call's result."""

    output_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" | "length"
    policy_version: int = 0
    generate_s: float = 0.0


class BackendError(AgentlogError, RuntimeError):
    """A backend call failed; ``status`` is the upstream HTTP status (0: no response)."""

    def __init__(self, backend: str, message: str, status: int = 0) -> None:
        super().__init__(f"backend {backend}: {message}")
        self.backend = backend
        self.status = status


class Backend(abc.ABC):
    """Generates from token ids. Implementations must be safe to call concurrently."""

    name = ""
    #: Longest prompt + output the model takes (None: unknown, the server enforces it).
    context_length: int | None = None
    #: Version of the weights answering right now (recorded with each turn).
    policy_version: int = 0

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Generate up to ``params.max_new_tokens`` tokens. Cancellation aborts the
        request upstream; failure raises BackendError. ``prompt_ids`` is any
        sequence of ints: the gateway passes a read-only int32 numpy array
        (:func:`id_list` makes a list of it)."""

    def ignored_sampling(self, params: SamplingParams) -> list[str]:
        """Names of parameters set away from their neutral value that this
        backend does not honour (recorded with the turn, so the log never
        claims a sampler that did not run)."""
        return []

    @property
    def fatal_reason(self) -> str | None:
        """None while the backend can serve; once a background part of it
        (a worker thread) has died, the one-line reason. The gateway's
        ``/health`` reports it and refuses turns with it."""
        return None

    async def close(self) -> None:
        """Release connections and threads."""


def id_list(ids: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints (for a JSON body or a tensor)."""
    if isinstance(ids, np.ndarray):
        return ids.tolist()
    return [int(t) for t in ids]


# ---------------------------------------------------------------- HTTP backends

#: The largest answer read from an inference server: a long generation with
#: per-token log-probs (and a server's top log-probs) is tens of MB.
ANSWER_LIMIT_BYTES = 256 << 20


class _HTTPBackend(Backend):
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 context_length: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.context_length = context_length
        # No connection cap: the gateway serves many sessions at once.
        self._http = JSONClient(timeout_s=timeout_s, headers=self._headers(), connection_limit=0)
        #: Upstream aborts still being posted (close() lets them finish).
        self._aborts: set[asyncio.Task] = set()

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.base_url + path
        try:
            out = await self._http.request("POST", url, body, limit=ANSWER_LIMIT_BYTES)
        except HTTPJSONError as exc:
            raise BackendError(self.name, str(exc), exc.status) from exc
        if not isinstance(out, dict):
            raise BackendError(self.name, f"POST {url}: expected a JSON object, found {type(out).__name__}", 200)
        return out

    async def close(self) -> None:
        if self._aborts:
            # A shutdown cancels every call at once: let their aborts reach
            # the server, or it keeps generating for nobody.
            await asyncio.wait(set(self._aborts), timeout=min(self.timeout_s, 5.0))
        await self._http.close()


class SGLangBackend(_HTTPBackend):
    """SGLang's native API: ``/generate`` with token ids and log-probs."""

    name = "sglang"

    def request_body(self, prompt_ids: Sequence[int], params: SamplingParams, rid: str) -> dict[str, Any]:
        """The ``/generate`` body for one call (exposed for tests and docs)."""
        sp: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.stop_ids:
            sp["stop_token_ids"] = list(params.stop_ids)
        if params.seed is not None:
            sp["sampling_seed"] = params.seed
        return {"rid": rid, "input_ids": id_list(prompt_ids), "sampling_params": sp, "return_logprob": True, "stream": False}

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        try:
            out = await self._post("/generate", self.request_body(prompt_ids, params, rid))
        except asyncio.CancelledError:
            # Tell SGLang to stop; shielded so the abort itself is not
            # cancelled, and kept so close() can wait for it.
            abort = asyncio.ensure_future(self._abort(rid))
            self._aborts.add(abort)
            abort.add_done_callback(self._aborts.discard)
            await asyncio.shield(abort)
            raise
        meta = out.get("meta_info")
        if not isinstance(meta, dict):
            raise BackendError(self.name, f"/generate response lacks meta_info (keys: {sorted(out)[:10]})", 200)
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise BackendError(self.name, "/generate meta_info lacks output_token_logprobs (was return_logprob honoured?)", 200)
        try:
            log_probs = [float(t[0]) for t in triples]
            output_ids = [int(t[1]) for t in triples]
        except (TypeError, ValueError, IndexError) as exc:
            raise BackendError(self.name, f"/generate output_token_logprobs: expected [logprob, token_id, ...] items: {exc}", 200) from exc
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in ("stop", "length"):
            raise BackendError(self.name, f"/generate finished with {fr!r} (rid {rid}); nothing to record", 200)
        version = meta.get("weight_version", self.policy_version)
        try:
            version = int(version)
        except (TypeError, ValueError):
            version = self.policy_version
        return Generation(output_ids, log_probs, kind, version, time.perf_counter() - t0)

    async def _abort(self, rid: str) -> None:
        try:
            await self._post("/abort_request", {"rid": rid})
            _log.info("gateway.backend_aborted", backend=self.name, rid=rid)
        except BackendError as exc:  # the cancel itself must not mask the cancellation
            _log.warning("gateway.backend_abort_failed", backend=self.name, rid=rid, error=str(exc))


class OpenAICompletionsBackend(_HTTPBackend):
    """An OpenAI-compatible ``/v1/completions`` server with token log-probs (vLLM)."""

    name = "openai-completions"

    def __init__(self, base_url: str, model: str = "", **kw: Any) -> None:
        super().__init__(base_url, **kw)
        #: The served model's name; "" sends none, which vLLM answers with its one base model
        #: (any other name it does not serve is a 404).
        self.model = model

    def request_body(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
        """The ``/v1/completions`` body for one call."""
        body: dict[str, Any] = {
            **({"model": self.model} if self.model else {}),
            "prompt": id_list(prompt_ids),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.stop_ids:
            body["stop_token_ids"] = list(params.stop_ids)
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        out = await self._post("/v1/completions", self.request_body(prompt_ids, params))
        try:
            choice = out["choices"][0]
            lp = choice["logprobs"]
            log_probs = [float(x) for x in lp["token_logprobs"]]
            ids = choice.get("token_ids")
            if ids is None:
                ids = [int(str(t).removeprefix("token_id:")) for t in lp["tokens"]]
            output_ids = [int(i) for i in ids]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendError(self.name, f"/v1/completions: expected choices[0].logprobs with token ids: {type(exc).__name__}: {exc}", 200) from exc
        if len(output_ids) != len(log_probs):
            raise BackendError(self.name, f"/v1/completions: {len(output_ids)} token ids but {len(log_probs)} log-probs", 200)
        fr = choice.get("finish_reason")
        if fr not in ("stop", "length"):
            raise BackendError(self.name, f"/v1/completions finished with {fr!r}; nothing to record", 200)
        return Generation(output_ids, log_probs, fr, self.policy_version, time.perf_counter() - t0)


# ---------------------------------------------------------------- built-in torch policy


class _Pending:
    __slots__ = ("prompt", "params", "future", "loop")

    def __init__(self, prompt: list[int], params: SamplingParams, future: asyncio.Future, loop: asyncio.AbstractEventLoop):
        self.prompt = prompt
        self.params = params
        self.future = future
        self.loop = loop


class TorchBackend(Backend):
    """The built-in policy in-process: ``GPT.sample`` on a worker thread.

    Calls that arrive while the model is busy are batched together (same
    temperature, and only while the longest prompt plus the largest output
    allowance fits the context), which is what keeps many concurrent sessions
    cheap. A cancelled call is dropped from the queue if it has not started;
    a batch already running finishes and its result is discarded.
    """

    name = "torch"

    def __init__(self, model: Any, *, max_batch: int = 64, seed: int = 0, policy_version: int = 0,
                 batch_window_s: float = 0.02, max_gather_s: float = 0.25, gil_switch_s: float | None = 0.0005) -> None:
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
        self._model_lock = threading.Lock()  # a weight update never lands mid-batch
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
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise BackendError(self.name, f"prompt token ids {bad[:5]} outside the model's vocabulary [0, {self.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.context_length:
            raise BackendError(
                self.name, f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the context ({self.context_length})"
            )
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
                most = max(b.params.max_new_tokens for b in batch)
                stops = sorted({s for b in batch for s in b.params.stop_ids})
                with self._model_lock:
                    version = self.policy_version
                    gen = self.model.sample(
                        [b.prompt for b in batch], most, temperature=batch[0].params.temperature,
                        stop_ids=stops, generator=self._generator,
                    )
                self.batches += 1
                dt = time.perf_counter() - t0
                self._last_gen_s = dt
                for i, b in enumerate(batch):
                    toks = gen.tokens[i].tolist()
                    lps = gen.log_probs[i].tolist()
                    own_stops = set(b.params.stop_ids)
                    cut = b.params.max_new_tokens
                    # Stop at this call's own stop ids and allowance (the batch
                    # shared the union of stops and the largest allowance).
                    end = next((j + 1 for j, t in enumerate(toks[:cut]) if t in own_stops), None)
                    fr = "stop" if end is not None else "length"
                    end = end if end is not None else min(cut, len(toks))
                    res = Generation(toks[:end], lps[:end], fr, version, dt)
                    _deliver(b, res, None)
            except Exception as exc:  # surfaced to every caller of the batch, never swallowed
                err = BackendError(self.name, f"sample() failed: {type(exc).__name__}: {exc}")
                for b in batch:
                    _deliver(b, None, err)
            batch.clear()

    async def load_weights(self, state_dict: Any, policy_version: int) -> None:
        """Swap in new weights between batches; later turns record ``policy_version``."""

        def swap() -> None:
            with self._model_lock:
                self.model.load_state_dict(state_dict)
                self.policy_version = policy_version

        await asyncio.to_thread(swap)

    async def reload_weights(self, path: Any, policy_version: int) -> None:
        """Load published weights from disk between batches; later turns record ``policy_version``.

        ``path`` is either an HF checkpoint directory (safetensors; the model
        must have ``load_hf_weights``, as learner.hf_model.HFCausalLM does) or a
        ``torch.save`` file: a learner checkpoint or weights file (its
        ``"model"`` entry) or a bare state dict, read with ``weights_only=True``.
        A file that cannot be loaded raises BackendError naming it, and the
        weights and version being served stay as they were."""
        import os

        import torch

        where = os.fspath(path)

        def swap() -> None:
            if os.path.isdir(where):
                loader = getattr(self.model, "load_hf_weights", None)
                if loader is None:
                    raise BackendError(self.name, f"reload_weights {where}: a directory (HF checkpoint), but the served "
                                                  f"model {type(self.model).__name__} has no load_hf_weights")
                with self._model_lock:
                    loader(where)
                    self.policy_version = policy_version
                return
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
            with self._model_lock:
                self.model.load_state_dict(state)
                self.policy_version = policy_version

        await asyncio.to_thread(swap)
        _log.info("gateway.weights_reloaded", backend=self.name, path=where, policy_version=policy_version)

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
