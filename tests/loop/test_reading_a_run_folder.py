"""The reading commands on a loop run folder read what the learner trained.

One short distilled run (a built-in GPT teacher with top-K, so the samples
carry teacher log-probs) whose config has a non-default ``min_valid``:

* `reconstruct` writes every field of every sample in each format: the
  jsonl and parquet rows equal the msgpack rows field by field, over the
  Sample type's own field list;
* `stats` and `reconstruct` fold with the run's own reduce settings (its
  ``config.json``), not the reducers' defaults, and so count the groups the
  learner skipped;
* `reconstruct RUN` without ``-o`` prints the per-step check and the digest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

from agentlog.loop import FaultConfig
from agentlog.events import read_log
from agentlog.loop.config import LoopConfig
from agentlog.loop.learner_records import read_learner_records
from agentlog.reducers.config import DEFAULT_CONFIG
from agentlog.reducers.pipeline import reduce_log
from agentlog.reducers.samples import PACKED_DTYPES, Sample
from agentlog.tools.cmd_reconstruct import read_msgpack_samples

from loop_helpers import small_config
from test_distill_loop import run_loop_here, teacher_file

#: The run's min_valid: not the reducers' default, so that reading it with the default shows.
MIN_VALID = 3


def agentlog(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentlog.tools.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, LoopConfig]:
    """A finished distilled run whose config says min_valid 3 (groups of 4, some members aborted or dropped)."""
    tmp = tmp_path_factory.mktemp("distilled")
    base = dict(steps=3, groups_per_step=4, group_size=4, stop_reward=0, temperature=0.8, min_valid=MIN_VALID,
                faults=FaultConfig(exception_rate=0.15, timeout_rate=0.0, drop_rate=0.1, straggler_rate=0.0, empty_marker_rate=0.0))
    path = teacher_file(tmp, small_config(**base))
    cfg = small_config(**base, distill={"teachers": [{"name": "gpt-big", "checkpoint": str(path)}], "topk": 2})
    assert DEFAULT_CONFIG.min_valid != MIN_VALID
    run_dir = tmp / "run"
    run_dir.mkdir()
    cfg.save(run_dir / "config.json")  # as run_loop (agentlog train / demo) does
    run_loop_here(run_dir, cfg)
    return run_dir, cfg


def _bare_copy(run_dir: Path, where: Path) -> Path:
    """The run's rollout log alone, away from its config.json (a bare log: the reducers' defaults)."""
    dst = where / "bare.log"
    shutil.copytree(run_dir / "rollout", dst, ignore=shutil.ignore_patterns("LOCK"))
    return dst


def _column_bytes(kind: str, value) -> bytes:
    """A jsonl / parquet packed-array column back to the Sample field's bytes."""
    return np.asarray(value, dtype=kind).tobytes()


def test_every_format_carries_every_field_of_every_sample(run, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    run_dir, _ = run
    for name in ("s.msgpack", "s.jsonl", "s.parquet"):
        res = agentlog("reconstruct", str(run_dir), "-o", str(tmp_path / name), "--quiet")
        assert res.returncode == 0, res.stderr
    samples = read_msgpack_samples(tmp_path / "s.msgpack")
    # The run is one with teacher scores and top-K: the fields the formats used to leave out hold data.
    assert any(s.teacher_top_k == 2 and s.teacher_log_probs and s.teacher_top_ids for s in samples)
    jsonl = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    parquet = pq.read_table(tmp_path / "s.parquet").to_pylist()
    fields = msgspec.structs.fields(Sample)
    assert len(samples) == len(jsonl) == len(parquet) > 0
    for fmt, rows in (("jsonl", jsonl), ("parquet", parquet)):
        assert list(rows[0]) == [f.name for f in fields], f"{fmt}: its columns are not the Sample's fields"
        for i, (want, row) in enumerate(zip(samples, rows)):
            for f in fields:
                value, expected = row[f.name], getattr(want, f.name)
                if f.name in PACKED_DTYPES:
                    value = _column_bytes(PACKED_DTYPES[f.name], value)
                elif f.name == "metadata" and isinstance(value, str):
                    value = json.loads(value)  # parquet: JSON text
                assert value == expected, f"{fmt} row {i} ({want.session_id}): field {f.name}: {value!r} != {expected!r}"


def _stats(path: Path) -> dict:
    res = agentlog("stats", str(path), "--json", "--quiet")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _reconstruct_line(path: Path, *args: str) -> str:
    res = agentlog("reconstruct", str(path), *args, "--quiet")
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_stats_and_reconstruct_of_a_run_folder_fold_with_the_runs_own_min_valid(run, tmp_path):
    run_dir, cfg = run
    own = reduce_log(read_log(run_dir / "rollout", 0), cfg.reduce_config())
    default = reduce_log(read_log(run_dir / "rollout", 0), DEFAULT_CONFIG)
    own_skips = Counter(g.skip_reason.split(" (")[0] for g in own.groups if g.skipped)  # stats counts the reason's head
    assert sum(own_skips.values()) != sum(1 for g in default.groups if g.skipped), "the run should skip groups min_valid 2 keeps"
    # What the learner trained: every group it skipped for too few valid members, the offline fold skips for the same reason.
    learner_skips = Counter(why.split(" (")[0] for r in read_learner_records(run_dir / "learner") for why in r.skipped.values()
                            if "min_valid" in why)
    assert learner_skips and all(f"min_valid {MIN_VALID}" in why for why in learner_skips)
    assert all(own_skips[why] >= n for why, n in learner_skips.items()), (learner_skips, own_skips)

    for path in (run_dir, run_dir / "rollout"):
        g = _stats(path)["groups"]
        assert (g["released"], g["skipped"], g["skip_reasons"]) == (len(own.groups), sum(own_skips.values()), dict(own_skips)), path
    bare = _bare_copy(run_dir, tmp_path)
    assert _stats(bare)["groups"]["skipped"] == sum(1 for g in default.groups if g.skipped)

    out = _reconstruct_line(run_dir, "-o", str(tmp_path / "s.msgpack"))
    assert f"{len(own.groups)} groups released ({sum(own_skips.values())} skipped)" in out, out
    # The settings that differ from the reducers' defaults, named: the run's teachers make it expect teacher scores.
    teachers = ", expect_teacher_scores True" if cfg.distill.teachers else ""
    assert (f"config {cfg.reduce_config().digest()[:19]} (the run's config.json: min_valid {MIN_VALID}, "
            f"abort_outcomes.policy fail{teachers})") in out, out
    out = _reconstruct_line(bare, "-o", str(tmp_path / "b.msgpack"))
    assert f"({sum(1 for g in default.groups if g.skipped)} skipped)" in out and "(defaults)" in out, out
    # A copy of the log without its config folds with the run's settings when given them.
    given = _reconstruct_line(bare, "--config", str(run_dir / "config.json"), "-o", str(tmp_path / "c.msgpack"))
    assert f"{len(own.groups)} groups released ({sum(own_skips.values())} skipped)" in given, given
    assert f"(the run's config.json: min_valid {MIN_VALID}" in given, given
    assert given.splitlines()[-1] == _reconstruct_line(run_dir, "-o", str(tmp_path / "d.msgpack")).splitlines()[-1]


def test_reconstruct_of_a_run_folder_without_an_output_prints_the_per_step_check(run, tmp_path):
    run_dir, _ = run
    with_file = _reconstruct_line(run_dir, "-o", str(tmp_path / "s.msgpack")).splitlines()
    res = agentlog("reconstruct", str(run_dir), "--quiet")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    steps = sum(1 for r in read_learner_records(run_dir / "learner") if r.step > 0)
    assert f"online per-step digests vs offline: EQUAL ({steps}/{steps} steps equal" in res.stdout, res.stdout
    assert lines[-1] == with_file[-1] and lines[-1].startswith("digest sha256:")  # the same samples, written nowhere
    assert "not written: no -o" in lines[0] and not any(tmp_path.glob("*.jsonl"))


def test_reconstruct_with_a_format_but_no_output_is_a_usage_error(run):
    run_dir, _ = run
    res = agentlog("reconstruct", str(run_dir), "--format", "parquet")
    assert res.returncode == 2 and "--format parquet needs -o OUT" in res.stderr, res.stderr
