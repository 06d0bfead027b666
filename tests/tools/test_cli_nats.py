"""The reading commands on ``nats://`` URLs, and ``agentlog export`` / ``import``.

One JetStream run per module, written by ``JetStreamLog`` (its own clock):
partition 0 holds the engine-written run of ``cli_helpers.write_run``,
partition 1 a few dozen random sessions, and a ``learner`` subject
PolicyUpdated records. It is exported to a run folder once; then each of
``replay``, ``reconstruct``, ``stats``, ``tail`` and ``verify`` must say the
same on the stream as on the exported folder (naming the URL where it names
the folder), and an import of the folder must give back the stream's digests.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_helpers import ROOT, read_lines_until, write_many_sessions, write_run
from nats_helpers import raw

pytest.importorskip("nats", reason="the nats:// URLs need the nats extra: pip install 'agentlog[nats]'")

from agentlog.events import read_log  # noqa: E402
from agentlog.events.log.jetstream import JetStreamLog  # noqa: E402
from agentlog.events.schema.types import (  # noqa: E402
    PolicyUpdated, SessionAborted, SessionFinished, SessionOpened, SessionStarted, TurnRecorded,
)
from agentlog.tools.cli import main  # noqa: E402

STREAM = "clirun"


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``agentlog ARGS`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _copy_to_jetstream(source: Path, url: str, stream: str, partition, batch: int = 1) -> int:
    """Append the records of the log directory ``source`` to a JetStreamLog
    (its own clock stamps them, as a live writer's would); returns how many."""
    envs = list(read_log(source))
    log = JetStreamLog.open(url, stream, partition)
    try:
        for i in range(0, len(envs), batch):
            log.append_batch([(e.session_id, e.session_seq, e.body) for e in envs[i : i + batch]])
    finally:
        log.close()
    return len(envs)


def _write_learner(url: str, stream: str, steps: int) -> None:
    log = JetStreamLog.open(url, stream, "learner")
    try:
        for k in range(steps):
            log.append_batch([("learner", k, PolicyUpdated(step=k, policy_version=k + 1, metrics={"loss": 1.0 / (k + 1)},
                                                           groups=["g-ok"] if k == 0 else []))])
    finally:
        log.close()


@pytest.fixture(scope="module")
def js_run(nats_server, tmp_path_factory):
    """(stream URL, exported run folder, events per partition): the module's JetStream run, exported once."""
    base = tmp_path_factory.mktemp("natscli")
    write_run_dir, many_dir = base / "engine.log", base / "many.log"
    asyncio.run(write_run(write_run_dir))
    write_many_sessions(many_dir, 30, seed=7)
    counts = {0: _copy_to_jetstream(write_run_dir, nats_server.url, STREAM, 0),
              1: _copy_to_jetstream(many_dir, nats_server.url, STREAM, 1, batch=16)}
    _write_learner(nats_server.url, STREAM, 3)
    url = f"{nats_server.url}/{STREAM}"
    exported = base / "exported"
    code = main(["export", url, str(exported)])
    assert code == 0
    return url, exported, counts


def _digest_lines(out: str) -> dict[str, str]:
    """``{log: records sha256}`` from ``verify --digest`` output."""
    found = {}
    for line in out.splitlines():
        head, sep, rest = line.partition(": records sha256:")
        if sep:
            found[head] = "sha256:" + rest
        elif line.startswith("records sha256:"):
            found[""] = line.split()[1]
    return found


@pytest.mark.required
def test_export_writes_a_run_folder_with_equal_digests(js_run, capsys):
    url, exported, counts = js_run
    assert sorted(p.name for p in (exported / "rollout").iterdir()) == ["p0000", "p0001"]
    assert (exported / "learner").is_dir()
    code, on_stream, err = cli(capsys, "verify", "--digest", url)
    assert code == 0, err
    code, on_dir, err = cli(capsys, "verify", "--digest", str(exported))
    assert code == 0, err
    stream_digests, dir_digests = _digest_lines(on_stream), _digest_lines(on_dir)
    assert set(stream_digests) == {"p0000", "p0001"} and stream_digests == dir_digests
    for pid, n in counts.items():
        assert f"p{pid:04d}: {url}/p{pid:04d}: ok, {n} records (lsn 0..{n - 1}) on JetStream subject {STREAM}.p{pid:04d}" in on_stream
        assert f"p{pid:04d}: {exported}/rollout/p{pid:04d}: ok, {n} records (lsn 0..{n - 1}) in 1 segments" in on_dir
    # The learner subject too, and the frames themselves: same LSN, session, seq, timestamp and payload bytes.
    code, a, _ = cli(capsys, "verify", "--digest", f"{url}/learner")
    code2, b, _ = cli(capsys, "verify", "--digest", str(exported / "learner"))
    assert code == code2 == 0 and _digest_lines(a) == _digest_lines(b) and len(_digest_lines(a)) == 1
    from agentlog.events.log.jetstream_read import JetStreamRun

    with JetStreamRun.open_url(url) as run:
        for name, directory in (("p0000", exported / "rollout/p0000"), ("learner", exported / "learner")):
            theirs = [(r.lsn, r.session_id, r.session_seq, r.ts_ns, r.terminal, bytes(r.payload)) for r in run.log(name).read(raw=True)]
            mine = [(r.lsn, r.session_id, r.session_seq, r.ts_ns, r.terminal, bytes(r.payload)) for r in read_log(directory, raw=True)]
            assert theirs == mine and theirs


@pytest.mark.required
def test_replay_stats_reconstruct_agree_on_the_stream_and_its_export(js_run, capsys, tmp_path):
    url, exported, counts = js_run
    code, a, err = cli(capsys, "replay", url)
    assert code == 0, err
    code, b, err = cli(capsys, "replay", str(exported))
    assert code == 0, err
    assert a == b and len(a.splitlines()) == sum(counts.values())
    assert a.splitlines()[0].split()[0] in ("p0000:0", "p0001:0")
    code, a, _ = cli(capsys, "replay", "--json", "--status", "aborted", url)
    code2, b, _ = cli(capsys, "replay", "--json", "--status", "aborted", str(exported))
    assert code == code2 == 0 and a == b and a

    code, a, err = cli(capsys, "stats", "--json", url)
    assert code == 0, err
    code, b, err = cli(capsys, "stats", "--json", str(exported))
    assert code == 0, err
    sa, sb = json.loads(a), json.loads(b)
    assert sa.pop("log") == url and sb.pop("log") == str(exported / "rollout")
    assert sa == sb
    assert {k: v["events"] for k, v in sa["partitions"].items()} == {f"p{pid:04d}": n for pid, n in counts.items()}
    code, text, _ = cli(capsys, "stats", url)
    assert code == 0 and text.splitlines()[0] == f"log        {url}"

    code, a, err = cli(capsys, "reconstruct", url, "-o", str(tmp_path / "a.msgpack"))
    assert code == 0, err
    code, b, err = cli(capsys, "reconstruct", str(exported), "-o", str(tmp_path / "b.msgpack"))
    assert code == 0, err
    digest = a.splitlines()[-1]
    assert digest.startswith("digest sha256:") and digest == b.splitlines()[-1]
    assert (tmp_path / "a.msgpack").read_bytes() == (tmp_path / "b.msgpack").read_bytes()
    assert (tmp_path / "a.msgpack").stat().st_size > 0  # real samples, not two empty streams


def test_one_log_url_reads_that_partition(js_run, capsys):
    url, exported, counts = js_run
    for args in (("replay",), ("stats", "--json"), ("verify", "--digest"), ("replay", "--from", "5", "--until", "9")):
        code, a, err = cli(capsys, *args, f"{url}/p0001")
        assert code == 0, (args, err)
        code, b, err = cli(capsys, *args, str(exported / "rollout/p0001"))
        assert code == 0, (args, err)
        if args[0] == "stats":
            a, b = json.loads(a), json.loads(b)
            assert a.pop("log") == f"{url}/p0001" and b.pop("log") == str(exported / "rollout/p0001")
        elif args[0] == "verify":
            a, b = _digest_lines(a), _digest_lines(b)
        assert a == b and a


def _start_tail(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentlog.tools.cli", "tail", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.required
def test_tail_on_the_stream_prints_what_tail_on_the_export_prints(js_run):
    url, exported, counts = js_run
    n = sum(counts.values())
    on_stream = read_lines_until(_start_tail(url), lambda ls: len(ls) >= n)
    on_dir = read_lines_until(_start_tail(str(exported)), lambda ls: len(ls) >= n)
    assert len(on_stream) == len(on_dir) == n
    # Lines of the partitions interleave in arrival order; each partition's own lines are the same, in the same order.
    for pid in counts:
        mine = [line for line in on_stream if line.split()[0].startswith(f"p{pid:04d}:")]
        theirs = [line for line in on_dir if line.split()[0].startswith(f"p{pid:04d}:")]
        assert mine == theirs and len(mine) == counts[pid]


def test_tail_summary_of_one_log_url_counts_its_records(js_run):
    """``tail --summary nats://.../stream/p0001`` folds that one subject (as ``tail --summary DIR/rollout/p0001`` does)."""
    url, exported, counts = js_run
    done = lambda ls: any(f"lsn {counts[1] - 1}:" in x for x in ls)  # noqa: E731
    proc = _start_tail("--summary", f"{url}/p0001")
    on_stream = read_lines_until(proc, done)
    assert done(on_stream), (on_stream, proc.stderr.read())
    on_dir = read_lines_until(_start_tail("--summary", str(exported / "rollout/p0001")), done)
    assert on_stream[-1].split("\r")[-1] == on_dir[-1].split("\r")[-1]


@pytest.mark.required
def test_tail_follows_new_records_and_new_partitions_on_the_stream(nats_server):
    """tail started before the stream exists waits for it, then follows new records and a partition that starts later."""
    stream = "tailrun"
    tail = _start_tail(f"{nats_server.url}/{stream}")
    time.sleep(1.0)
    assert tail.poll() is None, tail.stderr.read()  # waiting for the stream, not refusing it
    first = JetStreamLog.open(nats_server.url, stream, 0)
    try:
        first.append_batch([("s0", 0, SessionOpened(group_id="g0", group_size=1, sample_index=0))])
        time.sleep(1.0)
        first.append_batch([("s0", 1, SessionStarted(harness="t")), ("s0", 2, SessionFinished(reward=1.0))])
        second = JetStreamLog.open(nats_server.url, stream, 3)  # a worker that starts after tail did
        second.append_batch([("s3", 0, SessionOpened(group_id="g3", group_size=1, sample_index=0)), ("s3", 1, SessionStarted())])
        second.close()
    finally:
        first.close()
    lines = read_lines_until(tail, lambda ls: len(ls) >= 5)
    assert tail.returncode in (0, 130), tail.stderr.read()
    assert sorted(line.split()[0] for line in lines) == ["p0000:0", "p0000:1", "p0000:2", "p0003:0", "p0003:1"]
    assert any("running -> finished" in line and "p0000:2" in line for line in lines)
    summary = read_lines_until(_start_tail("--summary", f"{nats_server.url}/{stream}"), lambda ls: any("finished 1" in x for x in ls))
    assert any("lsn p0000:2 p0003:1: open 0 running 1 finished 1" in line for line in summary), summary


@pytest.mark.required
def test_import_of_the_export_gives_back_the_stream(js_run, nats_server, capsys, tmp_path):
    url, exported, _ = js_run
    back = f"{nats_server.url}/reimported"
    code, out, err = cli(capsys, "import", str(exported), back)
    assert code == 0, err
    assert "imported 3 log(s)" in out and "every log EQUAL" in out
    for args in (("verify", "--digest"),):
        code, a, _ = cli(capsys, *args, url)
        code2, b, _ = cli(capsys, *args, back)
        assert code == code2 == 0 and _digest_lines(a) == _digest_lines(b)
    code, a, _ = cli(capsys, "verify", "--digest", f"{url}/learner")
    code2, b, _ = cli(capsys, "verify", "--digest", f"{back}/learner")
    assert code == code2 == 0 and _digest_lines(a) == _digest_lines(b)
    code, a, _ = cli(capsys, "reconstruct", back, "-o", str(tmp_path / "a.jsonl"))
    code2, b, _ = cli(capsys, "reconstruct", str(exported), "-o", str(tmp_path / "b.jsonl"))
    assert code == code2 == 0 and a.splitlines()[-1] == b.splitlines()[-1]
    # A second import into the now non-empty stream is refused; --resume finds it complete and adds nothing.
    code, _, err = cli(capsys, "import", str(exported), back)
    assert code == 2 and "already holds logs (learner, p0000, p0001)" in err and "--resume" in err
    code, out, err = cli(capsys, "import", "--resume", str(exported), back)
    assert code == 0 and "every log EQUAL" in out, err


def test_import_resume_continues_a_partial_import_and_refuses_another_run(nats_server, capsys, tmp_path):
    src = tmp_path / "one.log"
    write_many_sessions(src, 6, seed=3)
    n = sum(1 for _ in read_log(src))
    # A partial import: the first half of the records, as a cut-off import leaves them.
    from agentlog.tools.log_transfer import ReplayClock, copy_records

    clock = ReplayClock()
    part = JetStreamLog.open(nats_server.url, "partial", 0, clock=clock)
    copy_records(iter(list(read_log(src, raw=True))[: n // 2]), part, clock, where="test", per_record_ts=True)
    part.close()
    code, out, err = cli(capsys, "import", "--resume", str(src), f"{nats_server.url}/partial")
    assert code == 0 and f"p0000: {n} records" in out and "EQUAL" in out, err
    code, a, _ = cli(capsys, "verify", "--digest", str(src))
    code2, b, _ = cli(capsys, "verify", "--digest", f"{nats_server.url}/partial/p0000")
    assert code == code2 == 0 and _digest_lines(a) == _digest_lines(b)
    other = tmp_path / "other.log"
    write_many_sessions(other, 6, seed=4)
    code, _, err = cli(capsys, "import", "--resume", str(other), f"{nats_server.url}/partial")
    assert code == 1 and "lsn 0 on the subject differs from the source's" in err
    # A stream holding a log the directory does not (another run's partition) is refused before anything is copied.
    extra = JetStreamLog.open(nats_server.url, "partial", 5)
    extra.close()
    code, _, err = cli(capsys, "import", "--resume", str(src), f"{nats_server.url}/partial")
    assert code == 2 and "holds logs" in err and "p0005" in err and "--resume continues an import of this directory only" in err, err


# ---------------------------------------------------------------- round trip, random event sets


def _sessions(draw_sessions):
    """The events of each drawn session: opened, started, turns, then finished or aborted (or still running)."""
    out = []
    for k, (pid, turns, end) in enumerate(draw_sessions):
        sid = f"h{k}"
        bodies = [SessionOpened(group_id=f"g{k}", group_size=1, sample_index=0), SessionStarted(harness="hyp")]
        for t in range(turns):
            bodies.append(TurnRecorded(turn_index=t, prompt_ids=[1, 2, 3 + t], output_ids=[7, 8 + t],
                                       output_log_probs=[-0.5, -0.25 * (t + 1)]))
        if end == "finished":
            bodies.append(SessionFinished(reward=float(turns % 2)))
        elif end == "aborted":
            bodies.append(SessionAborted(reason="wall_clock_timeout", error="hyp"))
        out.append((pid, sid, bodies))
    return out


@pytest.mark.required
def test_export_with_compression_stores_the_streams_records_compressed_and_equal(js_run, capsys, tmp_path):
    """``--compression zstd``: every copy's segments say zstd and hold the same records (digests
    equal to the plain export's and the stream's). A stream's records each carry their own
    timestamp, so the copy stages many of them for each write, and they compress together."""
    from agentlog.events.log.batch_compression import segment_compression
    from agentlog.events.log.verify import verify_log
    from agentlog.tools.log_transfer import digest_of

    url, exported, counts = js_run
    packed = tmp_path / "packed"
    code, out, err = cli(capsys, "export", "--compression", "zstd", url, str(packed))
    assert code == 0, err
    assert out.rstrip().endswith("every log EQUAL"), out
    for rel in ("rollout/p0000", "rollout/p0001", "learner"):
        assert segment_compression(packed / rel, 0) == "zstd" and segment_compression(exported / rel, 0) is None
        assert digest_of(read_log(packed / rel, raw=True)).hexdigest() == digest_of(read_log(exported / rel, raw=True)).hexdigest()
        assert verify_log(packed / rel).status == "ok"
    sizes = {d: sum(p.stat().st_size for p in (d / "rollout/p0001").glob("*.seg")) for d in (packed, exported)}
    assert sizes[packed] < sizes[exported] / 2, sizes


_STREAMS = iter(range(1 << 30))


@pytest.mark.required
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    sessions=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.sampled_from(["finished", "aborted", "running"])),
                      min_size=1, max_size=6),
    stamps=st.lists(st.integers(1_700_000_000_000_000_000, 1_700_000_000_000_000_005), min_size=64, max_size=64),
    compression=st.sampled_from(["none", "zstd"]),
)
def test_export_then_import_round_trips_random_runs(nats_server, tmp_path_factory, sessions, stamps, compression):
    """Random sessions over up to 3 partitions, stamped by a clock that repeats
    and goes back (what the copy must keep as it is): stream -> export (its
    copies compressed or not) -> import gives the same digests for every log,
    at each step."""
    n = next(_STREAMS)
    src, dst = f"hypsrc{n}", f"hypdst{n}"
    ticks = iter(stamps * 8)
    logs: dict[int, JetStreamLog] = {}
    try:
        for pid, sid, bodies in _sessions(sessions):
            if pid not in logs:
                logs[pid] = JetStreamLog.open(nats_server.url, src, pid, clock=lambda: next(ticks))
            # Sessions appended in one batch or one record at a time, by their parity.
            if len(sid) % 2:
                logs[pid].append_batch([(sid, i, b) for i, b in enumerate(bodies)])
            else:
                for i, b in enumerate(bodies):
                    logs[pid].append_batch([(sid, i, b)])
    finally:
        for log in logs.values():
            log.close()
    directory = tmp_path_factory.mktemp("hyp") / "run"
    assert main(["export", "--compression", compression, f"{nats_server.url}/{src}", str(directory)]) == 0
    assert main(["import", str(directory), f"{nats_server.url}/{dst}"]) == 0
    from agentlog.events.log.jetstream_read import JetStreamRun
    from agentlog.tools.log_transfer import digest_of

    with JetStreamRun.open(nats_server.url, src) as a, JetStreamRun.open(nats_server.url, dst) as b:
        assert a.partitions() == b.partitions() == sorted(logs)
        for pid in logs:
            want = digest_of(a.log(pid).read(raw=True)).hexdigest()
            assert digest_of(read_log(directory / "rollout" / f"p{pid:04d}", raw=True)).hexdigest() == want
            assert digest_of(b.log(pid).read(raw=True)).hexdigest() == want


# ---------------------------------------------------------------- errors


def test_bad_urls_and_missing_streams_are_named(nats_server, js_run, capsys, tmp_path):
    url, exported, _ = js_run
    host = nats_server.url[len("nats://"):]
    cases = [
        (("stats", f"nats://{host}"), "expected nats://host:port/stream"),
        (("stats", f"nats://{host}/a/b/c"), "expected nats://host:port/stream"),
        (("stats", f"nats://{host.split(':')[0]}/{STREAM}"), "is not host:port"),
        (("verify", f"nats://{host}/bad.name"), "stream 'bad.name'"),
        (("replay", f"nats://{host}/nosuchstream"), "nats stream 'nosuchstream' at nats://" + host + ": no such stream"),
        (("stats", f"{url}/p0009"), f"stream '{STREAM}' holds no log 'p0009' (no message on subject {STREAM}.p0009); it holds learner, p0000, p0001"),
        (("reconstruct", "nats://127.0.0.1:1/run", "-o", str(tmp_path / "x")), "nats://127.0.0.1:1/run: cannot connect to a NATS server (127.0.0.1:1:"),
        (("verify", "--repair", url), "a log on JetStream has none"),
        (("replay", "--from", "3", url), "--from/--until take one log's LSNs"),
        (("export", str(exported), str(tmp_path / "e")), "expected nats://host:port/stream, or a run folder whose logs are on JetStream"),
        (("export", url, str(exported)), "exists and is not empty"),
        (("export", f"nats://{host}/nosuchstream", str(tmp_path / "e2")), "no such stream"),
        (("export", "--compression", "gzip", url, str(tmp_path / "e3")), "--compression: invalid choice: 'gzip' (choose from 'zstd', 'none')"),
        (("import", str(exported), str(tmp_path / "i")), "expected nats://host:port/stream to import into"),
        (("import", str(exported), f"{url}/p0000"), "holds 3 logs"),
        (("import", str(exported), url), f"stream '{STREAM}' already holds logs"),
        (("import", str(tmp_path / "nothing"), f"nats://{host}/fresh"), "no such log directory"),
    ]
    for args, want in cases:
        code, out, err = cli(capsys, *args)
        assert code == 2, (args, out, err)
        assert want in err, (args, err)
    assert not (tmp_path / "e2").exists()


def test_verify_names_a_damaged_message_on_the_stream(nats_server, capsys):
    """A message that is no frame (a foreign publisher on the subject) is corruption: verify exits 1 naming
    the subject and the stream sequence; replay stops with exit 1 too, naming it."""
    log = JetStreamLog.open(nats_server.url, "damaged", 0)
    log.append_batch([("s0", 0, SessionOpened(group_id="g0", group_size=1, sample_index=0))])
    log.close()

    raw(nats_server.url, lambda js: js.publish("damaged.p0000", b"not a frame at all, but long enough to be read as one"))
    code, out, err = cli(capsys, "verify", f"{nats_server.url}/damaged")
    assert code == 1, (out, err)
    assert f"p0000: {nats_server.url}/damaged/p0000: CORRUPT: nats stream 'damaged' subject 'damaged.p0000' seq 3:" in out
    code, out, err = cli(capsys, "replay", f"{nats_server.url}/damaged")
    assert code == 1 and f"{nats_server.url}/damaged: partition p0000" in err and "seq 3: type byte" in err


# ---------------------------------------------------------------- a run folder whose logs are on JetStream


@pytest.fixture(scope="module")
def nats_run_folder(short_demo_run, nats_server, tmp_path_factory):
    """(file run folder, nats run folder): the short demo's run, and the same
    run with its logs imported to a stream and its config.json saying
    ``[log] backend = "nats"`` (what ``agentlog train`` on JetStream leaves:
    config and checkpoints in the folder, the logs on the stream)."""
    import dataclasses

    from agentlog.loop.config import LogConfig, LoopConfig

    cwd, _ = short_demo_run
    demo = cwd / "runs" / "demo"
    assert main(["import", str(demo), f"{nats_server.url}/demo_on_nats"]) == 0
    run = tmp_path_factory.mktemp("natsrun") / "run"
    run.mkdir()
    cfg = LoopConfig.load(demo / "config.json")
    cfg = dataclasses.replace(cfg, log=LogConfig(backend="nats", url=nats_server.url, stream="demo_on_nats"))
    cfg.save(run / "config.json")
    return demo, run


@pytest.mark.required
def test_a_run_folder_on_jetstream_reads_as_its_stream(nats_run_folder, nats_server, capsys, tmp_path):
    demo, run = nats_run_folder
    code, a, err = cli(capsys, "reconstruct", str(run), "-o", str(tmp_path / "a.msgpack"))
    assert code == 0, err
    code, b, err = cli(capsys, "reconstruct", str(demo), "-o", str(tmp_path / "b.msgpack"))
    assert code == 0, err
    # The online per-step digests are checked against the stream through the run folder's Run, as for the folder.
    online = [line for line in a.splitlines() if line.startswith("online per-step digests vs offline:")]
    assert online and online[0].startswith("online per-step digests vs offline: EQUAL"), a
    assert online == [line for line in b.splitlines() if line.startswith("online per-step digests vs offline:")]
    assert a.splitlines()[-1] == b.splitlines()[-1] and a.splitlines()[-1].startswith("digest sha256:")
    code, a, err = cli(capsys, "stats", "--json", str(run))
    assert code == 0, err
    code, b, err = cli(capsys, "stats", "--json", str(demo))
    sa, sb = json.loads(a), json.loads(b)
    assert sa.pop("log") == f"{nats_server.url}/demo_on_nats" and sb.pop("log") == str(demo / "rollout")
    # The stream is a partition root of one partition (p0000); the folder's rollout/ is one log.
    assert sa.pop("partitions") == {"p0000": {"events": sb["events"], "lsn_first": sb["lsn_first"], "lsn_last": sb["lsn_last"]}}
    sb["lsn_first"] = sb["lsn_last"] = None
    assert sa == sb
    code, a, err = cli(capsys, "verify", "--digest", str(run))
    assert code == 0, err
    code, b, _ = cli(capsys, "verify", "--digest", str(demo))
    assert list(_digest_lines(a).values()) == list(_digest_lines(b).values()) and _digest_lines(a)
    # report reads the stream's partitions and its learner subject (the learner's curves).
    code, out, err = cli(capsys, "report", str(run), "-o", str(tmp_path / "report.html"))
    assert code == 0, err
    assert f"{nats_server.url}/demo_on_nats/learner" in (tmp_path / "report.html").read_text()
    # export takes the run folder for its stream.
    code, out, err = cli(capsys, "export", str(run), str(tmp_path / "back"))
    assert code == 0 and "every log EQUAL" in out, err
    code, _, err = cli(capsys, "import", str(run), f"{nats_server.url}/again")
    assert code == 2 and "keeps its logs on JetStream already" in err


def test_a_failed_export_leaves_no_directory_that_looks_complete(nats_server, tmp_path, capsys, monkeypatch):
    for pid in (0, 1):
        log = JetStreamLog.open(nats_server.url, "halfexp", pid)
        log.append_batch([(f"s{pid}", 0, SessionOpened(group_id=f"g{pid}", group_size=1, sample_index=0))])
        log.close()

    # A foreign message on p0001: the export copies p0000 whole, then fails on p0001.
    raw(nats_server.url, lambda js: js.publish("halfexp.p0001", b"not a frame at all, but long enough to be read as one"))
    out_dir = tmp_path / "exported"
    code, _, err = cli(capsys, "export", f"{nats_server.url}/halfexp", str(out_dir))
    assert code == 1 and "halfexp" in err
    # Nothing that a reading command would take for the run (p0000 whole, p0001 cut at its damage).
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert not out_dir.exists() or not any(out_dir.iterdir()), left
    assert left in ([], ["exported"]), left
    # A good export into the same DIR afterwards works (an existing empty DIR too).
    out_dir.mkdir(exist_ok=True)
    assert main(["export", f"{nats_server.url}/halfexp/p0000", str(out_dir)]) == 0
    assert (out_dir).is_dir() and any(out_dir.iterdir())
    # The current directory, empty: it would be renamed away under the shell standing in it.
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code, _, err = cli(capsys, "export", f"{nats_server.url}/halfexp/p0000", ".")
    assert code == 2 and ".: is the current directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "here"] and not any((tmp_path / "here").iterdir())
