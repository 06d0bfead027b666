"""`agentlog ui`'s HTTP API and on-disk index, on the real server (tests/tools/ui_helpers.py).

Filters are checked against what `agentlog replay` selects for the same
question, and each row's mask against what `agentlog reconstruct` writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

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
    assert run["sessions"] == {"total": 8, "finished": 4, "aborted": 2, "dropped": 1, "running": 1}
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


def test_group_step_and_reconstruct_views(demo_ui):
    run = _ok(f"{demo_ui}/api/run")
    for step in run["steps"][1:]:
        view = _ok(f"{demo_ui}/api/step/{step['step']}")
        assert view["policy_version"] == step["policy_version"]
        assert sum(g["trained"] for g in view["groups"]) == step["trained_groups"]
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
