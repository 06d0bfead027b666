"""`agentlog stats` and `agentlog reconstruct` as subprocesses on an engine-written log."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from cli_helpers import EXPECTED, agentlog
from agentlog.reducers.samples import digest_samples
from agentlog.tools.cmd_reconstruct import read_msgpack_samples


def test_stats_json_counts_match_the_run(run_log):
    path, facts = run_log
    res = agentlog("stats", str(path), "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    sessions = EXPECTED["sessions"].values()
    by_status = {k: sum(1 for x in sessions if x["status"] == k) for k in ("finished", "aborted", "dropped", "running", "open")}
    assert s["sessions"]["total"] == len(EXPECTED["sessions"])
    for k, v in by_status.items():
        assert s["sessions"][k] == v, k
    assert s["abort_reasons"] == {"wall_clock_timeout": 1, "exception:ValueError": 1}
    assert s["drop_reasons"] == {"cancelled": 1}
    assert s["turns"]["total"] == sum(x["turns"] for x in sessions)
    assert s["tokens"] == {"prompt": EXPECTED["tokens_prompt"], "output": EXPECTED["tokens_output"]}
    rewards = [x["reward"] for x in sessions if x["status"] == "finished"]
    assert s["reward"]["count"] == len(rewards)
    assert math.isclose(s["reward"]["mean"], sum(rewards) / len(rewards))
    assert s["reward"]["min"] == min(rewards) and s["reward"]["max"] == max(rewards)
    g = s["groups"]
    assert {k: g[k] for k in ("released", "complete", "skipped", "pending")} == EXPECTED["groups"]
    assert s["events"] == facts["last_lsn"] + 1 and s["lsn_last"] == facts["last_lsn"]
    assert s["time_span"]["seconds"] > 0
    assert s["violations"]["count"] == 0


def test_stats_text_names_the_counts(run_log):
    path, _ = run_log
    res = agentlog("stats", str(path))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "sessions   8: finished 4, aborted 2, dropped 1, open 0, running 1" in out
    assert "wall_clock_timeout (1)" in out and "exception:ValueError (1)" in out
    assert "released 2: complete 1, skipped 1; pending 1" in out


def _digest_line(stdout: str) -> str:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("digest sha256:") and len(last) == len("digest sha256:") + 64, last
    return last.split()[1]


def test_reconstruct_prints_the_same_digest_twice_equal_to_the_online_reducer(run_log, tmp_path):
    path, facts = run_log
    a = agentlog("reconstruct", str(path), "-o", str(tmp_path / "a.msgpack"), "--format", "msgpack")
    b = agentlog("reconstruct", str(path), "-o", str(tmp_path / "b.jsonl"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert _digest_line(a.stdout) == _digest_line(b.stdout) == facts["online_digest"]
    # The msgpack file holds exactly the bytes the digest hashes.
    assert "sha256:" + hashlib.sha256((tmp_path / "a.msgpack").read_bytes()).hexdigest() == facts["online_digest"]
    samples = read_msgpack_samples(tmp_path / "a.msgpack")
    assert digest_samples(samples) == facts["online_digest"]
    lines = (tmp_path / "b.jsonl").read_text().splitlines()
    assert len(lines) == len(samples)
    rows = [json.loads(x) for x in lines]
    aborted = [r for r in rows if r["status"] == "aborted"]
    assert {r["session_id"] for r in aborted} == {"abort-0", "exc-1"}
    assert all(r["loss_mask"] == [0] and r["remove_sample"] and r["tokens"] == [0, 0] for r in aborted)
    assert not any(r["session_id"] in ("drop-2", "live-0") for r in rows)
    fin0 = next(r for r in rows if r["session_id"] == "fin-0")
    assert fin0["tokens"] == [1, 2, 3, 4, 10, 11, 12, 7, 8, 13, 14]
    assert fin0["loss_mask"] == [1, 1, 1, 0, 0, 1, 1]
    assert (fin0["temperature"], fin0["top_p"], fin0["top_k"]) == (1.0, 1.0, -1)  # the sampling it trains at
    assert [r["row_index"] for r in rows if r["session_id"] == "fork-2"] == [0, 1]


def test_reconstruct_parquet_holds_every_sample(run_log, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path, facts = run_log
    res = agentlog("reconstruct", str(path), "-o", str(tmp_path / "s.parquet"), "--format", "parquet")
    assert res.returncode == 0, res.stderr
    assert _digest_line(res.stdout) == facts["online_digest"]
    table = pq.read_table(tmp_path / "s.parquet")
    assert table.num_rows == int(res.stdout.split(": ")[1].split()[0])
    assert b"agentlog.reduce_config_digest" in table.schema.metadata
    fin0 = [r for r in table.to_pylist() if r["session_id"] == "fin-0"][0]
    assert fin0["loss_mask"] == [1, 1, 1, 0, 0, 1, 1]
    assert (fin0["temperature"], fin0["top_p"], fin0["top_k"]) == (1.0, 1.0, -1)  # the sampling it trains at


def test_reconstruct_options_change_the_samples_and_their_digest(run_log, tmp_path):
    path, facts = run_log
    res = agentlog("reconstruct", str(path), "-o", str(tmp_path / "c.jsonl"), "--max-context-tokens", "6")
    assert res.returncode == 0, res.stderr
    assert _digest_line(res.stdout) != facts["online_digest"]
    rows = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert all(len(r["tokens"]) <= 6 for r in rows if r["status"] != "aborted")


def test_reconstruct_trains_a_shared_turn_once_unless_repeated_targets_are_allowed(tmp_path):
    """A session that branches after its first response (two tool results): by default
    the shared response is a target in the first row only; --allow-repeated-targets
    trains it in both rows, and the digest says the samples differ."""
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded

    def turn(i, messages, prompt, output, content):
        return TurnRecorded(turn_index=i, messages=messages, prompt_ids=prompt, output_ids=output,
                            output_log_probs=[-0.5] * len(output), finish_reason="stop",
                            response_message={"role": "assistant", "content": content})

    system, user = {"role": "system", "content": "sys"}, {"role": "user", "content": "task"}
    a1 = {"role": "assistant", "content": "a1"}
    bodies = [
        SessionOpened(group_id="g", group_size=1, sample_index=0), SessionStarted(),
        turn(0, [system, user], [1, 2, 3], [10, 11], "a1"),
        turn(1, [system, user, a1, {"role": "tool", "content": "r1"}], [1, 2, 3, 10, 11, 20], [12], "a2"),
        turn(2, [system, user, a1, {"role": "tool", "content": "r1 retried"}], [1, 2, 3, 10, 11, 30], [13], "a3"),
        SessionFinished(reward=1.0),
    ]
    log_dir = tmp_path / "log"
    with FileLog.open(log_dir) as log:
        log.append_batch([("s", i, b) for i, b in enumerate(bodies)])
    masks, digests = {}, {}
    for name, extra in (("once", []), ("repeated", ["--allow-repeated-targets"])):
        out = tmp_path / f"{name}.jsonl"
        res = agentlog("reconstruct", str(log_dir), "-o", str(out), *extra)
        assert res.returncode == 0, res.stderr
        masks[name] = [json.loads(x)["loss_mask"] for x in out.read_text().splitlines()]
        digests[name] = _digest_line(res.stdout)
    assert masks["once"] == [[1, 1, 0, 1], [0, 0, 0, 1]]
    assert masks["repeated"] == [[1, 1, 0, 1], [1, 1, 0, 1]]
    assert digests["once"] != digests["repeated"]
