"""Policy weights through the JetStream object store (loop/weight_store.py).

One local JetStream server serves the module (``nats_server``). A learner
side publishes real checkpoints (the built-in GPT's learner checkpoint, and
the tiny HF model's directory) through ``publish`` with the run's
``weight_store()``; a worker side whose run folder view does not hold those
checkpoints loads each version from the object store: byte-identical, cached,
the cache pruned to the newest two. A chunk rewritten in the bucket's stream
is refused by its digest and leaves nothing in the cache; an object replaced
since its record is refused by the record's digest. The end-to-end run trains
through every version with a worker that loads only from the object store.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import shutil
import signal
import tarfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from agentlog.engine.tasks import select_task
from agentlog.events.schema.types import PolicyUpdated
from agentlog.learner.learner import Learner
from agentlog.loop.config import ConfigError, FaultConfig, LogConfig, LoopConfig
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.policy import build_model
from agentlog.loop.publish import PolicyFollower, checkpoint_path, hf_checkpoint_dir, publish
from agentlog.loop.run import start_process
from nats_helpers import pause
from agentlog.loop.run_folder import Run
from agentlog.loop.weight_store import DirectoryTar, WeightStore, WeightStoreError, bucket_name, version_source
from agentlog.loop.worker import RolloutWorker

from hf_helpers import tiny_hf_dir  # noqa: F401 - the session fixture
from loop_helpers import kill_live, small_config, wait_for


def _config(url: str, stream: str, **log) -> LoopConfig:
    return LoopConfig(task="lookup", warmup_steps=0, faults=FaultConfig.none(),
                      log=LogConfig(backend="nats", url=url, stream=stream, **log))


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _hosts(tmp_path: Path, cfg: LoopConfig) -> tuple[Path, Path]:
    """Two views of one run: the learner's folder and a worker's, with the same config (one stream)."""
    learner_dir, worker_dir = tmp_path / "learner-host" / "run", tmp_path / "worker-host" / "run"
    for d in (learner_dir, worker_dir):
        d.mkdir(parents=True)
        Run.save_config(d, cfg)
    return learner_dir, worker_dir


def _published(run: Run, count: int) -> list[PolicyUpdated]:
    """The first ``count`` records of ``run``'s learner log, read through a worker's follower."""
    follower = PolicyFollower(run.learner_tail())
    wait_for(f"{count} published versions", lambda: follower.poll() or len(follower.history) >= count, 10)
    return follower.history


@pytest.mark.required
def test_a_worker_without_the_run_folders_checkpoints_loads_each_version_from_the_object_store(
        tmp_path: Path, nats_server, tiny_hf_dir: Path) -> None:  # noqa: F811 - the fixture
    """Versions 0 and 1 (the built-in GPT's learner checkpoints) and 2 (an HF
    directory) are published; the learner's checkpoints folder is then gone
    from the worker's view. The worker loads 0, then 1, from the object store
    into its cache (its model then holds the learner's weights); version 2's
    directory arrives byte-identical; cached versions are reused and only the
    newest two stay. The records carry each object's name and digest."""
    cfg = _config(nats_server.url, "ws-roundtrip")
    learner_dir, worker_dir = _hosts(tmp_path, cfg)
    reference = tmp_path / "reference"  # what the learner wrote, kept aside to compare with
    model = build_model(cfg, select_task(cfg.task))
    learner = Learner(model, cfg.learner_config())
    states: dict[int, dict[str, torch.Tensor]] = {}
    with Run.open(learner_dir) as run:
        llog = run.open_learner()
        try:
            def publish_version(v: int, hf: bool = False) -> None:
                with torch.no_grad():
                    next(model.parameters()).add_(0.5 + v)  # each version differs
                states[v] = {k: t.clone() for k, t in model.state_dict().items()}
                path = learner.save_checkpoint(checkpoint_path(run.checkpoints, v))
                if hf:
                    shutil.copytree(tiny_hf_dir, hf_checkpoint_dir(path))
                publish(llog, PolicyUpdated(step=v, policy_version=v, checkpoint=str(path)), run.weight_store())

            publish_version(0)
            worker = RolloutWorker(worker_dir, cfg)
            try:
                shutil.move(run.checkpoints, reference)  # the worker's host does not see the learner's checkpoints
                wait_for("version 0 loaded", lambda: worker.maybe_reload() or worker.loaded_version == 0, 10)
                cache = worker.run_folder.weights_cache(worker.worker_id)
                assert cache == worker_dir / "weights-cache" / "ws-roundtrip" / "w0"
                assert (cache / "policy-v00000.pt").read_bytes() == (reference / "policy-v00000.pt").read_bytes()
                run.checkpoints.mkdir()
                publish_version(1)
                shutil.move(checkpoint_path(run.checkpoints, 1), reference)
                wait_for("version 1 loaded", lambda: worker.maybe_reload() or worker.loaded_version == 1, 10)
                assert (cache / "policy-v00001.pt").read_bytes() == (reference / "policy-v00001.pt").read_bytes()
                for name, tensor in worker.model.state_dict().items():
                    assert torch.equal(tensor, states[1][name]), name
                publish_version(2, hf=True)
                shutil.move(hf_checkpoint_dir(checkpoint_path(run.checkpoints, 2)), reference)
                shutil.move(checkpoint_path(run.checkpoints, 2), reference)
                records = _published(worker.run_folder, 3)
                source = version_source(worker.run_folder, records[2], hf_policy=True, worker_id=worker.worker_id)
                assert source == cache / "policy-v00002" and source.is_dir()
                assert _tree(source) == _tree(tiny_hf_dir)
                # Cached: asked again, the same files, not fetched anew.
                inode = (source / "config.json").stat().st_ino
                assert version_source(worker.run_folder, records[2], hf_policy=True, worker_id=worker.worker_id) == source
                assert (source / "config.json").stat().st_ino == inode
                assert sorted(p.name for p in cache.iterdir()) == [".policy-v00001.pt.digest", ".policy-v00002.digest",
                                                                   "policy-v00001.pt", "policy-v00002"]
            finally:
                worker.run_folder.close()
        finally:
            llog.close()
    with Run.open(learner_dir) as run:
        records = read_learner_records(run.learner)
    assert [r.weights_object for r in records] == ["policy-v00000.pt", "policy-v00001.pt", "policy-v00002.tar"]
    expected = hashlib.sha256((reference / "policy-v00001.pt").read_bytes()).digest()
    import base64

    assert records[1].weights_digest == "SHA-256=" + base64.urlsafe_b64encode(expected).decode()


def _rewrite_chunk(url: str, bucket: str, name: str, index: int) -> int:
    """Flip one byte of chunk ``index`` of object ``name``: its chunks are read,
    the chunk subject purged and every chunk published again in order, one
    changed (JetStream cannot edit a message in place). Returns the chunk count."""
    import nats

    async def rewrite() -> int:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            obs = await js.object_store(bucket)
            info = await obs.get_info(name)
            stream, subject = f"OBJ_{bucket}", f"$O.{bucket}.C.{info.nuid}"
            chunks, seq = [], 1
            while True:
                try:
                    msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
                except nats.js.errors.NotFoundError:
                    break
                chunks.append(bytearray(msg.data))
                seq = msg.seq + 1
            chunks[index][len(chunks[index]) // 2] ^= 0xFF
            await js.purge_stream(stream, subject=subject)
            for chunk in chunks:
                await js.publish(subject, bytes(chunk))
            # What nats-py's own get does with it: its digest check raises DigestMismatchError.
            with pytest.raises(nats.js.errors.DigestMismatchError):
                await obs.get(name)
            return len(chunks)
        finally:
            await nc.close()

    return asyncio.run(rewrite())


def test_a_corrupted_chunk_is_refused_by_its_digest_and_leaves_nothing_in_the_cache(tmp_path: Path, nats_server) -> None:
    """With 1 KiB chunks, one byte of one chunk of version 1 is changed in the
    bucket's stream: the worker's fetch raises WeightStoreError naming the
    bucket, the object and the version, its cache holds nothing (no temporary
    either), and the worker never loads it. An object replaced by other
    (self-consistent) bytes since its record is refused by the record's digest."""
    cfg = _config(nats_server.url, "ws-corrupt", weights="store", weights_chunk_kib=1)
    learner_dir, worker_dir = _hosts(tmp_path, cfg)
    model = build_model(cfg, select_task(cfg.task))
    learner = Learner(model, cfg.learner_config())
    with Run.open(learner_dir) as run:
        llog = run.open_learner()
        try:
            for v in (0, 1):
                path = learner.save_checkpoint(checkpoint_path(run.checkpoints, v))
                publish(llog, PolicyUpdated(step=v, policy_version=v, checkpoint=str(path)), run.weight_store())
        finally:
            llog.close()
    assert _rewrite_chunk(nats_server.url, bucket_name("ws-corrupt"), "policy-v00001.pt", 3) > 4
    with Run.open(worker_dir) as worker_run:
        records = _published(worker_run, 2)
        cache = worker_run.weights_cache("w0")
        with pytest.raises(WeightStoreError) as info:
            version_source(worker_run, records[1], hf_policy=False, worker_id="w0")
        text = str(info.value)
        assert "'ws-corrupt-weights'" in text and "'policy-v00001.pt'" in text and "policy version 1" in text, text
        assert "do not match the digest" in text and "not loaded" in text, text
        import nats.js.errors

        assert isinstance(info.value.__cause__, nats.js.errors.DigestMismatchError)  # nats-py's check refused it first
        assert list(cache.iterdir()) == [], "a refused fetch must leave nothing in the cache"
    worker = RolloutWorker(worker_dir, cfg)
    try:
        wait_for("both records", lambda: worker.follower.poll() or len(worker.follower.history) >= 2, 10)
        with pytest.raises(WeightStoreError, match="policy version 1"):
            worker.maybe_reload()
        assert worker.loaded_version == -1 and list(cache.iterdir()) == []
    finally:
        worker.run_folder.close()
    # Replaced by another valid object since the record: the store's own check passes, the record's digest refuses it.
    with Run.open(learner_dir) as run:
        store = run.weight_store()
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        store.put(1, learner.save_checkpoint(tmp_path / "other" / "policy-v00001.pt"))
        with pytest.raises(WeightStoreError) as info:
            store.fetch(1, "policy-v00001.pt", records[1].weights_digest, tmp_path / "other-cache")
        assert f"the policy_updated record names, {records[1].weights_digest}" in str(info.value), str(info.value)
        assert list((tmp_path / "other-cache").iterdir()) == []
        # A cached copy checked against another digest (a cache shared with an earlier run of the stream) is fetched again.
        shared = tmp_path / "shared-cache"
        first = store.fetch(0, "policy-v00000.pt", records[0].weights_digest, shared)
        right = first.read_bytes()
        first.write_bytes(b"an earlier run's weights")
        first.with_name(f".{first.name}.digest").write_text("SHA-256=an-earlier-runs-digest")
        assert store.fetch(0, "policy-v00000.pt", records[0].weights_digest, shared).read_bytes() == right
        assert store.fetch(0, "policy-v00000.pt", records[0].weights_digest, shared).read_bytes() == right  # reused
        with pytest.raises(WeightStoreError, match="names no digest"):
            store.fetch(0, "policy-v00000.pt", "", tmp_path / "no-digest")


def test_pruned_versions_stalled_fetches_and_oversized_chunks(tmp_path: Path, nats_server) -> None:
    """Objects leave the bucket by the folder's rule (keep_checkpoints newest, and every 50th):
    a worker passes a pruned version over (None) as it does a pruned file.
    Chunks larger than the server's max_payload are refused by name. A fetch
    from a server that stopped answering fails after ``weights_timeout_s``
    without a chunk, leaving nothing in the cache."""
    cfg = _config(nats_server.url, "ws-prune", weights="store")
    cfg.keep_checkpoints = 2
    learner_dir, worker_dir = _hosts(tmp_path, cfg)
    model = build_model(cfg, select_task(cfg.task))
    learner = Learner(model, cfg.learner_config())
    with Run.open(learner_dir) as run:
        llog = run.open_learner()
        try:
            for v in range(4):
                path = learner.save_checkpoint(checkpoint_path(run.checkpoints, v))
                publish(llog, PolicyUpdated(step=v, policy_version=v, checkpoint=str(path)), run.weight_store())
        finally:
            llog.close()
        big = _config(nats_server.url, "ws-prune", weights_chunk_kib=4096)
        with Run.open(tmp_path / "big", big) as big_run:
            with pytest.raises(WeightStoreError, match=r"weights_chunk_kib: 4096 KiB chunks exceed the server's max_payload"):
                big_run.weight_store().put(9, checkpoint_path(run.checkpoints, 2))
    with Run.open(worker_dir) as worker_run:
        records = _published(worker_run, 4)
        assert version_source(worker_run, records[1], hf_policy=False, worker_id="w0") is None  # pruned
        for v in (0, 2, 3):  # 0: every 50th version is kept, as in the folder
            assert version_source(worker_run, records[v], hf_policy=False, worker_id="w0").is_file()
    # A server that stops answering mid-fetch: refused after weights_timeout_s without a chunk, nothing cached.
    store = WeightStore(nats_server.url, "ws-prune", timeout_s=1.0)
    try:
        assert store.fetch(0, "policy-v00000.pt", records[0].weights_digest, tmp_path / "warm").is_file()  # connected
        pause(nats_server.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(WeightStoreError, match=r"fetch policy-v00003.pt \(policy version 3\): no chunk moved for 1\.\d s"):
                store.fetch(3, "policy-v00003.pt", records[3].weights_digest, tmp_path / "stalled")
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(nats_server.pid, signal.SIGCONT)
        assert list((tmp_path / "stalled").iterdir()) == []
    finally:
        store.close()


def test_an_append_that_fails_leaves_the_object_the_newest_record_names(tmp_path: Path, nats_server) -> None:
    """With keep_checkpoints = 1, putting version 2 used to delete version 1's object before the
    record naming version 2 was appended: when that append failed, the learner log's newest
    record named an object no longer in the bucket. The bucket is pruned only after the append."""
    cfg = _config(nats_server.url, "ws-prune-late", weights="store")
    cfg.keep_checkpoints = 1
    learner_dir, worker_dir = _hosts(tmp_path, cfg)
    learner = Learner(build_model(cfg, select_task(cfg.task)), cfg.learner_config())
    with Run.open(learner_dir) as run:
        llog = run.open_learner()
        for v in (0, 1):
            path = learner.save_checkpoint(checkpoint_path(run.checkpoints, v))
            publish(llog, PolicyUpdated(step=v, policy_version=v, checkpoint=str(path)), run.weight_store())
        llog.close()  # the next append fails, as one whose fsync failed does
        path = learner.save_checkpoint(checkpoint_path(run.checkpoints, 2))
        with pytest.raises(Exception, match="closed"):
            publish(llog, PolicyUpdated(step=2, policy_version=2, checkpoint=str(path)), run.weight_store())
    with Run.open(worker_dir) as worker_run:
        records = _published(worker_run, 2)
        assert records[-1].policy_version == 1
        source = version_source(worker_run, records[-1], hf_policy=False, worker_id="w0")
        assert source is not None and source.is_file(), "the newest record's object was deleted by a publish that failed"


def test_weights_settings_are_checked_by_name() -> None:
    """Bad ``[log] weights*`` values are refused by name, with what was expected."""
    cases = {
        "weights = \"s3\"": "[log] weights: expected one of ('auto', 'store', 'folder')",
        "weights = \"store\"": "[log] weights: 'store' needs backend 'nats'",
        "backend = \"nats\"\nurl = \"nats://h:4222\"\nweights_chunk_kib = 0": "[log] weights_chunk_kib: expected an int in 1..65536",
        "backend = \"nats\"\nurl = \"nats://h:4222\"\nweights_timeout_s = 0": "[log] weights_timeout_s: expected a number of seconds > 0",
    }
    import tomllib

    for body, expected in cases.items():
        with pytest.raises(ConfigError) as info:
            LoopConfig.from_dict({"log": tomllib.loads(body)})
        assert expected in str(info.value), (body, str(info.value))


_names = st.text(alphabet="abcxyz_-.0123456789", min_size=1, max_size=12).filter(lambda n: n not in (".", ".."))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(st.lists(_names, min_size=1, max_size=3).map("/".join), st.binary(max_size=3000), max_size=6),
       chunk=st.integers(1, 4096))
def test_a_directory_archive_is_deterministic_and_unpacks_to_the_same_files(tmp_path_factory, files, chunk) -> None:
    """For any small tree, read in any chunk size: two archives of it are the
    same bytes, tarfile reads it back to the same files, and its length is
    whole tar records."""
    root = tmp_path_factory.mktemp("tree")
    written: dict[str, bytes] = {}
    for rel, data in files.items():
        path = root / rel
        if any(parent.is_file() for parent in path.parents) or path.is_dir():
            continue  # a name that is both a file and a folder
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written[rel] = data

    def archive() -> bytes:
        out, stream, buf = bytearray(), DirectoryTar(root), bytearray(chunk)
        while n := stream.readinto(buf):
            out += buf[:n]
        return bytes(out)

    first = archive()
    assert archive() == first and len(first) % tarfile.RECORDSIZE == 0
    into = tmp_path_factory.mktemp("out")
    with tarfile.open(fileobj=io.BytesIO(first), mode="r:") as tar:
        tar.extractall(into, filter="data")
    assert _tree(into) == written


@pytest.mark.required
def test_a_loop_on_jetstream_trains_through_every_version_with_a_worker_loading_only_from_the_object_store(
        tmp_path: Path, nats_server) -> None:
    """The learner and one worker as processes, each given its own run folder
    (one stream): the worker never reads the learner's checkpoints folder
    (``[log] weights = "store"``) and loads every version it loads from its
    cache, fetched from the object store; the run reaches its final version."""
    cfg = small_config(steps=2, groups_per_step=4, group_size=4, max_lag=0, faults=FaultConfig.none(),
                       log=LogConfig(backend="nats", url=nats_server.url, stream="ws-loop", weights="store"))
    learner_dir, worker_dir = _hosts(tmp_path, cfg)
    learner = start_process("trainer", learner_dir)
    worker = start_process("worker", worker_dir)
    try:
        wait_for("the learner's final version", lambda: learner.poll() is not None, 120, [worker])
        assert learner.returncode == 0, (learner_dir / "logs" / "trainer.stderr").read_text()[-3000:]
        assert worker.wait(timeout=60) == 0, (worker_dir / "logs" / "worker.stderr").read_text()[-3000:]
    finally:
        kill_live(learner, worker)
    with Run.open(learner_dir) as run:
        records = read_learner_records(run.learner)
    assert records[-1].policy_version == cfg.steps and all(r.weights_object for r in records)
    assert all(r.groups for r in records if r.step > 0), "every step trained on the worker's groups"
    loads = [json.loads(line) for line in (worker_dir / "logs" / "worker-w0.jsonl").read_text().splitlines()
             if '"worker.weights_loaded"' in line]
    # max_lag 0: batch b is played with version b, which the worker could only have from the object store.
    assert sorted(e["policy_version"] for e in loads) == list(range(cfg.steps)), loads
    cache = worker_dir / "weights-cache" / "ws-loop" / "w0"
    assert all(Path(e["source"]).parent == cache for e in loads), [e["source"] for e in loads]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [f"policy-v{v:05d}.pt" for v in range(cfg.steps)]
    assert not (worker_dir / "checkpoints").exists()
