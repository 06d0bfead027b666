"""`agentlog stats`, `verify` and `replay` on a partitioned run folder
(``rollout/p0000``, ``rollout/p0001``, ...), run in-process; and
:func:`events.log.partitions.read_partitions`, the merged order they share."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import LogCorruption
from agentlog.events.log.format import SEG_HDR_SIZE, list_segments, segment_name
from agentlog.events.log.partitions import open_partition, partition_dir, read_partitions
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted
from agentlog.tools.cli import main

#: Sessions written per partition (partition id -> count): uneven on purpose.
SESSIONS = {0: 3, 1: 2, 2: 4}
BASE_TS = 1_800_000_000_000_000_000


def _clock(pid: int):
    """A deterministic clock per partition: different rates, with ties across
    partitions (so the merge's tie-break on partition and LSN is exercised)."""
    k = iter(range(1 << 30))
    return lambda: BASE_TS + 1000 * (next(k) * (pid + 2) // 2)


def write_partition(root: Path, pid: int) -> int:
    """Write partition ``pid``'s sessions (one record per append, each with its
    own clock tick); returns how many events it holds."""
    log = open_partition(root, pid, fsync="never", clock=_clock(pid))
    n = 0
    for i in range(SESSIONS[pid]):
        sid = f"p{pid}-s{i}"
        for seq, body in enumerate((SessionOpened(group_id=f"g{pid}-{i}", group_size=1, sample_index=0),
                                    SessionStarted(harness="test"), SessionFinished(reward=float(i % 2)))):
            log.append_batch([(sid, seq, body)])
            n += 1
    log.close()
    return n


def make_run(base: Path, order=tuple(SESSIONS)) -> tuple[Path, dict[int, int]]:
    """A run folder whose rollout/ holds the partitions, written in ``order``."""
    run = base / "run"
    counts = {pid: write_partition(run / "rollout", pid) for pid in order}
    return run, counts


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("partitioned"))


def test_stats_aggregates_every_partition(run_folder, capsys):
    run, counts = run_folder
    code, out, err = cli(capsys, "stats", str(run), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["events"] == sum(counts.values())
    assert s["sessions"]["total"] == s["sessions"]["finished"] == sum(SESSIONS.values())
    assert s["violations"]["count"] == 0
    assert {k: v["events"] for k, v in s["partitions"].items()} == {f"p{pid:04d}": n for pid, n in counts.items()}
    # The merged sums equal the sums of the partitions read one by one.
    for pid, n in counts.items():
        code, one, err = cli(capsys, "stats", str(partition_dir(run / "rollout", pid)), "--json")
        assert code == 0 and json.loads(one)["events"] == n, err
    code, text, _ = cli(capsys, "stats", str(run))
    assert code == 0 and f"events     {sum(counts.values())} in 3 partitions" in text and "  p0002    12 (lsn 0..11)" in text


def test_verify_one_line_per_partition_and_names_the_damaged_one(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    code, out, err = cli(capsys, "verify", str(run))
    assert code == 0, out + err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["p0000", "p0001", "p0002"] and all(": ok, " in line for line in lines)

    damaged = partition_dir(run / "rollout", 1)
    seg = damaged / segment_name(list_segments(damaged)[0])
    data = bytearray(seg.read_bytes())
    data[SEG_HDR_SIZE + 20] ^= 0xFF  # inside the first frame, with frames after it: corruption, not a torn tail
    seg.write_bytes(bytes(data))
    code, out, _ = cli(capsys, "verify", str(run))
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith("p0000: ") and ": ok, " in lines[0]
    assert lines[1].startswith("p0001: ") and str(damaged) in lines[1] and ": ok, " not in lines[1]
    assert lines[2].startswith("p0002: ") and ": ok, " in lines[2]

    # The merged reader's error names the partition, its directory, the segment.
    with pytest.raises(LogCorruption, match=r"partition p0001 \(.*p0001\): .*" + seg.name):
        list(read_partitions(run / "rollout"))
    code, _, err = cli(capsys, "stats", str(run))
    assert code == 1 and "partition p0001" in err and seg.name in err


def _replay_ids(capsys, run: Path) -> list[str]:
    code, out, err = cli(capsys, "replay", str(run))
    assert code == 0, err
    return [line.split()[0] for line in out.splitlines()]


def _expected_ids(root: Path) -> list[str]:
    """The documented order, computed from each partition read alone: (ts_ns, partition, LSN)."""
    from agentlog.events import read_log

    recs = [(env.ts_ns, pid, env.lsn) for pid in SESSIONS for env in read_log(partition_dir(root, pid))]
    return [f"p{pid:04d}:{lsn}" for _, pid, lsn in sorted(recs)]


def test_replay_names_events_by_partition_and_lsn_in_the_documented_order(run_folder, capsys):
    run, counts = run_folder
    ids = _replay_ids(capsys, run)
    assert len(ids) == sum(counts.values())
    assert ids == _expected_ids(run / "rollout")
    assert ids == _replay_ids(capsys, run)  # the same files, the same timeline
    assert ids[:3] == ["p0000:0", "p0001:0", "p0002:0"]  # a tie at the first tick: partition order
    code, out, _ = cli(capsys, "replay", str(run / "rollout"), "--json", "--session", "p1-s1")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(r["partition"], r["lsn"], r["state_after"]) for r in rows] == [
        (1, 3, "open"), (1, 4, "running"), (1, 5, "finished")]
    code, _, err = cli(capsys, "replay", str(run), "--from", "3")
    assert code == 2 and "partitioned" in err and "p0000" in err


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # cli() clears capsys each call
@given(order=st.permutations(list(SESSIONS)))
def test_replay_does_not_depend_on_the_order_partitions_were_written(order, capsys):
    with tempfile.TemporaryDirectory() as d:
        run, _ = make_run(Path(d), tuple(order))
        assert _replay_ids(capsys, run) == _expected_ids(run / "rollout")


def test_stats_names_a_violation_by_partition_and_lsn_and_lists_an_empty_partition(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    # p0003 reuses p0-s1's id, later in time than p0000's opening of it (BASE_TS + 3000 at p0000:3).
    log = open_partition(run / "rollout", 3, fsync="never", clock=lambda: BASE_TS + 10**9)
    log.append_batch([("p0-s1", 0, SessionOpened(group_id="x", group_size=1, sample_index=0))])
    log.close()
    open_partition(run / "rollout", 4, fsync="never").close()
    code, out, err = cli(capsys, "stats", str(run), "--json")
    s = json.loads(out)
    assert code == 1 and s["violations"]["first"][0]["lsn"] == "p0003:0" and "first at lsn p0003:0" in err
    assert s["partitions"]["p0004"] == {"events": 0, "lsn_first": None, "lsn_last": None}
    # Each partition alone is sound; the check across partitions names both places of the reused id.
    code, out, _ = cli(capsys, "verify", str(run))
    lines = out.splitlines()
    assert [line[:5] for line in lines[:5]] == ["p0000", "p0001", "p0002", "p0003", "p0004"]
    assert all(": ok, " in line for line in lines[:5])
    assert code == 1 and lines[5].startswith("across partitions: 1 session id(s) opened in more than one partition")
    assert lines[6:] == ["  session 'p0-s1': opened at p0000:3 and p0003:0"]


def test_a_stray_entry_beside_the_partitions_is_named(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    (run / "rollout" / "p3").mkdir()  # a misnamed partition would drop out of the merged view
    out = str(tmp_path / "out")
    for cmd, *extra in (("stats",), ("verify",), ("replay",), ("show", "p0-s0"), ("trace", "-o", out), ("report", "-o", out), ("tail",)):
        code, _, err = cli(capsys, cmd, str(run), *extra)
        assert code == 2 and "p3" in err and "p0000 .. p9999" in err, (cmd, err)
