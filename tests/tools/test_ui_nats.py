"""`agentlog ui` on a ``nats://host:port/stream`` source (a run whose log is on JetStream).

One local JetStream server per module (tests/nats_helpers.py). The real
SessionEngine writes a few sessions straight to a JetStreamLog (finished with
turns, aborted, dropped, still running); the UI, started on the stream's URL
with its index under tmp_path, must count and list what `agentlog replay
--json` reads from the same URL, show a session's turns, reuse its index on a
second start, and pick up a session appended after it started within 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest

from cli_helpers import SYSTEM, _turn, _user
from ui_helpers import start_ui

pytest.importorskip("nats", reason="the nats:// URLs need the nats extra: pip install 'agentlog[nats]'")

from agentlog.events.log.jetstream import JetStreamLog  # noqa: E402
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted  # noqa: E402

STREAM = "uirun"
#: What _write_with_the_engine leaves on the stream (written by hand, not computed by the code under test).
WRITTEN = {
    "ok-0": ("finished", 2),
    "ok-1": ("finished", 1),
    "bad-0": ("aborted", 1),
    "drop-0": ("dropped", 0),
    "live-0": ("running", 1),
}


async def _write_with_the_engine(url: str) -> None:
    """Sessions written by the real SessionEngine on a JetStreamLog (partition 0)."""
    from agentlog.engine import SessionEngine

    log = JetStreamLog.open(url, STREAM, 0)
    try:
        eng = await SessionEngine.open(log, drain_s=0.1)
        base = [1, 2, 3, 4]
        h = await eng.open_session("ok-0", group_id="g-ok", group_size=2, sample_index=0, prompt=[SYSTEM, _user(0)])
        await h.start(harness="test")
        await _turn(h, [SYSTEM, _user(0)], base, [10, 11, 12])
        await _turn(h, [SYSTEM, _user(0), {"role": "assistant", "content": "reply 10"}], base + [10, 11, 12, 7], [13, 14])
        await h.finish(reward=1.0)
        h = await eng.open_session("ok-1", group_id="g-ok", group_size=2, sample_index=1)
        await h.start()
        await _turn(h, [SYSTEM, _user(1)], base, [20, 21])
        await h.finish(reward=0.0)
        h = await eng.open_session("bad-0", group_id="g-bad", group_size=2, sample_index=0)
        await h.start()
        await _turn(h, [SYSTEM, _user(2)], base, [30, 31])
        await h.abort("wall_clock_timeout", error="budget of 1.0 s exhausted")
        h = await eng.open_session("drop-0", group_id="g-bad", group_size=2, sample_index=1)
        await h.drop("cancelled")
        h = await eng.open_session("live-0", group_id="g-live", group_size=1, sample_index=0)
        await h.start()
        await _turn(h, [SYSTEM, _user(3)], base, [40, 41])
    finally:
        log.close()  # no engine.close(): live-0 stays running, as in a live run


@pytest.fixture(scope="module")
def stream_url(nats_server) -> str:
    """``nats://127.0.0.1:<port>/uirun`` holding the engine-written sessions."""
    asyncio.run(_write_with_the_engine(nats_server.url))
    return f"{nats_server.url}/{STREAM}"


def _ok(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


def _rows(url: str) -> dict[str, dict]:
    body = _ok(f"{url}/api/sessions?limit=1000")
    assert body["total"] == len(body["rows"])
    return {r["session_id"]: r for r in body["rows"]}


def _replay_json(source: str) -> list[dict]:
    """The real `agentlog replay SOURCE --json` (run in this process): one event per line."""
    from agentlog.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["replay", source, "--json", "-q"])
    assert rc == 0, out.getvalue()[-500:]
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _fates(events: list[dict]) -> dict[str, str]:
    """Each session's status as replay tells it: the state after its last event."""
    return {e["session_id"]: e["state_after"] for e in events}


@pytest.mark.required
def test_ui_on_a_stream_agrees_with_replay_and_reuses_its_index(stream_url, tmp_path):
    index = tmp_path / "ui" / "index.sqlite"
    events = _replay_json(stream_url)
    fates = _fates(events)
    turns = Counter(e["session_id"] for e in events if "turn_index" in e)
    # replay reads what the engine wrote
    assert fates == {sid: status for sid, (status, _) in WRITTEN.items()}, fates
    assert dict(turns) == {sid: n for sid, (_, n) in WRITTEN.items() if n}, turns
    url, stop = start_ui(stream_url, index_path=index)
    try:
        run = _ok(f"{url}/api/run")
        counts = Counter(fates.values())
        assert run["sessions"] == {"total": len(fates), **{s: counts[s] for s in ("finished", "aborted", "dropped", "running", "open")}}, run
        first = run["index"]
        assert first["resumed"] is False and first["records_read"] == len(events) and first["sessions"] == len(fates)
        rows = _rows(url)
        assert {sid: r["status"] for sid, r in rows.items()} == fates
        assert {sid: r["turns"] for sid, r in rows.items()} == {sid: turns[sid] for sid in fates}
        view = _ok(f"{url}/api/session/ok-0")
        assert [t["turn"] for t in view["turns"]] == [0, 1]
        assert view["rows"] and view["rows"][0]["tokens"][:4] == [1, 2, 3, 4]
    finally:
        stop()
    assert index.exists()
    url, stop = start_ui(stream_url, index_path=index)
    try:
        again = _ok(f"{url}/api/run")["index"]
        assert again["resumed"] is True and again["rebuilt_why"] is None, again
        # Only the session still in flight (live-0) is read again.
        in_flight = sum(1 for e in events if e["session_id"] == "live-0")
        assert again["records_read"] == in_flight and again["sessions"] == len(fates), again
        assert again["built_to"] == first["built_to"]
        assert {sid: r["status"] for sid, r in _rows(url).items()} == fates
    finally:
        stop()


@pytest.mark.required
def test_a_session_appended_to_the_stream_after_start_appears_within_2_s(nats_server, tmp_path):
    stream = "uilive"
    writer = JetStreamLog.open(nats_server.url, stream, 0)
    try:

        def write(sid: str) -> None:
            writer.append_batch([(sid, 0, SessionOpened(group_id="g", group_size=1)), (sid, 1, SessionStarted()),
                                 (sid, 2, SessionFinished(reward=1.0))])

        write("first")
        url, stop = start_ui(f"{nats_server.url}/{stream}", index_path=tmp_path / "index.sqlite")
        try:
            assert set(_rows(url)) == {"first"}
            written = time.monotonic()
            write("second")
            while time.monotonic() - written < 2.0 and "second" not in _rows(url):
                time.sleep(0.05)
            rows = _rows(url)
            assert set(rows) == {"first", "second"}, "a session appended to the stream did not reach /api/sessions within 2 s"
            assert rows["second"]["status"] == "finished" and rows["second"]["reward"] == 1.0
        finally:
            stop()
        # Stopped, the UI holds no connection to the stream (none left reconnecting to a server long gone).
        readers = [t.name for t in threading.enumerate() if t.name == f"jetstream-read-{stream}"]
        assert readers == [], f"the stopped UI left its stream reader running: {readers}"
    finally:
        writer.close()
