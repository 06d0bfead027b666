"""No request may freeze the gateway: deep JSON, a failure's log line,
sampling values a sampler cannot use, and slow-loris connections.

Each hostile request is answered at once with a 400 naming what was wrong
(or its connection is closed in time), nothing is recorded for it, and the
gateway keeps answering everyone else meanwhile."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import aiohttp
import pytest
import structlog
from structlog.testing import capture_logs

from agentlog.gateway import GatewayConfig
from agentlog.gateway.json_depth import MAX_JSON_DEPTH
from gateway_helpers import ScriptedBackend, key_for, open_running, rig, run, turns_of

CHAT = [{"role": "user", "content": "hi"}]
ADMIN = {"X-Admin-Token": "tok"}


async def _post(url: str, path: str, body: object, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.json(content_type=None)


def _nested(levels: int) -> str:
    """JSON text of an object ``levels`` deep: {"a": {"a": ... {}}} (built as
    text: json.dumps itself recurses once per level)."""
    return '{"a": ' * (levels - 1) + "{}" + "}" * (levels - 1)


def _nested_text(levels: int) -> str:
    """JSON text of arrays ``levels`` deep."""
    return "[" * levels + "]" * levels


# ------------------------------------------------------------ deep JSON


def _chat_with_parameters(levels: int) -> str:
    """A chat body whose tool's parameters nest so that the body is ``levels`` deep
    (body, tools, tool, function: 4 levels around the parameters)."""
    return json.dumps({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": "P"}}]}).replace('"P"', _nested(levels - 4))


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 975])
def test_a_chat_body_nested_past_the_limit_is_400_naming_the_limit_and_where(levels):
    """975 levels passed the decoder and then failed (500) in the chat
    template; one level past the bound is refused too, before any generation."""

    async def body():
        backend = ScriptedBackend(lambda p: "ok")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            before = log.next_lsn
            status, err = await _post(gw.url, "/v1/chat/completions", _chat_with_parameters(levels), {"Authorization": f"Bearer {key_for(gw, 's')}"})
            message = err["error"]["message"]
            assert status == 400 and err["error"]["type"] == "invalid_request_error", err
            assert f"request body: JSON nested deeper than the limit of {MAX_JSON_DEPTH} levels" in message, message
            if levels == MAX_JSON_DEPTH + 1:  # decoded, then measured: the path names where
                assert "levels at $.tools[0].function.parameters.a.a.a" in message and "(52 levels more)" in message, message
            assert log.next_lsn == before and backend.prompts == []
            # At the limit is accepted: the bound refuses only what is past it.
            status, _ = await _post(gw.url, "/v1/chat/completions", _chat_with_parameters(MAX_JSON_DEPTH), {"Authorization": f"Bearer {key_for(gw, 's')}"})
            assert status == 200 and len(turns_of(log, "s")) == 1

    run(body())


@pytest.mark.parametrize("path, action", [("/admin/sessions", "open"), ("/admin/sessions/s/finish", "finish")])
def test_admin_metadata_nested_past_the_limit_is_400_and_appends_nothing(path, action):
    """One admin open with metadata 975 levels deep held the event loop for
    minutes (a RecursionError in the log's encoder, logged with locals)."""

    async def body():
        async with rig(ScriptedBackend(lambda p: "ok")) as (gw, engine, log):
            gw.admin_token = "tok"
            if action == "finish":
                await open_running(engine, "s")
            before = log.next_lsn
            fields = {"session_id": "t"} if action == "open" else {}
            t0 = time.perf_counter()
            deep = json.dumps({**fields, "metadata": "M"}).replace('"M"', _nested(975))
            status, err = await _post(gw.url, path, deep, ADMIN)
            assert status == 400 and f"the limit of {MAX_JSON_DEPTH} levels" in err["error"]["message"], err
            assert "request body" in err["error"]["message"]
            assert time.perf_counter() - t0 < 5
            assert log.next_lsn == before
            status, _ = await _post(gw.url, path, {**fields, "metadata": {"k": [1, {"x": "y"}]}}, ADMIN)
            assert status == 200

    run(body())


def test_deep_json_in_tool_call_arguments_text_stays_text_and_the_turn_is_served():
    """Arguments sent as JSON text are parsed when they are an object; text
    nested past the limit used to fail the turn (RecursionError, 500) and is
    kept as the text it is."""

    async def body():
        async with rig(ScriptedBackend(lambda p: "ok")) as (gw, engine, log):
            await open_running(engine, "s")
            deep_args = '{"a": ' + _nested_text(975) + "}"
            messages = CHAT + [
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ]
            status, err = await _post(gw.url, "/v1/chat/completions", {"messages": messages}, {"Authorization": f"Bearer {key_for(gw, 's')}"})
            assert status == 200, err
            (turn,) = turns_of(log, "s")
            assert turn.messages[1]["tool_calls"][0]["arguments"] == deep_args

    run(body())


def test_a_model_tool_call_nested_past_the_limit_is_an_ill_formed_call_not_a_failed_turn():
    """The model's own output is parsed with the same bound: a deep tool call
    is recorded as an ill-formed call (its text kept), never a 500."""

    async def body():
        reply = '<tool_call>{"name": "f", "arguments": {"a": ' + _nested_text(975) + "}}</tool_call>"
        async with rig(ScriptedBackend(lambda p: reply)) as (gw, engine, log):
            await open_running(engine, "s")
            with capture_logs() as logs:
                status, out = await _post(gw.url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4000}, {"Authorization": f"Bearer {key_for(gw, 's')}"})
            assert status == 200, out
            (turn,) = turns_of(log, "s")
            assert turn.ill_formed and out["choices"][0]["message"]["content"] == reply
            (event,) = [e for e in logs if e["event"] == "gateway.tool_call_ill_formed"]
            assert f"tool call 0: JSON nested deeper than the limit of {MAX_JSON_DEPTH} levels" in event["error"]

    run(body())


# ------------------------------------------------------------ a failure's log line


def test_a_failed_turn_logs_one_line_on_the_loop_and_its_traceback_at_debug_off_the_loop(capsys, monkeypatch):
    """`agentlog serve` configures structlog's console output; with rich
    installed its default renders every frame's locals, on the event loop.
    A failure on the loop is one line (type and message); the traceback,
    plain text without locals, follows at debug level, formatted on a worker
    thread, while /health keeps answering."""
    from agentlog.tools.cli import configure_output

    class Exploding(ScriptedBackend):
        async def generate(self, prompt_ids, params):
            secret_local = "LOCAL-VALUE-" * 10  # noqa: F841 - what a locals-rendering traceback would print

            def down(n: int) -> int:
                return down(n + 1)

            return down(0)

    printed: list[str] = []

    async def body():
        async with rig(Exploding(lambda p: "")) as (gw, engine, log):
            await open_running(engine, "s")
            status, err = await _post(gw.url, "/v1/chat/completions", {"messages": CHAT}, {"Authorization": f"Bearer {key_for(gw, 's')}"})
            assert status == 500 and "RecursionError" in err["error"]["message"]
            async with aiohttp.ClientSession() as s:
                async with s.get(gw.url + "/health") as r:
                    assert r.status == 200
            for _ in range(100):  # the traceback is formatted on a worker thread
                printed.append(capsys.readouterr().err)
                if "gateway.turn_failed.traceback" in "".join(printed):
                    break
                await asyncio.sleep(0.05)

    structlog.reset_defaults()
    monkeypatch.setenv("AGENTLOG_LOG_LEVEL", "debug")  # the traceback is a debug event
    configure_output()
    try:
        capsys.readouterr()
        run(body())
    finally:
        structlog.reset_defaults()
    out = re.sub(r"\x1b\[[0-9;]*m", "", "".join(printed))  # the console's colours
    (line,) = [ln for ln in out.splitlines() if "gateway.turn_failed " in ln]
    assert "[error" in line and "error='RecursionError: maximum recursion depth exceeded" in line, line
    before_traceback = out.split("gateway.turn_failed.traceback")[0]
    assert "Traceback" not in before_traceback and "LOCAL-VALUE" not in out and "locals" not in out, out[:2000]
    after = out.split("gateway.turn_failed.traceback", 1)[1]
    assert "Traceback (most recent call last)" in after and "in down" in after


# ------------------------------------------------------------ sampling values


@pytest.mark.parametrize(
    "path, fields, problem",
    [
        ("/v1/chat/completions", {"temperature": 5e-324}, "temperature: expected a number in [0.01, 100], found 5e-324"),
        ("/v1/chat/completions", {"temperature": 1e300}, "temperature: expected a number in [0.01, 100], found 1e+300"),
        ("/v1/messages", {"max_tokens": 5, "temperature": 0.001}, "temperature: expected a number in [0.01, 100], found 0.001"),
        ("/v1/responses", {"top_p": 1e-320}, "top_p: expected a number in [1.18e-38, 1], found 1e-320"),
        ("/v1/chat/completions", {"top_k": 2**40}, "top_k: expected an int in [-1, 2**31 - 1] (-1 or 0: off), found 1099511627776"),
        ("/v1/chat/completions", {"top_k": -2}, "top_k: expected an int in [-1, 2**31 - 1] (-1 or 0: off), found -2"),
        ("/v1/chat/completions", {"seed": 2**63}, "seed: expected an int in [0, 2**63), found 9223372036854775808"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens: expected an int >= 1 within 64 bits, found 0"),
    ],
)
def test_a_sampling_value_outside_the_samplers_range_is_400_naming_field_value_and_range(path, fields, problem):
    """5e-324 passed the "number > 0" check, then failed in the sampler (502)."""

    async def body():
        backend = ScriptedBackend(lambda p: "ok")
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            before = log.next_lsn
            base = {"input": "hi"} if path == "/v1/responses" else {"messages": CHAT}
            status, err = await _post(gw.url, path, {**base, **fields}, {"Authorization": f"Bearer {key_for(gw, 's')}"})
            assert status == 400, err
            assert problem in json.dumps(err) or problem in err["error"]["message"], err
            assert log.next_lsn == before and backend.prompts == []

    run(body())


def test_the_torch_sampler_runs_at_the_ends_of_the_temperature_range():
    """The bounds are ones the built-in sampler can use: a turn at each end is recorded."""

    async def body():
        async with rig() as (gw, engine, log):
            await open_running(engine, "s")
            for temperature in (0.01, 100):
                status, err = await _post(gw.url, "/v1/chat/completions", {"messages": CHAT, "temperature": temperature, "max_tokens": 4},
                                          {"Authorization": f"Bearer {key_for(gw, 's')}"})
                assert status == 200, (temperature, err)
            assert [t.sampling["temperature"] for t in turns_of(log, "s")] == [0.01, 100]

    run(body())


def test_gateway_defaults_outside_the_samplers_range_are_refused_at_construction():
    async def body():
        with pytest.raises(ValueError, match=r"GatewayConfig.temperature: expected a number in \[0.01, 100\], found 0.0"):
            async with rig(ScriptedBackend(lambda p: "ok"), config=GatewayConfig(temperature=0.0)):
                pass

    run(body())


# ------------------------------------------------------------ slow loris


class _Attackers:
    """Sockets that hold connection slots without ever finishing a request
    head: half send nothing, half trickle a byte every 50 ms. Each one that
    the gateway closes reconnects at once. They run on their own thread and
    event loop, as another machine's would."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count = port, count
        self.connects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="slow-loris", daemon=True)

    def __enter__(self) -> "_Attackers":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the attacker thread did not stop"

    async def _main(self) -> None:
        await asyncio.gather(*(self._one(trickle=i % 2 == 1) for i in range(self.count)))

    async def _one(self, trickle: bool) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.01)
                continue
            self.connects += 1
            try:
                if trickle:
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
                while not self._stop.is_set() and not reader.at_eof():
                    if trickle:
                        writer.write(b"X")
                    try:
                        await asyncio.wait_for(reader.read(1024), 0.05)
                    except asyncio.TimeoutError:
                        pass
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()


def test_silent_and_trickling_attackers_at_the_cap_leave_well_behaved_clients_served():
    """150 silent or trickling sockets used to fill the cap for good: a
    well-behaved client got 0 of 80 answers and the admin API was locked out.
    Heads are timed from accept, and at the cap a new connection closes the
    longest-waiting one that never sent a whole head, so clients and the
    operator are served while the attack goes on."""
    cap = 24

    async def body():
        config = GatewayConfig(max_connections=cap, admin_connections=4, header_timeout_s=1.0)
        async with rig(ScriptedBackend(lambda p: "ok"), config=config) as (gw, engine, log):
            gw.admin_token = "tok"
            for i in range(4):
                await open_running(engine, f"s{i}")
            with _Attackers(int(gw.url.rsplit(":", 1)[1]), cap) as attackers:
                deadline = time.monotonic() + 10
                while len(gw._site.open) < cap and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert len(gw._site.open) == cap, "the attackers did not reach the cap"

                async def client(sid: str) -> list[int]:
                    statuses = []
                    headers = {"Authorization": f"Bearer {key_for(gw, sid)}"}
                    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                        for _ in range(15):
                            try:
                                async with s.post(gw.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}, headers=headers) as r:
                                    await r.read()
                                    statuses.append(r.status)
                            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                                statuses.append(type(exc).__name__)
                    return statuses

                async def operator() -> list[int]:
                    statuses = []
                    for _ in range(5):
                        async with aiohttp.ClientSession() as s:
                            async with s.get(gw.url + "/admin/sessions/s0", headers=ADMIN) as r:
                                statuses.append(r.status)
                        await asyncio.sleep(0.1)
                    return statuses

                results = await asyncio.gather(*(client(f"s{i}") for i in range(4)), operator())
                reconnects = attackers.connects - cap
            answered = [x for statuses in results[:4] for x in statuses]
            ok = sum(1 for x in answered if x == 200)
            assert ok >= 0.95 * len(answered), (ok, len(answered), answered)
            assert results[4] == [200] * 5, results[4]
            assert reconnects > 0 and gw._site.evicted + gw._site.timed_out > 0
            assert len(turns_of(log)) == ok

    run(body())


def test_a_socket_that_sends_nothing_is_closed_after_the_head_timeout_from_accept():
    """The head clock used to start at a connection's first byte: a socket
    that never sent one was held until aiohttp's keep-alive timeout (75 s)."""

    async def body():
        async with rig(ScriptedBackend(lambda p: "ok"), config=GatewayConfig(header_timeout_s=0.3)) as (gw, engine, log):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
            t0 = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert 0.25 < time.monotonic() - t0 < 3 and gw._site.timed_out == 1
            writer.close()

    run(body())
