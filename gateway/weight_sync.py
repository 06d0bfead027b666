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

Every failure raises :class:`WeightSyncError` naming the server, the URL,
the status and the body; the gate then stays at the old version and opens
again, so turns keep recording the weights that really answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import msgspec

from agentlog._logging import get_logger

from .backends import Backend, Generation, SamplingParams

_log = get_logger("agentlog.gateway.weight_sync")


class WeightSyncError(RuntimeError):
    """A reload failed; the message names the server, the request and the answer."""


class ReloadGate:
    """Orders generations against reloads; see the module docstring.

    ``admit()`` / ``release()`` bracket one generation; ``reload(fn, v)``
    waits for the generations in flight, runs ``fn`` with new ones held
    back, and makes ``v`` the version new generations are admitted under.
    Reloads are serialised. Writers are preferred: once a reload is waiting,
    no new generation is admitted until it is done, so a stream of
    generations cannot starve it.
    """

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._inflight = 0
        self._reloading = False
        self._cond = asyncio.Condition()
        self._reload_lock = asyncio.Lock()

    @property
    def inflight(self) -> int:
        """Generations admitted and not yet released."""
        return self._inflight

    async def admit(self) -> int:
        """Wait until no reload is pending; count one generation in; return its version."""
        async with self._cond:
            while self._reloading:
                await self._cond.wait()
            self._inflight += 1
            return self.version

    async def release(self) -> None:
        """One admitted generation finished (or failed, or was cancelled)."""
        async with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    async def reload(self, fn: Callable[[], Awaitable[Any]], version: int) -> Any:
        """Hold new generations, wait for those in flight, run ``fn()``; on
        success the version becomes ``version``. A failing ``fn`` leaves the
        version as it was and re-raises. Either way the gate opens again."""
        async with self._reload_lock:
            async with self._cond:
                self._reloading = True
                try:
                    while self._inflight:
                        await self._cond.wait()
                except BaseException:
                    self._reloading = False
                    self._cond.notify_all()
                    raise
            try:
                result = await fn()
                self.version = version  # no generation is admitted between here and the open below
                return result
            finally:
                async with self._cond:
                    self._reloading = False
                    self._cond.notify_all()


class GatedBackend(Backend):
    """``inner`` behind a :class:`ReloadGate`: each generation is admitted by
    the gate and recorded with the version it was admitted under."""

    def __init__(self, inner: Backend, gate: ReloadGate | None = None) -> None:
        self.inner = inner
        self.gate = gate or ReloadGate(inner.policy_version)
        self.name = inner.name
        self.context_length = inner.context_length

    @property  # type: ignore[override]
    def policy_version(self) -> int:
        """The version new generations are admitted under."""
        return self.gate.version

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        version = await self.gate.admit()
        try:
            gen = await self.inner.generate(prompt_ids, params)
        finally:
            await self.gate.release()
        return msgspec.structs.replace(gen, policy_version=version)

    def ignored_sampling(self, params: SamplingParams) -> list[str]:
        return self.inner.ignored_sampling(params)

    @property
    def fatal_reason(self) -> str | None:
        return self.inner.fatal_reason

    async def close(self) -> None:
        await self.inner.close()


class _HTTPSync:
    """A JSON-over-HTTP client for one inference server's control endpoints."""

    server = ""

    def __init__(self, base_url: str, *, gate: ReloadGate, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.gate = gate
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._session: Any = None

    async def _post(self, path: str, body: dict[str, Any] | None) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        url = self.base_url + path
        try:
            async with self._session.post(url, json=body, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise WeightSyncError(f"{self.server} weight sync: POST {url} failed: {type(exc).__name__}: {exc}") from exc
        text = raw.decode("utf-8", "replace")
        if status != 200:
            raise WeightSyncError(f"{self.server} weight sync: POST {url} answered HTTP {status}: {text[:500]}")
        if not raw.strip():
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return text

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
        result = await self.gate.reload(lambda: self._reload(path, version), version)
        _log.info("gateway.weights_reloaded", server=self.server, url=self.base_url, policy_version=version, model_path=str(path))
        return result

    async def _reload(self, path: Path, version: int) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None


class SGLangWeightSync(_HTTPSync):
    """SGLang's ``/update_weights_from_disk`` (see the module docstring)."""

    server = "sglang"

    @staticmethod
    def request_body(path: Path, version: int) -> dict[str, Any]:
        """The ``/update_weights_from_disk`` body (exposed for tests and docs)."""
        return {"model_path": str(path), "weight_version": str(version), "flush_cache": True, "abort_all_requests": False}

    async def _reload(self, path: Path, version: int) -> Any:
        out = await self._post("/update_weights_from_disk", self.request_body(path, version))
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
        if path.resolve() != self.served_dir.resolve():
            await asyncio.to_thread(install_files, path, self.served_dir)
        out = await self._post("/collective_rpc", {"method": "reload_weights"})
        await self._post("/reset_prefix_cache", None)
        return out


def install_files(src: Path, dest: Path) -> list[str]:
    """Copy every file of ``src`` (one level) into ``dest``, each staged as
    ``.<name>.staging`` and moved in with ``os.replace`` (atomic per file).
    Returns the names installed."""
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in src.iterdir() if p.is_file())
    if not any(n.endswith(".safetensors") for n in names):
        raise WeightSyncError(f"vllm weight sync: {src}: no *.safetensors file to install (found {names[:10]})")
    for name in names:
        staged = dest / f".{name}.staging"
        shutil.copyfile(src / name, staged)
        os.replace(staged, dest / name)
    return names


__all__ = ["GatedBackend", "ReloadGate", "SGLangWeightSync", "VLLMWeightSync", "WeightSyncError", "install_files"]
