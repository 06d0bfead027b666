"""One reader type for every log: open_source gives a LogSource for a log
directory, a partition root, a run folder, a JetStream subject and a
JetStream stream, each reading the same records as the backend's own
readers; and nothing above events/log/ asks which backend it holds."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, open_source, read_frame_batches, read_log
from agentlog.events.log.partitions import partition_dir, read_partitions
from agentlog.events.log.source import LogSource, SourceError, StreamMissing, follow_sources
from agentlog.events.schema.types import SessionOpened
from event_samples import small_event

REPO = Path(__file__).resolve().parents[2]


def opened() -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1)


def write_dir(path: Path, sessions: list[str], per: int = 3) -> list:
    """Append ``per`` events for each of ``sessions`` to the file log at ``path``; its envelopes."""
    with FileLog.open(path, fsync="never") as lg:
        out = lg.append_batch([(s, 0, opened()) for s in sessions])
        for k in range(1, per):
            out += lg.append_batch([(s, k, small_event(k)) for s in sessions])
        return out


# ---------------------------------------------------------------- files


def test_a_log_directory_reads_as_read_log_does(tmp_path):
    envs = write_dir(tmp_path / "log", ["a", "b"])
    with open_source(tmp_path / "log") as src:
        assert isinstance(src, LogSource) and not src.partitioned and str(src) == str(tmp_path / "log")
        assert list(src.read()) == list(read_log(tmp_path / "log")) == envs
        assert list(src.read(3)) == envs[3:]
        assert [r.decode() for r in src.read(raw=True)] == envs
        assert [[f.lsn for f in b] for b in src.read(batches=True)] == [[f.lsn for f in b] for b in read_frame_batches(tmp_path / "log")]
        assert list(src.read_tagged()) == [(None, e) for e in envs]
        assert src.exists() and src.next_lsn() == len(envs) and src.byte_size() > 0
        assert src.partitions() == [] and src.repairable
        assert src.verify().status == "ok"
        tail = src.tail(2)
        assert tail.poll() == envs[2:] and tail.poll() == []


def test_a_partition_root_and_its_run_folder_read_merged_as_read_partitions_does(tmp_path):
    root = tmp_path / "run" / "rollout"
    write_dir(partition_dir(root, 0), ["a"])
    write_dir(partition_dir(root, 3), ["b", "c"])
    (tmp_path / "run" / "config.json").write_text("{}")
    for where in (root, tmp_path / "run"):  # a run folder stands for its rollout/
        with open_source(where) as src:
            assert src.partitioned and src.repairable and str(src) == str(root)
            assert src.partitions() == [0, 3]
            assert list(src.read_tagged()) == list(read_partitions(root))
            assert list(src.read()) == [env for _, env in read_partitions(root)]
            assert list(src.partition(3).read()) == list(read_log(partition_dir(root, 3)))
            assert src.sibling("learner").location == str(tmp_path / "run" / "learner")
            for read_from_lsn in (src.read, src.read_tagged):
                with pytest.raises(ValueError, match="one LSN sequence per partition"):
                    read_from_lsn(4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.integers(0, 20), st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True), min_size=1, max_size=4))
def test_any_partition_root_reads_the_same_records_through_open_source(tmp_path_factory, layout):
    root = tmp_path_factory.mktemp("parts")
    written = {pid: write_dir(partition_dir(root, pid), sessions, per=2) for pid, sessions in layout.items()}
    with open_source(root) as src:
        tagged = list(src.read_tagged())
        assert tagged == list(read_partitions(root))
        assert sorted((pid, env.lsn) for pid, env in tagged) == sorted((pid, e.lsn) for pid, envs in written.items() for e in envs)
        for pid, envs in written.items():
            assert list(src.partition(pid).read()) == envs


def test_following_sources_gives_each_log_in_order_and_picks_up_a_new_one(tmp_path):
    first = write_dir(tmp_path / "p0", ["a"])
    (tmp_path / "p1").mkdir()  # a partition whose writer has not started yet
    sources = {0: open_source(tmp_path / "p0"), 1: open_source(tmp_path / "p1", allow_empty=True)}

    async def main():
        got: dict[int, list] = {0: [], 1: []}
        later: list = []
        agen = follow_sources(sources, {0: 1}, poll_s=0.01)
        try:
            async for pid, env in agen:
                got[pid].append(env)
                if pid == 0 and env.lsn == first[-1].lsn and not later:
                    later.extend(write_dir(tmp_path / "p1", ["z"]))
                if later and got[1] == later:
                    break
        finally:
            await agen.aclose()
        return got, later

    got, later = asyncio.run(asyncio.wait_for(main(), 30))
    assert got == {0: first[1:], 1: later}


def test_a_writer_opened_through_a_source_is_read_back(tmp_path):
    (tmp_path / "new").mkdir()
    src = open_source(tmp_path / "new", allow_empty=True)
    assert not src.exists() and src.next_lsn() == 0
    with src.open_writer(fsync="never", fence=True) as lg:
        envs = lg.append_batch([("s", 0, opened())])
    assert src.exists() and list(src.read()) == envs


def test_bad_locations_are_named_with_what_was_expected(tmp_path):
    with pytest.raises(SourceError, match="no such log directory"):
        open_source(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(SourceError, match="is a file, expected a log directory"):
        open_source(tmp_path / "f")
    write_dir(tmp_path / "outer" / "runs" / "x", ["a"])
    with pytest.raises(SourceError, match=re.escape(f"did you mean {tmp_path / 'outer' / 'runs' / 'x'}?")):
        open_source(tmp_path / "outer")
    with pytest.raises(SourceError, match="expected nats://"):
        open_source("nats://nohost/stream/p/q")


def test_raw_is_a_declared_parameter_of_every_log_read(tmp_path):
    """EventLog.read takes ``raw`` (no caller probes for it): a MemoryLog gives
    the same undecoded records a FileLog stores for the same appends."""
    from agentlog.events import MemoryLog
    from agentlog.events.schema.types import SessionFinished

    batch = [("a", 0, opened()), ("a", 1, small_event(1)), ("a", 2, SessionFinished(reward=1.0))]
    clock = itertools.count(1000).__next__
    with FileLog.open(tmp_path / "log", fsync="never", clock=clock) as fl:
        fl.append_batch(batch)
        on_disk = [(r.lsn, r.session_id, r.session_seq, r.terminal, bytes(r.payload)) for r in fl.read(0, raw=True)]
    mem = MemoryLog(clock=itertools.count(1000).__next__)
    mem.append_batch(batch)
    in_memory = [(r.lsn, r.session_id, r.session_seq, r.terminal, bytes(r.payload)) for r in mem.read(0, raw=True)]
    assert in_memory == on_disk and on_disk[-1][3] is True
    assert [r.decode() for r in mem.read(1, raw=True)] == list(mem.read(1))


# ---------------------------------------------------------------- JetStream

_names = itertools.count()


def write_nats(url, stream, partition, sessions, per=3):
    from agentlog.events.log.jetstream import JetStreamLog

    with JetStreamLog.open(url, stream, partition) as lg:
        out = lg.append_batch([(s, 0, opened()) for s in sessions])
        for k in range(1, per):
            out += lg.append_batch([(s, k, small_event(k)) for s in sessions])
        return out


def test_a_stream_and_its_subjects_read_as_the_jetstream_readers_do(nats_server):
    pytest.importorskip("nats")
    from agentlog.events.log.jetstream_read import JetStreamRun

    stream = f"src{next(_names)}"
    a = write_nats(nats_server.url, stream, 0, ["a", "b"])
    b = write_nats(nats_server.url, stream, 2, ["c"])
    learner = write_nats(nats_server.url, stream, "learner", ["L"], per=1)
    url = f"{nats_server.url}/{stream}"
    with JetStreamRun.open(nats_server.url, stream) as run, open_source(url) as src:
        assert src.partitioned and not src.repairable and str(src) == url and src.partitions() == [0, 2]
        merged = list(src.read_tagged())
        assert sorted((pid, env.lsn) for pid, env in merged) == sorted([(0, e.lsn) for e in a] + [(2, e.lsn) for e in b])
        assert [env.ts_ns for _, env in merged] == sorted(env.ts_ns for _, env in merged)
        assert list(src.partition(0).read()) == list(run.log(0).read()) == a
        assert list(src.sibling("learner").read()) == learner
        assert src.byte_size() > 0 and src.exists()
    with open_source(f"{url}/p0002") as one:
        assert not one.partitioned and list(one.read()) == b and list(one.read(1)) == b[1:]
        assert [r.decode() for r in one.read(raw=True)] == b
        assert [r.lsn for batch in one.read(batches=True) for r in batch] == [e.lsn for e in b]
        assert one.next_lsn() == len(b) and one.exists()
        assert one.verify().summary().startswith(f"{url}/p0002: ok, {len(b)} records")
        tail = one.tail(1)
        try:
            got: list = []
            deadline = time.monotonic() + 10
            while len(got) < len(b) - 1 and time.monotonic() < deadline:  # the consumer delivers as messages arrive
                got += tail.poll()
                time.sleep(0.01)
            assert got == b[1:]
        finally:
            tail.close()


def test_a_missing_stream_a_missing_log_and_no_server_are_named(nats_server):
    pytest.importorskip("nats")
    stream = f"src{next(_names)}"
    with pytest.raises(StreamMissing, match="no such stream"):
        open_source(f"{nats_server.url}/{stream}")
    write_nats(nats_server.url, stream, 0, ["a"])
    with pytest.raises(SourceError, match=rf"holds no log 'p0009' \(no message on subject {stream}.p0009\); it holds p0000"):
        open_source(f"{nats_server.url}/{stream}/p0009")
    with open_source(f"{nats_server.url}/{stream}/p0009", allow_empty=True) as later:
        assert not later.exists() and later.next_lsn() == 0
    with pytest.raises(SourceError, match="cannot connect to a NATS server"):
        open_source("nats://127.0.0.1:1/whatever")


# ---------------------------------------------------------------- the factory is the only place

#: How code asked which backend a log was on before LogSource: the probes no library code outside events/log/ may use.
BACKEND_PROBES = re.compile(
    r'hasattr\([^)]*"(cursor|partitions)"\)|isinstance\([^)]*RemoteLog|\bRemoteLog\b|JetStreamRef|JetStreamRun|\b_remote\('
)
LIBRARY_LAYERS = ("engine", "events", "gateway", "learner", "loop", "reducers", "tools")


def test_no_library_code_outside_events_log_asks_which_backend_it_holds():
    """open_source chooses the backend once; every other module holds a
    LogSource. A probe of the old kind anywhere else is named by file:line."""
    found = []
    for layer in LIBRARY_LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel.parts[:2] == ("events", "log"):
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if BACKEND_PROBES.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "backend probes outside events/log/ (open a LogSource with open_source instead):\n" + "\n".join(found)
