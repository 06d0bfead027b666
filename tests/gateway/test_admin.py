"""The admin API (``agentlog serve``): checked fields, group membership, session keys.

Every refused admin request answers 400/409 JSON naming the field or the
conflict and appends nothing; every accepted one leaves a log the reducers
fold. Session ids are no credentials: only the random key issued at open
admits an agent's request, and that key is never logged or recorded.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from structlog.testing import capture_logs

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import EventValidationError, SessionFinished, SessionOpened, encode_body
from gateway_helpers import ScriptedBackend, rig, run, turns_of
from agentlog.reducers.pipeline import reduce_log

CHAT = [{"role": "user", "content": "hi"}]
ADMIN = {"X-Admin-Token": "tok"}


async def _call(url: str, path: str, body: object | None = None, headers: dict | None = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (None if body is None else json.dumps(body))
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, await r.json(content_type=None)


def _admin_rig():
    return rig(ScriptedBackend(lambda p: "ok"))


# ---------------------------------------------------------------- open: every field checked


@pytest.mark.parametrize(
    "fields, problem",
    [
        # Critical 1: each used to answer 200 and append a record the decoder refuses.
        ({"metadata": [1]}, "metadata: expected a JSON object, found [1]"),
        ({"prompt": "x"}, "prompt: expected a list of message objects, found 'x'"),
        ({"prompt": [1]}, "prompt[0]: expected a message object, found 1"),
        ({"prompt": {"a": 1}}, "prompt: expected a list of message objects, found {'a': 1}"),
        ({"label": {"n": 2**70}}, "label.n: expected an integer in [-2**63, 2**64 - 1], found 1180591620717411303424"),
        ({"metadata": {"deep": [[{"n": -(2**64)}]]}}, "metadata.deep[0][0].n: expected an integer in [-2**63, 2**64 - 1]"),
        ({"agent": 5}, "agent: expected a string, found 5"),
        # Medium 10: values that broke every later turn or were silently rounded.
        ({"sampling": {"max_new_tokens": "x"}}, "sampling.max_new_tokens: expected an int in [1, 2**31 - 1], found 'x'"),
        ({"sampling": {"max_new_tokens": -5}}, "sampling.max_new_tokens: expected an int in [1, 2**31 - 1], found -5"),
        ({"sampling": {"max_new_tokens": 2.0}}, "sampling.max_new_tokens: expected an int in [1, 2**31 - 1], found 2.0"),
        ({"sampling": {"temperature": 0}}, "sampling.temperature: expected a number in [0.01, 100]"),
        ({"sampling": {"temperature": True}}, "sampling.temperature: expected a number in [0.01, 100]"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p: expected a number in [1.18e-38, 1], found 1.5"),
        ({"sampling": {"top_k": 2.5}}, "sampling.top_k: expected an int in [-1, 2**31 - 1]"),
        ({"sampling": {"seed": 1.5}}, "sampling.seed: expected an int in [0, 2**63), found 1.5"),
        ({"sampling": {"seed": -1}}, "sampling.seed: expected an int in [0, 2**63), found -1"),
        ({"group_size": 1.9}, "group_size: expected an int >= 1, found 1.9"),
        ({"group_size": "2"}, "group_size: expected an int >= 1, found '2'"),
        ({"group_size": True}, "group_size: expected an int >= 1, found True"),
        ({"group_size": 0}, "group_size: expected an int >= 1, found 0"),
        ({"group_size": 2**64}, "group_size: expected an int >= 1, found 18446744073709551616"),
        ({"sample_index": -1}, "sample_index: expected an int >= 0, found -1"),
        ({"sample_index": 1.0}, "sample_index: expected an int >= 0, found 1.0"),
        ({"group_id": "a/b"}, "group_id: expected a non-empty id string"),
        ({"group_id": 7}, "group_id: expected a non-empty id string"),
        ({"max_turns": 2.5}, "max_turns: expected an int >= 1, found 2.5"),
        ({"sample_idx": 1}, "request body: expected fields among"),
    ],
)
def test_admin_open_refuses_a_bad_field_naming_it_and_appends_nothing(fields, problem):
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            status, err = await _call(gw.url, "/admin/sessions", {"session_id": "s", **fields}, ADMIN)
            assert status == 400, err
            assert err["error"]["type"] == "invalid_request_error" and problem in err["error"]["message"], err
            assert "'s'" in err["error"]["message"]
            assert log.next_lsn == 0 and engine.get("s") is None and gw.tracked_sessions == 0

    run(body())


@pytest.mark.parametrize("sid", [None, "", "a/b", 5])
def test_admin_open_without_a_usable_session_id_is_400(sid):
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            status, err = await _call(gw.url, "/admin/sessions", {} if sid is None else {"session_id": sid}, ADMIN)
            assert status == 400 and "session_id: expected a non-empty id string" in err["error"]["message"], err
            assert log.next_lsn == 0

    run(body())


def test_admin_open_with_every_field_opens_and_records_them():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            fields = {
                "session_id": "s", "group_id": "g", "group_size": 2, "sample_index": 1, "agent": "a",
                "prompt": [{"role": "user", "content": "p"}], "label": {"answer": [1, 2]}, "metadata": {"k": [None, 1.5]},
                "sampling": {"temperature": 0.5, "max_new_tokens": 3, "seed": 7}, "max_turns": 4,
            }
            status, out = await _call(gw.url, "/admin/sessions", fields, ADMIN)
            assert status == 200 and (out["state"], out["group_id"], out["sample_index"]) == ("running", "g", 1)
            (opened,) = [e.body for e in log.read() if isinstance(e.body, SessionOpened)]
            assert (opened.group_size, opened.sample_index, opened.label, opened.metadata) == (2, 1, {"answer": [1, 2]}, {"k": [None, 1.5]})
            status, _ = await _call(gw.url, "/v1/chat/completions", {"messages": CHAT}, {"Authorization": f"Bearer {out['api_key']}"})
            assert status == 200
            (turn,) = turns_of(log, "s")
            assert (turn.sampling["max_new_tokens"], turn.sampling["temperature"], turn.sampling["seed"]) == (3, 0.5, 7)

    run(body())


# ---------------------------------------------------------------- finish / abort / drop


@pytest.mark.parametrize(
    "action, fields, problem",
    [
        ("finish", {"metadata": ["x"]}, "metadata: expected a JSON object, found ['x']"),
        ("finish", {"reward": "high"}, "reward: expected a finite number, an object of finite numbers, or null"),
        ("finish", {"reward": {"a": "x"}}, "reward: expected a finite number"),
        ("finish", {"reward": [1.0]}, "reward: expected a finite number"),
        ("finish", {"metadata": {"n": 2**65}}, "metadata.n: expected an integer in [-2**63, 2**64 - 1]"),
        ("finish", {"rewards": 1.0}, "finish body: expected fields among ['metadata', 'reward']"),
        ("abort", {"reason": 5}, "reason: expected a non-empty string, found 5"),
        ("abort", {"reason": ""}, "reason: expected a non-empty string, found ''"),
        ("abort", {"reason": "x", "error": ["e"]}, "error: expected a string, found ['e']"),
        ("drop", {"reason": [1]}, "reason: expected a non-empty string, found [1]"),
        ("drop", {"why": "x"}, "drop body: expected fields among ['reason']"),
    ],
)
def test_admin_end_refuses_a_bad_field_naming_it_and_the_session_runs_on(action, fields, problem):
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            status, _ = await _call(gw.url, "/admin/sessions", {"session_id": "s"}, ADMIN)
            assert status == 200
            before = log.next_lsn
            status, err = await _call(gw.url, f"/admin/sessions/s/{action}", fields, ADMIN)
            assert status == 400 and problem in err["error"]["message"] and f"admin {action} of session 's'" in err["error"]["message"], err
            assert log.next_lsn == before and str(engine.status("s")) == "running"
            status, out = await _call(gw.url, "/admin/sessions/s/finish", {"reward": 1.0, "metadata": {"ok": True}}, ADMIN)
            assert (status, out["state"]) == (200, "finished")
            reduce_log(log)  # the log decodes and reduces
            last = list(log.read())[-1].body
            assert isinstance(last, SessionFinished) and (last.reward, last.metadata) == (1.0, {"ok": True})

    run(body())


def test_admin_end_of_an_unknown_action_or_session_is_404():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            await _call(gw.url, "/admin/sessions", {"session_id": "s"}, ADMIN)
            status, err = await _call(gw.url, "/admin/sessions/s/explode", {}, ADMIN)
            assert status == 404 and "unknown action 'explode'" in err["error"]["message"]
            status, err = await _call(gw.url, "/admin/sessions/nobody/finish", {}, ADMIN)
            assert status == 404 and "not live" in err["error"]["message"]

    run(body())


# ---------------------------------------------------------------- group membership (high 4)


def test_readme_example_two_sessions_of_one_group_without_sample_index_reduce():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            indices = []
            for sid in ("s1", "s2"):
                status, out = await _call(gw.url, "/admin/sessions", {"session_id": sid, "group_id": "g", "group_size": 2}, ADMIN)
                assert status == 200, out
                indices.append(out["sample_index"])
                status, _ = await _call(gw.url, "/v1/chat/completions", {"messages": CHAT}, {"Authorization": f"Bearer {out['api_key']}"})
                assert status == 200
            assert indices == [0, 1]
            for sid in ("s1", "s2"):
                assert (await _call(gw.url, f"/admin/sessions/{sid}/finish", {"reward": 1.0}, ADMIN))[0] == 200
            res = reduce_log(log)
            assert [sorted(m.session_id for m in g.members) for g in res.groups] == [["s1", "s2"]]

    run(body())


@pytest.mark.parametrize(
    "second, problem",
    [
        ({"group_size": 3}, "group 'g': session 's2' declares group_size 3, but sessions 's1' (lsn 0) declared group_size 2"),
        ({"group_size": 2, "sample_index": 0}, "group 'g': session 's2' repeats sample_index 0 of session 's1'"),
    ],
)
def test_admin_open_of_a_conflicting_member_is_409_naming_it(second, problem):
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            assert (await _call(gw.url, "/admin/sessions", {"session_id": "s1", "group_id": "g", "group_size": 2}, ADMIN))[0] == 200
            before = log.next_lsn
            status, err = await _call(gw.url, "/admin/sessions", {"session_id": "s2", "group_id": "g", **second}, ADMIN)
            assert status == 409 and problem in err["error"]["message"], err
            assert log.next_lsn == before and engine.get("s2") is None

    run(body())


def test_admin_open_beyond_group_size_is_409_naming_the_member_count():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            for sid in ("s1", "s2"):
                assert (await _call(gw.url, "/admin/sessions", {"session_id": sid, "group_id": "g", "group_size": 2}, ADMIN))[0] == 200
            status, err = await _call(gw.url, "/admin/sessions", {"session_id": "s3", "group_id": "g", "group_size": 2, "sample_index": 2}, ADMIN)
            assert status == 409 and "would be member 3 of a group of group_size 2 (members: 's1', 's2')" in err["error"]["message"], err
            status, err = await _call(gw.url, "/admin/sessions", {"session_id": "s1"}, ADMIN)
            assert status == 409 and "id already used" in err["error"]["message"]

    run(body())


# ---------------------------------------------------------------- session keys (security)


def test_a_session_id_or_a_guessed_key_is_refused_in_the_clients_dialect_and_records_nothing():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            _, a = await _call(gw.url, "/admin/sessions", {"session_id": "a"}, ADMIN)
            _, b = await _call(gw.url, "/admin/sessions", {"session_id": "b"}, ADMIN)
            assert a["api_key"] != b["api_key"] and len(a["api_key"]) >= 32
            before = log.next_lsn
            attempts = [
                ("/v1/chat/completions", {"messages": CHAT}, {"Authorization": "Bearer a"}),  # a's own id
                ("/v1/chat/completions", {"messages": CHAT}, {"Authorization": "Bearer b"}),  # another session's id
                ("/v1/responses", {"input": "hi"}, {"Authorization": "Bearer " + a["api_key"][:-1] + "x"}),  # a guessed key
                ("/v1/messages", {"messages": CHAT, "max_tokens": 4}, {"x-api-key": "a"}),
                ("/v1/messages/count_tokens", {"messages": CHAT}, {"x-api-key": "b"}),
            ]
            for path, req, headers in attempts:
                status, err = await _call(gw.url, path, req, headers)
                assert status == 401, (path, headers, err)
                if path.startswith("/v1/messages"):
                    assert err["type"] == "error" and err["error"]["type"] == "authentication_error"
                else:
                    assert err["error"]["type"] == "authentication_error" and err["error"]["code"] == 401
            assert log.next_lsn == before
            # The key admits its own session only.
            status, _ = await _call(gw.url, "/v1/messages", {"messages": CHAT, "max_tokens": 4}, {"x-api-key": b["api_key"]})
            assert status == 200 and len(turns_of(log, "b")) == 1 and not turns_of(log, "a")

    run(body())


def test_session_keys_are_never_logged_or_recorded():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            with capture_logs() as logs:
                _, out = await _call(gw.url, "/admin/sessions", {"session_id": "s"}, ADMIN)
                key = out["api_key"]
                agent = {"Authorization": f"Bearer {key}"}
                assert (await _call(gw.url, "/v1/chat/completions", {"messages": CHAT}, agent))[0] == 200
                assert (await _call(gw.url, "/v1/chat/completions", {"messages": "nope"}, agent))[0] == 400
                assert (await _call(gw.url, "/admin/sessions/s/finish", {"reward": 0.0}, ADMIN))[0] == 200
                status, err = await _call(gw.url, "/v1/chat/completions", {"messages": CHAT}, agent)
                assert status == 409 and key not in json.dumps(err)
            assert any(e.get("session_id") == "s" for e in logs)
            assert key not in repr(logs) and "tok" not in repr(logs)
            for env in log.read():
                assert key.encode() not in encode_body(env.body), env

    run(body())


@pytest.mark.parametrize("token", ["", "tokk", "to", "tox", "TOK"])
def test_a_wrong_admin_token_is_403_and_opens_nothing(token):
    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            status, err = await _call(gw.url, "/admin/sessions", {"session_id": "s"}, {"X-Admin-Token": token})
            assert status == 403 and err["error"]["type"] == "permission_error"
            assert log.next_lsn == 0

    run(body())


def test_configure_session_refuses_sampling_a_turn_could_not_run():
    async def body():
        async with _admin_rig() as (gw, engine, log):
            with pytest.raises(ValueError, match=r"session 's': sampling.max_new_tokens: expected an int in \[1, 2\*\*31 - 1\], found -5"):
                gw.configure_session("s", sampling={"max_new_tokens": -5})
            with pytest.raises(ValueError, match=r"max_turns: expected an int >= 1, found 1.5"):
                gw.configure_session("s", max_turns=1.5)
            assert gw.tracked_sessions == 0

    run(body())


@pytest.mark.parametrize("override, problem", [({"seed": 1.5}, "seed: expected an int in [0, 2**63), found 1.5"), ({"seed": -1}, "seed: expected an int in [0, 2**63), found -1")])
def test_a_clients_sampling_obeys_the_same_rules_as_the_sessions(override, problem):
    """One statement of the sampling rules (admin.SAMPLING_RULES) for admin
    defaults and per-request values: a float seed no longer reaches the sampler."""

    async def body():
        async with _admin_rig() as (gw, engine, log):
            gw.admin_token = "tok"
            _, out = await _call(gw.url, "/admin/sessions", {"session_id": "s"}, ADMIN)
            before = log.next_lsn
            status, err = await _call(gw.url, "/v1/chat/completions", {"messages": CHAT, **override}, {"Authorization": f"Bearer {out['api_key']}"})
            assert status == 400 and problem in err["error"]["message"], err
            assert log.next_lsn == before

    run(body())


class _RefusingLog(MemoryLog):
    """A log whose write path refuses every session_opened with ``error``
    (as a decode-back check on the write path does for an undecodable record)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def append(self, session_id, session_seq, body):
        if isinstance(body, SessionOpened):
            raise self.error
        return await super().append(session_id, session_seq, body)


@pytest.mark.parametrize(
    "error, status, text",
    [
        (EventValidationError("session_opened.metadata: expected a decodable value, found [1]"), 400, "session_opened.metadata: expected a decodable value"),
        (OSError(5, "Input/output error"), 500, "admin open of session 's' failed: OSError"),
    ],
)
def test_a_write_refused_by_the_log_is_answered_as_json_and_opens_nothing(error, status, text):
    async def body():
        async with rig(ScriptedBackend(lambda p: "ok"), log=_RefusingLog(error)) as (gw, engine, log):
            gw.admin_token = "tok"
            got, err = await _call(gw.url, "/admin/sessions", {"session_id": "s", "group_id": "g", "group_size": 2}, ADMIN)
            assert got == status and text in err["error"]["message"], err
            assert log.next_lsn == 0 and engine.get("s") is None
            assert engine._groups.pending() == {}  # the refused member left its group

    run(body())


class _GatedOpenLog(MemoryLog):
    """A log whose session_opened waits for ``gate`` (a slow disk)."""

    gate = None

    async def append(self, sid, seq, body):
        if isinstance(body, SessionOpened) and self.gate is not None:
            await self.gate.wait()
        return self.append_batch([(sid, seq, body)])[0]


def test_an_admin_open_that_a_drop_overtakes_is_a_409_json_answer_naming_the_session():
    """A drop finds the session live while its opening waits for the disk, and queues before the open's
    start. The start is then refused (dropped); the open's handler once aborted it, which raised out of its
    except block: aiohttp's plain-text 500 and a traceback in the log."""
    import asyncio

    async def body():
        log = _GatedOpenLog()
        async with rig(ScriptedBackend(lambda p: "ok"), log=log) as (gw, engine, log):
            gw.admin_token = "tok"
            log.gate = asyncio.Event()
            headers = {"X-Admin-Token": "tok", "Content-Type": "application/json"}
            async with aiohttp.ClientSession() as s:
                async def post(path, payload):
                    async with s.post(gw.url + path, data=json.dumps(payload), headers=headers) as r:
                        return r.status, await r.text()

                opening = asyncio.create_task(post("/admin/sessions", {"session_id": "s"}))
                while engine.get("s") is None:
                    await asyncio.sleep(0.005)
                dropping = asyncio.create_task(post("/admin/sessions/s/drop", {}))
                await asyncio.sleep(0.1)
                log.gate.set()
                (status, text), (drop_status, _) = await opening, await dropping
            assert drop_status == 200
            assert status == 409, (status, text)
            message = json.loads(text)["error"]["message"]
            assert "'s'" in message and "ended before it started" in message, message
            assert engine.status("s") == "dropped"

    run(body())
