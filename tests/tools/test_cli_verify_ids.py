"""`agentlog verify`'s lifecycle check and the id filter's false positives; trace, tail and report
confirm a reuse the filter alone reports as verify does."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentlog.events import FileLog
from agentlog.events.schema.types import SessionDropped, SessionFinished, SessionOpened, SessionStarted
from agentlog.reducers.lifecycle import IdFilter, LifecycleCheck
from agentlog.tools.cli import main
from agentlog.tools.cli_common import check_log_path, id_scans_of, read_records
from agentlog.tools.cmd_tail import _tail_events
from agentlog.tools.report.data import collect
from agentlog.tools.cmd_verify import check_lifecycle


def _write(path, records) -> None:
    log = FileLog.open(path, fsync="never")
    try:
        for rec in records:
            log.append_batch([rec])
    finally:
        log.close()


def _seeded(*false_positives: str):
    """A check whose id filter answers "maybe used" for these fresh ids (what a false positive
    answers) and whose window forgets every ended session, so the filter alone answers."""

    def make() -> LifecycleCheck:
        check = LifecycleCheck(recent_window=0, id_capacity=64)
        for sid in false_positives:
            check.ids.add(sid)
        return check

    return make


def test_a_filter_false_positive_is_no_reused_id_and_a_real_reuse_still_is(tmp_path):
    path = tmp_path / "log"
    _write(path, [
        ("old", 0, SessionOpened(group_id="O", group_size=1)), ("old", 1, SessionDropped(reason="y")),
        ("ghost", 0, SessionOpened(group_id="G", group_size=1)), ("ghost", 1, SessionStarted(harness="t")),
        ("ghost", 2, SessionFinished(reward=1.0)),
        ("old", 0, SessionOpened(group_id="O2", group_size=1)),  # a real reuse, at lsn 5
    ])
    count, shown = check_lifecycle(check_log_path(str(path)), new_check=_seeded("ghost"))
    assert count == 1, [v.describe() for v in shown]
    assert (shown[0].lsn, shown[0].session_id, shown[0].kind.value) == (5, "old", "reused_id")


def test_only_real_reuses_are_reported_as_they_are_without_a_second_check(tmp_path):
    path = tmp_path / "log"
    _write(path, [
        ("a", 0, SessionOpened(group_id="A", group_size=1)), ("a", 1, SessionDropped(reason="y")),
        ("a", 0, SessionOpened(group_id="A2", group_size=1)), ("a", 1, SessionDropped(reason="y")),
    ])
    made = []

    def make() -> LifecycleCheck:
        made.append(LifecycleCheck(recent_window=0))
        return made[-1]

    count, shown = check_lifecycle(check_log_path(str(path)), new_check=make)
    # The reuse at lsn 2 is refused; its drop at lsn 3 then belongs to no session in flight.
    assert [(v.lsn, v.kind.value) for v in shown][:1] == [(2, "reused_id")] and count == len(shown) >= 1
    assert len(made) == 1  # the scan proved it real: the first pass's answer stands


# ------------------------------------------------ trace, tail and report confirm as verify does


def _false_positive_log(path) -> None:
    """``ghost`` opens once (a false positive of the seeded filter); ``old`` is really reused at lsn 5."""
    _write(path, [
        ("old", 0, SessionOpened(group_id="O", group_size=1)), ("old", 1, SessionDropped(reason="y")),
        ("ghost", 0, SessionOpened(group_id="G", group_size=1)), ("ghost", 1, SessionStarted(harness="t")),
        ("ghost", 2, SessionFinished(reward=1.0)),
        ("old", 0, SessionOpened(group_id="O2", group_size=1)),
    ])


@pytest.fixture
def ghost_in_the_filter(monkeypatch):
    """Every id filter answers "maybe used" for the fresh id ``ghost``, as a false positive does."""
    real = IdFilter.__contains__
    monkeypatch.setattr(IdFilter, "__contains__", lambda self, sid: sid == "ghost" or real(self, sid))


def test_trace_shows_a_false_positive_as_the_session_it_is_and_a_real_reuse_as_skipped(tmp_path, ghost_in_the_filter):
    _false_positive_log(tmp_path / "log")
    assert main(["trace", str(tmp_path / "log"), "-o", str(tmp_path / "t.json"), "--quiet"]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"]
    assert [n.split()[0] for n in names] == ["old", "ghost"]
    finished = [e for e in trace["traceEvents"] if e.get("ph") == "i" and e["tid"] == 2]
    assert finished, "ghost's terminal event is drawn on its track"
    assert trace["otherData"]["skipped"] == 1  # old's reuse at lsn 5


def test_report_counts_a_false_positive_as_a_session_and_a_real_reuse_as_a_violation(tmp_path, ghost_in_the_filter):
    _false_positive_log(tmp_path / "log")
    source = check_log_path(str(tmp_path / "log"))
    data = collect(read_records(source, quiet=True), str(source), confirm_for=id_scans_of(source))
    assert data.outcomes["finished"] == 1 and data.sessions == 2
    assert len(data.violations) == 1 and "lsn 5, session 'old'" in data.violations[0], data.violations


def test_tail_shows_a_false_positive_as_a_fresh_session_and_a_real_reuse_as_a_violation(tmp_path, ghost_in_the_filter, capsys):
    _false_positive_log(tmp_path / "log")
    seen = []

    async def follow() -> None:
        job = asyncio.ensure_future(_tail_events(check_log_path(str(tmp_path / "log"))))
        try:
            for _ in range(400):  # until the last record is shown (20 s at most)
                await asyncio.sleep(0.05)
                seen.extend(capsys.readouterr().out.splitlines())
                if any("VIOLATION lsn 5 " in line for line in seen):
                    return
        finally:
            job.cancel()

    asyncio.run(follow())
    ghost = [line.split("ghost", 1)[1].split()[1:5] for line in seen if " ghost " in line]
    assert ghost == [["session_opened", "-", "->", "open"], ["session_started", "open", "->", "running"],
                     ["session_finished", "running", "->", "finished"]], seen
    assert [line.split()[6] for line in seen if "VIOLATION" in line] == ["'old':"], seen


def _partitioned(root, sessions_by_partition):
    """A partitioned log: partition ``i`` holds ``sessions_by_partition[i]``, each opened and dropped."""
    from agentlog.events.log.partitions import open_partition

    for pid, sessions in enumerate(sessions_by_partition):
        log = open_partition(root, pid, fsync="never")
        try:
            for sid in sessions:
                log.append_batch([(sid, 0, SessionOpened(group_id=sid, group_size=1))])
                log.append_batch([(sid, 1, SessionDropped(reason="y"))])
        finally:
            log.close()
    return root


def test_trace_of_a_partitioned_log_confirms_in_the_partition_of_the_opening(tmp_path, ghost_in_the_filter):
    """The scan reads the partition whose fold asks: ``ghost`` is fresh in p0001 though p0000 also holds one."""
    root = _partitioned(tmp_path / "rollout", [["ghost", "a"], ["b", "ghost"]])
    assert main(["trace", str(root), "-o", str(tmp_path / "t.json"), "--quiet"]) == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    names = sorted(e["args"]["name"].split()[0] + e["args"]["name"].split()[-1]
                   for e in trace["traceEvents"] if e.get("name") == "thread_name")
    assert names == ["ap0000", "bp0001", "ghostp0000", "ghostp0001"], names
    assert trace["otherData"]["skipped"] == 0


def test_the_report_command_counts_a_false_positive_as_a_session(tmp_path, ghost_in_the_filter, capsys):
    _false_positive_log(tmp_path / "log")
    assert main(["report", str(tmp_path / "log"), "-o", str(tmp_path / "r.html"), "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert ": 2 sessions (dropped 1, finished 1)" in first, first


def test_replay_shows_a_false_positive_as_a_fresh_session_and_a_real_reuse_as_a_violation(tmp_path, ghost_in_the_filter, capsys):
    _false_positive_log(tmp_path / "log")
    assert main(["replay", str(tmp_path / "log"), "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[6] for line in out if "VIOLATION" in line] == ["'old':"], out
    assert [line.split("ghost", 1)[1].split()[1] for line in out if " ghost " in line] == \
        ["session_opened", "session_started", "session_finished"], out


def test_replay_of_a_partitioned_log_confirms_over_the_merged_records(tmp_path, ghost_in_the_filter, capsys):
    """Read merged, one fold sees every partition: ``ghost``'s one opening (in p0001) is fresh."""
    root = _partitioned(tmp_path / "rollout", [["a"], ["b", "ghost"]])
    assert main(["replay", str(root), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "VIOLATION" not in out and out.count("session_dropped") == 3, out


# ------------------------------------------------ reconstruct, export-dataset and stats: every id ever opened


@pytest.fixture
def no_ended_window(monkeypatch):
    """The offline folds forget every ended session at once, so a reuse is seen by the id filter or not at all
    (as one of an id that ended more than ENDED_WINDOW sessions before)."""
    from agentlog.reducers import pipeline
    from agentlog.reducers.runstats import RunStats

    monkeypatch.setattr(pipeline, "ENDED_WINDOW", 0)
    monkeypatch.setattr(RunStats, "ENDED_WINDOW", 0)


def test_reconstruct_refuses_a_reuse_beyond_its_window_and_passes_a_false_positive(tmp_path, ghost_in_the_filter,
                                                                                   no_ended_window, capsys):
    """``ghost`` (lsn 2, a false positive of the filter) is folded as the fresh session it is; ``old``'s
    reuse at lsn 5 is refused, though the window forgot ``old`` long before."""
    _false_positive_log(tmp_path / "log")
    assert main(["reconstruct", str(tmp_path / "log"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "lsn 5" in err and "'old'" in err and "reused" in err, err


def test_reconstruct_of_a_log_with_only_a_false_positive_gives_its_samples(tmp_path, ghost_in_the_filter, no_ended_window, capsys):
    _write(tmp_path / "log", [
        ("old", 0, SessionOpened(group_id="O", group_size=1)), ("old", 1, SessionDropped(reason="y")),
        ("ghost", 0, SessionOpened(group_id="G", group_size=1)), ("ghost", 1, SessionStarted(harness="t")),
        ("ghost", 2, SessionFinished(reward=1.0)),
    ])
    assert main(["reconstruct", str(tmp_path / "log"), "--quiet"]) == 0
    assert "from 5 events; 2 groups released" in capsys.readouterr().out


def test_reconstruct_of_a_partitioned_log_confirms_in_the_partition_of_the_opening(tmp_path, ghost_in_the_filter,
                                                                                   no_ended_window, capsys):
    """``ghost`` is fresh in p0001 though p0000 also holds one; ``a``'s reuse in p0000 is refused, naming its partition."""
    from agentlog.events.log.partitions import open_partition

    root = _partitioned(tmp_path / "rollout", [["ghost", "a"], ["b", "ghost"]])
    assert main(["reconstruct", str(root), "--quiet"]) == 0
    root = _partitioned(tmp_path / "again", [["a", "c"], ["ghost"]])
    log = open_partition(root, 0, fsync="never")
    try:
        log.append_batch([("a", 0, SessionOpened(group_id="A2", group_size=1))])  # a reuse of a, in a group of its own
    finally:
        log.close()
    assert main(["reconstruct", str(root), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "partition p0000: lsn 4" in err and "'a'" in err and "reused" in err, err


def test_export_dataset_refuses_a_reuse_beyond_its_window_and_passes_a_false_positive(tmp_path, ghost_in_the_filter,
                                                                                      no_ended_window, capsys):
    _false_positive_log(tmp_path / "log")
    assert main(["export-dataset", str(tmp_path / "log"), "-o", str(tmp_path / "d.jsonl"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "lsn 5" in err and "'old'" in err and "reused" in err, err


def test_stats_counts_a_reuse_beyond_its_window_and_a_false_positive_as_a_session(tmp_path, ghost_in_the_filter,
                                                                                   no_ended_window, capsys):
    _false_positive_log(tmp_path / "log")
    main(["stats", str(tmp_path / "log"), "--json"])
    stats = json.loads(capsys.readouterr().out)
    assert stats["violations"]["by_kind"] == {"reused_id": 1}, stats["violations"]
    (first,) = stats["violations"]["first"]
    assert (first["lsn"], first["session_id"]) == (5, "old"), first
    assert stats["sessions"]["finished"] == 1, stats["sessions"]


def test_stats_of_a_partitioned_log_confirms_over_the_merged_records(tmp_path, ghost_in_the_filter, no_ended_window, capsys):
    root = _partitioned(tmp_path / "rollout", [["a", "c", "a"], ["b", "ghost"]])
    main(["stats", str(root), "--json"])
    stats = json.loads(capsys.readouterr().out)
    # The reuse at p0000:4 is refused; its drop at p0000:5 then follows a terminal event (as verify says too).
    assert [(v["lsn"], v["session_id"], v["kind"]) for v in stats["violations"]["first"]] == \
        [("p0000:4", "a", "reused_id"), ("p0000:5", "a", "after_terminal")], stats["violations"]


def test_the_reports_reducer_refuses_a_reuse_beyond_its_window_as_reconstruct_does_with_one_scan_an_opening(
        tmp_path, ghost_in_the_filter, no_ended_window):
    """The report's sample digest is reconstruct's: its reducer refuses ``old``'s reuse (reduce_problem) and
    folds ``ghost``; the lifecycle and the reducer ask about each opening once between them."""
    _false_positive_log(tmp_path / "log")
    source = check_log_path(str(tmp_path / "log"))
    made = []

    def confirm_for(pid):
        made.append(id_scans_of(source)(pid))
        return made[-1]

    data = collect(read_records(source, quiet=True), str(source), confirm_for=confirm_for)
    assert "lsn 5, session 'old'" in data.reduce_problem and "reused" in data.reduce_problem, data.reduce_problem
    assert len(made) == 1 and made[0].scans == 2  # ghost's opening and old's second one, each scanned once
