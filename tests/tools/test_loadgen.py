"""`agentlog loadgen`: a run's recorded sessions replayed against a real HTTP server that
records every request it gets and answers in SGLang's /generate shape or the OpenAI shape
(with cached tokens). The run is written by the real SessionEngine on a FileLog whose clock
the test sets, so every recorded time (session offsets, inter-turn gaps) is known exactly;
every turn is stored delta-encoded, so the replay must expand them."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings, strategies as st

from agentlog.tools.cli import main as cli_main
from agentlog.gateway.backends import ROUTING_HEADER_DEFAULT

SYSTEM = {"role": "system", "content": "You are a coding agent."}
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 5, "stop_ids": [2]}
GENERATE_S = 0.05
GAP_S = 0.3


@dataclass
class PlannedTurn:
    sent_s: float  # when its request left, seconds after the run's first request
    prompt: list[int]
    messages: list[dict[str, Any]]
    output: list[int]


#: Recorded request times per session: A and B overlap; C starts after A's last answer (0.75 s).
PLAN_TIMES = {"sess-a": [0.0, 0.35, 0.70], "sess-b": [0.10, 0.45], "sess-c": [1.20, 1.55]}


def _plan() -> dict[str, list[PlannedTurn]]:
    """Each session's turns: every prompt extends the previous prompt and output (so the log
    stores them as deltas), with outputs of different lengths."""
    plan: dict[str, list[PlannedTurn]] = {}
    for n, (sid, times) in enumerate(PLAN_TIMES.items()):
        prompt = [100 * (n + 1) + i for i in range(5)]
        messages = [SYSTEM, {"role": "user", "content": f"Fix bug {n}."}]
        turns = []
        for k, sent in enumerate(times):
            output = [1000 * (n + 1) + 10 * k + j for j in range(3 + k)]
            turns.append(PlannedTurn(sent, list(prompt), [dict(m) for m in messages], output))
            prompt = prompt + output + [7, 8 + k]
            messages = messages + [{"role": "assistant", "content": f"reply {k}"},
                                   {"role": "tool", "content": f"result {k}"}]
        plan[sid] = turns
    return plan


PLAN = _plan()
T0_NS = 1_800_000_000_000_000_000


async def _write_run(path: Path) -> None:
    """Write PLAN with the engine, the log's clock set to each event's planned time."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    now = [T0_NS]
    log = FileLog.open(path, fsync="batch", clock=lambda: now[0])
    eng = await SessionEngine.open(log, checkpoint_every=0)
    # (time, order, session, turn): opens a little before each first request, turns at their answer time.
    events: list[tuple[float, int, str, int]] = []
    for sid, turns in PLAN.items():
        events.append((turns[0].sent_s - 0.01, 0, sid, -1))
        events += [(t.sent_s + GENERATE_S, 1, sid, k) for k, t in enumerate(turns)]
        events.append((turns[-1].sent_s + GENERATE_S + 0.01, 2, sid, -2))
    handles = {}
    for at, _order, sid, k in sorted(events):
        now[0] = T0_NS + int(at * 1e9)
        if k == -1:
            handles[sid] = await eng.open_session(sid, group_id=f"g-{sid}", group_size=1)
            await handles[sid].start()
        elif k == -2:
            await handles[sid].finish(reward=1.0)
        else:
            t = PLAN[sid][k]
            await handles[sid].record_turn(messages=t.messages, prompt_ids=t.prompt, sampling=dict(SAMPLING),
                                           output_ids=t.output, output_log_probs=[-0.5] * len(t.output),
                                           response_message={"role": "assistant", "content": f"reply {k}"},
                                           generate_s=GENERATE_S)
    await eng.close()
    log.close()


@pytest.fixture(scope="module")
def run_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("loadgen") / "run.log"
    asyncio.run(_write_run(path))
    return path


# ---------------------------------------------------------------- the recording server


@dataclass
class Seen:
    route: str
    headers: dict[str, str]
    body: dict[str, Any]
    arrived: float  # perf_counter
    answered: float = 0.0
    cached: int = 0


@dataclass
class RecordingServer:
    """A real aiohttp server on a thread of its own: records every request, answers after
    ``delay_s`` in SGLang's or the OpenAI shape; ``fail``: which requests (1-based count)
    get an HTTP 500 instead. Its cached tokens: the prefix shared with the routing key's
    previous prompt (the prefix a router that keeps a session on one replica would hit)."""

    delay_s: float = 0.0
    fail: Any = None
    requests: list[Seen] = field(default_factory=list)
    url: str = ""

    def __enter__(self) -> "RecordingServer":
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def handle(request: web.Request) -> web.Response:
            seen = Seen(request.path, dict(request.headers), await request.json(), time.perf_counter())
            self.requests.append(seen)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.fail is not None and self.fail(len(self.requests)):
                seen.answered = time.perf_counter()
                return web.json_response({"error": {"message": f"engine overloaded (request {len(self.requests)})"}},
                                         status=500)
            body = seen.body
            prompt = body.get("input_ids") or body.get("prompt") or []
            key = seen.headers.get(ROUTING_HEADER_DEFAULT, "")
            before = [s for s in self.requests[:-1] if s.headers.get(ROUTING_HEADER_DEFAULT, "") == key]
            if before and prompt:
                prev = before[-1].body.get("input_ids") or before[-1].body.get("prompt") or []
                seen.cached = next((i for i, (a, b) in enumerate(zip(prev, prompt)) if a != b), min(len(prev), len(prompt)))
            n_out = body.get("sampling_params", body).get("max_new_tokens", body.get("max_tokens", 1))
            n_prompt = len(prompt) if prompt else 10 * len(body.get("messages", []))
            seen.answered = time.perf_counter()
            if request.path == "/generate":
                return web.json_response({"text": "x" * n_out, "output_ids": list(range(n_out)), "meta_info": {
                    "prompt_tokens": n_prompt, "completion_tokens": n_out, "cached_tokens": seen.cached,
                    "finish_reason": {"type": "length", "length": n_out}}})
            return web.json_response({"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                "total_tokens": n_prompt + n_out,
                                                "prompt_tokens_details": {"cached_tokens": seen.cached}}})

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/generate", handle)
            app.router.add_post("/v1/completions", handle)
            app.router.add_post("/v1/chat/completions", handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            started.set()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True, name="recording-server")
        self._thread.start()
        assert started.wait(10), "the recording server did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def by_session(self, header: str = ROUTING_HEADER_DEFAULT) -> dict[str, list[Seen]]:
        out: dict[str, list[Seen]] = {}
        for seen in self.requests:
            out.setdefault(seen.headers.get(header, ""), []).append(seen)
        return out


def _loadgen(*args: str) -> tuple[int, str, str]:
    """``agentlog loadgen ARGS -q`` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["loadgen", *args, "-q"])
    return rc, out.getvalue(), err.getvalue()


def _report(*args: str) -> dict[str, Any]:
    rc, out, err = _loadgen(*args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _packed(ids: list[int]) -> bytes:
    return np.asarray(ids, "<i4").tobytes()


# ---------------------------------------------------------------- (1) byte for byte, (7) routing key


@pytest.mark.parametrize("api", ["generate", "completions", "chat"])
def test_requests_are_the_recorded_prompts_per_session_in_order_with_the_session_as_routing_key(run_log, api) -> None:
    from agentlog.events import read_log

    # The log stores every turn as a delta (the first against an empty turn), which the replay must
    # expand to the whole prompt.
    assert [env.tag for env in read_log(run_log)].count("turn_delta") == 7
    with RecordingServer() as server:
        report = _report(str(run_log), "--target", server.url, "--api", api, "--speed", "20")
    assert report["stopped_by"] == "done" and report["requests_ok"] == report["requests_sent"] == 7
    route = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}[api]
    assert {s.route for s in server.requests} == {route}
    got = server.by_session()
    assert sorted(got) == sorted(PLAN)  # every request carried its session id, and only those
    for sid, turns in PLAN.items():
        assert len(got[sid]) == len(turns)
        for turn, seen in zip(turns, got[sid]):
            body = seen.body
            if api == "generate":
                assert _packed(body["input_ids"]) == _packed(turn.prompt)
                sampling = body["sampling_params"]
                assert sampling["max_new_tokens"] == len(turn.output) and sampling["sampling_seed"] == 5
            else:
                if api == "completions":
                    assert _packed(body["prompt"]) == _packed(turn.prompt)
                else:
                    assert json.dumps(body["messages"]) == json.dumps(turn.messages) and "prompt" not in body
                sampling = body
                assert sampling["max_tokens"] == len(turn.output) and sampling["seed"] == 5
            assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.7, 0.9, 20)
            assert sampling["stop_token_ids"] == [2]


def test_the_routing_header_can_be_renamed_or_left_out(run_log) -> None:
    with RecordingServer() as server:
        _report(str(run_log), "--target", server.url, "--speed", "20", "--routing-header", "X-Session", "--sessions", "2")
        assert sorted(server.by_session("X-Session")) == ["sess-a", "sess-b"]
        assert all(ROUTING_HEADER_DEFAULT not in s.headers for s in server.requests)
    with RecordingServer() as server:
        _report(str(run_log), "--target", server.url, "--speed", "20", "--routing-header", "", "--sessions", "1")
        assert len(server.requests) == 3 and all(ROUTING_HEADER_DEFAULT not in s.headers for s in server.requests)
    rc, _, err = _loadgen(str(run_log), "--target", "http://127.0.0.1:9", "--routing-header", "bad header")
    assert rc == 2 and "--routing-header" in err and "expected an HTTP header name" in err


# ---------------------------------------------------------------- (2) timing, (3) concurrency


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_recorded_gaps_and_offsets_are_honoured_at_speed(run_log, speed) -> None:
    tolerance = 0.08
    with RecordingServer(delay_s=0.02) as server:
        report = _report(str(run_log), "--target", server.url, "--speed", str(speed))
    assert report["requests_ok"] == 7
    got = server.by_session()
    first = min(s.arrived for s in server.requests)
    for sid, turns in PLAN.items():
        seen = got[sid]
        # The session starts at its recorded offset from the replay's first request, scaled.
        assert seen[0].arrived - first == pytest.approx(turns[0].sent_s / speed, abs=tolerance), sid
        for k in range(1, len(turns)):
            recorded_gap = turns[k].sent_s - (turns[k - 1].sent_s + GENERATE_S)
            replayed_gap = seen[k].arrived - seen[k - 1].answered
            assert replayed_gap == pytest.approx(recorded_gap / speed, abs=tolerance), (sid, k)
    assert report["latency_s"]["p50"] >= 0.02  # the server's delay is in every latency


def test_sessions_that_overlapped_in_the_recording_overlap_in_the_replay(run_log) -> None:
    with RecordingServer(delay_s=0.01) as server:
        _report(str(run_log), "--target", server.url, "--speed", "2")
    got = server.by_session()
    a, b, c = got["sess-a"], got["sess-b"], got["sess-c"]
    # B started while A was running, and A went on while B ran: the two were in flight together.
    assert a[0].arrived < b[0].arrived < a[-1].arrived
    assert b[0].arrived < a[1].arrived < b[-1].arrived
    # C started after A had ended, as recorded.
    assert c[0].arrived > a[-1].answered


# ---------------------------------------------------------------- (4) limits, (5) loopback


def test_the_request_count_stops_the_replay(run_log) -> None:
    with RecordingServer() as server:
        report = _report(str(run_log), "--target", server.url, "--speed", "20", "--max-requests", "3")
    assert len(server.requests) == 3 and report["requests_sent"] == 3
    assert report["stopped_by"] == "max_requests" and report["turns_recorded"] == 7


def test_the_time_limit_stops_the_replay_and_cancels_what_is_in_flight(run_log) -> None:
    with RecordingServer(delay_s=1.5) as server:
        began = time.perf_counter()
        report = _report(str(run_log), "--target", server.url, "--time-limit", "0.5")
        took = time.perf_counter() - began
    # A's and B's first requests (sent at 0 and 0.1 s) were waiting on the 1.5 s answers: a replay
    # that waited for them would take 1.5 s or more, one that cancels them stops near 0.5 s (0.54-0.63 s
    # measured, on two cores shared with other tests).
    assert report["stopped_by"] == "time_limit" and took < 1.2
    assert report["requests_sent"] == report["requests_cancelled"] == 2 and report["requests_ok"] == 0
    assert report["seconds"] == pytest.approx(0.5, abs=0.2)
    rc, out, err = _loadgen(str(run_log), "--target", "http://127.0.0.1:9", "--time-limit", "0")
    assert rc == 2 and "--time-limit" in err and "expected a number > 0" in err


@pytest.mark.parametrize("target", ["http://10.1.2.3:30000", "http://inference.example.com", "https://8.8.8.8"])
def test_a_remote_target_is_refused_without_allow_remote(run_log, target) -> None:
    rc, out, err = _loadgen(str(run_log), "--target", target)
    assert rc == 2 and out == ""
    assert "is not loopback" in err and "--allow-remote" in err and target in err


def test_loopback_targets_pass_and_allow_remote_lets_any_host_through() -> None:
    from agentlog.tools.loadgen import LoadgenError, check_target

    for url in ("http://localhost:8000/", "http://127.0.0.1:30000", "http://127.5.0.1", "http://[::1]:8000"):
        assert check_target(url) == url.rstrip("/")
    assert check_target("http://10.1.2.3:30000", allow_remote=True) == "http://10.1.2.3:30000"
    with pytest.raises(LoadgenError, match="expected an http:// or https:// base URL"):
        check_target("ftp://127.0.0.1/", allow_remote=True)


# ---------------------------------------------------------------- (6) cached tokens, throughput, errors


@pytest.mark.parametrize("api", ["generate", "completions"])
def test_cached_tokens_the_server_reports_are_summed(run_log, api) -> None:
    with RecordingServer() as server:
        report = _report(str(run_log), "--target", server.url, "--api", api, "--speed", "20")
    cached = sum(s.cached for s in server.requests)
    assert cached > 0 and report["cached_tokens"] == cached and report["cached_answers"] == 7
    prompts = sum(len(t.prompt) for turns in PLAN.values() for t in turns)
    assert report["prompt_tokens"] == report["cached_of_prompt_tokens"] == prompts
    assert report["output_tokens"] == sum(len(t.output) for turns in PLAN.values() for t in turns)
    assert report["prompt_tokens_per_s"] == pytest.approx(prompts / report["seconds"])
    assert report["requests_per_s"] == pytest.approx(7 / report["seconds"])


def test_the_human_table_names_throughput_latency_and_cache(run_log) -> None:
    with RecordingServer(delay_s=0.01) as server:
        rc, out, err = _loadgen(str(run_log), "--target", server.url, "--speed", "20")
    assert rc == 0, err
    lines = out.splitlines()
    row = {line.split()[0]: line for line in lines[1:]}
    assert "7 sent: 7 answered, 0 failed" in row["requests"]
    assert "req/s" in row["throughput"] and "p50" in row["latency"] and "p99" in row["latency"]
    assert "prompt tokens (" in row["cached"] and "every recorded turn replayed" in row["stopped"]


def test_server_errors_are_counted_with_the_first_ones_text_and_the_replay_goes_on(run_log) -> None:
    with RecordingServer(fail=lambda n: n % 2 == 0) as server:
        report = _report(str(run_log), "--target", server.url, "--speed", "20")
    assert len(server.requests) == 7  # every turn was still sent
    assert report["requests_failed"] == 3 and report["requests_ok"] == 4 and report["errors_by_status"] == {"500": 3}
    assert "engine overloaded (request 2)" in report["first_error"] and "HTTP 500" in report["first_error"]
    assert report["first_error"].startswith("session ")


def test_a_server_that_fails_every_request_stops_the_replay_and_exits_2(run_log) -> None:
    with RecordingServer(fail=lambda n: True) as server:
        rc, out, err = _loadgen(str(run_log), "--target", server.url, "--speed", "20", "--json")
    report = json.loads(out)
    assert rc == 2 and report["stopped_by"] == "all_failed" and report["requests_ok"] == 0
    assert "no request was answered (7 failed)" in err and "engine overloaded" in err
    rc, out, err = _loadgen(str(run_log), "--target", "http://127.0.0.1:9", "--speed", "20", "--json")
    report = json.loads(out)
    assert rc == 2 and report["errors_by_status"] == {"0": report["requests_failed"]}
    assert "POST http://127.0.0.1:9/generate failed" in report["first_error"]


def test_a_log_without_turns_and_chat_without_messages_are_clear_errors(run_log, tmp_path) -> None:
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    async def write(path: Path, with_turn: bool) -> None:
        log = FileLog.open(path)
        eng = await SessionEngine.open(log, checkpoint_every=0)
        h = await eng.open_session("tok-0", group_id="g", group_size=1)
        await h.start()
        if with_turn:  # a token-level turn: prompt ids, no messages
            await h.record_turn(prompt_ids=[1, 2, 3], output_ids=[4])
        await h.finish(reward=0.0)
        await eng.close()
        log.close()

    asyncio.run(write(tmp_path / "empty.log", False))
    rc, _, err = _loadgen(str(tmp_path / "empty.log"), "--target", "http://127.0.0.1:9")
    assert rc == 1 and "holds no recorded turn to replay" in err
    asyncio.run(write(tmp_path / "tokens.log", True))
    rc, _, err = _loadgen(str(tmp_path / "tokens.log"), "--target", "http://127.0.0.1:9", "--api", "chat")
    assert rc == 2 and "session 'tok-0' turn 0" in err and "recorded no messages" in err


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64), st.integers(0, 5000))
def test_a_generate_request_carries_any_prompt_byte_for_byte(ids, n_out) -> None:
    from agentlog.tools.loadgen import RecordedTurn, request_body

    prompt = np.asarray(ids, "<i4")
    turn = RecordedTurn(0, 0, prompt, [], n_out, {}, 0, 0)
    for api, key in (("generate", "input_ids"), ("completions", "prompt")):
        body = json.loads(json.dumps(request_body(api, turn)))
        assert _packed(body[key]) == prompt.tobytes()
        budget = body["sampling_params"]["max_new_tokens"] if api == "generate" else body["max_tokens"]
        assert budget == max(1, n_out)
