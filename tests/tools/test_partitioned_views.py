"""`agentlog show`, `trace`, `report` and `tail` on a partitioned run folder
(``rollout/p0000`` .. ``rollout/p0002``, each written by its own real
SessionEngine on its own FileLog, concurrently, so the partitions' records
interleave in time), and `verify`'s check across partitions. Every expected
value comes from reading each partition alone with ``read_log``, never from
the code under test."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from agentlog.events import read_log
from agentlog.events.log.partitions import open_partition, partition_dir
from agentlog.events.schema.types import SessionOpened, event_tag
from cli_helpers import read_lines_until
from test_cli_tail_report import _start_tail
from test_partitioned_run import cli

SYSTEM = {"role": "system", "content": "You are a coding agent."}
#: How each session ends, by partition (written by _write_partition below).
OUTCOMES = {
    0: {"p0-a": "finished", "p0-b": "finished"},
    1: {"p1-a": "finished", "p1-b": "aborted"},
    2: {"p2-a": "finished", "p2-b": "finished", "p2-live": "running"},
}


async def _write_partition(root: Path, pid: int) -> None:
    """One worker's partition: group g{pid} of two sessions (turns, a command,
    rewards; p1-b aborted), and in p0002 a session left running."""
    from agentlog.engine import SessionEngine

    log = open_partition(root, pid, fsync="never")
    eng = await SessionEngine.open(log, drain_s=0.1)

    async def turn(h, k: int) -> None:
        await h.record_turn(messages=[SYSTEM, {"role": "user", "content": f"task {pid}.{k}"}], prompt_ids=[1, 2, 3, 4 + k],
                            output_ids=[10 * pid + k, 7, 8], output_log_probs=[-0.5, -0.25, -0.125],
                            response_message={"role": "assistant", "content": f"reply {pid}.{k}"})
        await asyncio.sleep(0.002)  # let the other partitions' writers in: their records interleave in time

    a = await eng.open_session(f"p{pid}-a", group_id=f"g{pid}", group_size=2, sample_index=0)
    b = await eng.open_session(f"p{pid}-b", group_id=f"g{pid}", group_size=2, sample_index=1)
    await a.start(harness="test")
    await b.start(harness="test")
    await turn(a, 0)
    await a.record_command("pytest -x", 1, False, 0.01, "1 failed")
    await turn(b, 0)
    await turn(a, 1)
    await a.finish(reward=1.0)
    if pid == 1:
        await b.abort("wall_clock_timeout", error="budget of 1.0 s exhausted")
    else:
        await b.finish(reward=0.0)
    if pid == 2:
        live = await eng.open_session("p2-live", group_id="g2-live", group_size=1, sample_index=0)
        await live.start()
        await turn(live, 0)
    log.close()  # no engine.close(): p2-live stays running, as in a live run


def write_run(run: Path, pids=(0, 1, 2)) -> Path:
    """Write the partitions ``pids`` of ``run``'s rollout/ concurrently; returns rollout/."""

    async def all_of() -> None:
        await asyncio.gather(*(_write_partition(run / "rollout", pid) for pid in pids))

    asyncio.run(all_of())
    return run / "rollout"


def records(root: Path, pid: int) -> list:
    """Partition ``pid``'s envelopes, read alone."""
    return list(read_log(partition_dir(root, pid)))


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("views") / "run"
    write_run(run)
    return run


def test_the_partitions_interleave_in_time(run_folder):
    """The fixture's premise: a merged view is not partition after partition."""
    root = run_folder / "rollout"
    spans = {pid: (records(root, pid)[0].ts_ns, records(root, pid)[-1].ts_ns) for pid in OUTCOMES}
    assert all(spans[p][0] < spans[q][1] for p in spans for q in spans if p != q), spans


# ---------------------------------------------------------------- show


@pytest.mark.parametrize("sid,pid", [("p1-b", 1), ("p2-a", 2)])
@pytest.mark.parametrize("root", ["run folder", "partition root"])
def test_show_finds_the_session_in_its_partition_and_names_its_events(run_folder, capsys, sid, pid, root):
    where = run_folder if root == "run folder" else run_folder / "rollout"
    code, out, err = cli(capsys, "show", str(where), sid)
    assert code == 0, err
    mine = [e for e in records(run_folder / "rollout", pid) if e.session_id == sid]
    lines = out.splitlines()
    assert lines[0].startswith(f"session {sid}  group g{pid} [") and lines[0].endswith(f"partition p{pid:04d}")
    assert f"lsn p{pid:04d}:{mine[0].lsn}..p{pid:04d}:{mine[-1].lsn}" in lines[1]
    assert ("aborted (wall_clock_timeout)" if sid == "p1-b" else "finished") in lines[1]
    timeline = lines[lines.index("timeline") + 1:]
    timeline = timeline[: timeline.index("")]
    assert [line.split()[0] for line in timeline] == [f"p{pid:04d}:{e.lsn}" for e in mine]
    assert [line.split()[4] for line in timeline] == [event_tag(e.body) for e in mine]
    turn_lsns = [e.lsn for e in mine if event_tag(e.body) in ("turn_recorded", "turn_delta")]
    assert [m.group(1) for m in re.finditer(r"^  turn \d+ +lsn (\S+)", out, re.M)][: len(turn_lsns)] == [f"p{pid:04d}:{n}" for n in turn_lsns]


def test_show_of_a_session_id_in_two_partitions_names_both(run_folder, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_folder, run, ignore=shutil.ignore_patterns("LOCK"))
    log = open_partition(run / "rollout", 3, fsync="never")
    log.append_batch([("p0-a", 0, SessionOpened(group_id="x", group_size=1, sample_index=0))])
    log.close()
    first = records(run / "rollout", 0)
    a = [e.lsn for e in first if e.session_id == "p0-a"]
    code, _, err = cli(capsys, "show", str(run), "p0-a")
    assert code == 1 and f"p0000:{a[0]}..{a[-1]}" in err and "p0003:0..0" in err and "never spans partitions" in err, err
    code, out, _ = cli(capsys, "verify", str(run))
    assert code == 1 and f"  session 'p0-a': opened at p0000:{a[0]} and p0003:0" in out.splitlines(), out
    code, _, err = cli(capsys, "show", str(run), "nobody")
    assert code == 2 and "unknown session id 'nobody'" in err


# ---------------------------------------------------------------- trace


def test_trace_has_one_track_per_session_named_by_its_partition(run_folder, tmp_path, capsys):
    root = run_folder / "rollout"
    out_file = tmp_path / "trace.json"
    code, out, err = cli(capsys, "trace", str(run_folder), "-o", str(out_file))
    assert code == 0, err
    trace = json.loads(out_file.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    expected = {sid: pid for pid, sessions in OUTCOMES.items() for sid in sessions}
    assert sorted(n.split()[0] for n in names.values()) == sorted(expected)
    assert all(n.endswith(f" p{expected[n.split()[0]]:04d}") for n in names.values()), names
    sid_of = {tid: n.split()[0] for tid, n in names.items()}
    # Every session's span and terminal event; the running one as in flight.
    spans = {sid_of[e["tid"]]: e for e in events if e.get("cat") == "session"}
    assert {sid: e["args"]["status"] for sid, e in spans.items()} == {
        sid: ("in flight" if st == "running" else st) for pid in OUTCOMES for sid, st in OUTCOMES[pid].items()}
    assert all(e["args"]["partition"] == f"p{expected[sid]:04d}" for sid, e in spans.items())
    # Each turn and command span names the record it ends at, which is that session's turn or command.
    by_at = {f"p{pid:04d}:{e.lsn}": e for pid in OUTCOMES for e in records(root, pid)}
    work = [e for e in events if e.get("cat") in ("turn", "command")]
    n_work = sum(event_tag(e.body) in ("turn_recorded", "turn_delta", "command_ran") for e in by_at.values())
    assert len(work) == n_work
    for e in work:
        rec = by_at[e["args"]["at"]]
        assert rec.session_id == sid_of[e["tid"]] and event_tag(rec.body).startswith("turn" if e["cat"] == "turn" else "command")
    other = trace["otherData"]
    assert other["skipped"] == 0 and other["sessions"] == len(expected)
    assert other["partitions"] == {f"p{pid:04d}": {"sessions": len(OUTCOMES[pid]), "events": len(records(root, pid))} for pid in OUTCOMES}


# ---------------------------------------------------------------- report


def test_report_adds_per_partition_counts_to_the_merged_aggregates(run_folder, tmp_path, capsys):
    from agentlog.reducers.pipeline import Reducer

    root = run_folder / "rollout"
    page_file = tmp_path / "report.html"
    code, out, err = cli(capsys, "report", str(root), "-o", str(page_file))
    assert code == 0, err
    page = page_file.read_text()
    assert "lifecycle violation" not in page and "reducer stopped" not in page
    rows = {m.group(1): m.group(0) for m in re.finditer(r"<tr data-partition='(p\d{4})'[^>]*>", page)}
    assert sorted(rows) == ["p0000", "p0001", "p0002"]
    for pid, sessions in OUTCOMES.items():
        row = rows[f"p{pid:04d}"]
        assert f"data-events='{len(records(root, pid))}'" in row and f"data-sessions='{len(sessions)}'" in row
        for outcome in ("finished", "aborted", "running"):
            assert f"data-{outcome}='{list(sessions.values()).count(outcome)}'" in row, (pid, outcome, row)
        # The partition's digest is that of its samples reduced alone.
        alone = Reducer()
        alone.feed_many(records(root, pid))
        assert alone.digest.hexdigest() in page
    total = {o: sum(list(s.values()).count(o) for s in OUTCOMES.values()) for o in ("finished", "aborted", "running")}
    assert re.search(rf"data-status=\"finished\" data-count=\"{total['finished']}\"", page)
    assert f"{sum(total.values())} sessions (aborted 1, finished {total['finished']}, running 1)" in out
    assert "  p0001: " in out and f"{len(records(root, 1))} events, 2 sessions (finished 1, aborted 1)" in out
    assert "<b>p1-b</b> · p0001 · group g1" in page


# ---------------------------------------------------------------- tail


def test_tail_follows_every_partition_including_ones_made_after_it_started(tmp_path):
    run = tmp_path / "run"
    (run / "rollout").mkdir(parents=True)
    (run / "config.json").write_text("{}")  # a run folder whose rollout/ is still empty
    tail = _start_tail(str(run))
    time.sleep(1.0)
    assert tail.poll() is None, tail.stderr.read()
    root = write_run(run, pids=(0, 1))
    n_first = len(records(root, 0)) + len(records(root, 1))
    third: list[int] = []

    def done(lines: list[str]) -> bool:
        if not third and len(lines) >= n_first:
            write_run(run, pids=(2,))  # a new worker's partition, once tail shows the first two
            third.append(len(records(root, 2)))
            return False
        return bool(third) and len(lines) >= n_first + third[0]

    lines = read_lines_until(tail, done)
    assert tail.returncode in (0, 130), tail.stderr.read()
    want = [f"p{pid:04d}:{e.lsn}" for pid in OUTCOMES for e in records(root, pid)]
    labels = [line.split()[0] for line in lines]
    assert sorted(labels) == sorted(want), (labels, want)
    assert all(label.startswith("p0002:") for label in labels[n_first:])
    # Within a partition, in LSN order; each line's states come from its own partition's fold.
    for pid in OUTCOMES:
        assert [x for x in labels if x.startswith(f"p{pid:04d}:")] == [x for x in want if x.startswith(f"p{pid:04d}:")]
    assert all("!!" not in line for line in lines), lines
    assert any(line.split()[0].startswith("p0001:") and " p1-b " in line and "running -> aborted" in line for line in lines)


def test_tail_summary_counts_over_every_partition(run_folder):
    tail = _start_tail(str(run_folder), "--summary")
    last = " ".join(f"p{pid:04d}:{records(run_folder / 'rollout', pid)[-1].lsn}" for pid in OUTCOMES)
    want = f"lsn {last}: open 0 running 1 finished 5 aborted 1 dropped 0 | groups released 3"
    lines = read_lines_until(tail, lambda ls: any(want in line for line in ls))
    assert any(want in line for line in lines), lines
