"""The multi-worker loop with its logs on NATS JetStream (``[log] backend = "nats"``).

One 3-node cluster serves the module (the ``nats_cluster`` fixture); every
run's stream has 3 replicas. A worker is restarted mid-run while its old
incarnation is still alive (SIGSTOP, then SIGCONT once the new one has
fenced the partition): the old one is refused, and the run reconstructs
offline to the learner's online digests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentlog.events.schema.types import SessionAborted, SessionOpened, TERMINAL_EVENT_TYPES
from agentlog.loop.check import check_run
from agentlog.loop.config import ConfigError, LogConfig, LoopConfig, RolloutConfig
from agentlog.loop.run_folder import Run
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.run import start_process

from loop_helpers import freeze_mid_batch, small_config, wait_for

README = Path(__file__).resolve().parents[2] / "README.md"


def _url(cluster) -> str:
    """The cluster as one ``[log] url``: nats://h:p1,h:p2,h:p3."""
    return "nats://" + ",".join(u.removeprefix("nats://") for u in cluster.urls)


def _version(run: Run) -> int:
    if not run.learner.exists():
        return -1
    recs = read_learner_records(run.learner)
    return recs[-1].policy_version if recs else -1


def _open_sessions(source) -> set[str]:
    opened: set[str] = set()
    for env in source.read():
        if isinstance(env.body, SessionOpened):
            opened.add(env.session_id)
        elif isinstance(env.body, TERMINAL_EVENT_TYPES):
            opened.discard(env.session_id)
    return opened


def _epochs(source) -> list[tuple[int, int, bool]]:
    """(stream sequence, writer epoch, is a fence) of every message on the log's subject, in order."""
    from nats.js.errors import NotFoundError

    ref = source._ref()  # the subject behind the LogSource: its raw messages carry the epochs

    from agentlog.events.log.jetstream import HDR_EPOCH
    from agentlog.events.log.jetstream_msg import HDR_KIND, KIND_FENCE

    async def scan() -> list[tuple[int, int, bool]]:
        out, seq = [], 1
        while True:
            try:
                msg = await ref.run.js.get_msg(ref.run.stream, seq=seq, subject=ref.subject, next=True, direct=True)
            except NotFoundError:
                return out
            headers = msg.headers or {}
            out.append((msg.seq, int(headers[HDR_EPOCH]), headers.get(HDR_KIND) == KIND_FENCE))
            seq = msg.seq + 1

    return ref.run.bridge.call(scan())


def _last_epoch(ref) -> int:
    msgs = _epochs(ref) if ref.exists() else []
    return msgs[-1][1] if msgs else -1


@pytest.mark.required
def test_a_run_on_jetstream_with_a_restarted_worker_fences_the_old_one_and_reconstructs_equal(tmp_path: Path, nats_cluster) -> None:
    """Two local workers and the learner on a 3-replica stream. Worker 1 is
    frozen (SIGSTOP) with sessions in flight and a new incarnation started on
    its partition: it takes a higher epoch. The frozen one, thawed, is
    refused by the server (LogFenced) and exits non-zero; no message of an
    older epoch lands after a newer fence; the records acknowledged before
    the restart are unchanged; the orphaned sessions are aborted
    (engine_restart) and consumed; the run finishes and ``check_run`` finds
    every step EQUAL."""
    # 30 steps of 8 groups: long enough that a test process slowed by a loaded
    # machine still finds worker 1 mid-run (6 steps of 4 could all be over, in
    # about a second, before its first poll, and a "frozen" worker had in fact
    # already finished its work and exited 0 once thawed).
    cfg = small_config(steps=30, groups_per_step=8, max_lag=1, rollout=RolloutConfig(workers=2),
                       log=LogConfig(backend="nats", url=_url(nats_cluster), stream="jsloop-restart", replicas=3))
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    learner = start_process("trainer", run)
    workers = {pid: start_process("worker", run, "--partition", str(pid)) for pid in (0, 1)}
    stale: subprocess.Popen | None = None
    try:
        with Run.open(run) as run_logs:
            procs = [learner, *workers.values()]
            wait_for("the run's stream", run_logs.rollout.exists, 120, procs)
            p1 = run_logs.rollout_log(1)
            # Only p0001 is watched from here on: polls of the whole learner log
            # are slow on a loaded machine, and the run must still be young when
            # worker 1 is frozen.
            wait_for("worker 1's first record", p1.exists, 120, procs)
            epoch_before = _last_epoch(p1)
            # Freeze it the moment its log shows a session in flight (a tail: each poll reads only what is new).
            tail, live = p1.tail(), set()

            def in_flight() -> bool:
                for env in tail.poll():
                    if isinstance(env.body, SessionOpened):
                        live.add(env.session_id)
                    elif isinstance(env.body, TERMINAL_EVENT_TYPES):
                        live.discard(env.session_id)
                return bool(live)

            try:
                orphans = freeze_mid_batch(workers[1], lambda: _open_sessions(p1), procs, in_flight=in_flight)
            finally:
                tail.close()
            assert workers[1].poll() is None and _version(run_logs) < cfg.steps, (
                "the run was over before worker 1 could be frozen mid-run")
            acknowledged = [(e.lsn, e.session_id, e.body) for e in p1.read()]
            stale = workers[1]
            workers[1] = start_process("worker", run, "--partition", "1")
            wait_for("the new incarnation's fence", lambda: _last_epoch(p1) > epoch_before, 60, [learner, workers[1]])
            os.kill(stale.pid, signal.SIGCONT)
            assert stale.wait(timeout=60) != 0, "the stale incarnation carried on after a newer epoch fenced its partition"
            wait_for("the final version", lambda: learner.poll() is not None, 180, list(workers.values()))
            assert learner.returncode == 0
            for w in workers.values():
                assert w.wait(timeout=60) == 0
            after = [(e.lsn, e.session_id, e.body) for e in p1.read()]
            msgs = _epochs(p1)
            final_version = _version(run_logs)
    finally:
        for p in [learner, *workers.values(), *([stale] if stale else [])]:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    stderr = (run / "logs" / "worker-partition-1.stderr").read_text(errors="replace")
    assert "fenced by a newer writer" in stderr, stderr[-3000:]
    fences = [(seq, epoch) for seq, epoch, fence in msgs if fence]
    assert fences[-1][1] > epoch_before >= 0
    assert [e for _, e, _ in msgs] == sorted(e for _, e, _ in msgs), "a stale epoch's message landed after a newer fence"
    assert after[: len(acknowledged)] == acknowledged, "a record acknowledged before the restart changed or vanished"
    reasons = {sid: body.reason for _, sid, body in after if isinstance(body, SessionAborted)}
    assert all(reasons.get(sid) == "engine_restart" for sid in orphans), {sid: reasons.get(sid) for sid in orphans}
    assert final_version == cfg.steps
    assert not (run / "rollout").exists() and not (run / "learner").exists(), "the logs must live on JetStream only"
    check = check_run(run)  # from config.json alone, as `agentlog reconstruct RUN` does
    assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
    assert check.steps >= cfg.steps and check.digests_equal == check.steps
    with Run.open(run) as run_logs:
        consumed = {(ref.partition, ref.group_id) for r in read_learner_records(run_logs.learner) for ref in r.batch}
    assert {(1, sid.rsplit("-s", 1)[0]) for sid in orphans} & consumed, "the orphans' groups must still be released and consumed"


def _readme_toml() -> str:
    """The TOML config of the README's "Training on JetStream" section."""
    text = README.read_text()
    section = text[text.index("### Training on JetStream"):]
    return re.search(r"```toml\n(.*?)```", section, re.S).group(1)


@pytest.mark.required
def test_agentlog_train_with_the_readme_config_runs_on_jetstream(tmp_path: Path, nats_cluster) -> None:
    """``agentlog train --config`` with the README's ``[log] backend = "nats"``
    config (its url pointed at the test cluster, sizes shrunk by flags): two
    local workers write ``<stream>.p0000`` / ``p0001``, the learner
    ``<stream>.learner``, the stream is named after the run folder, nothing
    is written to log folders, and the offline check says EQUAL."""
    toml = _readme_toml()
    assert 'backend = "nats"' in toml
    toml = re.sub(r'url = "[^"]*"', f'url = "{_url(nats_cluster)}"', toml)
    toml = re.sub(r"replicas = \d+", "replicas = 3", toml)
    (tmp_path / "train.toml").write_text(toml)
    run = tmp_path / "run.cli-1"
    res = subprocess.run(
        [str(Path(sys.executable).parent / "agentlog"), "train", "--config", str(tmp_path / "train.toml"), "--out", str(run),
         "--steps", "3", "--warmup-steps", "0", "--groups-per-step", "4", "--group-size", "4", "--quiet", "--timeout", "150"],
        capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "EQUAL" in res.stdout and "DIFFERENT" not in res.stdout, res.stdout[-2000:]
    assert (run / "report.html").is_file() and "report.html failed" not in res.stdout  # the report reads the stream
    saved = json.loads((run / "config.json").read_text())["log"]
    assert saved["backend"] == "nats" and saved["stream"] == "run_cli-1", saved  # pinned: the folder may be renamed
    assert not (run / "rollout").exists() and not (run / "learner").exists()
    with Run.open(run) as run_logs:
        from agentlog.events.log.jetstream_read import JetStreamRun

        with JetStreamRun.open(_url(nats_cluster), run_logs.stream) as stream:
            assert stream.names() == ["learner", "p0000", "p0001"]
        trained = [r for r in read_learner_records(run_logs.learner) if r.step > 0]
        assert {ref.partition for r in trained for ref in r.batch} == {0, 1}
        ends = {pid: src.next_lsn() for pid, src in run_logs.rollout_logs().items()}
        assert all(end == sum(1 for _ in run_logs.rollout_log(pid).read()) for pid, end in ends.items())
    # A second run into a new folder of the same name must not adopt the first run's stream.
    again = tmp_path / "again" / "run.cli-1"
    again.parent.mkdir()
    res = subprocess.run(
        [str(Path(sys.executable).parent / "agentlog"), "train", "--config", str(tmp_path / "train.toml"), "--out", str(again),
         "--steps", "1", "--quiet", "--no-report"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "already holds a run" in res.stdout + res.stderr, res.stdout[-1000:] + res.stderr[-1000:]


def test_log_table_errors_name_the_field_and_what_was_expected() -> None:
    """Bad ``[log]`` values are refused by name, with what was expected."""
    cases = {
        "backend = \"s3\"": "[log] backend: expected one of ('file', 'nats')",
        "backend = \"nats\"": "[log] url: backend 'nats' needs the servers' URL",
        "backend = \"nats\"\nurl = \"http://h:4222\"": "[log] url: expected nats://host:port",
        "backend = \"nats\"\nurl = \"nats://h:4222/run\"": "without a path (the stream goes in [log] stream)",
        "backend = \"nats\"\nurl = \"nats://h\"": "[log] url: expected nats://host:port",
        "backend = \"nats\"\nurl = \"nats://h:4222\"\nstream = \"a.b\"": "[log] stream: expected letters, digits",
        "backend = \"nats\"\nurl = \"nats://h:4222\"\nreplicas = 0": "[log] replicas: expected an int in 1..5",
        "backend = \"nats\"\nurl = \"nats://h:4222\"\nduplicate_window_s = -1": "[log] duplicate_window_s: expected a number of seconds > 0",
        "url = \"nats://h:4222\"": "[log] url: only the nats backend takes it",
        "replica = 3": "[log] unknown key(s) ['replica']",
        "compression = \"gzip\"": "[log] compression: expected one of ('zstd', 'none')",
        "backend = \"nats\"\nurl = \"nats://h:4222\"\ncompression = \"zstd\"": "[log] compression: 'zstd' needs backend 'file'",
    }
    import tomllib

    for body, expected in cases.items():
        with pytest.raises(ConfigError) as info:
            LoopConfig.from_dict({"log": tomllib.loads(body)})
        assert expected in str(info.value), (body, str(info.value))
    cfg = LoopConfig.from_dict({"log": {"backend": "nats", "url": "nats://a:1,b:2", "replicas": 3}})
    assert cfg.log.servers() == ["nats://a:1", "nats://b:2"]
    assert cfg.log.stream_for(Path("/runs/2026 12.02:x")) == "2026_12_02_x"
    assert LoopConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # round-trips through config.json


def test_run_logs_on_jetstream_end_tail_and_sources(tmp_path: Path, nats_cluster) -> None:
    """The Run of a nats run: partitions and the learner log are the stream's
    subjects; ``durable_end`` is the next LSN even when the subject ends in
    fences (writers that opened and wrote nothing); the learner tail
    log returns each record once, across polls."""
    from agentlog.events.schema.types import SessionOpened as Opened

    cfg = LoopConfig(rollout=RolloutConfig(workers=2), log=LogConfig(backend="nats", url=_url(nats_cluster), replicas=3))
    run = tmp_path / "tail.run"
    with Run.open(run, cfg) as run_logs:
        assert run_logs.stream == "tail_run" and not run_logs.rollout.exists() and not run_logs.learner.exists()
        assert run_logs.existing_rollout_logs() == {}
        w = run_logs.open_rollout(1, fence=True)
        try:
            w.append_batch([(f"s{i}", 0, Opened(group_id="g", group_size=1, sample_index=0, agent="t")) for i in range(3)])
        finally:
            w.close()
        for _ in range(2):  # two more incarnations that write nothing: the subject ends in two fences
            run_logs.open_rollout(1, fence=True).close()
        assert run_logs.rollout.exists()
        sources = run_logs.rollout_logs()
        assert [str(s).rsplit("/", 1)[1] for s in sources.values()] == ["p0000", "p0001"]
        assert sources[1].next_lsn() == 3 and sources[0].next_lsn() == 0
        assert set(run_logs.existing_rollout_logs()) == {1}
        learner = run_logs.open_learner()
        try:
            tail = run_logs.learner_tail()
            assert tail.poll() == []
            learner.append_batch([("learner", 0, Opened(group_id="g", group_size=1, sample_index=0, agent="t"))])
            wait_for("the learner record", lambda: bool(tail.poll(1)) or tail.next_lsn == 1, 10)
            learner.append_batch([("learner", 1, Opened(group_id="g", group_size=1, sample_index=0, agent="t"))])
            got = []
            wait_for("the second record", lambda: bool(got.extend(tail.poll()) or got), 10)
            assert [e.lsn for e in got] == [1] and tail.next_lsn == 2
        finally:
            learner.close()
