"""Weight sync: new policy versions reach the inference server, and turns record the right version.

The ordering guarantee. No turn generated after a reload is recorded with
the old ``policy_version``, and none generated before it with the new one.
:class:`ReloadGate` gives it: a reload closes the gate to new generations,
waits for those in flight to finish (they keep the version they were
admitted under, which is the one that generated them), runs the server's
reload, bumps the version, and opens the gate again. A generation admitted
after the bump can only have run on the new weights. :class:`GatedBackend`
puts any :class:`~.backends.Backend` behind a gate and stamps each
:class:`~.backends.Generation` with the version it was admitted under.

The reloads, each a small HTTP client against the server's own API:

* :class:`SGLangWeightSync`: ``POST /update_weights_from_disk`` with
  ``{"model_path": DIR, "weight_version": "N", "flush_cache": true,
  "abort_all_requests": false}``. SGLang answers 200 ``{"success": true,
  "message": ..., "num_paused_requests": ...}`` or 400 with ``success``
  false (``sglang/srt/entrypoints/http_server.py``,
  ``UpdateWeightFromDiskReqInput`` in ``managers/io_struct.py``). The radix
  (prefix) cache holds KV computed by the old weights, so it is flushed
  with the update (``flush_cache``, SGLang's default since the field
  exists; older servers flush in this call anyway). ``DIR`` must be a
  Hugging Face directory the server can load (config.json + safetensors).
* :class:`VLLMWeightSync`: vLLM reloads the weights of the directory it was
  launched on. Its development endpoints (``VLLM_SERVER_DEV_MODE=1``;
  ``vllm/entrypoints/serve/dev``) offer ``POST /collective_rpc
  {"method": "reload_weights"}`` (every worker's ``reload_weights()``) and
  ``POST /reset_prefix_cache``. So the sync first copies the new version's
  files into ``served_dir`` (each staged under a temporary name and moved
  in with ``os.replace``, so the server never reads a half-written file),
  then asks for the reload, then resets the prefix cache (KV computed by
  the old weights must not be reused). vLLM answers 200 on success.

Partial rollouts against SGLang (``GatedBackend(weight_update="resubmit")``):
a reload does not drain. It holds new generations, then ``POST
/pause_generation {"mode": "abort"}`` (SGLang aborts the requests in flight,
each answering with its partial output, ``finish_reason`` ``abort`` and the
``weight_version`` that made it, and holds requests that arrive meanwhile),
``/update_weights_from_disk``, and ``POST /continue_generation {}`` (also after
a refused update, so the server never stays paused). The gated backend
resubmits each aborted generation with its partial output appended to the
prompt; each part's version is the one the server reports
(``meta_info.weight_version``), so a request that reached the server during
the pause, and ran on the new weights, is recorded with the new version. The
turn records its version spans.

Partial rollouts against vLLM (``GatedBackend(weight_update="resubmit")`` over
an :class:`~.backends.OpenAICompletionsBackend`, whose answers are then
streamed): vLLM reports no weight version per answer, so the client draws the
boundary. A reload closes the gate, cuts every stream in flight at its last
received token (``ReloadGate.interrupt``; the closed connection makes vLLM
abort the request), waits for the cut generations to return, then runs
:class:`VLLMWeightSync`'s reload inside vLLM's dev-mode ``POST
/pause?mode=abort`` ... ``POST /resume`` (``vllm/entrypoints/serve/dev/rlhf/
api_router.py``), so no request the server has not yet freed keeps KV made by
the old weights. Every received token predates the reload, so each part is
recorded with the version it was admitted under. (Pausing first, without the
client-side cut, would not be exact: a request in transit at the pause is held
and runs on the new weights, and vLLM's answer names no version.)

Every failure raises :class:`WeightSyncError` naming the server, the URL,
the status and the body. A failure before anything reached the server (or
SGLang's explicit refusal, after which it rolls back) leaves the gate at the
old version, which still answers. A failure after a request with
server-side effects was sent, or after files of ``served_dir`` were
replaced, leaves the served weights unknown: the gate gets a
``fatal_reason`` naming the server, the version and the step, and the
gateway refuses turns (503) until a later reload succeeds. Once vLLM's
reload RPC succeeded, the version is bumped before the cache reset.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import msgspec

from agentlog.events.errors import AgentlogError
from agentlog._logging import get_logger
from agentlog.events.fs import atomic_path

from agentlog.events.schema.turn import canonical_version_spans

from .backends import Backend, BackendError, Generation, SamplingParams, id_list
from .http_json import HTTPJSONError, JSONClient

_log = get_logger("agentlog.gateway.weight_sync")


class WeightSyncError(AgentlogError, RuntimeError):
    """A reload failed; the message names the server, the request and the answer.
    ``status`` / ``answer``: the HTTP status and decoded body, when the server answered."""

    def __init__(self, message: str, *, status: int | None = None, answer: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.answer = answer


class ReloadGate:
    """Orders generations against reloads; see the module docstring.

    ``admit()`` / ``release()`` bracket one generation; ``reload(fn, v)``
    waits for the generations in flight, runs ``fn`` with new ones held
    back, and makes ``v`` the version new generations are admitted under.
    Reloads are serialised. Writers are preferred: once a reload is waiting,
    no new generation is admitted until it is done, so a stream of
    generations cannot starve it.

    ``release`` is synchronous and takes no lock: it runs in a ``finally``
    of a generation that may be cancelled, and an ``await`` there could be
    interrupted by a second cancellation and leak the in-flight count, which
    would make the next reload wait forever. The drain is bounded too
    (``drain_timeout_s``), so a leak would show as an error, not a hang.

    ``fatal_reason`` is set when a reload failed after the server may have
    changed its weights (see :meth:`fail`); the gateway then refuses turns
    until a later reload succeeds.
    """

    def __init__(self, version: int = 0, *, drain_timeout_s: float = 300.0, drains: bool = True) -> None:
        if not drain_timeout_s > 0:
            raise ValueError(f"ReloadGate: drain_timeout_s: expected a number > 0, found {drain_timeout_s!r}")
        self.version = version
        self.drain_timeout_s = drain_timeout_s
        #: False for partial rollouts: a reload does not wait for the generations in
        #: flight (the server aborts them and they are resubmitted; see the module docstring).
        self.drains = drains
        #: Reloads begun so far: a generation aborted while it was in flight and
        #: this moved was aborted by a reload.
        self.reloads_begun = 0
        #: For partial rollouts whose generations the client cuts (a streamed
        #: /v1/completions): called as a reload begins, before it waits for the
        #: cut generations to return and then touches the weights.
        self.interrupt: Callable[[], int] | None = None
        self.fatal_reason: str | None = None
        self._inflight = 0
        self._reloading = False
        self._open = asyncio.Event()  # set while no reload is pending: admit() waits on it
        self._open.set()
        self._drained = asyncio.Event()  # set while no generation is in flight: reload() waits on it
        self._drained.set()
        self._reload_lock = asyncio.Lock()

    @property
    def inflight(self) -> int:
        """Generations admitted and not yet released."""
        return self._inflight

    async def admit(self) -> int:
        """Wait until no reload is pending; count one generation in; return its version."""
        while self._reloading:  # a loop: another reload may start before this waiter runs
            await self._open.wait()
        self._inflight += 1
        self._drained.clear()
        return self.version

    def release(self) -> None:
        """One admitted generation finished (or failed, or was cancelled)."""
        if self._inflight <= 0:
            raise RuntimeError("ReloadGate.release: no generation in flight (release without admit)")
        self._inflight -= 1
        if self._inflight == 0:
            self._drained.set()

    def advance(self, version: int) -> None:
        """Inside a running reload: the server now runs ``version`` (its
        reload step succeeded), even if a later step of the same reload
        fails. Only legal while the gate is closed and drained, so no
        generation can be admitted under the wrong version."""
        if not self._reloading or self._inflight:
            raise RuntimeError(f"ReloadGate.advance({version}): only inside reload() with no generation in flight")
        self.version = version

    def fail(self, reason: str) -> None:
        """Mark the served weights as unknown: set ``fatal_reason`` (logged
        as an error). Cleared by the next successful reload."""
        self.fatal_reason = reason
        _log.error("gateway.weight_sync_fatal", reason=reason, policy_version=self.version)

    async def reload(self, fn: Callable[[], Awaitable[Any]], version: int, *, drain_timeout_s: float | None = None) -> Any:
        """Hold new generations, wait (at most ``drain_timeout_s``, default
        the gate's) for those in flight, run ``fn()``; on success the version
        becomes ``version`` and ``fatal_reason`` is cleared. A failing ``fn``
        leaves the version as it was (unless ``fn`` called :meth:`advance`)
        and re-raises. Either way the gate opens again."""
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        async with self._reload_lock:
            self._reloading = True
            self.reloads_begun += 1
            self._open.clear()
            try:
                try:
                    if not self.drains and self.interrupt is not None:
                        cut = self.interrupt()
                        _log.debug("gateway.generations_cut", policy_version=version, cut=cut)
                    if self.drains or self.interrupt is not None:
                        await asyncio.wait_for(self._drained.wait(), timeout)
                except asyncio.TimeoutError:
                    raise WeightSyncError(
                        f"reload to policy version {version}: {self._inflight} generation(s) still in flight "
                        f"after waiting {timeout:g} s for them to finish (drain_timeout_s); the reload did not run"
                    ) from None
                result = await fn()
                self.version = version  # no generation is admitted between here and the open below
                self.fatal_reason = None
                return result
            finally:
                self._reloading = False
                self._open.set()


class GatedBackend(Backend):
    """``inner`` behind a :class:`ReloadGate`: each generation is admitted by
    the gate and recorded with the version it was admitted under."""

    def __init__(self, inner: Backend, gate: ReloadGate | None = None, *, weight_update: str = "drain") -> None:
        if weight_update not in ("drain", "resubmit"):
            raise ValueError(f"GatedBackend: weight_update: expected 'drain' or 'resubmit' (a server reports no "
                             f"per-token version boundary to continue from), found {weight_update!r}")
        if weight_update == "resubmit":
            if not hasattr(inner, "partial"):
                raise ValueError(f"GatedBackend: weight_update 'resubmit' needs a backend that returns aborted partial "
                                 f"outputs (SGLang's, or a streamed /v1/completions); {inner.name!r} does not")
            inner.partial = True
        self.inner = inner
        self.weight_update = weight_update
        self.gate = gate or ReloadGate(inner.policy_version, drains=weight_update == "drain")
        #: The inner backend cuts its own generations at a reload (a streamed /v1/completions):
        #: each part then ran on the version it was admitted under. Otherwise (SGLang) the
        #: server aborts them, and each part's version is the one the server reports.
        interrupt = getattr(inner, "interrupt", None) if weight_update == "resubmit" else None
        self._cuts_client_side = interrupt is not None
        if interrupt is not None:
            self.gate.interrupt = interrupt
        self.name = inner.name
        self.context_length = inner.context_length

    @property
    def policy_version(self) -> int:  # type: ignore[override]  # read-only here: the gate's version
        """The version new generations are admitted under."""
        return self.gate.version

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self.weight_update == "resubmit":
            return await self._generate_through_reloads(prompt_ids, params)
        version = await self._admit()
        try:
            gen = await self.inner.generate(prompt_ids, params)
        finally:
            self.gate.release()
        return msgspec.structs.replace(gen, policy_version=version)

    async def _admit(self) -> int:
        """The gate's admission, refused when a reload that failed while this generation
        waited left the served weights unknown: it would run on weights no version names
        (a fleet then sends it to another server; nothing was recorded)."""
        version = await self.gate.admit()
        reason = self.gate.fatal_reason
        if reason is not None:
            self.gate.release()
            raise BackendError(self.name, f"not generated: {reason}")
        return version

    async def _generate_through_reloads(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """One generation that a reload may abort: each aborted part is
        resubmitted with the output so far appended to the prompt, under the
        version the server then serves; the parts' versions (as the server
        reported them) become the turn's version spans."""
        prompt = id_list(prompt_ids)
        toks: list[int] = []
        lps: list[float] = []
        starts: list[tuple[int, int]] = []
        t0 = time.perf_counter()
        while True:
            admitted = await self._admit()
            reloads = self.gate.reloads_begun
            try:
                part = await self.inner.generate(
                    prompt + toks, msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - len(toks)))
            finally:
                self.gate.release()
            starts.append((len(toks), admitted if self._cuts_client_side else part.policy_version))
            toks += part.output_ids
            lps += part.log_probs
            finish = part.finish_reason
            if finish != "abort":
                break
            if self.gate.reloads_begun == reloads:
                raise BackendError(self.name, f"the server aborted a generation after {len(toks)} tokens while no weight "
                                              "update was under way; nothing to record")
            if len(toks) >= params.max_new_tokens:
                finish = "length"
                break
        version, spans = canonical_version_spans(starts, len(toks))
        return Generation(toks, lps, finish, version, time.perf_counter() - t0, spans, self.weight_update)

    def ignored_sampling(self, params: SamplingParams) -> list[str]:
        return self.inner.ignored_sampling(params)

    @property
    def fatal_reason(self) -> str | None:
        """The inner backend's reason, else the gate's (a reload that failed
        after the server may have changed its weights)."""
        return self.inner.fatal_reason or self.gate.fatal_reason

    async def probe(self) -> str | None:
        """The server's own health, then the gate's fatal reason."""
        return await self.inner.probe() or self.gate.fatal_reason

    async def close(self) -> None:
        await self.inner.close()


class _HTTPSync:
    """A JSON-over-HTTP client for one inference server's control endpoints.

    Each reload tracks its current step and whether a step with server-side
    effects has begun (a request that may have reached the server, or files
    replaced in the served directory). A failure after that point leaves the
    served weights unknown, so the gate is made fatal (:meth:`ReloadGate.fail`)
    naming the server, the version and the step; a failure before it (the
    server could not be reached, or it answered that it kept its weights)
    leaves the gate at the old version, which still answers.
    """

    server = ""

    def __init__(self, base_url: str, *, gate: ReloadGate, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.gate = gate
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._http = JSONClient(timeout_s=timeout_s,
                                headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
        self._step = ""
        self._effects = False

    async def _post(self, path: str, body: dict[str, Any] | None, *, effects: bool) -> Any:
        """POST ``body``; ``effects``: the request may change what the server serves."""
        url = self.base_url + path
        self._step = f"POST {path}"
        before, self._effects = self._effects, self._effects or effects
        try:
            return await self._http.request("POST", url, body, empty=True)
        except HTTPJSONError as exc:
            if not exc.reached:
                self._effects = before  # no connection: the request never reached the server
            raise WeightSyncError(f"{self.server} weight sync: {exc}", status=exc.status or None,
                                  answer=exc.answer) from exc

    async def reload(self, model_path: str | os.PathLike[str], version: int) -> Any:
        """Load ``model_path`` as policy ``version`` with the gate held (see :class:`ReloadGate`)."""
        if type(version) is not int or version < 0:
            raise ValueError(f"{self.server} weight sync: version: expected an int >= 0, found {version!r}")
        path = Path(model_path)
        if not path.is_dir():
            raise WeightSyncError(
                f"{self.server} weight sync: model_path {str(path)!r}: expected a Hugging Face model directory "
                "(config.json + safetensors), found " + ("a file" if path.exists() else "nothing")
            )

        async def run() -> Any:
            self._step, self._effects = "start", False
            try:
                return await self._reload(path, version)
            except BaseException as exc:  # cancellation mid-request leaves the server just as unknown
                if self._effects:
                    self.gate.fail(
                        f"{self.server} weight sync at {self.base_url}: reload to policy version {version} failed at "
                        f"step {self._step!r} after the server may have changed its weights (gate version "
                        f"{self.gate.version}); turns are refused until a reload succeeds: {type(exc).__name__}: {exc}"
                    )
                raise

        result = await self.gate.reload(run, version)
        _log.info("gateway.weights_reloaded", server=self.server, url=self.base_url, policy_version=version, model_path=str(path))
        return result

    async def _reload(self, path: Path, version: int) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._http.close()


class SGLangWeightSync(_HTTPSync):
    """SGLang's ``/update_weights_from_disk`` (see the module docstring)."""

    server = "sglang"

    @staticmethod
    def request_body(path: Path, version: int) -> dict[str, Any]:
        """The ``/update_weights_from_disk`` body (exposed for tests and docs)."""
        return {"model_path": str(path), "weight_version": str(version), "flush_cache": True, "abort_all_requests": False}

    async def _reload(self, path: Path, version: int) -> Any:
        if self.gate.drains:
            return await self._update(path, version)
        # Partial rollouts: abort what is in flight (each answers with its part), update, go on.
        await self._post("/pause_generation", {"mode": "abort"}, effects=True)
        try:
            out = await self._update(path, version)
        except WeightSyncError:
            refused = not self._effects  # SGLang rolled back: the old weights still answer once it goes on
            # The server is paused whatever happened: a continue that cannot reach it leaves it so (fatal).
            self._effects = True
            await self._post("/continue_generation", {}, effects=True)
            self._effects = not refused
            raise
        await self._post("/continue_generation", {}, effects=True)
        return out

    async def _update(self, path: Path, version: int) -> Any:
        """``/update_weights_from_disk``; an explicit refusal leaves ``_effects`` False."""
        try:
            out = await self._post("/update_weights_from_disk", self.request_body(path, version), effects=True)
        except WeightSyncError as exc:
            if exc.status == 400 and isinstance(exc.answer, dict) and exc.answer.get("success") is False:
                # An explicit refusal: SGLang answers 400 success=false after
                # rolling back to the weights it ran (ModelRunner.
                # update_weights_from_disk), so the old version still answers.
                self._effects = False
            raise
        if not isinstance(out, dict) or out.get("success") is not True:
            raise WeightSyncError(f"sglang weight sync: /update_weights_from_disk answered 200 without success: {out!r:.300}")
        return out


class VLLMWeightSync(_HTTPSync):
    """vLLM's dev-mode reload of its served directory (see the module docstring)."""

    server = "vllm"

    def __init__(self, base_url: str, served_dir: str | os.PathLike[str], **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.served_dir = Path(served_dir)

    async def _reload(self, path: Path, version: int) -> Any:
        if self.gate.drains:
            return await self._swap(path, version)
        # Partial rollouts: the gate has cut our streams and seen them return, but vLLM frees a
        # request only once it notices the closed connection. Pausing with abort ends whatever
        # still runs (KV made by the old weights must not outlive the reload in a running
        # request's blocks, which a cache reset cannot free); resume afterwards, also after a
        # failure, so the server never stays paused. (A request cut while in transit may reach
        # the server paused and run after the resume: nobody reads it.)
        self._check_routes_answer(await self._post("/pause?mode=abort", None, effects=True), "/pause?mode=abort")
        try:
            return await self._swap(path, version)
        finally:
            await self._post("/resume", None, effects=True)

    def _check_routes_answer(self, out: Any, route: str) -> None:
        if isinstance(out, dict) and out.get("success") is False:
            raise WeightSyncError(f"vllm weight sync: {route} answered 200 with success false: {out!r:.300}", status=200,
                                  answer=out)

    async def _swap(self, path: Path, version: int) -> Any:
        """Install ``path``'s files into the served directory, reload them, reset the prefix cache."""
        if path.resolve() != self.served_dir.resolve():
            _installable(path)  # checked before anything is replaced
            # Files replaced one by one: a failure part way leaves served_dir mixed.
            self._step, self._effects = f"install files into {self.served_dir}", True
            await asyncio.to_thread(install_files, path, self.served_dir)
        out = await self._post("/collective_rpc", {"method": "reload_weights"}, effects=True)
        # The server now runs the new weights: record that before the cache
        # reset, so a failing reset cannot leave them under the old version.
        self.gate.advance(version)
        # A failing reset is fatal too (run() sets fatal_reason, since the RPC
        # had effects): the prefix cache still holds KV computed by the old
        # weights, and turns recorded under the new version would reuse it.
        # Newer servers answer {"success": false} when blocks were still held: as fatal as a failed call.
        self._check_routes_answer(await self._post("/reset_prefix_cache", None, effects=True), "/reset_prefix_cache")
        return out


def _installable(src: Path) -> list[str]:
    """The files of ``src`` (sorted names); raises unless one is a safetensors file."""
    names = sorted(p.name for p in src.iterdir() if p.is_file())
    if not any(n.endswith(".safetensors") for n in names):
        raise WeightSyncError(f"vllm weight sync: {src}: no *.safetensors file to install (found {names[:10]})")
    return names


def install_files(src: Path, dest: Path) -> list[str]:
    """Copy every file of ``src`` (one level) into ``dest``, each staged as
    ``.<name>.staging`` and moved in with :func:`agentlog.events.fs.atomic_path` (atomic per file).
    Returns the names installed."""
    names = _installable(src)
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        # Not fsynced: the server loads the files now, and the checkpoint they came from is durable.
        with atomic_path(dest / name, durable=False, tmp_name=f".{name}.staging") as staged:
            shutil.copyfile(src / name, staged)
    return names


__all__ = ["GatedBackend", "ReloadGate", "SGLangWeightSync", "VLLMWeightSync", "WeightSyncError", "install_files"]
