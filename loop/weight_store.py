"""Policy weights through the JetStream object store: workers without a shared folder.

With ``[log] backend = "nats"`` the learner puts every version it publishes
into the run's object store bucket ``<stream>-weights`` before it appends the
``policy_updated`` record naming it (:func:`agentlog.loop.publish.publish`):
one object per version, ``policy-vNNNNN.pt`` (the learner checkpoint of the
built-in GPT) or ``policy-vNNNNN.tar`` (an HF policy's directory as a
deterministic, uncompressed tar: :class:`DirectoryTar`), in chunks of
``[log] weights_chunk_kib``. The record names the object (``weights_object``)
and its SHA-256 digest (``weights_digest``, as the object store writes it:
``SHA-256=<base64url>``). Objects fall out of the bucket by the rule that
prunes the checkpoints folder.

A worker asks :func:`version_source` where to load a version from: the run
folder's checkpoint when its host sees it (``[log] weights = "auto"``), else
the version fetched into its cache folder (:meth:`Run.weights_cache`): into a
temporary name, checked, then renamed, so a half-fetched or corrupt version is
never loaded. A cached version is reused; the newest :data:`CACHE_KEEP` stay.

Two digest checks guard a fetch: nats-py's ``ObjectStore.get`` hashes the
chunks and raises ``DigestMismatchError`` when they do not match the object's
metadata, and this module hashes the bytes as they are written and compares
them with the record's digest, the learner's own (which also catches an
object replaced since, or a stale object of an earlier run on the same
stream). Either failure raises :class:`WeightStoreError` naming the bucket,
the object, the version and the digests, and leaves nothing in the cache.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import re
import shutil
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, NamedTuple

import msgspec

from agentlog._logging import get_logger
from agentlog.events.errors import AgentlogError
from agentlog.events.fs import atomic_path, write_atomic, write_dir_atomically
from agentlog.events.log.jetstream_conn import Bridge, connect, retried
from agentlog.events.schema.types import PolicyUpdated

from .publish import KEEP_EVERY, hf_checkpoint_dir

if TYPE_CHECKING:
    from .run_folder import Run

log = get_logger("agentlog.loop.weight_store")

#: Versions a worker keeps in its cache: the one it loads and the one before.
CACHE_KEEP = 2
#: Seconds to wait for a TCP connection to a NATS server.
CONNECT_TIMEOUT_S = 5.0
#: Seconds one request (bucket info, an object's metadata, a delete) may take before it is tried again.
REQUEST_TIMEOUT_S = 10.0
#: How nats-py's object store writes a digest: this prefix, then the SHA-256 in URL-safe base64.
DIGEST_PREFIX = "SHA-256="

OBJECT_RE = re.compile(r"policy-v(\d+)\.(pt|tar)")


class WeightStoreError(AgentlogError, RuntimeError):
    """A version could not be put into, or fetched from, the run's object store
    (the message names the bucket, the object, the version and what was expected)."""


class StoredWeights(NamedTuple):
    """One version's object in the bucket: its name, digest and size in bytes."""

    name: str
    digest: str
    size: int


def bucket_name(stream: str) -> str:
    """The object store bucket of the run whose stream is ``stream``."""
    return f"{stream}-weights"


def object_name(version: int, directory: bool) -> str:
    """The object holding ``version``: ``policy-vNNNNN.tar`` for a directory, ``.pt`` for a file."""
    return f"policy-v{version:05d}.{'tar' if directory else 'pt'}"


def digest_of(sha256: Any) -> str:
    """A finished ``hashlib.sha256`` written as the object store writes digests."""
    return DIGEST_PREFIX + base64.urlsafe_b64encode(sha256.digest()).decode()


def version_source(run: "Run", rec: PolicyUpdated, *, hf_policy: bool, worker_id: str) -> Path | None:
    """Where a worker loads ``rec``'s version from, or None to pass it over (pruned since).

    The run folder's checkpoint (an HF policy: the HF directory beside it) when
    this host sees it, unless ``[log] weights = "store"``; else, on JetStream,
    the version fetched from the run's object store into this worker's cache
    (:meth:`WeightStore.fetch`, which blocks while it fetches)."""
    hf_dir = hf_checkpoint_dir(rec.checkpoint)
    local = hf_dir if hf_policy and hf_dir.is_dir() else Path(rec.checkpoint)
    mode = run.config.log.weights
    if mode != "store" and local.exists():
        return local
    store = run.weight_store()
    if store is None:
        return None
    if not isinstance(rec.weights_object, str) or not isinstance(rec.weights_digest, str):
        if mode == "store":
            raise WeightStoreError(f"policy version {rec.policy_version}: its record names no object in bucket {store.bucket!r} "
                                   "(published with [log] weights = 'folder'?); [log] weights = 'store' loads only from the object store")
        return None
    return store.fetch(rec.policy_version, rec.weights_object, rec.weights_digest, run.weights_cache(worker_id))


class DirectoryTar(io.RawIOBase):
    """``directory`` as an uncompressed tar, produced as it is read (nothing
    written to disk): entries sorted by path, mtime 0, owner 0:0 without names,
    modes 0644 / 0755, so the same files always make the same bytes and digest.
    Symbolic links and special files are refused; a file that changes size
    while it is read raises."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._pieces = self._generate()
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._pieces.close()  # closes the file being read, when a put stops part way
        super().close()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = 0
        while n < len(view):
            if not self._pending:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                self._pending = memoryview(piece)
            k = min(len(view) - n, len(self._pending))
            view[n:n + k] = self._pending[:k]
            self._pending = self._pending[k:]
            n += k
        return n

    def _generate(self) -> Generator[bytes, None, None]:
        offset = 0
        for path in sorted(self.directory.rglob("*"), key=lambda p: p.relative_to(self.directory).as_posix()):
            info = tarfile.TarInfo(path.relative_to(self.directory).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise WeightStoreError(f"{path}: not a regular file or directory; a published checkpoint directory holds only those")
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            else:
                info.size, info.mode = path.stat().st_size, 0o644
            header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            offset += len(header)
            yield header
            if info.isdir():
                continue
            with open(path, "rb") as f:
                left = info.size
                while left:
                    block = f.read(min(left, 1 << 20))
                    if not block:
                        raise WeightStoreError(f"{path}: shrank while it was archived (expected {info.size} bytes)")
                    left -= len(block)
                    yield block
                if f.read(1):
                    raise WeightStoreError(f"{path}: grew while it was archived (expected {info.size} bytes)")
            padding = -info.size % tarfile.BLOCKSIZE
            offset += info.size + padding
            yield bytes(padding)
        # The end of the archive as tarfile writes it: two zero blocks, then zeros to a whole record.
        offset += 2 * tarfile.BLOCKSIZE
        yield bytes(2 * tarfile.BLOCKSIZE + (-offset % tarfile.RECORDSIZE))


class _Progress:
    """When a transfer last moved a chunk (monotonic seconds): what the stall timeout watches."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def moved(self) -> None:
        self.at = time.monotonic()


class _ProgressReader(io.RawIOBase):
    """What a put reads (a file or a :class:`DirectoryTar`), each chunk read noted as progress."""

    def __init__(self, inner: Any, progress: _Progress) -> None:
        self.inner, self.progress = inner, progress

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.inner.readinto(buffer)
        self.progress.moved()
        return n

    def close(self) -> None:
        self.inner.close()
        super().close()


class _HashingWriter:
    """The file a fetch writes into, hashing what it writes (our own check,
    independent of nats-py's), each chunk noted as progress. No ``buffer``
    attribute: nats-py writes through ``write``."""

    def __init__(self, f: Any, progress: _Progress) -> None:
        self.f, self.progress, self.sha256, self.size = f, progress, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        self.progress.moved()
        return self.f.write(data)


class WeightStore:
    """One run's bucket of policy weights: :meth:`put` (learner), :meth:`fetch` (workers).

    Synchronous: a :class:`~agentlog.events.log.jetstream_conn.Bridge` thread
    holds the connection, opened on first use; :meth:`close` ends both. A put
    or fetch fails once no chunk has moved for ``timeout_s`` (however long a
    big version takes as a whole); one request waits :data:`REQUEST_TIMEOUT_S`
    and is tried again during a leader election, for up to ``timeout_s``."""

    def __init__(self, servers: str | list[str], stream: str, *, replicas: int = 1, chunk_bytes: int = 128 * 1024,
                 timeout_s: float = 60.0, keep: int = 3) -> None:
        self.servers, self.stream, self.bucket = servers, stream, bucket_name(stream)
        self.replicas, self.chunk_bytes, self.timeout_s, self.keep = replicas, chunk_bytes, timeout_s, keep
        self._bridge: Bridge | None = None
        self._nc: Any = None
        self._obs: Any = None
        #: The version put last and its object (a step that trained nothing republishes it).
        self._last: tuple[int, StoredWeights] | None = None
        #: Cache folders this process cleared of temporaries a killed fetch left.
        self._swept: set[Path] = set()

    @classmethod
    def for_run(cls, run: "Run") -> "WeightStore":
        """The bucket of ``run`` (a run on JetStream), configured by its ``[log]`` table."""
        c = run.config.log
        return cls(c.servers(), run.stream, replicas=c.replicas, chunk_bytes=c.weights_chunk_kib * 1024,
                   timeout_s=c.weights_timeout_s, keep=run.config.keep_checkpoints)

    # -- the learner side -----------------------------------------------------

    def publish(self, record: PolicyUpdated) -> PolicyUpdated:
        """``record`` naming its version's object and digest, put first unless
        this process already put that version (see :meth:`put`)."""
        if self._last is None or self._last[0] != record.policy_version:
            self._last = (record.policy_version, self.put(record.policy_version, Path(record.checkpoint)))
        stored = self._last[1]
        return msgspec.structs.replace(record, weights_object=stored.name, weights_digest=stored.digest)

    def put(self, version: int, checkpoint: Path) -> StoredWeights:
        """Put ``version`` into the bucket (created on first use): the HF directory
        beside ``checkpoint`` when there is one, else the checkpoint file. Nothing is
        deleted here: :meth:`prune` runs once the record naming ``version`` is appended."""
        hf_dir = hf_checkpoint_dir(checkpoint)
        source = hf_dir if hf_dir.is_dir() else Path(checkpoint)
        if not source.exists():
            raise WeightStoreError(f"bucket {self.bucket!r}: policy version {version}: no checkpoint at {source} to put")
        name = object_name(version, source.is_dir())
        stored = self._call(self._put(name, version, source))
        log.info("weights.put", bucket=self.bucket, object=name, policy_version=version, bytes=stored.size, digest=stored.digest)
        return stored

    async def _put(self, name: str, version: int, source: Path) -> StoredWeights:
        from nats.js.api import ObjectMeta, ObjectMetaOptions

        obs = await self._store(create=True)
        if self.chunk_bytes > self._nc.max_payload:
            raise WeightStoreError(f"[log] weights_chunk_kib: {self.chunk_bytes // 1024} KiB chunks exceed the server's max_payload "
                                   f"of {self._nc.max_payload} bytes; expected at most {self._nc.max_payload // 1024}")
        meta = ObjectMeta(name=name, description=f"policy version {version} of run stream {self.stream}",
                          options=ObjectMetaOptions(max_chunk_size=self.chunk_bytes))
        progress = _Progress()
        data = _ProgressReader(DirectoryTar(source) if source.is_dir() else open(source, "rb"), progress)
        try:
            info = await self._watched(obs.put(name, data, meta=meta), progress, f"put {name} (policy version {version})")
        finally:
            data.close()
        return StoredWeights(name, info.digest, info.size)

    def prune(self, newest_version: int) -> None:
        """Delete the object of the version that falls out of the kept window once
        ``newest_version`` is published (newest ``keep`` and every
        :data:`~agentlog.loop.publish.KEEP_EVERY`-th, as the folder keeps). Called only
        after the learner log holds the record naming ``newest_version``: until then the
        newest record names an older version, which a worker and a resumed learner read."""
        old = newest_version - self.keep
        if old >= 0 and old % KEEP_EVERY != 0:
            self._call(self._delete(old))

    async def _delete(self, version: int) -> None:
        from nats.js.errors import ObjectNotFoundError

        obs = await self._store(create=True)
        for stale in (object_name(version, True), object_name(version, False)):
            try:
                await retried(lambda stale=stale: obs.delete(stale), f"delete {stale}", self._where(), self.timeout_s,
                              self._per_try_s, "[log] weights_timeout_s")
            except ObjectNotFoundError:
                continue

    # -- the worker side ------------------------------------------------------

    def fetch(self, version: int, name: str, digest: str, cache_dir: Path) -> Path | None:
        """The cached path of object ``name`` (policy ``version``, whose record says
        ``digest``): a file, or the directory a ``.tar`` holds. Fetched into a
        temporary in ``cache_dir`` unless cached already, checked against both
        digests, then renamed into place; the cache keeps the newest
        :data:`CACHE_KEEP` versions. None when the bucket no longer holds it
        (pruned). A digest or size mismatch raises WeightStoreError and leaves
        nothing in the cache."""
        m = OBJECT_RE.fullmatch(name)
        if m is None or int(m.group(1)) != version:
            raise WeightStoreError(f"bucket {self.bucket!r}: object {name!r} of policy version {version}: expected the name "
                                   f"{object_name(version, False)!r} or {object_name(version, True)!r}")
        if not digest.startswith(DIGEST_PREFIX):
            raise WeightStoreError(f"bucket {self.bucket!r}: object {name!r} of policy version {version}: its policy_updated "
                                   f"record names no digest (expected {DIGEST_PREFIX}<base64url>, found {digest!r}): not loaded")
        directory = m.group(2) == "tar"
        final = Path(cache_dir) / (name.removesuffix(".tar") if directory else name)
        # The digest the cached copy was checked against, written after it: a copy without
        # it, or of another digest (a cache shared by an earlier run of the same stream),
        # is fetched again.
        checked = final.with_name(f".{final.name}.digest")
        if final.exists():
            if checked.is_file() and checked.read_text() == digest:
                return final
            shutil.rmtree(final, ignore_errors=True) if final.is_dir() else final.unlink()
        final.parent.mkdir(parents=True, exist_ok=True)
        self._sweep(final.parent)
        part = final.parent / f".{name}.{os.getpid()}.part"
        try:
            if not self._call(self._get(name, version, digest, part)):
                return None
            if directory:
                write_dir_atomically(final, lambda tmp: _extract(part, tmp), replace=True)
            else:
                with atomic_path(final) as tmp:  # fsynced before the rename: a cached file is whole after a power loss
                    os.rename(part, tmp)
            write_atomic(checked.parent, checked.name, digest.encode())
        finally:
            part.unlink(missing_ok=True)
        _prune_cache(final.parent)
        log.info("weights.fetched", bucket=self.bucket, object=name, policy_version=version, path=str(final))
        return final

    async def _get(self, name: str, version: int, digest: str, into: Path) -> bool:
        from nats.js.errors import DigestMismatchError, ObjectNotFoundError

        obs = await self._store(create=False)
        what = f"object {name!r} (policy version {version})"
        with open(into, "wb") as f:
            progress = _Progress()
            writer = _HashingWriter(f, progress)
            try:
                result = await self._watched(obs.get(name, writeinto=writer), progress, f"fetch {name} (policy version {version})")
            except ObjectNotFoundError:
                return False
            except DigestMismatchError as exc:  # nats-py's own check (a bare exception): said with what was expected
                stored = await obs.get_info(name)
                raise WeightStoreError(
                    f"bucket {self.bucket!r}: {what}: its chunks do not match the digest the object store recorded "
                    f"(expected {stored.digest}, the chunks hash to {digest_of(writer.sha256)}): refused, not loaded") from exc
        got = digest_of(writer.sha256)
        if writer.size != result.info.size or got != digest:
            raise WeightStoreError(
                f"bucket {self.bucket!r}: {what}: fetched {writer.size} bytes with digest {got}; expected "
                f"{result.info.size} bytes with the digest the policy_updated record names, {digest}: refused, not loaded")
        return True

    def _sweep(self, cache_dir: Path) -> None:
        """Remove the temporaries a killed fetch left in this worker's cache (once per process)."""
        if cache_dir in self._swept:
            return
        for stale in cache_dir.glob(".policy-v*"):
            if stale.name.endswith(".digest"):
                continue  # what a cached version was checked against, not a temporary
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        self._swept.add(cache_dir)

    # -- the connection -------------------------------------------------------

    @property
    def _per_try_s(self) -> float:
        """How long one request waits before it is tried again."""
        return min(REQUEST_TIMEOUT_S, self.timeout_s)

    def _where(self) -> str:
        return f"bucket {self.bucket!r} on {self.servers}"

    def _call(self, coro: Any) -> Any:
        """Run ``coro`` on the connection's thread and wait for it. Every wait in
        it is bounded: connecting, each request (:func:`retried`), and a transfer
        by its stall timeout (:meth:`_watched`), not by its size."""
        if self._bridge is None:
            self._bridge = Bridge(f"weights-{self.stream}")
        return self._bridge.call(coro)

    async def _watched(self, coro: Any, progress: _Progress, what: str) -> Any:
        """``await coro`` (a put or a get), cancelled once no chunk has moved for
        ``timeout_s`` (a stalled server or network), however long a big version takes."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                idle = time.monotonic() - progress.at
                if idle >= self.timeout_s:
                    raise WeightStoreError(f"{self._where()}: {what}: no chunk moved for {idle:.1f} s "
                                           f"([log] weights_timeout_s={self.timeout_s:g})")
                done, _ = await asyncio.wait({task}, timeout=self.timeout_s - idle)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _store(self, *, create: bool) -> Any:
        """The bucket's ObjectStore (the learner creates it; a worker finds it)."""
        if self._obs is not None:
            return self._obs
        from nats.js.api import ObjectStoreConfig
        from nats.js.errors import APIError, BucketNotFoundError

        if self._nc is None:
            try:
                self._nc = await asyncio.wait_for(connect(self.servers, CONNECT_TIMEOUT_S), max(self.timeout_s, CONNECT_TIMEOUT_S))
            except Exception as exc:
                raise WeightStoreError(f"{self._where()}: cannot connect: {exc!r}") from exc
        js = self._nc.jetstream(timeout=self._per_try_s)
        try:
            if create:
                config = ObjectStoreConfig(description=f"policy weights of run stream {self.stream}", replicas=self.replicas)
                self._obs = await retried(lambda: js.create_object_store(self.bucket, config=config), "create the bucket",
                                          self._where(), self.timeout_s, self._per_try_s, "[log] weights_timeout_s")
            else:
                self._obs = await retried(lambda: js.object_store(self.bucket), "the bucket's info", self._where(),
                                          self.timeout_s, self._per_try_s, "[log] weights_timeout_s")
        except BucketNotFoundError:
            raise WeightStoreError(f"{self._where()}: no such bucket; expected the learner of stream {self.stream!r} "
                                   "to have put its versions there ([log] weights is not 'folder')") from None
        except APIError as exc:
            raise WeightStoreError(f"{self._where()}: refused: {exc}") from exc
        return self._obs

    def close(self) -> None:
        """Close the connection and its thread (idempotent)."""
        bridge, nc, self._bridge, self._nc, self._obs = self._bridge, self._nc, None, None, None
        if bridge is None:
            return
        try:
            if nc is not None:
                bridge.call(nc.close(), timeout=10)
        finally:
            bridge.stop()


def _extract(tar_path: Path, into: Path) -> None:
    """Unpack a fetched ``.tar`` into the new directory ``into`` (tarfile's
    ``data`` filter: no absolute paths, no ``..``, no links out, no devices)."""
    into.mkdir(parents=True)
    with tarfile.open(tar_path, "r:") as tar:
        tar.extractall(into, filter="data")


def _prune_cache(cache_dir: Path) -> None:
    """Remove all but the newest :data:`CACHE_KEEP` cached versions."""
    cached = []
    for entry in cache_dir.glob("policy-v*"):
        m = re.fullmatch(r"policy-v(\d+)(\.pt)?", entry.name)
        if m:
            cached.append((int(m.group(1)), entry))
    for _, entry in sorted(cached, key=lambda c: c[0])[:-CACHE_KEEP]:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        entry.with_name(f".{entry.name}.digest").unlink(missing_ok=True)
        log.info("weights.cache_pruned", path=str(entry))
