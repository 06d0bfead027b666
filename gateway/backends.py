"""Inference backends behind one interface: prompt ids in, output ids and log-probs out.

* :class:`SGLangBackend`: SGLang's native ``POST /generate`` with
  ``input_ids`` and ``return_logprob``; a cancelled call posts
  ``/abort_request`` with its ``rid`` so the server stops generating.
* :class:`OpenAICompletionsBackend`: an OpenAI-compatible ``/v1/completions``
  server that returns token log-probs for token-id prompts (vLLM, with
  ``return_tokens_as_token_ids``); a cancelled call closes its connection,
  which makes vLLM abort the request.
* :class:`~.torch_backend.TorchBackend`: a torch policy such as the learner's GPT (built by
  ``agentlog serve``) in-process, with simple dynamic batching in a worker thread.

Every backend returns a :class:`Generation` or raises :class:`BackendError`
(naming the backend, the URL and the upstream status); the gateway turns that
into a 502 and records nothing.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import re
import time
import urllib.parse
import uuid
from typing import Any, Callable, Sequence

import msgspec
import numpy as np

from agentlog.events.errors import AgentlogError
from agentlog._logging import get_logger

from .http_json import HTTPJSONError, JSONClient

_log = get_logger("agentlog.gateway")

#: The routing key of the generation being made in this context: the gateway sets
#: it (a session's id, or its group's) before it generates. A
#: :class:`~.fleet.Fleet` routes on it; an HTTP backend sends it upstream in its
#: routing header, so the user's own router (sglang-router's consistent hashing)
#: keeps the session on one server too. None: no key.
ROUTING_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("agentlog_routing_key", default=None)
#: An HTTP header name (RFC 9110's token): what ``routing_header`` may be.
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: A routing key sent as it is: visible ASCII (no control character, no space at the ends).
_HEADER_SAFE = re.compile(r"[!-~]+(?: +[!-~]+)*")
#: The header an HTTP backend sends the routing key in, unless told another: the one
#: sglang-router's consistent_hashing policy hashes (a fixed name; the router drops
#: headers it does not know), so a fleet behind that router keeps affinity as it is.
ROUTING_HEADER_DEFAULT = "X-SMG-Routing-Key"


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
    #: ``((first output token, version), ...)`` when a weight update landed
    #: mid-generation (a partial rollout; ``policy_version`` is then the first
    #: span's), else UNSET: the turn's ``version_spans`` as recorded.
    version_spans: tuple[tuple[int, int], ...] | msgspec.UnsetType = msgspec.UNSET
    #: How the backend met weight updates in flight (``events.schema.turn.WEIGHT_UPDATE_MODES``).
    weight_update: str = "drain"
    #: The fleet member that generated it (:class:`~.fleet.Fleet`); "" behind a single backend.
    server: str = ""


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

    async def probe(self) -> str | None:
        """None when the backend can serve; else why not, in one line. A fleet
        asks every ``probe_interval_s`` (an HTTP backend asks its server's
        ``/health``; an in-process one reports its ``fatal_reason``)."""
        return self.fatal_reason

    async def close(self) -> None:
        """Release connections and threads."""


def id_list(ids: "Sequence[int] | np.ndarray") -> list[int]:
    """Token ids as a list of Python ints (for a JSON body or a tensor)."""
    if isinstance(ids, np.ndarray):
        return ids.tolist()
    return list(map(int, ids))  # 1.3x faster than a comprehension on a 100k-token prompt


def _is_token_id(x: Any) -> bool:
    """A token id as a server's JSON answer must hold it: an int. ``int()`` would take a bool or a
    float such as 72.9 and record token 1 or 72, which the server never produced."""
    return type(x) is int


def _is_log_prob(x: Any) -> bool:
    """A log-prob as a server's JSON answer must hold it: a number (a bool or a string is not one,
    whatever ``float()`` would make of it)."""
    return type(x) is float or type(x) is int


def _answered(values: Any, where: str, is_item: Callable[[Any], bool], items: str, item: str) -> list:
    """A list in a server's JSON answer, as sent (``items``: what it holds): ValueError naming the
    first entry ``is_item`` refuses (``item``: what each must be)."""
    if not isinstance(values, list):
        raise ValueError(f"{where}: expected a list of {items}, found {type(values).__name__}")
    for i, x in enumerate(values):
        if not is_item(x):
            raise ValueError(f"{where}[{i}]: expected {item}, found {x!r:.60}")
    return values


# ---------------------------------------------------------------- HTTP backends

#: The largest answer read from an inference server: a long generation with
#: per-token log-probs (and a server's top log-probs) is tens of MB.
ANSWER_LIMIT_BYTES = 256 << 20


class _HTTPBackend(Backend):
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 context_length: int | None = None, routing_header: str | None = ROUTING_HEADER_DEFAULT) -> None:
        self.base_url = base_url.rstrip("/")
        #: The header each request carries its routing key in ("" or None: none).
        self.routing_header = routing_header or None
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

    def routing_headers(self) -> dict[str, str] | None:
        """This request's routing header (see :data:`ROUTING_KEY`), or None."""
        key = ROUTING_KEY.get()
        if key is None or self.routing_header is None:
            return None
        if not _HEADER_SAFE.fullmatch(key):
            # A header value is visible ASCII: any other key travels percent-encoded (the same
            # key always encodes the same way, so a router's hashing still keeps it together).
            key = urllib.parse.quote(key, safe="")
        return {self.routing_header: key}

    async def probe(self) -> str | None:
        """The server's ``GET /health`` (SGLang and vLLM both answer 200 when they can serve)."""
        if self.fatal_reason is not None:
            return self.fatal_reason
        try:
            await self._http.request("GET", self.base_url + "/health", None, limit=1 << 16, empty=True)
        except HTTPJSONError as exc:
            if exc.status != 200:  # a 200 whose text is not JSON is healthy too
                return str(exc)
        return None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.base_url + path
        try:
            out = await self._http.request("POST", url, body, limit=ANSWER_LIMIT_BYTES, headers=self.routing_headers())
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
    #: Return a generation the server aborted (``finish_reason`` "abort", its
    #: partial output and ``weight_version``) instead of raising: set by a
    #: :class:`~.weight_sync.GatedBackend` that resubmits partial outputs.
    partial = False

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
        log_probs, output_ids = [], []
        for i, t in enumerate(triples):
            if not isinstance(t, list) or len(t) < 2 or not _is_token_id(t[1]) or not _is_log_prob(t[0]):
                raise BackendError(self.name, f"/generate output_token_logprobs[{i}]: expected a [logprob (a number), "
                                              f"token_id (an int), ...] item, found {t!r:.120}", 200)
            log_probs.append(float(t[0]))
            output_ids.append(t[1])
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in ("stop", "length") and not (kind == "abort" and self.partial):
            raise BackendError(self.name, f"/generate finished with {fr!r} (rid {rid}); nothing to record", 200)
        if self.partial and "weight_version" not in meta:
            raise BackendError(self.name, f"/generate meta_info lacks weight_version (rid {rid}): resubmitting partial "
                                          "outputs needs the version that generated each part", 200)
        answered = meta.get("weight_version", self.policy_version)
        if isinstance(answered, str) and answered.isascii() and answered.isdigit():
            version = int(answered)
        elif type(answered) is int and answered >= 0:
            version = answered
        elif self.partial and answered != "default":  # "default": SGLang's launch weights, before any update
            raise BackendError(self.name, f"/generate meta_info.weight_version {answered!r:.60} (rid {rid}): expected a "
                                          "policy version (an int >= 0, as a string) or 'default' (the launch weights)", 200)
        else:
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

    #: Stream answers so that a reload can cut them (see :meth:`interrupt`): set by a
    #: :class:`~.weight_sync.GatedBackend` that resubmits partial outputs.
    partial = False

    def __init__(self, base_url: str, model: str = "", **kw: Any) -> None:
        super().__init__(base_url, **kw)
        #: The served model's name; "" sends none, which vLLM answers with its one base model
        #: (any other name it does not serve is a 404).
        self.model = model
        self._streams: set[asyncio.Future] = set()

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

    def _tokens(self, choice: Any) -> tuple[list[int], list[float]]:
        """One answer's (or one streamed chunk's) ``choices[0]``: its token ids and log-probs."""
        try:
            lp = choice["logprobs"]
            log_probs = [float(x) for x in _answered(lp["token_logprobs"], "choices[0].logprobs.token_logprobs", _is_log_prob, "log-probs", "a number")]
            ids = choice.get("token_ids")
            if ids is None:  # "token_id:123" strings (vLLM's return_tokens_as_token_ids)
                output_ids = [int(str(t).removeprefix("token_id:")) for t in lp["tokens"]]
            else:
                output_ids = _answered(ids, "choices[0].token_ids", _is_token_id, "token ids", "an int token id")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendError(self.name, f"/v1/completions: expected choices[0].logprobs with token ids: {type(exc).__name__}: {exc}", 200) from exc
        if len(output_ids) != len(log_probs):
            raise BackendError(self.name, f"/v1/completions: {len(output_ids)} token ids but {len(log_probs)} log-probs", 200)
        return output_ids, log_probs

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self.partial:
            return await self._generate_streamed(prompt_ids, params)
        t0 = time.perf_counter()
        out = await self._post("/v1/completions", self.request_body(prompt_ids, params))
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise BackendError(self.name, f"/v1/completions: expected choices[0]: {type(exc).__name__}: {exc}", 200) from exc
        output_ids, log_probs = self._tokens(choice)
        fr = choice.get("finish_reason")
        if fr not in ("stop", "length"):
            raise BackendError(self.name, f"/v1/completions finished with {fr!r}; nothing to record", 200)
        return Generation(output_ids, log_probs, fr, self.policy_version, time.perf_counter() - t0)

    # Partial rollouts (``partial``, set by a GatedBackend that resubmits): the answer is
    # streamed, and a reload cuts every stream in flight (``interrupt``) before it touches the
    # weights. Each cut generation returns the tokens received so far, finish_reason "abort":
    # all of them arrived before the reload began, so the old weights made them. Tokens the
    # server made after the cut are never read; closing the connection makes vLLM abort the
    # request. No server-side pause is needed, and no version per answer.

    def interrupt(self) -> int:
        """Cut every streamed generation in flight at the last token received; returns how many."""
        for reader in self._streams:
            reader.cancel()
        return len(self._streams)

    async def _generate_streamed(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        ids: list[int] = []
        lps: list[float] = []
        finish: list[Any] = []
        # Registered before the first await: a reload that closes the gate after this
        # generation was admitted finds it here.
        reader = asyncio.ensure_future(self._read_stream({**self.request_body(prompt_ids, params), "stream": True},
                                                         ids, lps, finish))
        self._streams.add(reader)
        try:
            await asyncio.wait({reader})
        except asyncio.CancelledError:  # the caller went away: stop reading, which closes the stream
            reader.cancel()
            raise
        finally:
            self._streams.discard(reader)
        if reader.cancelled():
            # A cut between the event that finished the generation and the stream's end loses
            # nothing: the generation is whole (resubmitting it would run past its stop token).
            if finish and finish[0] in ("stop", "length"):
                return Generation(ids, lps, finish[0], self.policy_version, time.perf_counter() - t0)
            return Generation(ids, lps, "abort", self.policy_version, time.perf_counter() - t0)
        reader.result()
        fr = finish[0] if finish else None
        if fr not in ("stop", "length"):
            raise BackendError(self.name, f"/v1/completions (streamed) finished with {fr!r}; nothing to record", 200)
        return Generation(ids, lps, fr, self.policy_version, time.perf_counter() - t0)

    async def _read_stream(self, body: dict[str, Any], ids: list[int], lps: list[float], finish: list[Any]) -> None:
        """Read the streamed answer into ``ids``/``lps`` one chunk at a time (each chunk's tokens
        are added whole, so a cut never splits one); ``finish`` gets the finish reason."""
        url = self.base_url + "/v1/completions"
        try:
            async for event in self._http.server_sent_events(url, body, limit=ANSWER_LIMIT_BYTES, headers=self.routing_headers()):
                choices = event.get("choices") if isinstance(event, dict) else None
                if not isinstance(choices, list):
                    raise BackendError(self.name, f"/v1/completions (streamed) at {self.base_url}: expected an event with "
                                                  f"choices, found {str(event)[:500]}", 200)
                if not choices:  # a usage-only event
                    continue
                choice = choices[0]
                if not isinstance(choice, dict):
                    raise BackendError(self.name, f"/v1/completions (streamed) at {self.base_url}: expected choices[0] to "
                                                  f"be an object, found {str(choice)[:200]}", 200)
                if choice.get("logprobs") is not None:
                    chunk_ids, chunk_lps = self._tokens(choice)
                    ids += chunk_ids
                    lps += chunk_lps
                elif choice.get("token_ids"):
                    raise BackendError(self.name, "/v1/completions (streamed): a chunk has token ids but no logprobs "
                                                  "(was logprobs honoured?)", 200)
                if choice.get("finish_reason") is not None:
                    finish.append(choice["finish_reason"])
        except HTTPJSONError as exc:
            raise BackendError(self.name, str(exc), exc.status) from exc


# ---------------------------------------------------------------- built-in torch policy


# The in-process torch backend lives in its own module; exported here with the others.
from .torch_backend import TorchBackend  # noqa: E402  (after Backend/Generation, which it imports)

__all__ = ["Backend", "BackendError", "Generation", "OpenAICompletionsBackend", "SGLangBackend", "SamplingParams",
           "TorchBackend", "id_list"]
