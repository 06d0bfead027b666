"""The official openai and anthropic clients, as agents, against the gateway on loopback.

The built-in torch policy is the backend; a spy around it keeps what it
produced, and the reduced log must hold exactly those tokens and log-probs.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from gateway_helpers import TEMPLATE, key_for, an_client, oa_client, ScriptedBackend, SpyBackend, open_running, rig, run, turns_of
from agentlog.reducers.pipeline import reduce_log, session_trajectory


def _check_turn_matches_backend(turn, spy: SpyBackend) -> None:
    produced = {tuple(p): g for p, g in spy.produced}
    gen = produced[tuple(turn.prompt_tokens.tolist())]
    assert turn.output_tokens.tolist() == gen.output_ids
    np.testing.assert_array_equal(turn.log_probs, np.asarray(gen.log_probs, dtype=np.float32))
    assert turn.finish_reason == gen.finish_reason


def test_openai_chat_plain_and_streaming_turns_are_recorded_as_the_backend_produced_them():
    async def body():
        async with rig() as (gw, engine, log):
            h = await open_running(engine, "s-chat")
            client = oa_client(gw, "s-chat")
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
            r = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=1.0)
            text = r.choices[0].message.content
            stream = await client.chat.completions.create(
                model="tiny", messages=msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}],
                max_tokens=12, stream=True, stream_options={"include_usage": True},
            )
            streamed, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    streamed += c.delta.content or ""
                    finish = c.finish_reason or finish
            await h.finish(reward=1.0)
            turns = turns_of(log, "s-chat")
            assert len(turns) == 2
            for t in turns:
                _check_turn_matches_backend(t, gw.backend)
            assert text == TEMPLATE.decode(turns[0].output_tokens.tolist())
            assert streamed == TEMPLATE.decode(turns[1].output_tokens.tolist())
            assert finish == turns[1].finish_reason and usage.completion_tokens == len(turns[1].output_tokens)
            assert r.usage.prompt_tokens == len(turns[0].prompt_tokens)
            # The echoed assistant message routes turn 2 under turn 1 and its prompt extends turn 1 cleanly.
            assert turns[1].messages[2] == turns[0].response_message
            traj = session_trajectory(log.read(), "s-chat")
            assert [d.drift for d in traj.decisions] == ["clean", "clean"]
            res = reduce_log(log)
            (sample,) = res.samples
            toks = sample.token_ids
            assert toks.tolist() == turns[1].prompt_tokens.tolist() + turns[1].output_tokens.tolist()
            n = sample.response_length
            resp, mask, lps = toks[-n:], sample.mask, sample.log_probs
            # mask 1 exactly over the two generated outputs, with their log-probs
            o1, o2 = turns[0].output_tokens, turns[1].output_tokens
            start1 = len(turns[0].prompt_tokens) - (len(toks) - n)
            assert mask[start1 : start1 + len(o1)].all() and mask[-len(o2) :].all()
            assert int(mask.sum()) == len(o1) + len(o2)
            np.testing.assert_array_equal(resp[start1 : start1 + len(o1)], o1)
            np.testing.assert_array_equal(lps[start1 : start1 + len(o1)], turns[0].log_probs)
            np.testing.assert_array_equal(lps[-len(o2) :], turns[1].log_probs)

    run(body())


def test_anthropic_messages_plain_and_streaming_turns_are_recorded():
    async def body():
        async with rig() as (gw, engine, log):
            h = await open_running(engine, "s-anth")
            client = an_client(gw, "s-anth")
            m = await client.messages.create(model="tiny", max_tokens=10, system="sys", messages=[{"role": "user", "content": "hi"}])
            async with client.messages.stream(
                model="tiny", max_tokens=10, system="sys",
                messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": [{"type": "text", "text": "again"}]}],
            ) as s:
                final = await s.get_final_message()
            await h.finish(reward=0.5)
            turns = turns_of(log, "s-anth")
            assert len(turns) == 2
            for t in turns:
                _check_turn_matches_backend(t, gw.backend)
            assert m.content[0].text == TEMPLATE.decode(turns[0].output_tokens.tolist())
            assert final.content[0].text == TEMPLATE.decode(turns[1].output_tokens.tolist())
            assert final.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[turns[1].finish_reason]
            assert final.usage.output_tokens == len(turns[1].output_tokens)
            assert turns[0].messages[0] == {"role": "system", "content": "sys"}
            (sample,) = reduce_log(log).samples
            assert int(sample.mask.sum()) == len(turns[0].output_tokens) + len(turns[1].output_tokens)

    run(body())


def test_openai_responses_plain_and_streaming_turns_are_recorded():
    async def body():
        async with rig() as (gw, engine, log):
            h = await open_running(engine, "s-resp")
            client = oa_client(gw, "s-resp")
            r = await client.responses.create(model="tiny", instructions="sys", input="hi", max_output_tokens=10)
            events = []
            stream = await client.responses.create(model="tiny", input=[{"role": "developer", "content": "dev"}, {"role": "user", "content": "x"}], max_output_tokens=10, stream=True)
            async for ev in stream:
                events.append(ev)
            await h.finish(reward=0.0)
            turns = turns_of(log, "s-resp")
            assert len(turns) == 2
            for t in turns:
                _check_turn_matches_backend(t, gw.backend)
            assert r.output_text == TEMPLATE.decode(turns[0].output_tokens.tolist())
            final = events[-1]
            assert final.type in ("response.completed", "response.incomplete")
            assert final.response.output_text == TEMPLATE.decode(turns[1].output_tokens.tolist())
            assert [ev.sequence_number for ev in events] == list(range(len(events)))
            assert turns[1].messages[0] == {"role": "system", "content": "dev"}

    run(body())


def _tool_reply(prompt: str) -> str:
    # The model asks for the weather once, then answers from the tool result.
    if "<tool>\n" in prompt:
        return "It is sunny."
    return 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


WEATHER = {"name": "get_weather", "description": "weather by city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_tool_calls_out_and_results_in_route_through_the_tree_for_all_three_apis():
    async def body():
        async with rig(ScriptedBackend(_tool_reply)) as (gw, engine, log):
            hs = [await open_running(engine, sid, "tools", 3, i) for i, sid in enumerate(["t-chat", "t-anth", "t-resp"])]
            # Chat Completions
            oa = oa_client(gw, "t-chat")
            msgs = [{"role": "user", "content": "weather in Paris?"}]
            r1 = await oa.chat.completions.create(model="m", messages=msgs, tools=[{"type": "function", "function": WEATHER}])
            (call,) = r1.choices[0].message.tool_calls
            assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            assert r1.choices[0].message.content == "Let me check."
            msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
            r2 = await oa.chat.completions.create(model="m", messages=msgs, tools=[{"type": "function", "function": WEATHER}])
            assert r2.choices[0].message.content == "It is sunny."
            # Anthropic Messages, streaming
            an = an_client(gw, "t-anth")
            tools = [{"name": "get_weather", "description": "weather by city", "input_schema": WEATHER["parameters"]}]
            amsgs = [{"role": "user", "content": "weather in Paris?"}]
            async with an.messages.stream(model="m", max_tokens=200, messages=amsgs, tools=tools) as s:
                m1 = await s.get_final_message()
            assert m1.stop_reason == "tool_use"
            use = [b for b in m1.content if b.type == "tool_use"][0]
            assert use.input == {"city": "Paris"}
            amsgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
            m2 = await an.messages.create(model="m", max_tokens=200, messages=amsgs, tools=tools)
            assert m2.content[0].text == "It is sunny."
            # Responses API, streaming
            rtools = [{"type": "function", **WEATHER}, {"type": "web_search"}]
            items = [{"role": "user", "content": "weather in Paris?"}]
            stream = await oa.with_options(api_key=key_for(gw, "t-resp")).responses.create(model="m", input=items, tools=rtools, stream=True)
            done = [ev async for ev in stream][-1].response
            fc = [o for o in done.output if o.type == "function_call"][0]
            assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
            items += [o.model_dump(exclude_none=True) for o in done.output] + [{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}]
            r3 = await oa.with_options(api_key=key_for(gw, "t-resp")).responses.create(model="m", input=items, tools=rtools)
            assert r3.output_text == "It is sunny."
            for h in hs:
                await h.finish(reward=1.0)
            for sid in ("t-chat", "t-anth", "t-resp"):
                t1, t2 = turns_of(log, sid)
                calls = t1.response_message["tool_calls"]
                assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == {"city": "Paris"} and not t1.ill_formed
                # turn 2 holds turn 1's response verbatim, then the tool result for that call id
                i = t2.messages.index(t1.response_message)
                assert t2.messages[i + 1] == {"role": "tool", "content": "sunny", "tool_call_id": calls[0]["id"]}
                traj = session_trajectory(log.read(), sid)
                assert len(traj.rows) == 1 and [d.trained for d in traj.decisions] == [True, True]
            res = reduce_log(log)
            assert len(res.samples) == 3 and len(res.groups) == 1

    run(body())


def test_ill_formed_tool_call_is_flagged_and_returned_as_text():
    async def body():
        bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
        async with rig(ScriptedBackend(lambda p: bad)) as (gw, engine, log):
            await open_running(engine, "s-bad")
            r = await oa_client(gw, "s-bad").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function", "function": WEATHER}]
            )
            assert r.choices[0].message.tool_calls is None and r.choices[0].message.content == bad
            (turn,) = turns_of(log, "s-bad")
            assert turn.ill_formed and "tool_calls" not in turn.response_message

    run(body())


def test_concurrent_sessions_each_reduce_to_the_tokens_the_backend_produced():
    async def one(gw, engine, i):
        sid = f"c{i}"
        h = await open_running(engine, sid, group="conc", size=8, index=i)
        if i % 2:
            client = an_client(gw, sid)
            msgs = [{"role": "user", "content": f"task {i}"}]
            for k in range(3):
                m = await client.messages.create(model="m", max_tokens=8, messages=msgs)
                msgs += [{"role": "assistant", "content": m.content[0].text}, {"role": "user", "content": f"next {k}"}]
        else:
            client = oa_client(gw, sid)
            msgs = [{"role": "user", "content": f"task {i}"}]
            for k in range(3):
                r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"next {k}"}]
        await h.finish(reward=float(i % 3))

    async def body():
        async with rig() as (gw, engine, log):
            await asyncio.gather(*(one(gw, engine, i) for i in range(8)))
            assert gw.tracked_sessions == 0 and engine.live_count == 0
            res = reduce_log(log)
            assert len(res.samples) == 8 and len(res.groups) == 1
            for s in res.samples:
                turns = turns_of(log, s.session_id)
                assert len(turns) == 3
                for t in turns:
                    _check_turn_matches_backend(t, gw.backend)
                # one clean row: the last prompt + output, mask 1 exactly on the three outputs
                last = turns[-1]
                assert s.token_ids.tolist() == last.prompt_tokens.tolist() + last.output_tokens.tolist()
                assert int(s.mask.sum()) == sum(len(t.output_tokens) for t in turns)
                trained_lp = s.log_probs[s.mask.astype(bool)]
                np.testing.assert_array_equal(trained_lp, np.concatenate([t.log_probs for t in turns]))
            assert gw.backend.inner.batches < 24  # concurrent calls were batched

    run(body(), timeout=90)


def test_models_and_health_endpoints_answer_without_a_session():
    async def body():
        async with rig(ScriptedBackend(lambda p: "x")) as (gw, engine, log):
            models = await oa_client(gw, "nobody").models.list()
            assert [m.id for m in models.data] == ["agentlog"]
            import aiohttp

            async with aiohttp.ClientSession() as s:
                async with s.head(gw.url + "/") as r:
                    assert r.status == 200
            await open_running(engine, "s")
            before = log.next_lsn
            n = await an_client(gw, "s").messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
            assert n.input_tokens == len(TEMPLATE.encode_prompt([{"role": "user", "content": "hi"}], []))
            assert log.next_lsn == before  # counting records nothing

    run(body())


@pytest.mark.parametrize("sid", ["s1"])
def test_unknown_fields_from_real_clients_are_ignored(sid):
    async def body():
        async with rig(ScriptedBackend(lambda p: "ok")) as (gw, engine, log):
            await open_running(engine, sid)
            m = await an_client(gw, sid).messages.create(
                model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}, {"role": "system", "content": "mid"}],
                extra_body={"thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "high"}},
                extra_query={"beta": "true"},
            )
            assert m.content[0].text == "ok"
            (turn,) = turns_of(log, sid)
            assert turn.messages == [{"role": "user", "content": "x"}, {"role": "system", "content": "mid"}]

    run(body())
