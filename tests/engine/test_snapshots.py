"""The snapshot store: sandbox trees round-trip exactly (modes, symlinks, odd names),
damaged or missing content is refused with the workdir untouched, unchanged files
are neither read nor stored again, and collection removes only what nothing names,
also while other sessions snapshot."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from agentlog.engine import LocalSandbox, Sandbox, SnapshotDamaged, SnapshotError, SnapshotMissing, SnapshotStore
from agentlog.engine.snapshot_files import Manifest, ManifestEntry, blake
from agentlog.engine.snapshots import RACY_WINDOW_NS
from agentlog.events.schema.types import SNAPSHOT_DIGEST_RE

CTL = b".agentlog-cmd"


def listing(root: Path) -> dict[bytes, tuple]:
    """Everything under ``root`` but the control dir: path -> (kind, mode, content) or ("symlink", target)."""
    out: dict[bytes, tuple] = {}
    broot = os.fsencode(root)
    for dirpath, dirnames, filenames in os.walk(broot):
        if dirpath == broot and CTL in dirnames:
            dirnames.remove(CTL)
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, broot)
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                out[rel] = ("symlink", os.readlink(p))
            elif stat.S_ISDIR(s.st_mode):
                out[rel] = ("dir", stat.S_IMODE(s.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", stat.S_IMODE(s.st_mode), f.read())
    return out


def object_path(store: SnapshotStore, digest: str) -> Path:
    return store.root / "objects" / digest[:2] / digest[2:]


def manifest_path(store: SnapshotStore, digest: str) -> Path:
    return store.root / "manifests" / digest[:2] / digest[2:]


def rmtree_any(path: Path) -> None:
    """Remove a test tree, read-only dirs included."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            if not os.path.islink(os.path.join(dirpath, d)):
                os.chmod(os.path.join(dirpath, d), 0o700)
    shutil.rmtree(path)


def every_kind_tree(w: Path) -> None:
    (w / "src" / "pkg" / "deep").mkdir(parents=True)
    (w / "empty_dir").mkdir()
    (w / "empty_file").write_bytes(b"")
    (w / "src" / "pkg" / "deep" / "mod.py").write_bytes(b"print('hi')\n" * 100)
    (w / "run.sh").write_bytes(b"#!/bin/sh\necho run\n")
    os.chmod(w / "run.sh", 0o755)
    (w / "readonly.txt").write_bytes(b"do not touch")
    os.chmod(w / "readonly.txt", 0o444)
    (w / "odd_mode").write_bytes(b"\x00\x01\x02")
    os.chmod(w / "odd_mode", 0o640)
    (w / "big.bin").write_bytes(random.Random(1).randbytes(2_500_000))  # over CHUNK: read in chunks
    os.symlink("src/pkg/deep/mod.py", w / "link_to_file")
    os.symlink("src/pkg", w / "link_to_dir")
    os.symlink("../nowhere/at/all", w / "dangling")
    (w / "locked_dir").mkdir()
    (w / "locked_dir" / "inside").write_bytes(b"in a read-only dir")
    os.chmod(w / "locked_dir", 0o555)
    try:
        with open(os.path.join(os.fsencode(w), b"caf\xe9-latin1"), "wb") as f:
            f.write(b"a name that is not UTF-8")
    except OSError as e:  # a filesystem that enforces UTF-8 names
        if e.errno != errno.EILSEQ:
            raise


def test_a_tree_of_every_kind_round_trips_exactly(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    every_kind_tree(w)
    (w / ".agentlog-cmd").mkdir()
    (w / ".agentlog-cmd" / "marker").write_bytes(b"sandbox's own")
    before = listing(w)
    store = SnapshotStore(tmp_path / "store")
    info = store.snapshot(w, "s1")
    assert SNAPSHOT_DIGEST_RE.fullmatch(info.digest) and store.has(info.digest)
    files = [v for v in before.values() if v[0] == "file"]
    assert info.files == len(files) and info.bytes == sum(len(v[2]) for v in files)
    assert all(e.path != CTL and not e.path.startswith(CTL + b"/") for e in store.manifest(info.digest))

    # The agent messes the workdir up: deletes, rewrites, adds, chmods, replaces a link.
    os.chmod(w / "locked_dir", 0o755)
    shutil.rmtree(w / "src")
    (w / "readonly.txt").unlink()
    (w / "run.sh").write_bytes(b"#!/bin/sh\nrm -rf /\n")
    os.chmod(w / "odd_mode", 0o777)
    (w / "new_file").write_bytes(b"new")
    (w / "new_dir").mkdir()
    os.unlink(w / "dangling")
    os.symlink("elsewhere", w / "dangling")
    (w / "big.bin").write_bytes(b"small now")
    assert listing(w) != before

    restored = store.restore(info.digest, w)
    assert listing(w) == before
    assert (restored.digest, restored.files, restored.bytes) == (info.digest, info.files, info.bytes)
    assert (w / ".agentlog-cmd" / "marker").read_bytes() == b"sandbox's own"  # kept, not snapshotted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "w"]  # no staging or old tree left

    fresh = tmp_path / "elsewhere" / "fresh"  # a new worker's sandbox: the dir does not exist yet
    store.restore(info.digest, fresh)
    assert listing(fresh) == before


def snapshot_and_mess(tmp_path: Path) -> tuple[SnapshotStore, Path, str, dict]:
    w = tmp_path / "w"
    w.mkdir()
    for i in range(5):
        (w / f"f{i}.txt").write_bytes(f"content {i}\n".encode() * 50)
    (w / "sub").mkdir()
    (w / "sub" / "target.txt").write_bytes(b"the file to damage")
    store = SnapshotStore(tmp_path / "store")
    digest = store.snapshot(w, "s1").digest
    (w / "f0.txt").write_bytes(b"changed after the snapshot")
    (w / "added").write_bytes(b"added after the snapshot")
    return store, w, digest, listing(w)


def test_a_damaged_object_is_refused_naming_the_file_and_both_digests_and_the_workdir_is_untouched(tmp_path):
    store, w, digest, before = snapshot_and_mess(tmp_path)
    expected = blake(b"the file to damage").hexdigest()
    obj = object_path(store, expected)
    os.chmod(obj, 0o644)
    data = bytearray(obj.read_bytes())
    data[3] ^= 0x01
    obj.write_bytes(bytes(data))
    with pytest.raises(SnapshotDamaged) as caught:
        store.restore(digest, w)
    err = caught.value
    assert err.path == "sub/target.txt" and err.expected == expected and err.found == blake(bytes(data)).hexdigest()
    assert err.object == str(obj)
    for text in ("sub/target.txt", expected, err.found, str(obj), digest):
        assert text in str(err)
    assert listing(w) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "w"]


def test_a_missing_object_or_manifest_is_named_and_the_workdir_is_untouched(tmp_path):
    store, w, digest, before = snapshot_and_mess(tmp_path)
    obj = object_path(store, blake(b"the file to damage").hexdigest())
    obj.unlink()
    with pytest.raises(SnapshotMissing, match=rf"file 'sub/target.txt'.*{obj}"):
        store.restore(digest, w)
    assert listing(w) == before
    manifest_path(store, digest).unlink()
    assert not store.has(digest)
    with pytest.raises(SnapshotMissing, match=f"snapshot {digest}: its manifest"):
        store.restore(digest, w)
    with pytest.raises(SnapshotError, match="not a snapshot digest"):
        store.restore("../../etc/passwd", w)
    assert listing(w) == before


def test_a_damaged_manifest_is_refused(tmp_path):
    store, w, digest, before = snapshot_and_mess(tmp_path)
    path = manifest_path(store, digest)
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotDamaged, match=f"manifest {path} is damaged.*expected {digest}"):
        store.restore(digest, w)
    assert listing(w) == before


@pytest.mark.parametrize("entries", [
    [ManifestEntry(b"../escaped", "file", 0o644, 1, "0" * 64)],
    [ManifestEntry(b"link", "symlink", 0o777, target=b"/tmp"), ManifestEntry(b"link/x", "file", 0o644, 1, "0" * 64)],
    [ManifestEntry(b"b", "dir", 0o755), ManifestEntry(b"a", "dir", 0o755)],
])
def test_a_manifest_that_would_write_outside_its_tree_is_refused(tmp_path, entries):
    """Its hash matches its address, but it was not made by a snapshot: refused before anything is written."""
    store = SnapshotStore(tmp_path / "store")
    data = msgspec.msgpack.encode(Manifest(1, entries))
    digest = blake(data).hexdigest()
    manifest_path(store, digest).parent.mkdir()
    manifest_path(store, digest).write_bytes(data)
    with pytest.raises(SnapshotDamaged, match="is malformed"):
        store.restore(digest, tmp_path / "w")
    assert not (tmp_path / "w").exists() and not (tmp_path / "escaped").exists()


def test_unchanged_files_are_neither_read_nor_stored_again_and_changes_cost_only_themselves(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    rng = random.Random(7)
    for i in range(20):
        (w / f"f{i:02d}").write_bytes(rng.randbytes(20_000))
    (w / "changing").write_bytes(b"0" * 1000)
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.02)  # older than the racy window: stats are trusted
    tree = 20 * 20_000 + 1000
    store = SnapshotStore(tmp_path / "store", keep_last=100)
    first = store.snapshot(w, "s1")
    assert first.read_bytes == tree and first.new_bytes > tree
    again = store.snapshot(w, "s1")
    assert (again.digest, again.new_bytes, again.read_bytes) == (first.digest, 0, 0)
    manifests = first.new_bytes - tree
    for turn in range(1, 30):
        (w / "changing").write_bytes(str(turn).encode().rjust(1000, b"x"))
        info = store.snapshot(w, "s1")
        assert info.read_bytes <= 2 * 1000  # this turn's file, and the last turn's (racy) again
        assert 1000 <= info.new_bytes <= 1000 + manifests + 100
    assert store.stored_bytes() <= tree + 30 * (1000 + manifests + 100)
    assert len(store.refs()["s1"]) == 30  # keep_last=100: the first, then 29 changes; the unchanged one not twice


def _racy_tree(w: Path, late: bytes, *, fifo: bool) -> None:
    """``w`` holding ``z/late`` (written now, so its stat is inside the racy window) and, with
    ``fifo``, a fifo at the top: the walk reaches the fifo (skipped, with a warning) before it
    goes down into ``z``."""
    (w / "z").mkdir(parents=True)
    if fifo:
        os.mkfifo(w / "pipe")
    (w / "z" / "late").write_bytes(late)


def test_a_file_written_just_before_the_snapshot_is_read_again_next_time(tmp_path):
    # Its stat is too fresh to trust: a write in the same clock tick, after the snapshot read it,
    # could leave size, mtime and ctime as they were.
    store = SnapshotStore(tmp_path / "store")  # first: its own fsyncs are not part of the window
    w = tmp_path / "w"
    _racy_tree(w, b"x" * 5000, fifo=False)
    written = os.stat(w / "z" / "late").st_ctime_ns
    began = time.time_ns()
    store.snapshot(w, "s1")  # reads the one file before its first fsync
    assert began - written < RACY_WINDOW_NS // 2, "the set-up took longer than half the racy window: nothing tested"
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.02)
    assert store.snapshot(w, "s1").read_bytes == 5000  # read again, now a window after its write
    assert store.snapshot(w, "s1").read_bytes == 0  # and trusted from then on


def test_a_file_read_a_racy_window_after_its_write_is_trusted_though_the_snapshot_began_inside_it(tmp_path):
    # What decides is when the snapshot read the file, not when the snapshot began: a write after
    # the read comes a tick after the file's mtime at the least, so the stat shows it. A sandbox's
    # first snapshot, right after its set-up wrote the tree, then needs no second reading of the files
    # it read late. The walk lists the whole top directory before it goes down into z, and the
    # application's log processor holds it up at the fifo (the snapshot logs a skipped fifo), past
    # the window, before it reads z/late.
    store = SnapshotStore(tmp_path / "store")
    w = tmp_path / "w"
    _racy_tree(w, b"x" * 5000, fifo=True)
    written = os.stat(w / "z" / "late").st_ctime_ns

    def slow(logger, method, event_dict):
        if event_dict["event"] == "sandbox.snapshot_skipped":
            time.sleep(RACY_WINDOW_NS / 1e9 + 0.05)
        return event_dict

    with capture_logs(processors=[slow]):
        began = time.time_ns()
        first = store.snapshot(w, "s1")
        second = store.snapshot(w, "s1")
    assert began - written < RACY_WINDOW_NS, "the set-up took longer than the racy window: nothing tested"
    assert first.read_bytes == 5000
    assert second.read_bytes == 0


def test_a_same_size_rewrite_with_its_mtime_put_back_is_still_seen(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    (w / "f").write_bytes(b"aaaa")
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.02)
    store = SnapshotStore(tmp_path / "store")
    first = store.snapshot(w, "s1")
    st0 = os.stat(w / "f")
    (w / "f").write_bytes(b"bbbb")
    os.utime(w / "f", ns=(st0.st_atime_ns, st0.st_mtime_ns))  # ctime still moves
    second = store.snapshot(w, "s1")
    assert second.digest != first.digest and second.read_bytes == 4
    store.restore(first.digest, w)
    assert (w / "f").read_bytes() == b"aaaa"


def test_sockets_and_fifos_are_skipped_with_a_warning(tmp_path):
    w = tmp_path / "w"
    w.mkdir()
    os.mkfifo(w / "pipe")
    (w / "f").write_bytes(b"x")
    with capture_logs() as logs:
        info = SnapshotStore(tmp_path / "store").snapshot(w, "s1")
    assert info.files == 1
    skipped = [e for e in logs if e["event"] == "sandbox.snapshot_skipped"]
    assert skipped and skipped[0]["path"] == "pipe" and skipped[0]["kind"] == "fifo" and skipped[0]["log_level"] == "warning"


# ---------------------------------------------------------------- refs and collection


def make_tree(w: Path, files: dict[str, bytes]) -> None:
    w.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (w / name).write_bytes(data)


def test_collection_removes_finished_sessions_keeps_shared_objects_and_aborted_ones_until_their_ttl(tmp_path):
    store = SnapshotStore(tmp_path / "store", keep_aborted_s=100)
    shared, own = b"shared by every session", {s: f"only {s}".encode() for s in ("done", "aborted", "live")}
    for s in own:
        make_tree(tmp_path / s, {"shared": shared, "own": own[s]})
    snaps = {s: store.snapshot(tmp_path / s, s).digest for s in own}
    make_tree(tmp_path / "aborted", {"own": b"the aborted session's last state"})
    last_aborted = store.snapshot(tmp_path / "aborted", "aborted").digest
    assert store.refs()["aborted"] == [snaps["aborted"], last_aborted]

    assert store.collect().objects == 0  # every snapshot is still named by a ref
    store.session_ended("done", keep=False)
    store.session_ended("aborted", keep=True)
    assert set(store.refs()) == {"live"}
    (digest, expires), = store.kept().values()
    assert digest == last_aborted and expires == pytest.approx(time.time() + 100, abs=5)
    report = store.collect()
    assert (report.objects, report.manifests, report.expired) == (2, 2, 0)  # done's own + aborted's first own
    assert not object_path(store, blake(own["done"]).hexdigest()).exists()
    assert object_path(store, blake(shared).hexdigest()).exists()
    for digest in (snaps["live"], last_aborted):
        store.restore(digest, tmp_path / "check")
    assert not store.has(snaps["done"]) and not store.has(snaps["aborted"])

    report = store.collect(now=expires + 1)
    assert (report.objects, report.manifests, report.expired) == (1, 1, 1)
    assert store.kept() == {} and store.has(snaps["live"]) and object_path(store, blake(shared).hexdigest()).exists()
    store.session_ended("live", keep=False)
    store.collect()
    assert store.stored_bytes() == 0


def test_refs_of_any_valid_session_id_survive_a_new_store_instance(tmp_path):
    ids = ["plain-id_1.x", "..", ".hidden", "with space:and|pipe", "ü" * 128, "a" * 256]
    store = SnapshotStore(tmp_path / "store", keep_aborted_s=0)
    make_tree(tmp_path / "w", {"f": b"x"})
    for sid in ids:
        store.snapshot(tmp_path / "w", sid)
    reopened = SnapshotStore(tmp_path / "store")  # what the next worker sees after a crash
    assert set(reopened.refs()) == set(ids)
    store.session_ended("..", keep=True)  # keep_aborted_s=0: nothing kept
    assert ".." not in reopened.refs() and reopened.kept() == {}


def test_a_resumed_session_keeps_the_snapshot_before_its_last_durable_turn(tmp_path):
    """The ref holds the newest snapshot of each of the last two turns, not the last two
    snapshots: after a resume from turn 1 (whose dead incarnation had snapshotted turn 2 too)
    the new incarnation's snapshot of turn 2 must not push turn 1's out."""
    store = SnapshotStore(tmp_path / "store", keep_aborted_s=0)
    work = tmp_path / "w"
    digests = {}
    for turn in range(3):  # the first incarnation: turns 0, 1 and 2's requests
        make_tree(work, {"f": f"before turn {turn}".encode()})
        digests[turn] = store.snapshot(work, "s", turn_index=turn).digest
    reopened = SnapshotStore(tmp_path / "store")  # killed while turn 2 generated; turn 1 is the last durable one
    assert reopened.refs() == {"s": [digests[1], digests[2]]}
    reopened.restore(digests[1], work)
    make_tree(work, {"f": b"before turn 2, again"})  # the new incarnation re-ran turn 1's commands
    again = reopened.snapshot(work, "s", turn_index=2).digest
    assert reopened.refs() == {"s": [digests[1], again]}
    reopened.collect()
    assert reopened.has(digests[1]) and reopened.has(again) and not reopened.has(digests[2]) and not reopened.has(digests[0])


def test_snapshots_in_threads_never_lose_an_object_to_a_concurrent_collection(tmp_path):
    """Sessions share contents from a small pool and end and start, so objects keep
    turning garbage and live again while collections run back to back."""
    store = SnapshotStore(tmp_path / "store", keep_aborted_s=0)
    pool = [f"content {i}".encode() * 100 for i in range(6)]
    stop = threading.Event()
    failures: list[str] = []
    counts = {"snapshots": 0, "collections": 0, "removed": 0}

    def session_thread(k: int) -> None:
        rng = random.Random(k)
        w = tmp_path / f"w{k}"
        make_tree(w, {f"f{j}": rng.choice(pool) for j in range(3)})
        sid, n = f"s{k}-0", 0
        while not stop.is_set():
            (w / f"f{rng.randrange(3)}").write_bytes(rng.choice(pool))
            info = store.snapshot(w, sid)
            counts["snapshots"] += 1
            for e in store.manifest(info.digest):  # live now: every object must be there
                if e.kind == "file" and not object_path(store, e.digest).exists():
                    failures.append(f"{sid}: {info.digest} lost {e.path!r}")
            n += 1
            if n % 4 == 0:
                store.session_ended(sid, keep=False)
                sid = f"s{k}-{n}"

    def gc_thread() -> None:
        while not stop.is_set():
            counts["removed"] += store.collect().objects
            counts["collections"] += 1

    threads = [threading.Thread(target=session_thread, args=(k,)) for k in range(4)] + [threading.Thread(target=gc_thread)]
    for t in threads:
        t.start()
    time.sleep(0.6)
    stop.set()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    assert counts["snapshots"] > 20 and counts["collections"] > 5 and counts["removed"] > 0, counts
    for digests in store.refs().values():
        for d in digests:
            store.restore(d, tmp_path / "check")


# ---------------------------------------------------------------- random trees

NAMES = st.sampled_from(["a", "b", "c.txt", "d-e", "F", "g_h"])
FILE_MODES = st.sampled_from([0o644, 0o600, 0o755, 0o444, 0o640, 0o4755])
DIR_MODES = st.sampled_from([0o755, 0o700, 0o750, 0o555])
leaf = st.one_of(
    st.tuples(st.just("file"), st.binary(max_size=300), FILE_MODES),
    st.tuples(st.just("link"), st.sampled_from(["a", "../b", "/nonexistent", "c.txt/x", "."])),
)
trees = st.recursive(
    st.dictionaries(NAMES, leaf, max_size=4),
    lambda children: st.dictionaries(NAMES, st.one_of(leaf, st.tuples(st.just("dir"), children, DIR_MODES)), max_size=4),
    max_leaves=12,
)


def build(root: Path, tree: dict) -> None:
    root.mkdir(exist_ok=True)
    for name, node in tree.items():
        p = root / name
        if node[0] == "file":
            p.write_bytes(node[1])
            os.chmod(p, node[2])
        elif node[0] == "link":
            os.symlink(node[1], p)
        else:
            build(p, node[1])
            os.chmod(p, node[2])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees)
def test_random_trees_round_trip_exactly_and_their_digest_is_deterministic(tmp_path, tree):
    store = SnapshotStore(tmp_path / "store")  # one store for every example (tmp_path is shared)
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        build(base / "w1", tree)
        build(base / "w2", tree)  # the same tree built again: other inodes and times
        one = store.snapshot(base / "w1", f"{base.name}-1")
        assert store.snapshot(base / "w2", f"{base.name}-2").digest == one.digest
        store.restore(one.digest, base / "fresh")
        assert listing(base / "fresh") == listing(base / "w1")
    finally:
        rmtree_any(base)


# ---------------------------------------------------------------- the sandbox API


def test_local_sandbox_snapshots_and_restores_through_its_async_api(arun, tmp_path):
    box = LocalSandbox(tmp_path / "w")
    store = SnapshotStore(tmp_path / "store")
    assert box.snapshottable
    res = arun(box.run_command("mkdir -p src && echo one > src/a && chmod 700 src/a && ln -s src/a link", 10))
    assert res.exit_code == 0
    before = listing(box.workdir)
    info = arun(box.snapshot(store, "s1", 0))
    assert arun(box.run_command("rm -rf src && echo two > b", 10)).exit_code == 0
    assert arun(box.restore(store, info.digest)).digest == info.digest
    assert listing(box.workdir) == before
    res = arun(box.run_command("cat link", 10))  # the sandbox still runs commands in its restored workdir
    assert (res.exit_code, res.output_tail) == (0, "one\n")


def test_a_sandbox_that_cannot_snapshot_says_which_one(arun, tmp_path):
    class Remote(Sandbox):
        async def run_command(self, cmd, budget_s):
            raise AssertionError("not run")

    assert not Remote.snapshottable
    store = SnapshotStore(tmp_path / "store")
    with pytest.raises(NotImplementedError, match="Remote cannot snapshot"):
        arun(Remote().snapshot(store, "s1"))
    with pytest.raises(NotImplementedError, match="Remote cannot restore"):
        arun(Remote().restore(store, "0" * 64))


@pytest.mark.skipif(not os.environ.get("AGENTLOG_TEST_REFLINK_DIR"), reason="set AGENTLOG_TEST_REFLINK_DIR to a dir on btrfs or XFS")
def test_on_a_filesystem_with_reflinks_snapshots_and_restores_clone(tmp_path):
    base = Path(tempfile.mkdtemp(dir=os.environ["AGENTLOG_TEST_REFLINK_DIR"]))
    try:
        w = base / "w"
        w.mkdir()
        every_kind_tree(w)
        before = listing(w)
        store = SnapshotStore(base / "store")
        with capture_logs() as logs:
            info = store.snapshot(w, "s1")
            (w / "big.bin").write_bytes(b"in place")
            store.restore(info.digest, w)
        assert listing(w) == before
        assert not [e for e in logs if e["event"] == "snapshots.no_reflink"]
    finally:
        rmtree_any(base)
