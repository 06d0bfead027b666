"""Content-addressed snapshots of sandbox working directories, and their garbage collection.

A worker's :class:`SnapshotStore` holds each of its sessions' sandbox as each
turn's request found it, so a session whose worker was killed resumes from its
last durable turn with its files as they were (``SandboxSnapshotted``,
``SessionResumed``). One store per worker, shared by its sessions::

    objects/ab/cdef...   file contents, named by their BLAKE2b-256 (hex, split after 2 chars)
    manifests/ab/cd...   snapshots (snapshot_files.Manifest), named by their bytes' BLAKE2b-256
    refs/<name>          a live session's id and the newest snapshot of each of its last ``keep_last`` turns
    kept/<name>          an aborted session's id, its last digest and when that expires
    tmp/                 files being written, renamed into place once complete

A ref's file name is the session id when it is a plain name (letters, digits,
``._-``, no leading dot, at most 128 characters), else ``~`` and a hash of it: a
valid id may be ``..`` or longer than a file name may be. The id is in the file.

**Dedup.** Contents are stored once, whoever holds them. Per session the store keeps the
previous snapshot's stat of each file (size, mtime, inode, ctime -> its manifest entry)
and does not read a file whose stat is unchanged. A stat is remembered only if its mtime
and ctime are older, by :data:`RACY_WINDOW_NS`, than the moment the snapshot began to
read that file: timestamps tick with the kernel's coarse clock, so a write in the same
tick as an earlier one could leave the stat unchanged (such a file is read again next
time). A write begun after the read gets a timestamp a tick after an mtime that old at
the least (timestamps finer than the window, from this machine's clock), so the stat
shows it; a tree written just before a sandbox's first snapshot is read twice only where
that snapshot read it within the window. Other files are read once each, hashed while
copied (or reflinked and the clone hashed; see snapshot_files on why never hard links).

**Durability.** :meth:`SnapshotStore.snapshot` returns once the snapshot is
durable: the new objects, the manifest and the session's new ref are written to
``tmp/`` and fsynced (side by side, snapshot_files.SyncBatch), renamed into
place (objects, manifest, then the ref), and every directory that got a new name
is fsynced. The caller appends ``SandboxSnapshotted`` after that, so a crash
before it leaves at worst a ref naming a snapshot no event names, and the ref
still holds the one before it. A failed fsync raises and is never retried.

**Restore** builds the tree in a hidden sibling of the working directory,
checking every object's content against its address (and the manifest's), then
swaps it in with two renames: on any failure the working directory is left as
it was; a crash between the renames leaves it absent (the next restore clears
the leftovers).

**Garbage collection** is mark-and-sweep: live are the manifests a ref or an
unexpired kept ref names, their objects, and whatever a snapshot or restore in
progress pinned. A snapshot pins each object before it looks for it in the
store and unpins after its ref is written; the sweep checks the pins under the
same lock right before each unlink, and pins released while a collection runs
count until it ends.

Not kept: owners, timestamps, extended attributes, hard links between sandbox
files (each path comes back as its own file). Sockets, fifos and devices are
skipped with a warning. One process at a time uses a store; one session's
snapshot and restore calls do not overlap (other sessions' may, from threads).
"""

from __future__ import annotations

import operator
import os
import re
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable

import msgspec

from agentlog._logging import get_logger
from agentlog.events.errors import ConfigError
from agentlog.events.schema.types import SNAPSHOT_DIGEST_RE
from agentlog.events.schema.validation import is_number

from .snapshot_files import (
    CHUNK, MANIFEST_VERSION, Manifest, ManifestEntry, Reflinks, SnapshotDamaged, SnapshotError, SnapshotMissing, SyncBatch,
    blake, check_manifest, copy_hashing, fsync_dir, kind_name, make_store_dirs, new_stage, remove_tree, stored_files, swap_in, walk_tree, write_all,
)

__all__ = ["SnapshotStore", "SnapshotInfo", "GcReport", "ManifestEntry", "SnapshotError", "SnapshotDamaged", "SnapshotMissing"]

_log = get_logger("agentlog.engine.snapshots")
_entry_path = operator.attrgetter("path")  # a manifest's entries are sorted by path
#: A stat is trusted next time only if older than the file's reading by this much (see Dedup).
RACY_WINDOW_NS = 100_000_000
#: Temp files of another store instance older than this are a dead process's leftovers.
STALE_TMP_S = 3600.0
_PLAIN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")

StatKey = tuple[int, int, int, int]  # size, mtime_ns, inode, ctime_ns


class SnapshotInfo(msgspec.Struct, frozen=True):
    """One snapshot (or restore): its digest, its regular files and their bytes, the
    bytes it added to the store, its seconds, and the file bytes it read and hashed."""

    digest: str
    files: int
    bytes: int
    new_bytes: int
    seconds: float
    read_bytes: int = 0


class GcReport(msgspec.Struct, frozen=True):
    """What one :meth:`SnapshotStore.collect` removed: objects, manifests, their bytes, expired kept refs."""

    objects: int
    manifests: int
    bytes: int
    expired: int
    seconds: float


class _Ref(msgspec.Struct):
    session_id: str
    #: Oldest first; ``turns[i]`` is the turn ``digests[i]`` was taken before.
    digests: list[str]
    expires: float = 0.0
    turns: list[int] = []


class _StatCache(msgspec.Struct):
    root: bytes
    files: dict[bytes, tuple[StatKey, ManifestEntry]]  # a file's trusted stat and its entry


class SnapshotStore:
    """Content-addressed snapshots of working directories under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int = 2, keep_aborted_s: float = 86400.0) -> None:
        if type(keep_last) is not int or keep_last < 1:
            raise ConfigError(f"SnapshotStore keep_last: expected an int >= 1, found {keep_last!r}")
        if not is_number(keep_aborted_s, at_least=0):
            raise ConfigError(f"SnapshotStore keep_aborted_s: expected a finite number >= 0, found {keep_aborted_s!r}")
        self.root = Path(root).absolute()
        self.keep_last = keep_last
        self.keep_aborted_s = float(keep_aborted_s)
        self._objects, self._manifests = self.root / "objects", self.root / "manifests"
        self._refs, self._kept, self._tmp = self.root / "refs", self.root / "kept", self.root / "tmp"
        make_store_dirs(self.root, (self._objects, self._manifests, self._refs, self._kept, self._tmp))
        self._dev = os.stat(self._tmp).st_dev
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # names this instance's temp files
        self._lock = threading.Lock()  # the pins, the refs in memory, a collection's extra pins
        self._gc_lock = threading.Lock()  # one collection at a time
        self._pinned: dict[str, int] = {}
        self._gc_extra: set[str] | None = None  # pins released while a collection runs
        self._caches: dict[str, _StatCache] = {}
        self._ref_lists: dict[str, _Ref] = {}
        self._reflinks = Reflinks()
        self._fans: set[Path] = {self._refs}  # directories _publish renames into known to exist (fan-outs made on demand)
        self._log = _log.bind(store=str(self.root))

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.root)!r})"

    # ------------------------------------------------------------ snapshot

    def snapshot(self, workdir: str | os.PathLike[str], session_id: str, *, turn_index: int | None = None) -> SnapshotInfo:
        """Store ``workdir`` (but its control dir) as session ``session_id``'s newest
        snapshot: durable when this returns, and named by the session's ref.
        ``turn_index``: the turn it precedes; the ref keeps the newest snapshot of each of the
        session's last ``keep_last`` turns (None: the next turn after the ref's newest)."""
        t0 = time.perf_counter()
        root = os.fsencode(Path(workdir).absolute())
        cache = self._caches.pop(session_id, None)
        old = cache.files if cache is not None and cache.root == root else {}
        fresh: dict[bytes, tuple[StatKey, ManifestEntry]] = {}
        entries: list[ManifestEntry] = []
        pins: list[str] = []
        temps: list[Path] = []
        syncs = SyncBatch()
        # (temp file, its place), fsynced then renamed in this order: objects by digest, the manifest, the ref.
        new: dict[str, tuple[Path, Path]] = {}
        hits: list[str] = []
        files = total = new_bytes = read_bytes = 0
        try:
            for rel, path, st in walk_tree(root):
                kind = stat.S_IFMT(st.st_mode)
                if kind == stat.S_IFREG:
                    key = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
                    known = old.get(rel)
                    if known is not None and known[0] == key:
                        # Unchanged, its stat trusted already: its entry as last time (a chmod moves the ctime).
                        entry = known[1]
                        hits.append(entry.digest)
                        fresh[entry.path] = known  # keyed by the entry's own path: one copy of each name
                    else:
                        read_ns = time.time_ns()
                        digest, size, added, key, mode = self._store_file(path, rel, pins, temps, syncs, new)
                        new_bytes += added
                        read_bytes += size
                        entry = ManifestEntry(rel, "file", mode, size, digest)
                        if max(key[1], key[3]) < read_ns - RACY_WINDOW_NS:
                            fresh[rel] = (key, entry)
                    entries.append(entry)
                    files, total = files + 1, total + entry.size
                elif kind == stat.S_IFDIR:
                    entries.append(ManifestEntry(rel, "dir", st.st_mode & 0o7777))
                elif kind == stat.S_IFLNK:
                    entries.append(ManifestEntry(rel, "symlink", st.st_mode & 0o7777, target=os.readlink(path)))
                else:
                    self._log.warning("sandbox.snapshot_skipped", session=session_id, turn_index=turn_index, path=os.fsdecode(rel),
                                      kind=kind_name(st.st_mode))
            # Live through the session's previous snapshot (its ref); pinned in case that ref goes.
            self._pin(hits, pins)
            entries.sort(key=_entry_path)
            data = msgspec.msgpack.encode(Manifest(MANIFEST_VERSION, entries))
            digest = blake(data).hexdigest()
            self._pin([digest], pins)
            final = self._manifest_path(digest)
            if not final.exists():
                new["m" + digest] = (self._queue_temp(data, temps, syncs), final)
                new_bytes += len(data)
            ref = self._next_ref(session_id, digest, turn_index)
            if ref is not None:
                new["ref"] = (self._queue_temp(msgspec.msgpack.encode(ref), temps, syncs), self._refs / _ref_name(session_id))
            syncs.wait()  # the contents are durable: objects, manifest, the new ref
            dirs: set[Path] = set()
            for tmp, final in new.values():
                self._publish(tmp, final, temps, dirs)
            names = SyncBatch()
            for d in dirs:
                names.add_dir(d)
            names.wait()  # and their names
            if ref is not None:
                with self._lock:
                    self._ref_lists[session_id] = ref
        finally:
            syncs.drain()  # every descriptor closed before the temp files go
            self._unpin(pins)
            for tmp in temps:
                tmp.unlink(missing_ok=True)
        self._caches[session_id] = _StatCache(root, fresh)
        info = SnapshotInfo(digest, files, total, new_bytes, time.perf_counter() - t0, read_bytes)
        self._log.debug("sandbox.snapshotted", session=session_id, turn_index=turn_index, digest=digest, files=files, bytes=total,
                        new_bytes=new_bytes, read_bytes=read_bytes, seconds=round(info.seconds, 4))
        return info

    def _store_file(self, path: bytes, rel: bytes, pins: list[str], temps: list[Path], syncs: SyncBatch,
                    new: dict[str, tuple[Path, Path]]) -> tuple[str, int, int, StatKey, int]:
        """Hash one regular file and, if the store lacks its content, write it to a temp
        file queued in ``syncs`` and ``new``: (digest, size, bytes added, stat key, mode)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise SnapshotError(f"snapshot store {self.root}: cannot read sandbox file {os.fsdecode(rel)!r}: {e}") from e
        tfd, tmp = -1, None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotError(f"snapshot store {self.root}: sandbox file {os.fsdecode(rel)!r} stopped being a regular "
                                    f"file during the snapshot (now a {kind_name(st.st_mode)}); is a process still running there?")
            key = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
            h, head = blake(), b""
            devices = (st.st_dev, self._dev)
            if self._reflinks.may(devices):
                tfd, tmp = self._temp(temps)
            if tfd >= 0 and self._reflinks.clone(tfd, fd, devices):
                size = copy_hashing(tfd, None, h, from_start=True)  # hash the clone: nothing else writes it
            else:
                head = os.read(fd, CHUNK)
                h.update(head)
                size = len(head)
                if len(head) == CHUNK:  # a big file: spilled to the temp file as it is read
                    if tfd < 0:
                        tfd, tmp = self._temp(temps)
                    write_all(tfd, head)
                    head = b""
                    size += copy_hashing(fd, tfd, h)
            digest = h.hexdigest()
            self._pin([digest], pins)  # before the look: a collection keeps it from now on
            final = self._object_path(digest)
            if digest in new or final.exists():
                return digest, size, 0, key, st.st_mode & 0o7777
            if tfd < 0:
                tfd, tmp = self._temp(temps)
            assert tmp is not None
            write_all(tfd, head)
            syncs.add_file(tfd, tmp)
            tfd = -1
            new[digest], tmp = (tmp, final), None
            return digest, size, size, key, st.st_mode & 0o7777
        finally:
            os.close(fd)
            if tfd >= 0:
                os.close(tfd)
            if tmp is not None:  # not queued: the store holds the content already, or a failure
                temps.remove(tmp)
                tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------ restore

    def restore(self, digest: str, workdir: str | os.PathLike[str], *, cancel: threading.Event | None = None) -> SnapshotInfo:
        """Make ``workdir`` exactly snapshot ``digest`` (its control dir kept), every
        content checked against its address; on failure ``workdir`` is left as it was.
        ``cancel``: once set, the restore stops before its next entry (SnapshotError)."""
        t0 = time.perf_counter()
        workdir = Path(os.path.realpath(workdir))  # a link to the workdir stays a link
        entries = self.manifest(digest)
        pins: list[str] = []
        self._pin([digest] + [e.digest for e in entries if e.kind == "file"], pins)
        try:
            stage = new_stage(workdir)
            try:
                files, total = self._fill(os.fsencode(stage), entries, digest, (self._dev, os.stat(stage).st_dev), cancel)
                swap_in(stage, workdir)
            except BaseException:
                if os.path.lexists(stage):
                    remove_tree(stage)
                raise
        finally:
            self._unpin(pins)
        info = SnapshotInfo(digest, files, total, 0, time.perf_counter() - t0, total)
        self._log.debug("sandbox.restored", digest=digest, workdir=str(workdir), files=files, bytes=total, seconds=round(info.seconds, 4))
        return info

    def _fill(self, stage: bytes, entries: list[ManifestEntry], digest: str, devices: tuple[int, int],
              cancel: threading.Event | None) -> tuple[int, int]:
        dir_modes: list[tuple[bytes, int]] = []
        files = total = 0
        for i, e in enumerate(entries):
            if cancel is not None and cancel.is_set():
                raise SnapshotError(f"snapshot store {self.root}: restore of snapshot {digest} stopped (cancelled) after "
                                    f"{i} of {len(entries)} entries; the workdir was left as it was")
            dst = stage + b"/" + e.path
            if e.kind == "dir":
                os.mkdir(dst, 0o700)  # its own mode at the end: a read-only dir is filled first
                dir_modes.append((dst, e.mode))
            elif e.kind == "symlink":
                os.symlink(e.target, dst)
            else:
                self._restore_file(e, dst, digest, devices)
                files, total = files + 1, total + e.size
        for dst, mode in reversed(dir_modes):
            os.chmod(dst, mode)
        return files, total

    def _restore_file(self, e: ManifestEntry, dst: bytes, digest: str, devices: tuple[int, int]) -> None:
        obj = self._object_path(e.digest)
        try:
            src = os.open(obj, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SnapshotMissing(f"snapshot store {self.root}: snapshot {digest}, file {os.fsdecode(e.path)!r}: "
                                  f"its object {obj} is missing (expected content with BLAKE2b-256 {e.digest})") from None
        h = blake()
        try:
            out = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if self._reflinks.clone(out, src, devices):
                    copy_hashing(src, None, h)  # the clone shares the object's blocks: check those
                else:
                    copy_hashing(src, out, h)
                os.fchmod(out, e.mode)
            finally:
                os.close(out)
        finally:
            os.close(src)
        found = h.hexdigest()
        if found != e.digest:
            raise SnapshotDamaged(
                f"snapshot store {self.root}: snapshot {digest}, file {os.fsdecode(e.path)!r}: object {obj} is damaged: "
                f"its content has BLAKE2b-256 {found}, expected {e.digest} (its address); the workdir was left as it was",
                path=os.fsdecode(e.path), object=str(obj), expected=e.digest, found=found)

    # ------------------------------------------------------------ reading

    def has(self, digest: str) -> bool:
        """Whether snapshot ``digest``'s manifest is in the store (its objects are not checked)."""
        return isinstance(digest, str) and SNAPSHOT_DIGEST_RE.fullmatch(digest) is not None and self._manifest_path(digest).exists()

    def manifest(self, digest: str) -> list[ManifestEntry]:
        """Snapshot ``digest``'s entries, sorted by path; its bytes checked against the digest."""
        if not isinstance(digest, str) or SNAPSHOT_DIGEST_RE.fullmatch(digest) is None:
            raise SnapshotError(f"snapshot store {self.root}: {digest!r} is not a snapshot digest (expected 64 lowercase hex digits)")
        path = self._manifest_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotMissing(f"snapshot store {self.root}: snapshot {digest}: its manifest {path} is missing") from None
        found = blake(data).hexdigest()
        if found != digest:
            raise SnapshotDamaged(f"snapshot store {self.root}: snapshot {digest}: manifest {path} is damaged: its content has "
                                  f"BLAKE2b-256 {found}, expected {digest} (its address)", object=str(path), expected=digest, found=found)
        try:
            m = msgspec.msgpack.decode(data, type=Manifest)
            check_manifest(m)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
            raise SnapshotDamaged(f"snapshot store {self.root}: snapshot {digest}: manifest {path} is malformed: {e}",
                                  object=str(path), expected="a version-1 manifest", found=str(e)) from e
        return m.entries

    def refs(self) -> dict[str, list[str]]:
        """Live sessions and their last snapshot digests, oldest first."""
        return {r.session_id: r.digests for r in self._read_refs(self._refs).values()}

    def kept(self) -> dict[str, tuple[str, float]]:
        """Aborted sessions kept for debugging: their last digest and its expiry (epoch seconds)."""
        return {r.session_id: (r.digests[-1], r.expires) for r in self._read_refs(self._kept).values() if r.digests}

    def stored_bytes(self) -> int:
        """Bytes of the objects and manifests on disk."""
        return sum(p.stat().st_size for _, p in stored_files(self._objects)) + sum(p.stat().st_size for _, p in stored_files(self._manifests))

    # ------------------------------------------------------------ refs and collection

    def session_ended(self, session_id: str, *, keep: bool) -> None:
        """Session ``session_id`` ended: its ref goes, or with ``keep`` (aborted) its
        last snapshot stays in ``kept/`` for ``keep_aborted_s`` seconds."""
        self._caches.pop(session_id, None)
        with self._lock:
            cached = self._ref_lists.pop(session_id, None)
        name = _ref_name(session_id)
        ref = cached if cached is not None else self._read_ref(self._refs / name)
        digests = ref.digests if ref is not None else []
        if keep and self.keep_aborted_s > 0 and digests:
            # Kept written before the ref goes: a collection always sees one of them.
            self._write_ref(self._kept / name, _Ref(session_id, digests[-1:], time.time() + self.keep_aborted_s))
        (self._refs / name).unlink(missing_ok=True)
        fsync_dir(self._refs)

    def collect(self, now: float | None = None) -> GcReport:
        """Remove every manifest and object no ref, unexpired kept ref or pin names."""
        t0 = time.perf_counter()
        now = time.time() if now is None else now
        with self._gc_lock:
            with self._lock:
                self._gc_extra = set()
            try:
                live_manifests: set[str] = set()
                for r in self._read_refs(self._refs).values():  # refs before kept: see session_ended
                    live_manifests.update(r.digests)
                expired = 0
                for path, r in self._read_refs(self._kept).items():
                    if r.expires <= now:
                        path.unlink(missing_ok=True)
                        expired += 1
                    else:
                        live_manifests.update(r.digests)
                live = set(live_manifests)
                for d in live_manifests:
                    live.update(self._manifest_objects(d))
                objects, freed = self._sweep(self._objects, live)
                manifests, freed_m = self._sweep(self._manifests, live)
                self._sweep_tmp()
            finally:
                with self._lock:
                    self._gc_extra = None
        report = GcReport(objects, manifests, freed + freed_m, expired, time.perf_counter() - t0)
        self._log.debug("snapshots.collected", objects=objects, manifests=manifests, bytes=report.bytes, expired=expired, seconds=round(report.seconds, 4))
        return report

    def _manifest_objects(self, digest: str) -> Iterable[str]:
        try:
            data = self._manifest_path(digest).read_bytes()
            return [e.digest for e in msgspec.msgpack.decode(data, type=Manifest).entries if e.kind == "file"]
        except FileNotFoundError:
            self._log.warning("snapshots.ref_dangling", digest=digest, why="a ref names a manifest that is not in the store")
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            self._log.warning("snapshots.manifest_unreadable", digest=digest, error=str(e), why="its objects are not kept alive by it")
        return []

    def _sweep(self, base: Path, live: set[str]) -> tuple[int, int]:
        removed = freed = 0
        for digest, path in stored_files(base):
            if digest in live:
                continue
            with self._lock:
                if digest in self._pinned or (self._gc_extra is not None and digest in self._gc_extra):
                    continue
                try:
                    size = path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue
            removed, freed = removed + 1, freed + size
        return removed, freed

    def _sweep_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for p in self._tmp.iterdir():
            if not p.name.startswith(self._token + "-") and p.lstat().st_mtime < cutoff:
                if stat.S_ISDIR(p.lstat().st_mode):  # the store writes files only: not its leftover
                    self._log.warning("snapshots.tmp_not_ours", path=str(p), why="a directory in the store's tmp/; left in place")
                    continue
                p.unlink(missing_ok=True)

    def _next_ref(self, session_id: str, digest: str, turn_index: int | None) -> _Ref | None:
        """The session's ref once ``digest`` is its snapshot before turn ``turn_index``; None if
        ``digest`` is its newest already. The ref keeps the newest snapshot of each of the
        session's last ``keep_last`` turns (a resume needs the one before the last durable
        turn; a resumed session snapshots a turn again, which replaces that turn's)."""
        with self._lock:
            old = self._ref_lists.get(session_id)
        if old is None:
            old = self._read_ref(self._refs / _ref_name(session_id))
        by_turn = dict(zip(old.turns, old.digests)) if old is not None else {}
        newest = max(by_turn, default=-1)
        if by_turn.get(newest) == digest and turn_index in (None, newest):
            return None  # the newest already
        turn = turn_index if turn_index is not None else newest + 1
        by_turn[turn] = digest
        # Turns past this one were another incarnation's: this snapshot supersedes them.
        kept = sorted(t for t in by_turn if t <= turn)[-self.keep_last:]
        return _Ref(session_id, [by_turn[t] for t in kept], turns=kept)

    def _queue_temp(self, data: bytes, temps: list[Path], syncs: SyncBatch) -> Path:
        """A temp file holding ``data``, its fsync queued in ``syncs``."""
        fd, tmp = self._temp(temps)
        try:
            write_all(fd, data)
        except BaseException:
            os.close(fd)
            raise
        syncs.add_file(fd, tmp)
        return tmp

    def _write_ref(self, path: Path, ref: _Ref) -> None:
        temps: list[Path] = []
        syncs = SyncBatch()
        try:
            tmp = self._queue_temp(msgspec.msgpack.encode(ref), temps, syncs)
            syncs.wait()
            os.rename(tmp, path)
        finally:
            syncs.drain()
            for tmp in temps:
                tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)

    def _read_ref(self, path: Path) -> _Ref | None:
        try:
            return msgspec.msgpack.decode(path.read_bytes(), type=_Ref)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as e:
            # A directory, an unreadable or undecodable file. Never guess: a collection that skipped it
            # could remove a live snapshot.
            raise SnapshotError(f"snapshot store {self.root}: ref file {path} cannot be read ({e}); expected a msgpack ref") from e

    def _read_refs(self, base: Path) -> dict[Path, _Ref]:
        out = {}
        for p in sorted(base.iterdir()):
            r = self._read_ref(p)
            if r is not None:
                out[p] = r
        return out

    # ------------------------------------------------------------ plumbing

    def _object_path(self, digest: str) -> Path:
        return self._objects / digest[:2] / digest[2:]

    def _manifest_path(self, digest: str) -> Path:
        return self._manifests / digest[:2] / digest[2:]

    def _temp(self, temps: list[Path]) -> tuple[int, Path]:
        path = self._tmp / f"{self._token}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o444)
        temps.append(path)
        return fd, path

    def _publish(self, tmp: Path, final: Path, temps: list[Path], dirs: set[Path]) -> None:
        if final.parent not in self._fans:
            try:
                os.mkdir(final.parent)
                dirs.add(final.parent.parent)
            except FileExistsError:
                pass  # made before this instance looked (collections never remove one)
            self._fans.add(final.parent)
        os.rename(tmp, final)
        temps.remove(tmp)
        dirs.add(final.parent)

    def _pin(self, digests: Iterable[str], pins: list[str]) -> None:
        with self._lock:
            for d in digests:
                self._pinned[d] = self._pinned.get(d, 0) + 1
                pins.append(d)

    def _unpin(self, pins: list[str]) -> None:
        with self._lock:
            for d in pins:
                n = self._pinned[d] - 1
                if n:
                    self._pinned[d] = n
                else:
                    del self._pinned[d]
            if self._gc_extra is not None:
                self._gc_extra.update(pins)


def _ref_name(session_id: str) -> str:
    """The file name of a session's ref (see the module docstring)."""
    if _PLAIN_ID.fullmatch(session_id):
        return session_id
    return "~" + blake(session_id.encode("utf-8", "surrogatepass")).hexdigest()
