"""Refusals and failure paths: each a clear error or event, nothing trainable recorded."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from structlog.testing import capture_logs

from agentlog.gateway import GatewayConfig, TorchBackend
from agentlog.events.schema.types import TurnDelta, TurnRecorded
from gateway_helpers import GatedLog, bearer, key_for, HangingBackend, ScriptedBackend, an_client, oa_client, open_running, rig, run, turns_of, undelivered_of
from agentlog.learner.model import GPT, GPTConfig
from agentlog.reducers.pipeline import reduce_log, session_trajectory

CHAT = [{"role": "user", "content": "hi"}]


async def _post(url: str, path: str, key: str | None, data: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=data, headers=h) as r:
            return r.status, await r.json(content_type=None)


def test_unknown_key_is_401_and_never_auto_creates_a_session():
    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            with pytest.raises(openai.AuthenticationError, match="no session's key"):
                await oa_client(gw, "ghost").chat.completions.create(model="m", messages=CHAT)
            status, err = await _post(gw.url, "/v1/messages", None, json.dumps({"messages": CHAT, "max_tokens": 5}), {"x-api-key": "ghost2"})
            assert status == 401 and err["type"] == "error" and err["error"]["type"] == "authentication_error"
            status, err = await _post(gw.url, "/v1/chat/completions", None, json.dumps({"messages": CHAT}))
            assert status == 401 and "API key" in err["error"]["message"]
            assert log.next_lsn == 0 and engine.live_count == 0 and engine.get("ghost") is None

    run(body())


@pytest.mark.parametrize("end", ["finish", "abort", "drop", "not_started"])
def test_terminal_or_unstarted_session_is_409_and_nothing_is_appended(end):
    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            if end == "not_started":
                await engine.open_session("s", group_id="g", group_size=1)
                client = oa_client(gw, "s")
            else:
                h = await open_running(engine, "s")
                client = oa_client(gw, "s")  # the agent holds its key from before the end
                await {"finish": lambda: h.finish(reward=1.0), "abort": lambda: h.abort("boom"), "drop": lambda: h.drop("x")}[end]()
            before = log.next_lsn
            with pytest.raises(openai.ConflictError) as ei:
                await client.chat.completions.create(model="m", messages=CHAT)
            expected = {"finish": "finished", "abort": "aborted", "drop": "dropped", "not_started": "open"}[end]
            assert expected in str(ei.value)
            assert log.next_lsn == before

    run(body())


def test_turn_cap_answers_429_and_records_nothing_more():
    async def body():
        async with rig(ScriptedBackend(lambda p: "x"), config=GatewayConfig(max_turns=2)) as (gw, engine, log):
            await open_running(engine, "s")
            gw.configure_session("s", max_turns=3)
            await open_running(engine, "t")
            c = oa_client(gw, "s")
            for _ in range(3):
                await c.chat.completions.create(model="m", messages=CHAT)
            with pytest.raises(openai.RateLimitError, match="turn cap of 3"):
                await c.chat.completions.create(model="m", messages=CHAT)
            t = oa_client(gw, "t")
            for _ in range(2):
                await t.chat.completions.create(model="m", messages=CHAT)
            with pytest.raises(openai.RateLimitError, match="turn cap of 2"):
                await t.chat.completions.create(model="m", messages=CHAT)
            assert len(turns_of(log, "s")) == 3 and len(turns_of(log, "t")) == 2

    run(body())


def test_a_sessions_output_cap_holds_against_the_clients_max_tokens_and_its_calls_are_counted():
    """configure_session(max_new_tokens=N) caps every turn at N tokens even when the client asks
    for 64000 (as Claude Code does); session_calls counts the session's requests and recorded turns,
    a refused request among the first and not the second."""
    async def body():
        async with rig(ScriptedBackend(lambda p: "x" * 40)) as (gw, engine, log):
            await open_running(engine, "s")
            gw.configure_session("s", max_turns=2, max_new_tokens=5)
            await open_running(engine, "t")
            assert gw.session_calls("s") == {"requests": 0, "turns": 0}
            c = an_client(gw, "s")
            for _ in range(2):
                await c.messages.create(model="claude-x", max_tokens=64000, messages=CHAT)
            with pytest.raises(Exception, match="turn cap of 2"):
                await c.messages.create(model="claude-x", max_tokens=64000, messages=CHAT)
            await an_client(gw, "t").messages.create(model="claude-x", max_tokens=64000, messages=CHAT)
            assert [len(t.output_tokens) for t in turns_of(log, "s")] == [5, 5]
            assert len(turns_of(log, "t")[0].output_tokens) == 41  # no session cap: the client's allowance
            assert gw.session_calls("s") == {"requests": 3, "turns": 2} and gw.session_calls("t") == {"requests": 1, "turns": 1}
            with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1, found 0"):
                gw.configure_session("s", max_new_tokens=0)

    run(body())


def test_context_exhaustion_finishes_the_turn_with_length_and_a_full_context_is_refused():
    async def body():
        model = GPT(GPTConfig(vocab_size=129, max_seq_len=64, d_model=32, n_layer=1, n_head=2))
        async with rig(TorchBackend(model)) as (gw, engine, log):
            h = await open_running(engine, "s")
            c = oa_client(gw, "s")
            # 11-token prompt in a 64-token context: the output is cut at the room left
            r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=500, temperature=0.01)
            t1 = turns_of(log, "s")[0]
            assert len(t1.prompt_tokens) + len(t1.output_tokens) <= 64
            if t1.finish_reason == "length":
                assert r.choices[0].finish_reason == "length" and len(t1.prompt_tokens) + len(t1.output_tokens) == 64
            # a prompt that fills the context: refused before anything runs,
            # in each client's dialect, and nothing is recorded
            before = log.next_lsn
            batches = gw.backend.batches
            status, err = await _post(gw.url, "/v1/chat/completions", key_for(gw, "s"), json.dumps({"messages": [{"role": "user", "content": "y" * 80}]}))
            assert status == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["type"] == "invalid_request_error"
            status, err = await _post(gw.url, "/v1/messages", None, json.dumps({"max_tokens": 10, "messages": [{"role": "user", "content": "y" * 80}]}), {"x-api-key": key_for(gw, "s")})
            assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert "prompt is too long" in err["error"]["message"] and "context is 64 tokens" in err["error"]["message"]
            assert log.next_lsn == before and len(turns_of(log, "s")) == 1
            assert gw.backend.batches == batches
            await h.finish(reward=1.0)

    run(body())


async def _turn_held_at_the_log(gw, engine, log: GatedLog, session: aiohttp.ClientSession):
    """Start running session "s", post one chat turn and return (handle, the
    request's future) once its turn_recorded append waits on the log's gate."""
    log.gate.set()
    h = await open_running(engine, "s")
    log.gate.clear()
    req = asyncio.ensure_future(session.post(gw.url + "/v1/chat/completions", json={"messages": CHAT}, headers=bearer(gw, "s")))
    await asyncio.wait_for(log.waiting.wait(), 10)
    return h, req


def test_response_is_sent_only_after_the_turn_is_durable():
    """While the log holds the turn_recorded append, the client gets no byte of the answer."""

    async def body():
        log = GatedLog()
        async with rig(ScriptedBackend(lambda p: "answer"), log=log) as (gw, engine, _):
            async with aiohttp.ClientSession() as session:
                _, req = await _turn_held_at_the_log(gw, engine, log, session)
                done, _ = await asyncio.wait({req}, timeout=0.3)
                assert not done, "the response started before its turn was recorded"
                assert turns_of(log, "s") == []
                log.gate.set()
                resp = await asyncio.wait_for(req, 10)
                out = await resp.json()
                assert resp.status == 200 and out["choices"][0]["message"]["content"] == "answer"
                (turn,) = turns_of(log, "s")
                assert turn.response_message == {"role": "assistant", "content": "answer"}

    run(body())


def test_client_disconnect_after_recording_appends_turn_undelivered():
    async def body():
        log = GatedLog()
        async with rig(ScriptedBackend(lambda p: "answer"), log=log) as (gw, engine, _):
            session = aiohttp.ClientSession()
            h, req = await _turn_held_at_the_log(gw, engine, log, session)  # the turn is being made durable...
            req.cancel()  # ...when the client goes away
            await session.close()
            await asyncio.sleep(0.05)
            log.gate.set()
            for _ in range(200):
                if undelivered_of(log):
                    break
                await asyncio.sleep(0.01)
            (turn,) = turns_of(log, "s")
            (und,) = undelivered_of(log)
            assert und.turn_index == turn.turn_index and "client" in und.reason
            await h.finish(reward=1.0)
            traj = session_trajectory(log.read(), "s")
            assert traj.decisions[0].trainable is False and traj.decisions[0].reason == "undelivered"
            assert reduce_log(log).samples == []

    run(body())


def test_client_disconnect_during_generation_records_nothing_and_logs_why():
    async def body():
        slow = HangingBackend()
        started = slow.started
        async with rig(slow) as (gw, engine, log):
            await open_running(engine, "s")
            session = aiohttp.ClientSession()
            with capture_logs() as logs:
                req = asyncio.ensure_future(session.post(gw.url + "/v1/chat/completions", json={"messages": CHAT}, headers=bearer(gw, "s")))
                await asyncio.wait_for(started.wait(), 10)
                req.cancel()
                await session.close()
                for _ in range(200):
                    if gw.stats["cancelled"]:
                        break
                    await asyncio.sleep(0.01)
            assert gw.stats["cancelled"] == 1 and turns_of(log) == []
            assert any(e["event"] == "gateway.turn_cancelled" and "client disconnected" in e["reason"] for e in logs)

    run(body())


def test_malformed_json_and_bad_fields_are_400_naming_the_problem():
    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            await open_running(engine, "s")
            before = log.next_lsn
            status, err = await _post(gw.url, "/v1/chat/completions", key_for(gw, "s"), '{"messages": [')
            assert status == 400 and "malformed JSON" in err["error"]["message"]
            status, err = await _post(gw.url, "/v1/chat/completions", key_for(gw, "s"), "[1, 2]")
            assert status == 400 and "expected a JSON object" in err["error"]["message"]
            status, err = await _post(gw.url, "/v1/chat/completions", key_for(gw, "s"), json.dumps({"messages": [{"role": "wizard", "content": "x"}]}))
            assert status == 400 and "messages[0].role" in err["error"]["message"]
            status, err = await _post(gw.url, "/v1/messages", key_for(gw, "s"), json.dumps({"messages": CHAT, "max_tokens": "lots"}))
            assert status == 400 and err["error"]["type"] == "invalid_request_error" and "max_tokens" in err["error"]["message"]
            status, err = await _post(gw.url, "/v1/responses", key_for(gw, "s"), json.dumps({"input": 7}))
            assert status == 400 and "input" in err["error"]["message"]
            status, err = await _post(gw.url, "/v1/responses", key_for(gw, "s"), json.dumps({"input": "x", "previous_response_id": "resp_1"}))
            assert status == 400 and "previous_response_id" in err["error"]["message"]
            # Wrong shapes in optional fields are 400s naming the field, not 500s.
            for path, bad, where in [
                ("/v1/chat/completions", {"messages": CHAT, "tools": "shell"}, "tools: expected a list of tool objects"),
                ("/v1/chat/completions", {"messages": CHAT, "tools": [5]}, "tools[0]: expected a tool object"),
                ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, "stop: expected a string or a list of strings"),
                ("/v1/messages", {"messages": CHAT, "max_tokens": 5, "tools": "shell"}, "tools: expected a list of tool objects"),
                ("/v1/responses", {"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": 3}]}, "tools[0].tools: expected a list"),
                # Sampling values no recorded turn can use: 400 before anything runs, never a backend 502.
                ("/v1/chat/completions", {"messages": CHAT, "temperature": 0}, "temperature: expected a number in [0.01, 100], found 0"),
                ("/v1/messages", {"messages": CHAT, "max_tokens": 5, "temperature": -1}, "temperature: expected a number in [0.01, 100], found -1"),
                ("/v1/chat/completions", {"messages": CHAT, "top_p": 7}, "top_p: expected a number in [1.18e-38, 1], found 7"),
            ]:
                status, err = await _post(gw.url, path, key_for(gw, "s"), json.dumps(bad))
                message = err["error"]["message"]
                assert status == 400 and where in message, (path, bad, status, err)
            assert log.next_lsn == before

    run(body())


def test_oversized_body_is_413_and_records_nothing():
    async def body():
        async with rig(ScriptedBackend(lambda p: "x"), config=GatewayConfig(max_body_bytes=4096)) as (gw, engine, log):
            await open_running(engine, "s")
            before = log.next_lsn
            big = json.dumps({"messages": [{"role": "user", "content": "z" * 10000}]})
            status, err = await _post(gw.url, "/v1/chat/completions", key_for(gw, "s"), big)
            assert status == 413 and "4096" in err["error"]["message"]
            assert log.next_lsn == before

    run(body())


def test_backend_failure_is_502_and_records_nothing():
    async def body():
        class Broken(ScriptedBackend):
            async def generate(self, prompt_ids, params):
                from agentlog.gateway import BackendError

                raise BackendError("broken", "HTTP 500 from upstream", 500)

        async with rig(Broken(lambda p: "")) as (gw, engine, log):
            await open_running(engine, "s")
            with capture_logs() as logs:
                with pytest.raises(openai.InternalServerError, match="HTTP 500 from upstream"):
                    await oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT)
            assert not any(isinstance(e.body, (TurnRecorded, TurnDelta)) for e in log.read())
            assert any(e["event"] == "gateway.backend_failed" for e in logs)

    run(body())


def test_session_ending_during_generation_cancels_the_call_and_records_nothing():
    async def body():
        slow = HangingBackend()
        started = slow.started
        async with rig(slow) as (gw, engine, log):
            engine.drain_s = 0.05
            h = await open_running(engine, "s")
            call = asyncio.ensure_future(oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT))
            await asyncio.wait_for(started.wait(), 10)
            await h.abort("wall_clock_timeout")
            with pytest.raises(openai.ConflictError, match="ended"):
                await call
            assert turns_of(log) == []

    run(body())


def test_backend_answer_the_log_cannot_hold_is_a_json_500_and_records_nothing():
    async def body():
        from agentlog.gateway import Generation

        class Bad(ScriptedBackend):
            async def generate(self, prompt_ids, params):
                return Generation([1, 2], [-0.1], "stop", 0, 0.0)  # one log-prob short

        async with rig(Bad(lambda p: "")) as (gw, engine, log):
            await open_running(engine, "s")
            with capture_logs() as logs:
                with pytest.raises(openai.InternalServerError, match="output_log_probs"):
                    await oa_client(gw, "s").chat.completions.create(model="m", messages=CHAT)
            assert turns_of(log) == [] and any(e["event"] == "gateway.turn_failed" for e in logs)

    run(body())


def test_new_weights_are_used_and_recorded_with_their_policy_version():
    async def body():
        model = GPT(GPTConfig(vocab_size=129, max_seq_len=128, d_model=32, n_layer=1, n_head=2))
        backend = TorchBackend(model)
        async with rig(backend) as (gw, engine, log):
            await open_running(engine, "s")
            c = oa_client(gw, "s")
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
            state = {k: v.clone() * 0 for k, v in model.state_dict().items()}  # uniform logits
            await backend.load_weights(state, 3)
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=4)
            await c.chat.completions.create(model="m", messages=CHAT, max_tokens=4, top_p=0.5)
            t0, t1, t2 = turns_of(log, "s")
            assert (t0.policy_version, t1.policy_version) == (0, 3)
            assert "ignored" not in t0.sampling and t2.sampling["ignored"] == ["top_p"]  # the sampler never claims top_p
            assert t1.log_probs.tolist() == pytest.approx([-4.8598] * len(t1.log_probs), abs=1e-3)  # log(1/129)

    run(body())


@pytest.mark.parametrize(
    "extra, problem",
    [
        ({"sampling": {"temprature": 0.5}}, "unknown keys ['temprature']"),
        ({"sampling": "hot"}, "sampling: expected a JSON object, found 'hot'"),
        ({"max_turns": "ten"}, "max_turns: expected an int >= 1, found 'ten'"),
        ({"max_turns": 0}, "max_turns: expected an int >= 1, found 0"),
    ],
)
def test_admin_open_with_bad_options_is_400_and_opens_nothing(extra, problem):
    """A refused admin open leaves no session behind (no half-opened, running session)."""

    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            gw.admin_token = "tok"
            status, err = await _post(gw.url, "/admin/sessions", None, json.dumps({"session_id": "s", **extra}), {"X-Admin-Token": "tok"})
            assert status == 400 and problem in err["error"]["message"] and "'s'" in err["error"]["message"]
            assert log.next_lsn == 0 and engine.get("s") is None
            # the same id is still free: a corrected request opens it
            status, ok = await _post(gw.url, "/admin/sessions", None, json.dumps({"session_id": "s", "max_turns": 2}), {"X-Admin-Token": "tok"})
            assert status == 200 and (ok["session_id"], ok["state"]) == ("s", "running")
            status, _ = await _post(gw.url, "/admin/sessions", None, json.dumps({"session_id": "s"}), {"X-Admin-Token": "tok"})
            assert status == 409

    run(body())
