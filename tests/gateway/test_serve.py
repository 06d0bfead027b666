"""`agentlog serve`: the gateway as a process over a durable log."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agentlog.events import FileLog, read_log, verify_log
from agentlog.events.log.batch_compression import segment_compression
from agentlog.events.log.format import list_segments
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import SessionDropped, TurnRecorded
from agentlog.reducers.pipeline import reduce_log
from gateway_helpers import ScriptedBackend, run

REPO = Path(__file__).resolve().parents[2]


def _call(url: str, body: dict | None, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _serve(logdir: Path, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `agentlog serve` on a free port; returns (process, base URL, output lines so far)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentlog.tools.cli", "serve", "--log", str(logdir), "--port", "0", "--admin-token", "tok", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = None
    deadline = time.time() + 60
    lines: list[str] = []
    while time.time() < deadline and url is None:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        raise AssertionError("".join(lines))
    return proc, url, lines


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_serve_records_turns_of_admin_opened_sessions_into_a_durable_log(tmp_path, compression):
    """(With ``--compression zstd`` the log's segments say so, and the records read back the same.)"""
    logdir = tmp_path / "log"
    proc, url, lines = _serve(logdir, "--max-tokens", "6", *(["--compression", compression] if compression else []))
    try:
        admin = {"X-Admin-Token": "tok"}
        assert _call(url + "/admin/sessions", {"session_id": "x"}, {})[0] == 403
        status, out = _call(url + "/admin/sessions", {"session_id": "a1", "group_id": "g", "group_size": 1}, admin)
        assert status == 200 and out["state"] == "running"
        key = out["api_key"]
        agent = {"Authorization": f"Bearer {key}"}  # the session's key, not its id
        status, out = _call(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, agent)
        assert status == 200 and out["usage"]["completion_tokens"] <= 6
        assert _call(url + "/v1/chat/completions", {"messages": []}, {"Authorization": "Bearer a1"})[0] == 401
        assert _call(url + "/v1/chat/completions", {"messages": []}, {"Authorization": "Bearer nobody"})[0] == 401
        assert _call(url + "/admin/sessions/a1/finish", {"reward": 1.0}, admin) == (200, {"session_id": "a1", "state": "finished"})
        assert _call(url + "/v1/chat/completions", {"messages": []}, agent)[0] == 409
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0
    # The key is a credential: in no structlog line and in no byte of the log.
    output = "".join(lines) + proc.stdout.read()
    assert "a1" in output and key not in output
    assert not [f for f in logdir.rglob("*") if f.is_file() and key.encode() in f.read_bytes()]
    assert not [r.lsn for r in read_log(logdir, raw=True) if key.encode() in bytes(r.payload)]  # compressed or not
    assert {segment_compression(logdir, first) for first in list_segments(logdir)} == {compression}
    with FileLog.open(logdir) as log:
        turns = [e.body for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]
        assert len(turns) == 1 and turns[0].output_tokens.size <= 6
        (sample,) = reduce_log(log).samples
        assert sample.session_id == "a1" and sample.reward == 1.0


def test_serve_bad_input_is_one_line_exit_2_and_never_a_traceback(tmp_path, capsys):
    """Bad options, an unreadable checkpoint and a --log that is a file: one line naming it, exit 2.
    The first case runs as its own process (what a user sees, traceback-free); the others call
    the CLI's entry point in this one (a process each cost 2-3 s of imports)."""
    from agentlog.tools.cli import main

    (tmp_path / "plain").write_text("not a log")
    (tmp_path / "bad.pt").write_text("not a checkpoint")
    cases = [
        (["--port", "70000"], "--port: expected a port 0-65535, found 70000"),
        (["--max-turns", "0"], "--max-turns: expected an int >= 1, found 0"),
        (["--fsync", "sometimes"], "--fsync: invalid choice: 'sometimes'"),
        (["--compression", "gzip"], "--compression: invalid choice: 'gzip'"),
        (["--checkpoint", str(tmp_path / "missing.pt")], "missing.pt: No such file or directory"),
        (["--checkpoint", str(tmp_path / "bad.pt")], "expected a learner checkpoint, a weights file or a state_dict of the built-in GPT"),
        (["--model", str(tmp_path / "no-model")], "no-model' is not a directory; expected a local Hugging Face model directory"),
        (["--log", str(tmp_path / "plain")], "is a file, expected a log directory"),
        # Served with /health ok while every turn failed 502, the option never named:
        (["--backend", "sglang", "--backend-url", "notaurl"], "--backend-url: expected an http(s) base URL"),
        (["--backend", "sglang", "--backend-url", "ftp://127.0.0.1:30000"], "--backend-url: expected an http(s) base URL"),
        (["--backend", "sglang", "--backend-url", "http://"], "--backend-url: expected an http(s) base URL"),
    ]
    for i, (extra, message) in enumerate(cases):
        args = ["--log", str(tmp_path / "log"), "--port", "0", *extra]
        if i == 0:
            res = subprocess.run([sys.executable, "-m", "agentlog.tools.cli", "serve", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
            code, err = res.returncode, res.stderr
        else:
            try:
                code = main(["serve", *args])
            except SystemExit as exc:  # argparse's own errors
                code = exc.code
            err = capsys.readouterr().err
        assert code == 2, (extra, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agentlog: error: ") and message in lines[0], (extra, err)


class _StalledInference:
    """An SGLang-style server on a thread whose /generate never answers
    (a model busy with a long batch), until released; /abort_request is
    answered and counted."""

    def __init__(self) -> None:
        import http.server

        self.release = threading.Event()
        self.generating = threading.Semaphore(0)
        self.aborts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/abort_request":
                    outer.aborts += 1
                    payload = b"{}"
                else:
                    outer.generating.release()
                    outer.release.wait(120)
                    payload = b'{"error": "released"}'
                try:
                    self.send_response(200 if self.path == "/abort_request" else 500)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:
                    pass  # the gateway hung up (it aborted this call)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_sigterm_under_load_drains_within_the_bound_and_drops_the_rest_with_shutdown(tmp_path):
    """Every agent has a turn in flight that the model will not finish soon;
    SIGTERM ends the process within the drain bound (with slack for the
    interpreter), exit 0, no traceback; every session still live is dropped
    with reason shutdown, its generation aborted upstream; the log verifies."""
    logdir = tmp_path / "log"
    upstream = _StalledInference()
    proc, url, lines = _serve(logdir, "--backend", "sglang", "--backend-url", upstream.url, "--drain", "0.5")
    admin = {"X-Admin-Token": "tok"}
    sessions = [f"s{i}" for i in range(8)]
    answers: list[int] = []

    keys: dict[str, str] = {}

    def agent(sid: str) -> None:
        try:
            status, _ = _call(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}, {"Authorization": f"Bearer {keys[sid]}"})
        except (OSError, ValueError) as exc:
            status = repr(exc)
        answers.append(status)

    try:
        for sid in sessions:
            status, opened = _call(url + "/admin/sessions", {"session_id": sid, "group_id": sid}, admin)
            assert status == 200, opened
            keys[sid] = opened["api_key"]
        threads = [threading.Thread(target=agent, args=(sid,), daemon=True) for sid in sessions]
        for t in threads:
            t.start()
        for _ in sessions:  # every turn has reached the model
            assert upstream.generating.acquire(timeout=30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("SIGTERM under load: still running after 30 s") from None
        stopped_in = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        upstream.close()
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    assert stopped_in < 10, f"took {stopped_in:.1f} s with --drain 0.5"
    # Each agent was answered (409: its session was dropped) rather than left hanging.
    assert answers == [409] * len(sessions), answers
    assert upstream.aborts == len(sessions), text
    assert verify_log(logdir).status == "ok"
    with FileLog.open(logdir) as log:
        drops = {e.session_id: e.body.reason for e in log.read() if isinstance(e.body, SessionDropped)}
    assert drops == dict.fromkeys(sessions, "shutdown")


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_gateways_url_on_an_ipv6_host_is_one_a_client_can_use():
    """It printed http://::1:PORT, which names no port a client can use; an IPv6 host is bracketed."""
    from agentlog.engine import SessionEngine
    from agentlog.events import MemoryLog
    from agentlog.gateway import Gateway

    async def body():
        engine = await SessionEngine.open(MemoryLog())
        gw = Gateway(engine, ScriptedBackend(lambda p: "ok"))
        try:
            url = await gw.start("::1", 0)
            def get() -> dict:  # what an agent pointed at it does (on a thread: the loop serves it)
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    return json.loads(r.read())

            return url, await asyncio.to_thread(get)
        finally:
            await gw.stop()
            await engine.close()

    url, health = run(body(), timeout=20)
    assert url.startswith("http://[::1]:"), url
    assert isinstance(health, dict) and health["status"] == "ok", health
