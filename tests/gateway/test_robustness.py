"""The gateway under hostile or failing conditions: a dying worker thread, a
fatal log, slow and excess connections, oversized and malformed bodies.
Each failure is loud, /health reflects it, and nothing runs the model that
cannot be recorded."""

from __future__ import annotations

import asyncio
import errno
import json

import aiohttp
import msgspec
import pytest
from hypothesis import given, settings, strategies as st
from structlog.testing import capture_logs

from agentlog.engine import SessionEngine
from agentlog.gateway import Gateway, GatewayConfig, SamplingParams, TorchBackend
from agentlog.gateway.backends import BackendError
from agentlog.events import FileLog, OsOps
from agentlog.events.log.api import LogClosed, MemoryLog
from agentlog.events.schema.types import SessionAborted, SessionOpened
from gateway_helpers import HangingBackend, ScriptedBackend, key_for, open_running, rig, run, turns_of
from agentlog.tools.cmd_serve import default_gateway_model

CHAT = [{"role": "user", "content": "hi"}]


async def _request(url: str, method: str, path: str, key: str | None = None, body: object = None, headers: dict | None = None) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, data=data, headers=h) as r:
            return r.status, await r.json(content_type=None)


# ------------------------------------------------------------ the torch worker thread


def test_calls_cancelled_while_the_worker_gathers_a_batch_leave_it_serving():
    """A client that disconnects while the worker waits for a batch to fill
    empties the queue under it; the worker must go back to waiting, and the
    next call is served (it used to pop from the empty queue and die)."""

    async def body():
        backend = TorchBackend(default_gateway_model(), batch_window_s=0.3, max_gather_s=0.3)
        # As if a batch of 8 just took 10 s: the next gather waits (up to
        # max_gather_s) for 8 calls, which gives the cancel below its window.
        backend._last_batch, backend._last_gen_s = 8, 10.0
        params = SamplingParams(max_new_tokens=3, stop_ids=(128,))
        try:
            gathered = asyncio.ensure_future(backend.generate([1, 2, 3], params))
            await asyncio.sleep(0.05)  # queued; the worker is gathering around it
            gathered.cancel()
            await asyncio.sleep(0.4)  # past the gather window
            gen = await asyncio.wait_for(backend.generate([1, 2, 3], params), 10)
            assert 1 <= len(gen.output_ids) <= 3
            assert backend.fatal_reason is None
        finally:
            await backend.close()

    run(body())


class _TemperatureThatCannotCompare(float):
    """A temperature whose comparison raises: it makes the worker's batching
    code itself fail, outside any one batch's generation."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("injected: temperatures cannot be compared")

    __hash__ = float.__hash__


def test_a_crashed_worker_fails_every_pending_call_logs_loudly_and_fails_health():
    async def body():
        backend = TorchBackend(default_gateway_model())
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            odd = SamplingParams(max_new_tokens=3, temperature=_TemperatureThatCannotCompare(1.0))
            with capture_logs() as logs:
                # Both calls are queued before the worker looks (it waits on this lock).
                with backend._cv:
                    calls = [asyncio.ensure_future(backend.generate([1, 2], odd)) for _ in range(2)]
                    await asyncio.sleep(0)
                results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
            assert all(isinstance(r, BackendError) and "worker thread crashed" in str(r) for r in results), results
            assert "injected: temperatures cannot be compared" in backend.fatal_reason
            crash = [e for e in logs if e["event"] == "gateway.backend_worker_crashed"]
            assert crash and crash[0]["log_level"] == "critical"
            # Later calls fail at once with the reason instead of waiting forever.
            with pytest.raises(BackendError, match="worker thread crashed"):
                await asyncio.wait_for(backend.generate([1, 2], SamplingParams(max_new_tokens=3)), 5)
            status, health = await _request(gw.url, "GET", "/health")
            assert status == 503 and health["status"] == "failing" and "worker thread crashed" in health["reason"]
            before = log.next_lsn
            status, err = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": CHAT})
            assert status == 503 and "worker thread crashed" in err["error"]["message"]
            assert log.next_lsn == before

    run(body())


class _FailingAbortLog(MemoryLog):
    """A MemoryLog that cannot append a session_aborted (an injected fault)."""

    async def append(self, session_id, session_seq, body):
        if isinstance(body, SessionAborted):
            raise RuntimeError("injected: abort not appendable")
        return await super().append(session_id, session_seq, body)


def test_a_crashed_engine_background_task_fails_health():
    """The engine's budget timer runs the abort as a background task; when
    that task crashes, /health says so (it used to be logged only)."""

    async def body():
        log = _FailingAbortLog()
        engine = await SessionEngine.open(log, session_budget_s=0.05)
        gw = Gateway(engine, ScriptedBackend(lambda p: "x"))
        await gw.start("127.0.0.1", 0)
        try:
            await open_running(engine, "s")
            for _ in range(100):
                if engine.background_failure is not None:
                    break
                await asyncio.sleep(0.02)
            status, health = await _request(gw.url, "GET", "/health")
            assert status == 503 and "injected: abort not appendable" in health["reason"], health
        finally:
            await gw.stop()

    run(body())


# ------------------------------------------------------------ a fatal log


class _DiskFullOps(OsOps):
    """Real OS calls; once ``full`` is set every write fails with ENOSPC."""

    full = False

    def writev(self, fd, buffers):
        if self.full:
            raise OSError(errno.ENOSPC, "injected No space left on device")
        return super().writev(fd, buffers)


def test_fatal_log_answers_503_with_the_reason_before_any_generation_and_health_fails(tmp_path):
    async def body():
        ops = _DiskFullOps()
        log = FileLog.open(tmp_path / "log", os_ops=ops)
        engine = await SessionEngine.open(log)
        backend = ScriptedBackend(lambda p: "answer")  # counts its calls in .prompts
        gw = Gateway(engine, backend)
        await gw.start("127.0.0.1", 0)
        try:
            await open_running(engine, "s")
            status, _ = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": CHAT})
            assert status == 200 and len(backend.prompts) == 1
            assert (await _request(gw.url, "GET", "/health"))[0] == 200
            ops.full = True
            with pytest.raises(LogClosed):
                await log.append("other", 0, SessionOpened(group_id="g", group_size=1))
            assert log.fatal_reason is not None
            status, health = await _request(gw.url, "GET", "/health")
            assert status == 503 and health["reason"] == f"log: {log.fatal_reason}"
            status, err = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": CHAT})
            assert status == 503 and log.fatal_reason in err["error"]["message"]
            status, err = await _request(gw.url, "POST", "/v1/messages", None, {"messages": CHAT, "max_tokens": 5}, {"x-api-key": key_for(gw, "s")})
            assert status == 503 and err["type"] == "error" and log.fatal_reason in err["error"]["message"]
            assert len(backend.prompts) == 1  # the model never ran for a turn that could not be recorded
        finally:
            await gw.stop()
            with pytest.raises(LogClosed):
                await engine.close()  # the live session cannot be dropped on a dead log
            log.close()

    run(body())


class _ClosableBackend(ScriptedBackend):
    closed = False

    async def close(self) -> None:
        self.closed = True


def test_shutdown_on_a_fatal_log_closes_the_backend_and_the_log_and_reports_one_line(tmp_path):
    """Dropping the live sessions fails on a dead log; the steps after it
    (stop listening, close the backend, close and unlock the log) still run."""
    from agentlog.tools.cmd_serve import _shut_down

    async def body():
        ops = _DiskFullOps()
        log = FileLog.open(tmp_path / "log", os_ops=ops)
        engine = await SessionEngine.open(log)
        backend = _ClosableBackend(lambda p: "x")
        gw = Gateway(engine, backend)
        await gw.start("127.0.0.1", 0)
        await open_running(engine, "s")
        ops.full = True
        with pytest.raises(LogClosed):
            await log.append("other", 0, SessionOpened(group_id="g", group_size=1))
        failures = await _shut_down(gw, engine, backend, log, drain_s=0.1)
        assert len(failures) == 1 and failures[0].startswith("drop live sessions: LogClosed: ") and "\n" not in failures[0]
        assert backend.closed and gw._runner is None
        with FileLog.open(tmp_path / "log") as reopened:  # the lock was released: the log was closed
            assert reopened.fatal_reason is None

    run(body())


# ------------------------------------------------------------ slow and excess connections


async def _raw_connection(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to the gateway (to send partial requests byte by byte)."""
    return await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))


async def _closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """Everything the server sent until it closed the connection (fails if it stays open)."""
    return await asyncio.wait_for(reader.read(), within_s)


def test_slow_loris_connections_are_closed_after_the_header_timeout():
    async def body():
        config = GatewayConfig(header_timeout_s=0.3)
        async with rig(ScriptedBackend(lambda p: "x"), config=config) as (gw, engine, log):
            await open_running(engine, "s")
            # unfinished headers, then silence
            r1, w1 = await _raw_connection(gw)
            w1.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            # unfinished headers, one byte every 0.1 s: trickling does not extend the timeout
            r2, w2 = await _raw_connection(gw)
            w2.write(b"POST /v1/chat/completions HTTP/1.1\r\n")

            async def trickle():
                try:
                    for _ in range(100):
                        await asyncio.sleep(0.1)
                        w2.write(b"X")
                        await w2.drain()
                except (ConnectionError, RuntimeError):
                    return

            trickler = asyncio.ensure_future(trickle())
            assert await _closed_by_server(r1, 5) == b""
            assert await _closed_by_server(r2, 5) == b""
            trickler.cancel()
            assert gw._site.timed_out == 2
            # a normal request on a new connection is served
            status, _ = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": CHAT})
            assert status == 200
            w1.close()
            w2.close()

    run(body())


def test_at_the_cap_a_new_connection_closes_the_longest_waiting_one_and_503_only_when_all_are_busy():
    async def body():
        config = GatewayConfig(max_connections=3, admin_connections=1, header_timeout_s=30)
        async with rig(HangingBackend(), config=config) as (gw, engine, log):
            gw.admin_token = "tok"
            await open_running(engine, "s")
            held = [await _raw_connection(gw) for _ in range(3)]
            for _, w in held:
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
            await asyncio.sleep(0.05)
            # At the cap, no request in progress: the oldest waiting connection makes room.
            status, _ = await _request(gw.url, "GET", "/admin/sessions/s", headers={"X-Admin-Token": "tok", "Connection": "close"})
            assert status == 200 and gw._site.evicted == 1
            assert await _closed_by_server(held[0][0], 5) == b""
            # Two agent requests in progress fill the agents' share (cap 3, one kept for the admin API).
            busy = [asyncio.ensure_future(_request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": CHAT})) for _ in range(2)]
            while gw._site.agent_requests < 2:
                await asyncio.sleep(0.01)
            status, err = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": CHAT})
            assert status == 503 and "1 of the 3 connections are kept for the admin API" in err["error"]["message"], err
            assert gw._site.refused_for_admin == 1
            # An admin request in progress (its body is slow) takes the last slot: every
            # connection has a request in progress, so a new one is answered 503 and closed.
            r, w = await _raw_connection(gw)
            w.write(b"POST /admin/sessions HTTP/1.1\r\nHost: x\r\nX-Admin-Token: tok\r\nContent-Length: 100\r\n\r\n{")
            while len(gw._site.open) < 3 or gw._site.fresh or gw._site.idle:
                await asyncio.sleep(0.01)
            r2, w2 = await _raw_connection(gw)
            answer = await _closed_by_server(r2, 5)
            assert answer.startswith(b"HTTP/1.1 503 ")
            assert "each with a request in progress; the cap is 3" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
            assert gw._site.refused == 1
            for t in busy:
                t.cancel()
            for _, wr in held + [(r, w), (r2, w2)]:
                wr.close()

    run(body())


def test_a_body_that_does_not_arrive_in_time_is_answered_408():
    async def body():
        config = GatewayConfig(body_timeout_s=0.3)
        async with rig(ScriptedBackend(lambda p: "x"), config=config) as (gw, engine, log):
            await open_running(engine, "s")
            r, w = await _raw_connection(gw)
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key_for(gw, "s").encode() + b"\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"")
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 408 ")
            w.close()
            assert turns_of(log) == []

    run(body())


# ------------------------------------------------------------ oversized requests


def test_the_body_cap_is_derived_from_the_log_record_cap_and_a_body_at_the_cap_is_recorded(tmp_path):
    async def body():
        log = FileLog.open(tmp_path / "log", max_record_bytes=2**18)
        engine = await SessionEngine.open(log)
        gw = Gateway(engine, ScriptedBackend(lambda p: "x"))  # no context length: one token per byte at worst
        await gw.start("127.0.0.1", 0)
        try:
            cap = gw.max_body_bytes
            assert 4096 <= cap < log.max_record_bytes
            await open_running(engine, "s")
            envelope = json.dumps({"messages": [{"role": "user", "content": ""}]})
            at_cap = json.dumps({"messages": [{"role": "user", "content": "y" * (cap - len(envelope))}]})
            assert len(at_cap) == cap
            status, _ = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), at_cap)
            assert status == 200
            status, err = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), at_cap[:-2] + ' "}]}')
            assert status == 413 and str(cap) in err["error"]["message"]
            assert len(turns_of_file(log)) == 1
        finally:
            await gw.stop()
            await engine.close()
            log.close()

    run(body())


def turns_of_file(log: FileLog) -> list:
    from agentlog.events.schema.turn_delta import full_turns
    from agentlog.events.schema.types import TurnRecorded

    return [e for e in full_turns(log.read()) if isinstance(e.body, TurnRecorded)]


class _HeldBackend(ScriptedBackend):
    """Holds every call until ``release`` is set (``held`` counts the waiting ones)."""

    def __init__(self) -> None:
        super().__init__(lambda p: "x")
        self.release = asyncio.Event()
        self.held = 0

    async def generate(self, prompt_ids, params):
        self.held += 1
        await self.release.wait()
        return await super().generate(prompt_ids, params)


def test_large_bodies_beyond_the_in_flight_budget_are_answered_503_before_reading():
    async def body():
        backend = _HeldBackend()
        config = GatewayConfig(large_body_bytes=10_000, large_bodies_bytes=25_000)
        async with rig(backend, config=config) as (gw, engine, log):
            for sid in ("a", "b", "c", "d"):
                await open_running(engine, sid)
            big = json.dumps({"messages": [{"role": "user", "content": "y" * 12_000}]})
            small = json.dumps({"messages": CHAT})
            first = [asyncio.ensure_future(_request(gw.url, "POST", "/v1/chat/completions", key_for(gw, sid), big)) for sid in ("a", "b")]
            while backend.held < 2:
                await asyncio.sleep(0.01)
            status, err = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "c"), big)
            assert status == 503 and "large request bodies in flight" in err["error"]["message"]
            small_turn = asyncio.ensure_future(_request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "d"), small))  # small bodies pass
            while backend.held < 3:
                await asyncio.sleep(0.01)
            backend.release.set()
            assert [s for s, _ in await asyncio.gather(*first, small_turn)] == [200, 200, 200]
            assert gw._large_bodies == 0
            status, _ = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "c"), big)  # room again
            assert status == 200

    run(body())


# ------------------------------------------------------------ values the log could not hold


@pytest.mark.parametrize(
    "path, extra, field",
    [
        ("/v1/chat/completions", {"max_tokens": 2**70}, "max_tokens: expected an int >= 1 within 64 bits"),
        ("/v1/chat/completions", {"seed": 2**70}, "seed: expected an int in [0, 2**63)"),
        ("/v1/messages", {"max_tokens": 5, "temperature": 2**70}, "temperature: expected a number in [0.01, 100]"),
        ("/v1/responses", {"seed": -(2**64)}, "seed: expected an int in [0, 2**63)"),
    ],
)
def test_integers_beyond_64_bits_are_refused_400_in_the_dialect_before_generation(path, extra, field):
    async def body():
        backend = ScriptedBackend(lambda p: "x")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            payload = {"input": "hi"} if path == "/v1/responses" else {"messages": CHAT}
            status, err = await _request(gw.url, "POST", path, key_for(gw, "s"), {**payload, **extra})
            assert status == 400, err
            message = err["error"]["message"]
            assert field in message, message
            if path == "/v1/messages":
                assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert backend.prompts == [] and turns_of(log) == []

    run(body())


@pytest.mark.parametrize("arguments, named", [
    ({"n": 2**70}, "outside 64 bits"),
    # As JSON text (as the wire has them): msgspec refuses a lone surrogate in the body itself,
    # json.loads of the arguments text takes it; it was aiohttp's plain-text 500.
    ('{"command": "\\ud800"}', "lone surrogate"),
])
def test_a_value_the_log_cannot_store_inside_the_messages_is_refused_before_generation(arguments, named):
    """An integer beyond 64 bits, or a "\\ud800" escape in a tool call's arguments text: valid JSON
    the log cannot record, a 400 naming it before anything runs."""
    async def body():
        backend = ScriptedBackend(lambda p: "x")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            messages = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
            status, err = await _request(gw.url, "POST", "/v1/chat/completions", key_for(gw, "s"), {"messages": messages})
            assert status == 400 and named in err["error"]["message"], (status, err)
            assert backend.prompts == [] and turns_of(log) == []

    run(body())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_json_nested_too_deeply_is_a_400_json_answer_in_the_dialect(path):
    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            await open_running(engine, "s")
            deep = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
            status, err = await _request(gw.url, "POST", path, key_for(gw, "s"), deep)
            assert status == 400 and "JSON nested deeper than the limit of 64 levels" in err["error"]["message"]
            if path == "/v1/messages":
                assert err["type"] == "error"
            assert turns_of(log) == []

    run(body())


@pytest.mark.parametrize("path, anthropic", [("/v1/chat/completions", False), ("/v1/messages", True), ("/v1/responses", False)])
def test_a_get_on_a_post_route_is_a_405_json_answer(path, anthropic):
    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            status, err = await _request(gw.url, "GET", path)
            assert status == 405
            assert "method not allowed" in err["error"]["message"] and "POST" in err["error"]["message"]
            assert (err.get("type") == "error") is anthropic
            status, err = await _request(gw.url, "GET", "/v1/nothing-here")
            assert status == 404 and err["error"]["type"] == "not_found_error"

    run(body())


# ------------------------------------------------------------ the body cap, as an invariant


@settings(max_examples=20, deadline=None)
@given(
    record_cap=st.integers(2**18, 2**21),
    max_output=st.integers(1, 4096),
    text=st.sampled_from(["y", "\u00e9", "\\n", "\\u0001", "{\\\"a\\\": 1}"]),
)
def test_any_body_within_the_derived_cap_makes_a_record_within_the_record_cap(record_cap, max_output, text):
    """The worst case for the byte-level template (one token per body byte,
    context unknown) and a full output allowance still fits the log's record."""
    from agentlog.gateway import ByteChatTemplate, ChatCompletionsAPI
    from agentlog.gateway.server import body_cap_for
    from agentlog.events.log.format import ENV_HDR
    from agentlog.events.schema.types import TurnRecorded

    cap = body_cap_for(record_cap, None, max_output)
    empty = '{"messages": [{"role": "user", "content": ""}]}'
    content = text * ((cap - len(empty)) // len(text.encode()))  # whole units: no escape is cut in half
    raw = '{"messages": [{"role": "user", "content": "' + content + '"}]}'
    assert len(raw.encode()) <= cap
    req = ChatCompletionsAPI.parse(json.loads(raw))
    template = ByteChatTemplate()
    body = TurnRecorded(
        turn_index=0, messages=req.messages, prompt_ids=template.encode_prompt(req.messages, req.tools),
        output_ids=[65] * max_output, output_log_probs=[-1.0] * max_output,
        response_message={"role": "assistant", "content": "\U0001f600" * (max_output * 4)},
        sampling={"max_new_tokens": max_output, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None, "stop_ids": [128],
                  "client": {"max_tokens": max_output}, "api": "chat", "model": "m" * 200},
    )
    assert ENV_HDR.size + 200 + len(msgspec.msgpack.encode(body)) <= record_cap
