"""`agentlog ui`'s HTTP API and on-disk index, on the real server (tests/tools/ui_helpers.py).

Filters are checked against what `agentlog replay` selects for the same
question, and each row's mask against what `agentlog reconstruct` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ui_helpers import start_ui, ui_run  # noqa: F401  (ui_run is a fixture)


def _get(url: str, *, method: str = "GET", headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _ok(url: str) -> dict:
    status, body = _get(url)
    assert status == 200, (url, body)
    return body


def _cli(*args: str) -> str:
    """The real `agentlog` command, run in this process (stdout)."""
    from agentlog.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    assert rc == 0, (args, out.getvalue()[-500:])
    return out.getvalue()


def _ids(url: str, **params: str) -> set[str]:
    query = "&".join(f"{k}={urllib.request.quote(v)}" for k, v in {**params, "limit": "1000"}.items())
    body = _ok(f"{url}/api/sessions?{query}")
    assert body["total"] == len(body["rows"])
    return {r["session_id"] for r in body["rows"]}


@pytest.fixture(scope="module")
def log_ui(ui_run, tmp_path_factory):  # noqa: F811
    """The server on the CLI tests' engine log (index in a temporary file)."""
    url, stop = start_ui(ui_run.log, index_path=tmp_path_factory.mktemp("ui") / "log.sqlite")
    yield url
    stop()


@pytest.fixture(scope="module")
def demo_ui(ui_run, tmp_path_factory):  # noqa: F811
    """The server on the short demo's run folder (rollout + learner)."""
    url, stop = start_ui(ui_run.demo, index_path=tmp_path_factory.mktemp("ui") / "demo.sqlite")
    yield url
    stop()


def test_filters_select_what_replay_selects(ui_run, log_ui, demo_ui):  # noqa: F811
    for log, url in ((ui_run.log, log_ui), (ui_run.demo, demo_ui)):
        run = _ok(f"{url}/api/run")
        questions = [("--status", "status", s) for s in ("finished", "aborted", "dropped", "running")
                     if run["sessions"][s]]
        questions += [("--reason", "reason", r) for r in run["reasons"]]
        questions += [("--flag", "flag", f) for f in run["flags"]]
        assert len(questions) >= 6, run
        for option, param, value in questions:
            events = [json.loads(line) for line in _cli("replay", str(log), option, value, "--json", "-q").splitlines()]
            assert _ids(url, **{param: value}) == {e["session_id"] for e in events}, (log, option, value)


def test_run_view_counts_the_sessions_and_steps(ui_run, log_ui, demo_ui):  # noqa: F811
    expected = ui_run.log_facts and __import__("cli_helpers").EXPECTED["sessions"]
    run = _ok(f"{log_ui}/api/run")
    assert run["sessions"] == {"total": 8, "finished": 4, "aborted": 2, "dropped": 1, "running": 1, "open": 0}
    assert run["reasons"] == {"wall_clock_timeout": 1, "exception:ValueError": 1, "cancelled": 1}
    assert run["live"] is True and "error" not in run and run["steps"] == []
    rows = {r["session_id"]: r for r in _ok(f"{log_ui}/api/sessions?limit=100")["rows"]}
    for sid, want in expected.items():
        assert (rows[sid]["group_id"], rows[sid]["status"], rows[sid]["turns"]) == (want["group"], want["status"], want["turns"])
    demo = _ok(f"{demo_ui}/api/run")
    assert [s["step"] for s in demo["steps"]] == [0, 1, 2] and demo["steps"][1]["trained_groups"] >= 1


def test_paging_and_sorting(log_ui):
    all_rows = _ok(f"{log_ui}/api/sessions?sort=session_id&limit=100")["rows"]
    assert [r["session_id"] for r in all_rows] == sorted(r["session_id"] for r in all_rows)
    pages = [_ok(f"{log_ui}/api/sessions?sort=-session_id&limit=3&offset={o}") for o in (0, 3, 6)]
    assert all(p["total"] == 8 for p in pages) and [len(p["rows"]) for p in pages] == [3, 3, 2]
    assert [r["session_id"] for p in pages for r in p["rows"]] == sorted((r["session_id"] for r in all_rows), reverse=True)
    by_reward = _ok(f"{log_ui}/api/sessions?sort=-reward&limit=100")["rows"]
    rewards = [r["reward"] for r in by_reward if r["reward"] is not None]
    assert rewards == sorted(rewards, reverse=True) and by_reward[-1]["reward"] is None  # no reward: last
    assert _ids(log_ui, min_reward="0.5") == {"fin-0", "fork-2", "strag-3"}
    assert _ids(log_ui, group="g-bad", status="finished") == {"strag-3"}


def test_text_search_finds_messages_command_output_and_errors(log_ui):
    assert _ids(log_ui, q="1 failed") == {"fin-0"}  # a command's output
    assert _ids(log_ui, q="Fix bug 2") == {"fork-2"}  # a user message
    assert _ids(log_ui, q="budget of 1.0 s exhausted") == {"abort-0"}  # an abort's error
    assert _ids(log_ui, q="no such words anywhere") == set()


def test_each_rows_mask_is_the_mask_reconstruct_writes(ui_run, log_ui, demo_ui, tmp_path):  # noqa: F811
    for log, url in ((ui_run.log, log_ui), (ui_run.demo, demo_ui)):
        out = tmp_path / f"{Path(log).name}.jsonl"
        _cli("reconstruct", str(log), "-o", str(out), "-q")
        written: dict[str, list] = {}
        for line in out.read_text().splitlines():
            s = json.loads(line)
            written.setdefault(s["session_id"], []).append(s)
        assert len(written) >= 5
        for sid, samples in written.items():
            view = _ok(f"{url}/api/session/{sid}")
            rows = {r["row"]: r for r in view["rows"]}
            assert sorted(rows) == sorted(s["row_index"] for s in samples), sid
            for s in samples:
                r = rows[s["row_index"]]
                n_prompt = len(s["tokens"]) - s["response_length"]
                assert r["tokens"] == s["tokens"], sid
                assert r["mask"] == [0] * n_prompt + s["loss_mask"], sid
                assert [k == "trained" for k in r["kinds"]] == [m == 1 for m in r["mask"]], sid
                assert r["kinds"][:n_prompt] == ["prompt"] * n_prompt
                assert len(r["rollout_logprob"]) == len(r["teacher_logprob"]) == len(r["version"]) == len(r["tokens"])


def test_session_view_kinds_forks_and_abort_details(log_ui):
    fin = _ok(f"{log_ui}/api/session/fin-0")
    (row,) = fin["rows"]
    assert list(zip(row["tokens"], row["kinds"])) == [
        (1, "prompt"), (2, "prompt"), (3, "prompt"), (4, "prompt"), (10, "trained"), (11, "trained"), (12, "trained"),
        (7, "tool"), (8, "tool"), (13, "trained"), (14, "trained")]
    assert fin["commands"][0]["command"] == "pytest -x" and fin["commands"][0]["output"] == "1 failed"
    assert [t["turn"] for t in fin["turns"]] == [0, 1] and any("reward" in line for line in fin["why"])
    fork = _ok(f"{log_ui}/api/session/fork-2")
    assert [b["turns"] for b in fork["forks"]["branches"]] == [[0], [1]] and fork["forks"]["train_once"]["ok"] is True
    exc = _ok(f"{log_ui}/api/session/exc-1")
    assert exc["status"] == "aborted" and "ValueError" in (exc["traceback"] or "") and "the agent crashed" in exc["error"]
    status, body = _get(f"{log_ui}/api/session/nope")
    assert status == 404 and "'nope'" in body["error"]


def test_group_step_and_reconstruct_views(demo_ui, ui_run):  # noqa: F811
    from agentlog.events.log.source import open_source

    records = {e.body.step: e.body for e in open_source(str(ui_run.demo / "learner")).read()}
    run = _ok(f"{demo_ui}/api/run")
    for step in run["steps"][1:]:
        view = _ok(f"{demo_ui}/api/step/{step['step']}")
        rec = records[step["step"]]
        assert view["policy_version"] == step["policy_version"]
        assert sum(g["trained"] for g in view["groups"]) == step["trained_groups"]
        # The learner's own metrics and decisions, as its record holds them.
        finite = {k: v if math.isfinite(v) else None for k, v in rec.metrics.items()}  # JSON has no NaN: null
        assert view["metrics"] == finite
        assert {g["group_id"] for g in view["groups"] if g["trained"]} == set(rec.groups)
        for g in view["groups"]:
            assert g["skip_reason"] == (rec.skipped.get(g["group_id"]) or None), g
            # Staleness as the learner judged it: its version before this update minus the oldest
            # version that generated the group's trained sessions (read from the sessions table).
            members = _ok(f"{demo_ui}/api/sessions?group={g['group_id']}&status=finished&limit=100")["rows"]
            assert g["staleness"] == rec.policy_version - 1 - min(m["version_min"] for m in members), g
        check = _ok(f"{demo_ui}/api/step/{step['step']}/reconstruct")
        assert check["equal"] is True and check["online_digest"] == check["offline_digest"], check
        trained = next(g for g in view["groups"] if g["trained"])
        group = _ok(f"{demo_ui}/api/group/{trained['group_id']}")
        assert group["step"] == step["step"]
        assert {m["session_id"] for m in trained["members"]} <= {m["session_id"] for m in group["members"]}
        baseline = [m for m in group["members"] if m["in_baseline"]]
        assert all(m["advantage"] is not None for m in baseline)
        assert all(m["excluded_why"] for m in group["members"] if not m["in_baseline"])
    assert _get(f"{demo_ui}/api/step/999")[0] == 404


def test_bad_parameters_are_a_400_naming_them(log_ui):
    for query, named in (("limit=-1", "limit"), ("limit=abc", "limit"), ("offset=x", "offset"), ("sort=colour", "sort"),
                         ("status=sleeping", "status"), ("flag=shiny", "flag"), ("min_reward=high", "min_reward"),
                         ("version=v1", "version"), ("colour=red", "colour")):
        status, body = _get(f"{log_ui}/api/sessions?{query}")
        assert status == 400 and named in body["error"], (query, body)
    assert _get(f"{log_ui}/api/step/abc")[0] == 400


def test_out_of_range_and_odd_values_are_a_400_or_an_answer_never_a_crash(log_ui):
    huge = "99999999999999999999999"
    for query, named in ((f"version={huge}", "version"), (f"offset={huge}", "offset"), (f"offset=-{huge}", "offset"),
                         (f"limit={huge}", "limit")):
        status, body = _get(f"{log_ui}/api/sessions?{query}")
        assert status == 400 and body["error"].startswith(f"/api/sessions: {named}:"), (query, body)
    assert _get(f"{log_ui}/api/step/{huge}")[0] == 400
    assert _ok(f"{log_ui}/api/sessions?offset={2**63 - 1}")["rows"] == []
    for q in ("%00", "a%00b", "%22%00%22", "NEAR(", "*"):  # NUL, quotes, FTS syntax: searched as text
        assert _ok(f"{log_ui}/api/sessions?q={q}")["rows"] == [], q


def test_an_unexpected_error_is_a_json_500_logged_without_the_token(ui_run, tmp_path):  # noqa: F811
    from structlog.testing import capture_logs

    url, stop = start_ui(ui_run.log, host="0.0.0.0", token="s3cret", index_path=tmp_path / "i.sqlite")
    url = url.replace("0.0.0.0", "127.0.0.1")

    def broken() -> list:  # a fault inside a view, as a bug there would raise
        raise RuntimeError("views broke")

    stop.server.views.step_summaries = broken  # type: ignore[attr-defined]
    try:
        with capture_logs() as logs:
            status, body = _get(f"{url}/api/run?token=s3cret")
        assert status == 500 and body == {"error": "/api/run: internal error (RuntimeError); see the server log"}
        failed = [e for e in logs if e["event"] == "ui.request.failed"]
        assert failed and failed[0]["path"] == "/api/run" and "views broke" in str(failed[0]), logs
        assert "s3cret" not in repr(logs)
    finally:
        stop()


def test_a_tokenless_server_answers_only_loopback_host_names(log_ui):
    port = log_ui.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert _get(f"{log_ui}/api/run", headers={"Host": host})[0] == 200, host
    for host in (f"evil.example:{port}", "127.0.0.1.evil.example", f"192.168.1.2:{port}", "[::2]"):
        status, body = _get(f"{log_ui}/api/sessions", headers={"Host": host})
        assert status == 403 and repr(host) in body["error"] and "loopback" in body["error"], host


def test_read_only_every_other_method_is_405(log_ui):
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/api/run", "/api/sessions", "/"):
            status, body = _get(f"{log_ui}{path}", method=method)
            assert status == 405 and "read-only" in body["error"], (method, path)


def test_a_token_is_required_off_loopback_and_checked_on_every_request(ui_run, tmp_path):  # noqa: F811
    from agentlog.tools.cli import CliError

    with pytest.raises(CliError, match="--token"):
        start_ui(ui_run.log, host="0.0.0.0", index_path=tmp_path / "a.sqlite")
    url, stop = start_ui(ui_run.log, host="0.0.0.0", token="s3cret", index_path=tmp_path / "b.sqlite")
    url = url.replace("0.0.0.0", "127.0.0.1")
    try:
        for path in ("/api/run", "/api/sessions", "/api/session/fin-0", "/api/stream", "/", "/static/app.js"):
            status, body = _get(f"{url}{path}")
            assert status == 401 and "token" in body["error"], path
            assert _get(f"{url}{path}?token=wrong")[0] == 401
            assert _get(f"{url}{path}", headers={"Authorization": "Bearer nope"})[0] == 401
        assert _get(f"{url}/api/run?token=s3cret")[0] == 200
        assert _get(f"{url}/api/sessions", headers={"Authorization": "Bearer s3cret"})[0] == 200
    finally:
        stop()


def test_the_index_is_reused_on_a_second_start(ui_run, tmp_path):  # noqa: F811
    index = tmp_path / "index.sqlite"
    url, stop = start_ui(ui_run.demo, index_path=index)
    first = _ok(f"{url}/api/run")["index"]
    stop()
    assert first["resumed"] is False and first["records_read"] > 100 and first["sessions"] == 48
    url, stop = start_ui(ui_run.demo, index_path=index)
    try:
        again = _ok(f"{url}/api/run")["index"]
    finally:
        stop()
    assert again["resumed"] is True and again["rebuilt_why"] is None
    assert again["records_read"] == 0 and again["sessions"] == 48 and again["built_to"] == first["built_to"]
    assert again["build_s"] < max(first["build_s"], 0.05)
    # A log with a session in flight: a reused start reads only that session's records again.
    from agentlog.tools.cli_common import check_log_path

    ix = _open_index(ui_run.log, tmp_path / "log.sqlite")
    ix.catch_up()
    ix.close()
    ix = _open_index(ui_run.log, tmp_path / "log.sqlite")
    try:
        (running,) = ix.query(status="running")[1]
        ix.catch_up()
        in_flight = [e for e in check_log_path(str(ui_run.log)).read() if e.session_id == running["session_id"]]
        assert ix.resumed and ix.rebuilt_why is None and ix.records_read == len(in_flight) > 0
    finally:
        ix.close()


def test_a_log_whose_identity_changed_is_rebuilt_saying_why(ui_run, tmp_path):  # noqa: F811
    index, log = tmp_path / "index.sqlite", tmp_path / "log"
    shutil.copytree(ui_run.log, log, ignore=shutil.ignore_patterns("LOCK"))
    url, stop = start_ui(log, index_path=index)
    stop()
    shutil.rmtree(log)
    shutil.copytree(ui_run.demo / "rollout", log, ignore=shutil.ignore_patterns("LOCK"))  # another log, same name
    url, stop = start_ui(log, index_path=index)
    try:
        ix = _ok(f"{url}/api/run")["index"]
        assert "first record changed" in ix["rebuilt_why"] and ix["resumed"] is False and ix["sessions"] == 48
        assert _get(f"{url}/api/session/fin-0")[0] == 404
    finally:
        stop()


def test_a_live_log_shows_new_sessions_on_the_api_and_the_stream_within_2_s(tmp_path):
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted

    path = tmp_path / "live"
    writer = FileLog.open(path, fsync="batch")

    def write(sid: str) -> None:
        writer.append_batch([(sid, 0, SessionOpened(group_id="g", group_size=1)), (sid, 1, SessionStarted()),
                             (sid, 2, SessionFinished(reward=1.0))])

    write("first")
    url, stop = start_ui(path, index_path=tmp_path / "index.sqlite")
    events: list[tuple[str, dict]] = []
    connected = threading.Event()

    def listen() -> None:
        with urllib.request.urlopen(f"{url}/api/stream", timeout=10) as resp:
            kind = None
            for raw in resp:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[len("data: "):])))
                    connected.set()
                    if kind == "session" and events[-1][1]["session_id"] == "second":
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        assert connected.wait(5), "the stream sent nothing"
        assert _ids(url) == {"first"}
        written = time.monotonic()
        write("second")
        while time.monotonic() - written < 2.0 and "second" not in _ids(url):
            time.sleep(0.05)
        assert _ids(url) == {"first", "second"}, "a new session did not reach /api/sessions within 2 s"
        listener.join(max(0.1, 2.0 - (time.monotonic() - written)))
        assert not listener.is_alive(), f"a new session did not reach /api/stream within 2 s: {events}"
        pushed = [d for k, d in events if k == "session"]
        assert pushed[-1]["session_id"] == "second" and pushed[-1]["status"] == "finished" and pushed[-1]["reward"] == 1.0
        assert _ok(f"{url}/api/run")["live"] is True
    finally:
        stop()
        writer.close()


def _write_sessions(writer, ids, *, end: bool = True, start: bool = True) -> None:
    from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted

    batch = []
    for sid in ids:
        batch.append((sid, 0, SessionOpened(group_id="g", group_size=1)))
        if start:
            batch.append((sid, 1, SessionStarted()))
        if end:
            batch.append((sid, 2, SessionFinished(reward=1.0)))
    writer.append_batch(batch)


def _open_index(log, path):
    from agentlog.tools.cli_common import check_log_path, reduce_config_of
    from agentlog.tools.ui.index import SessionIndex

    source = check_log_path(str(log))
    return SessionIndex(source, Path(path), reduce_config_of(source))


def _index_content(ix) -> tuple[list, list]:
    rows = [{k: v for k, v in r.items()} for r in ix.query(limit=1000, sort="session_id")[1]]
    texts = sorted(ix._reader.execute("SELECT session_id, body FROM session_text").fetchall())
    return rows, texts


def test_memory_holds_only_the_sessions_in_flight(ui_run, tmp_path):  # noqa: F811
    ix = _open_index(ui_run.log, tmp_path / "i.sqlite")
    try:
        ix.catch_up()
        in_flight = {r["session_id"] for r in ix.query(limit=1000)[1] if r["status"] in ("open", "running")}
        assert ix.count() == 8 and len(in_flight) == 1
        assert set(ix._fold.live) == set(ix._live) == in_flight  # no ended session's transcript or health is kept
    finally:
        ix.close()


def test_open_sessions_are_counted_apart_from_running_ones(tmp_path):
    from agentlog.events import FileLog

    writer = FileLog.open(tmp_path / "log", fsync="batch")
    _write_sessions(writer, ["done"])
    _write_sessions(writer, ["busy"], end=False)
    _write_sessions(writer, ["queued"], end=False, start=False)
    writer.close()
    url, stop = start_ui(tmp_path / "log", index_path=tmp_path / "i.sqlite")
    try:
        assert _ok(f"{url}/api/run")["sessions"] == {"total": 3, "finished": 1, "aborted": 0, "dropped": 0,
                                                     "running": 1, "open": 1}
        assert _ids(url, status="running") == {"busy"} and _ids(url, status="open") == {"queued"}
    finally:
        stop()


def test_a_second_opener_of_the_same_index_is_refused_naming_the_lock(ui_run, tmp_path):  # noqa: F811
    import os

    from agentlog.tools.cli import CliError
    from agentlog.tools.ui.index import IndexLockedError

    index = tmp_path / "i.sqlite"
    url, stop = start_ui(ui_run.log, index_path=index)
    try:
        with pytest.raises(IndexLockedError, match=f"pid {os.getpid()}.*{index}.lock"):
            _open_index(ui_run.log, index)
        with pytest.raises(CliError, match=f"{index}.lock"):
            start_ui(ui_run.log, index_path=index)
        assert _ok(f"{url}/api/run")["index"]["sessions"] == 8  # the first server goes on
    finally:
        stop()
    ix = _open_index(ui_run.log, index)  # released on stop
    ix.close()


def test_stop_during_a_long_build_waits_for_it_and_a_restart_resumes(tmp_path):
    from structlog.testing import capture_logs

    from agentlog.events import FileLog

    writer = FileLog.open(tmp_path / "log", fsync="batch")
    for b in range(30):
        _write_sessions(writer, [f"s{i:05d}" for i in range(b * 500, b * 500 + 500)])
    writer.close()
    total = 30 * 500 * 3
    with capture_logs() as logs:
        url, stop = start_ui(tmp_path / "log", index_path=tmp_path / "i.sqlite", wait_indexed=False)
        ix = stop.server.index  # type: ignore[attr-defined]
        started = time.monotonic()
        # Until the build has folded its first record (under load it can take longer than a fixed sleep to start;
        # records_read counts only when a pass ends): then stop it while it runs.
        while ix._record is None and time.monotonic() - started < 30:
            time.sleep(0.002)
        stopped = time.monotonic()
        stop()
        assert time.monotonic() - stopped < 5.0
    assert 0 < ix.records_read < total, "the build was not stopped part way (or never started)"
    assert not [e for e in logs if e.get("log_level") in ("error", "critical")], logs
    again = _open_index(tmp_path / "log", tmp_path / "i.sqlite")
    ref = _open_index(tmp_path / "log", tmp_path / "ref.sqlite")
    try:
        assert again.resumed and again.rebuilt_why is None
        again.catch_up()
        ref.catch_up()
        # On from where the stopped build got to (the one session in flight there is folded again).
        assert total - ix.records_read <= again.records_read <= total - ix.records_read + 3
        assert again.count() == ref.count() == 15000
        assert _index_content(again) == _index_content(ref)
    finally:
        again.close()
        ref.close()


def test_an_sse_client_that_falls_behind_is_dropped(tmp_path):
    import asyncio

    from agentlog.events import FileLog
    from agentlog.tools.ui.server import SSE_QUEUE_MAX

    writer = FileLog.open(tmp_path / "log", fsync="batch")
    _write_sessions(writer, ["one"])
    writer.close()
    url, stop = start_ui(tmp_path / "log", index_path=tmp_path / "i.sqlite")
    ui = stop.server  # type: ignore[attr-defined]
    try:
        with urllib.request.urlopen(f"{url}/api/stream", timeout=10) as resp:
            assert resp.readline().startswith(b"event: index")
            while not ui._clients:
                time.sleep(0.01)

            async def flood() -> None:  # no await: the stream's handler cannot drain the queue meanwhile
                for n in range(SSE_QUEUE_MAX + 1):
                    ui._push("index", {"n": n})

            asyncio.run_coroutine_threadsafe(flood(), ui.follower.get_loop()).result(10)
            rest = resp.read()  # the server ends the stream
        assert b'"n": 1' not in rest and not ui._clients
    finally:
        stop()


def test_a_port_in_use_is_a_usage_error_naming_it(ui_run, tmp_path, capsys):  # noqa: F811
    import socket

    from agentlog.tools.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = main(["ui", str(ui_run.log), "--port", str(port), "--index", str(tmp_path / "i.sqlite"), "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and f"127.0.0.1:{port}" in err and "--port 0" in err, err
    _open_index(ui_run.log, tmp_path / "i.sqlite").close()  # the failed start released the index


def test_an_index_built_in_pieces_with_restarts_equals_one_built_in_one_go(tmp_path):
    """The CLI tests' engine-written log, appended in random pieces (sessions in flight at the
    cuts), indexed after each piece by the same or a new SessionIndex on the same file."""
    import asyncio
    import random

    from cli_helpers import write_run

    from agentlog.events import FileLog
    from agentlog.tools.cli_common import check_log_path

    asyncio.run(write_run(tmp_path / "src"))
    envs = list(check_log_path(str(tmp_path / "src")).read())
    ref = _open_index(tmp_path / "src", tmp_path / "ref.sqlite")
    ref.catch_up()
    want = _index_content(ref)
    ref.close()
    assert len(want[0]) == 8 and any(r["status"] == "running" for r in want[0])
    for trial in range(12):
        rng = random.Random(trial)
        d = tmp_path / f"t{trial}"
        writer = FileLog.open(d / "log", fsync="batch")
        cuts = sorted(rng.sample(range(1, len(envs)), rng.randint(1, 6))) + [len(envs)]
        restart = trial % 2 == 0
        done, ix = 0, None
        try:
            for cut in cuts:
                writer.append_batch([(e.session_id, e.session_seq, e.body) for e in envs[done:cut]])
                done = cut
                if ix is None or restart:
                    if ix is not None:
                        ix.close()
                    ix = _open_index(d / "log", d / "ix.sqlite")
                ix.catch_up()
            got = _index_content(ix)
        finally:
            writer.close()
            if ix is not None:
                ix.close()
        assert [{k: v for k, v in r.items() if k != "first_ts"} for r in got[0]] == \
               [{k: v for k, v in r.items() if k != "first_ts"} for r in want[0]], (trial, cuts, restart)
        assert got[1] == want[1], (trial, cuts, restart)


def test_each_abort_bar_opens_exactly_the_sessions_it_counts(tmp_path):
    """For every bucket of /api/run aborts_over_time, /api/sessions?reason=R&since=..&until=.. lists
    exactly ``count`` sessions, and together the buckets list each abort and drop once. The opening
    times sit on bucket edges (lo + k * width), where a bucket computed by division and a filter
    by comparison would disagree."""
    import random

    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionOpened, SessionStarted

    now_ns = [0]
    writer = FileLog.open(tmp_path / "log", fsync="batch", clock=lambda: now_ns[0])
    base, rng = 1_767_000_000_123_456_789, random.Random(7)
    offsets = sorted([k * 100_000_000 for k in range(31)] + [rng.randrange(3_000_000_000) for _ in range(40)])
    expected: dict[str, str] = {}
    for i, offset in enumerate(offsets):
        sid, reason = f"s{i:03d}", ("cancelled", "wall_clock_timeout", "exception:ValueError")[i % 3]
        now_ns[0] = base + offset
        end = SessionDropped(reason=reason) if i % 4 == 0 else SessionAborted(reason=reason)
        writer.append_batch([(sid, 0, SessionOpened(group_id="g", group_size=1)), (sid, 1, SessionStarted()), (sid, 2, end)])
        expected[sid] = reason
    writer.close()
    url, stop = start_ui(tmp_path / "log", index_path=tmp_path / "i.sqlite")
    try:
        buckets = _ok(f"{url}/api/run")["aborts_over_time"]
        assert len({b["bucket_ts"] for b in buckets}) >= 25, buckets
        listed: list[str] = []
        for b in buckets:
            got = _ids(url, reason=b["reason"], since=repr(b["bucket_ts"]), until=repr(b["bucket_end"]))
            assert len(got) == b["count"] and {expected[s] for s in got} == {b["reason"]}, b
            listed += got
        assert sorted(listed) == sorted(expected)  # every abort and drop in exactly one bucket
        for query in ("since=soon", "until=nan"):
            status, body = _get(f"{url}/api/sessions?{query}")
            assert status == 400 and query.split("=")[0] in body["error"], (query, body)
    finally:
        stop()


def test_partition_and_version_filters_select_by_hand(tmp_path):
    """A partitioned log (p0000, p0001, each its own engine) whose sessions' turns were generated at
    known policy versions: ``partition`` selects a partition's sessions, ``version`` the sessions whose
    turns span that version (a partial rollout's turn spans both of its versions)."""
    from agentlog.engine import SessionEngine
    from agentlog.events.log.partitions import open_partition

    root = tmp_path / "rollout"
    # partition -> session -> each turn's (policy_version, version_spans or None)
    written: dict[int, dict[str, list[tuple[int, list | None]]]] = {0: {"a0": [(0, None), (1, None)], "b0": [(2, None)]},
                                                                   1: {"a1": [(1, None)], "b1": [(3, [(0, 3), (1, 4)])]}}

    async def write(pid: int) -> None:
        log = open_partition(root, pid, fsync="never")
        eng = await SessionEngine.open(log, drain_s=0.1)
        for k, (sid, turns) in enumerate(written[pid].items()):
            h = await eng.open_session(sid, group_id=f"g{pid}", group_size=2, sample_index=k)
            await h.start()
            prompt = [1, 2, 3]
            for version, spans in turns:
                extra: dict[str, Any] = {"version_spans": spans} if spans else {}
                await h.record_turn(messages=[{"role": "user", "content": sid}], prompt_ids=prompt, output_ids=[7, 8],
                                    output_log_probs=[-0.5, -0.5], policy_version=version, **extra)
                prompt = prompt + [7, 8, 9]
            await h.finish(reward=1.0)
        await eng.close()
        log.close()

    for pid in written:
        asyncio.run(write(pid))
    url, stop = start_ui(root, index_path=tmp_path / "i.sqlite")
    try:
        assert _ids(url, partition="p0000") == {"a0", "b0"} and _ids(url, partition="p0001") == {"a1", "b1"}
        assert _ids(url, partition="p0002") == set()
        assert _ids(url, version="0") == {"a0"}
        assert _ids(url, version="1") == {"a0", "a1"}
        assert _ids(url, version="2") == {"b0"}
        assert _ids(url, version="3") == _ids(url, version="4") == {"b1"}
        assert _ids(url, version="5") == set()
        assert _ids(url, partition="p0000", version="1") == {"a0"}
        rows = {r["session_id"]: r for r in _ok(f"{url}/api/sessions?limit=100")["rows"]}
        assert {sid: (r["partition"], r["version_min"], r["version_max"]) for sid, r in rows.items()} == {
            "a0": ("p0000", 0, 1), "b0": ("p0000", 2, 2), "a1": ("p0001", 1, 1), "b1": ("p0001", 3, 4)}
    finally:
        stop()


def test_a_new_learner_step_reaches_the_api_and_the_stream_within_2_s(ui_run, tmp_path):  # noqa: F811
    """The short demo's run folder with its learner log cut after step 1; step 2's record, appended
    while the server runs, is pushed on /api/stream and listed by /api/run without a restart."""
    from agentlog.events import FileLog
    from agentlog.events.log.source import open_source

    run = tmp_path / "run"
    shutil.copytree(ui_run.demo, run, ignore=shutil.ignore_patterns("LOCK", "learner", ".agentlog-ui"))
    records = [(e.session_id, e.session_seq, e.body) for e in open_source(str(ui_run.demo / "learner")).read()]
    assert [body.step for _, _, body in records] == [0, 1, 2]
    learner = FileLog.open(run / "learner", fsync="batch")
    learner.append_batch(records[:2])
    url, stop = start_ui(run, index_path=tmp_path / "i.sqlite")
    steps: list[dict] = []
    connected = threading.Event()

    def listen() -> None:
        with urllib.request.urlopen(f"{url}/api/stream", timeout=10) as resp:
            kind = None
            for raw in resp:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    connected.set()
                    if kind == "step":
                        steps.append(json.loads(line[len("data: "):]))
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        assert connected.wait(5), "the stream sent nothing"
        assert [s["step"] for s in _ok(f"{url}/api/run")["steps"]] == [0, 1]
        written = time.monotonic()
        learner.append_batch(records[2:])
        listener.join(2.0)
        assert not listener.is_alive(), f"step 2 did not reach /api/stream within 2 s (took over {time.monotonic() - written:.1f} s)"
        assert steps[0]["step"] == 2 and steps[0]["policy_version"] == records[2][2].policy_version
        assert [s["step"] for s in _ok(f"{url}/api/run")["steps"]] == [0, 1, 2]
        assert _ok(f"{url}/api/step/2")["step"] == 2
    finally:
        stop()
        learner.close()


def test_sigterm_stops_the_server_cleanly_even_with_sigint_ignored(ui_run, tmp_path):  # noqa: F811
    """A child started in the background ignores SIGINT; SIGTERM stops it as Ctrl-C does: exit 0, index released."""
    import signal
    import subprocess
    import sys

    index = tmp_path / "i.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "agentlog.tools.cli", "ui", str(ui_run.log), "--port", "0", "--index", str(index)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert "serving" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)  # ignored, as in a background job
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    _open_index(ui_run.log, index).close()  # the index lock was released


def _write_ended(path, sessions) -> None:
    """A log of one-member sessions: (id, the finish's metadata, or an abort's reason when given)."""
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionAborted, SessionFinished, SessionOpened, SessionStarted

    writer = FileLog.open(path, fsync="batch")
    batch = []
    for sid, verdict, reason in sessions:
        batch += [(sid, 0, SessionOpened(group_id="g-" + sid, group_size=1)), (sid, 1, SessionStarted())]
        batch.append((sid, 2, SessionAborted(reason=reason) if reason else SessionFinished(reward=1.0, metadata=verdict)))
    writer.append_batch(batch)
    writer.close()


def test_a_session_whose_verifier_details_hold_nan_or_inf_is_served_with_them_as_text(tmp_path):
    """A verifier may record float('nan') or inf in its details, which no JSON holds: the session view was a
    500 ("internal error (ValueError)") for such a session, which `show` and the report display."""
    _write_ended(tmp_path / "log", [("nan-score", {"score": float("nan")}, ""), ("inf-score", {"score": float("-inf")}, "")])
    url, stop = start_ui(tmp_path / "log", index_path=tmp_path / "i.sqlite")
    try:
        for sid, shown in (("nan-score", "nan"), ("inf-score", "-inf")):
            with urllib.request.urlopen(f"{url}/api/session/{sid}", timeout=20) as resp:
                assert resp.status == 200
                assert f'"score": "{shown}"' in resp.read().decode()
    finally:
        stop()


@pytest.mark.parametrize("authorization, status", [(b"Bearer \xff\xfe", 401), (b"bearer s3cret", 200), (b"BEARER s3cret", 200)])
def test_the_token_check_answers_any_authorization_header_as_json(tmp_path, authorization, status):
    """A header that is not UTF-8 made the token check raise UnicodeEncodeError: aiohttp's plain-text 500 and
    a traceback in the log. The scheme's name is case-insensitive."""
    import socket

    _write_ended(tmp_path / "log", [("s", {}, "")])
    url, stop = start_ui(tmp_path / "log", index_path=tmp_path / "i.sqlite", host="0.0.0.0", token="s3cret")
    host, port = url.split("//")[1].rsplit(":", 1)
    try:
        with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
            s.sendall(b"GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + authorization + b"\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
    finally:
        stop()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), answer[:300]
    if status == 401:
        assert "token" in json.loads(body)["error"]
