"""`agentlog serve`: the gateway as a process over a durable log."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from events.log import FileLog
from events.types import TurnRecorded
from reducers.pipeline import reduce_log

REPO = Path(__file__).resolve().parents[2]


def _call(url: str, body: dict | None, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_records_turns_of_admin_opened_sessions_into_a_durable_log(tmp_path):
    logdir = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "serve", "--log", str(logdir), "--port", "0", "--admin-token", "tok", "--max-tokens", "6"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = None
        deadline = time.time() + 60
        lines = []
        while time.time() < deadline and url is None:
            line = proc.stdout.readline()
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
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
    with FileLog.open(logdir) as log:
        turns = [e.body for e in log.read() if isinstance(e.body, TurnRecorded)]
        assert len(turns) == 1 and turns[0].output_tokens.size <= 6
        (sample,) = reduce_log(log).samples
        assert sample.session_id == "a1" and sample.reward == 1.0


def test_serve_bad_input_is_one_line_exit_2_and_never_a_traceback(tmp_path):
    """Bad options, an unreadable checkpoint and a --log that is a file: one line naming it, exit 2."""
    (tmp_path / "plain").write_text("not a log")
    (tmp_path / "bad.pt").write_text("not a checkpoint")
    cases = [
        (["--port", "70000"], "--port: expected a port 0-65535, found 70000"),
        (["--max-turns", "0"], "--max-turns: expected an int >= 1, found 0"),
        (["--fsync", "sometimes"], "--fsync: invalid choice: 'sometimes'"),
        (["--checkpoint", str(tmp_path / "missing.pt")], "missing.pt: No such file or directory"),
        (["--checkpoint", str(tmp_path / "bad.pt")], "bad.pt: expected a state_dict of the built-in GPT"),
        (["--log", str(tmp_path / "plain")], "is a file, expected a log directory"),
    ]
    for extra, message in cases:
        args = ["--log", str(tmp_path / "log"), "--port", "0", *extra]
        res = subprocess.run([sys.executable, "-m", "tools.cli", "serve", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert res.returncode == 2, (extra, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agentlog: error: ") and message in lines[0], (extra, res.stderr)
