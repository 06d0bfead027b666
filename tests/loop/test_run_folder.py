"""Run: the one owner of a run folder's layout, its typed config and its logs
(as LogSources, on files or on a JetStream stream), and of opening the writers."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from pathlib import Path

import pytest

from agentlog.events import read_log
from agentlog.events.log.source import LogSource, SourceError, StreamMissing
from agentlog.events.schema.types import PolicyUpdated, SessionOpened
from agentlog.loop.config import ConfigError, LogConfig, LoopConfig, RolloutConfig
from agentlog.loop import FaultConfig, LoopLearner, RolloutWorker
from agentlog.loop.run import LoopError, refuse_another_runs_stream, run_loop
from agentlog.loop.run_marker import incomplete_reason
from agentlog.loop.run_folder import Run


def opened(i: int = 0) -> SessionOpened:
    return SessionOpened(group_id=f"g{i}", group_size=1, sample_index=0, agent="t")


def test_a_file_run_lays_out_its_folder_and_reads_back_what_its_writers_wrote(tmp_path: Path) -> None:
    cfg = LoopConfig(fsync="never")
    (tmp_path / "run").mkdir()
    Run.save_config(tmp_path / "run", cfg)
    with Run.open(tmp_path / "run") as run:
        assert run.config == cfg and isinstance(run.config, LoopConfig)
        assert run.config_path == tmp_path / "run" / "config.json" and run.checkpoints == tmp_path / "run" / "checkpoints"
        assert isinstance(run.rollout, LogSource) and str(run.rollout) == str(tmp_path / "run" / "rollout")
        assert str(run.learner) == str(tmp_path / "run" / "learner") and run.partitions is None
        assert not run.logs_elsewhere and run.rollout_logs() == {0: run.rollout}
        assert not run.learner.exists() and run.existing_rollout_logs() == {}
        with run.open_rollout(None, fence=False) as w:
            envs = w.append_batch([(f"s{i}", 0, opened(i)) for i in range(3)])
        tail = run.learner_tail()
        assert tail.poll() == []
        with run.open_learner() as w:
            rec = w.append_batch([("learner", 0, PolicyUpdated(step=0, policy_version=0, checkpoint="c"))])
        assert tail.poll() == rec and tail.poll() == []
        assert list(run.rollout.read()) == envs == list(read_log(tmp_path / "run" / "rollout"))
        assert set(run.existing_rollout_logs()) == {0} and run.learner.exists()
        assert "rollout (rollout)" in run.describe() and "learner (learner)" in run.describe()


def test_a_new_file_run_folder_resumes_the_learner_log_put_in_it(tmp_path: Path) -> None:
    """A learner log inside a new run folder was put there on purpose (version 0
    published before the loop, as tools/bench/bench_distill.py does): the loop
    starts from it. Only a stream, which outlives folders, is refused."""
    with Run.open(tmp_path / "run", LoopConfig(fsync="never")) as run:
        with run.open_learner() as w:
            w.append_batch([("learner", 0, PolicyUpdated(step=0, policy_version=0, checkpoint="c"))])
        assert run.learner.exists()
        refuse_another_runs_stream(run)


def test_a_partitioned_run_has_one_rollout_log_per_partition(tmp_path: Path) -> None:
    run = Run.open(tmp_path / "run", LoopConfig(fsync="never", rollout=RolloutConfig(workers=3)))
    assert run.partitions == [0, 1, 2]
    assert {pid: str(src) for pid, src in run.rollout_logs().items()} == {
        pid: str(tmp_path / "run" / "rollout" / f"p{pid:04d}") for pid in range(3)}
    with run.open_rollout(1, fence=True) as w:
        envs = w.append_batch([("s", 0, opened())])
    assert set(run.existing_rollout_logs()) == {1}
    assert run.rollout.partitioned and run.rollout.partitions() == [1]
    assert [(pid, env) for pid, env in run.rollout.read_tagged()] == [(1, envs[0])]
    assert "(3 partitions, one per worker)" in run.describe()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_log_compression_from_the_config_reaches_every_log_the_run_writes(tmp_path: Path, compression: str) -> None:
    """``[log] compression``: each partition's log and the learner log are written with it, and read back the same."""
    from agentlog.events.log.batch_compression import segment_compression
    from agentlog.events.log.format import list_segments

    cfg = LoopConfig(fsync="never", rollout=RolloutConfig(workers=2), log=LogConfig(compression=compression))
    with Run.open(tmp_path / "run", cfg) as run:
        written = {}
        for pid in (0, 1):
            with run.open_rollout(pid, fence=True) as w:
                written[pid] = w.append_batch([(f"s{pid}-{i}", 0, opened(i)) for i in range(40)])
        with run.open_learner() as w:
            learner = w.append_batch([("learner", 0, PolicyUpdated(step=0, policy_version=0, checkpoint="c"))])
        folders = [tmp_path / "run" / "rollout" / "p0000", tmp_path / "run" / "rollout" / "p0001", tmp_path / "run" / "learner"]
        expected = None if compression == "none" else compression
        assert {str(d): {segment_compression(d, first) for first in list_segments(d)} for d in folders} == {
            str(d): {expected} for d in folders}
        assert {pid: list(run.rollout_logs()[pid].read()) for pid in (0, 1)} == written
        assert list(run.learner.read()) == learner


def test_the_config_is_typed_and_a_folder_without_one_is_no_run(tmp_path: Path) -> None:
    assert Run.at(tmp_path) is None and not Run.has_config(tmp_path)
    (tmp_path / "config.json").write_text('{"steps": "many"}')
    with pytest.raises(ConfigError, match=r"config\.json: .*steps"):
        Run.at(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert Run.at(tmp_path).config == LoopConfig()
    ckpt = tmp_path / "checkpoints" / "policy-v00003.pt"
    assert Run.folder_of_checkpoint(ckpt) == tmp_path.resolve() and Run.folder_of_checkpoint(tmp_path / "x.pt") is None


_streams = itertools.count()


def test_a_nats_run_keeps_its_logs_on_one_stream(tmp_path: Path, nats_server) -> None:
    pytest.importorskip("nats")
    stream = f"runfolder{next(_streams)}"
    cfg = LoopConfig(log=LogConfig(backend="nats", url=nats_server.url, stream=stream))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    Run.save_config(run_dir, cfg)
    with Run.open(run_dir) as run:
        assert run.logs_elsewhere and str(run.rollout) == f"{nats_server.url}/{stream}"
        assert str(run.learner) == f"{nats_server.url}/{stream}/learner"
        assert str(run.rollout_log(None)) == f"{nats_server.url}/{stream}/p0000"  # a single rollout log is partition 0
        assert not run.rollout.exists() and not run.learner.exists() and run.existing_rollout_logs() == {}
        tail = run.learner_tail()
        assert tail.poll() == []  # no stream yet: nothing to read, no error
        with pytest.raises(StreamMissing, match=rf"\(its logs: {nats_server.url}/{stream}\): .*no such stream"):
            run.open_rollout_view()
        with pytest.raises(ValueError, match=rf"{stream}.p0000: compression 'zstd' compresses a file log's record batches"):
            run.rollout_log(None).open_writer(compression="zstd")  # what [log] refuses for nats, refused by the API too
        with run.open_rollout(None, fence=True) as w:
            envs = w.append_batch([("s", 0, opened())])
        with run.open_learner() as w:
            rec = w.append_batch([("learner", 0, PolicyUpdated(step=0, policy_version=0, checkpoint="c"))])
        assert run.rollout.partitions() == [0] and set(run.existing_rollout_logs()) == {0}
        assert list(run.rollout_log(None).read()) == envs and list(run.learner.read()) == rec
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < len(rec) and time.monotonic() < deadline:  # the consumer delivers what it has, when it has it
            got += tail.poll()
            time.sleep(0.01)
        assert got == rec
        with run.open_rollout_view() as view:
            assert view.run_dir == run_dir and [env for _, env in view.read_tagged()] == envs
    assert not (run_dir / "rollout").exists() and not (run_dir / "learner").exists()
    with Run.open(tmp_path / "new", cfg) as new_folder:  # the same stream from a new folder: another run's logs
        with pytest.raises(LoopError, match=rf"{stream}/learner already holds a run's learner log, and .*new is a new run folder"):
            refuse_another_runs_stream(new_folder)
    with pytest.raises(SourceError, match="cannot connect to a NATS server"):
        bad = LoopConfig(log=LogConfig(backend="nats", url="nats://127.0.0.1:1", stream=stream))
        Run.open(run_dir, bad).open_rollout_view()


def test_run_loop_refuses_a_folder_holding_a_run_made_with_another_config(tmp_path):
    cfg = LoopConfig(steps=1, groups_per_step=2, group_size=2, warmup_steps=0, faults=FaultConfig.none(), stop_reward=0,
                     time_budget_s=0, max_lag=0, d_model=32, n_layer=1, n_head=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    Run.save_config(run_dir, cfg)

    async def train() -> None:
        await asyncio.wait_for(asyncio.gather(LoopLearner(run_dir, cfg).run(), RolloutWorker(run_dir, cfg).run()), 60)

    asyncio.run(train())  # a complete run: its config.json, logs and checkpoints
    before = Run.config_file(run_dir).read_bytes()
    other = dataclasses.replace(cfg, seed=7, group_size=4)
    with pytest.raises(LoopError, match="another config"):
        run_loop(other, run_dir, timeout_s=60)
    assert Run.config_file(run_dir).read_bytes() == before, "the run's config.json was replaced by another run's"
    assert incomplete_reason(run_dir) is None, f"the complete run was marked incomplete: {incomplete_reason(run_dir)}"


def test_run_loop_marks_the_folder_with_an_unexpected_failure_not_running(tmp_path, monkeypatch):
    """An error other than a LoopError (here the OS refusing to start the learner's process) used to
    leave INCOMPLETE saying the loop was still running."""
    from agentlog.loop import run as run_module

    def no_process(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable (fork refused)")

    monkeypatch.setattr(run_module, "start_process", no_process)
    with pytest.raises(OSError, match="fork refused"):
        run_loop(LoopConfig(steps=1), tmp_path / "run", timeout_s=60)
    reason = incomplete_reason(tmp_path / "run")
    assert reason is not None and reason.endswith(" failed: BlockingIOError: [Errno 11] Resource temporarily unavailable (fork refused)"), reason


def test_a_driver_failing_before_its_workers_start_stops_the_learners_process(tmp_path, monkeypatch):
    """The driver starts the learner's process first; a failure setting up what follows (the
    partitions' progress here, as an unreachable log store fails) used to leave it running, orphaned."""
    from agentlog.loop import run as run_module

    started = []

    def recorded(*args, **kwargs):
        started.append(start(*args, **kwargs))
        return started[-1]

    def unreadable(run):
        raise OSError(5, "Input/output error (the rollout logs cannot be listed)")

    start = run_module.start_process
    monkeypatch.setattr(run_module, "start_process", recorded)
    monkeypatch.setattr(run_module, "PartitionProgress", unreadable)
    try:
        with pytest.raises(OSError, match="cannot be listed"):
            run_loop(LoopConfig(steps=1), tmp_path / "run", timeout_s=60)
        assert [p.poll() is not None for p in started] == [True], "the learner's process was left running"
    finally:
        for p in started:  # without the fix: not left behind the test either
            if p.poll() is None:
                p.kill()
                p.wait()
