"""The capture-CPU arms of ``bench_capture.py`` (see its docstring, part 2): one session's turns,
and many sessions recording a turn each at once, with the garbage collector's share."""

from __future__ import annotations

import asyncio
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

_FILLER = "def add(a, b):\n    return a + b\n# the tool's output, line by line\n"


def text(n: int, salt: str) -> str:
    """``n`` ASCII characters (one token each with the built-in template)."""
    head = f"[{salt}]\n"
    body = (_FILLER * (n // len(_FILLER) + 1))[: max(0, n - len(head))]
    return (head + body)[:n]


class _GcClock:
    """CPU time the garbage collector spends while this is in ``gc.callbacks``, and its collections
    by generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._t0
            self.collections[min(info["generation"], 2)] += 1


def _record(h, prompt, response, out):
    """Record a turn as the gateway's turn path does (gateway/turn.py): staged with
    ``begin_turn`` before the first await, in the request handler's own task (no
    task per turn), its frozen messages and the cached prompt handed over as they
    are. Returns the :class:`~agentlog.engine.staged.PendingTurn`."""
    return h.begin_turn(messages=prompt.messages, prompt_ids=prompt.recorded, output_ids=out,
                        output_log_probs=[-0.5] * len(out), finish_reason="stop", response_message=response,
                        sampling={"temperature": 1.0}, frozen_messages=True)


async def cpu_per_turn(args, contexts: list[int]) -> list[dict]:
    """Per context size: one session grown to it (context/20 new tokens a
    turn), then ``cpu_turns`` turns that add context/400 tokens each (and an
    answer with a tool call), timed phase by phase."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.gateway import ByteChatTemplate, HFChatTemplate, ToolSpec
    from agentlog.gateway.chat import assistant_message, pack_ids
    from agentlog.gateway.prompt_cache import LineagePrompts, PromptCache
    from agentlog.learner.hf_tiny import build_tokenizer

    tools = [ToolSpec("bash", "run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})]
    byte, hf = ByteChatTemplate(), HFChatTemplate(build_tokenizer())
    tmp = tempfile.mkdtemp(prefix="bench-capture-cpu-")
    log = FileLog.open(Path(tmp) / "log", fsync="batch")
    engine = await SessionEngine.open(log)
    rows = []
    pt = time.process_time
    try:
        for ctx in contexts:
            sid = f"cpu{ctx}"
            h = await engine.open_session(sid, group_id=sid, group_size=1)
            await h.start(harness="bench")
            step = max(100, ctx // 20)
            msgs = [{"role": "system", "content": text(min(ctx // 2, 8000), sid)}, {"role": "user", "content": "fix it"}]
            lineages = LineagePrompts()  # the gateway's byte-template caches, one per lineage (one here)
            caches = {"byte": PromptCache(), "hf": PromptCache()}
            cost = {k: [] for k in ("capture", "main", "byte_full", "byte_inc", "hf_full", "hf_inc", "wall")}
            k, sizes = 0, []
            while True:
                wire = msgspec.json.encode(msgs)  # each request's messages arrive as fresh objects
                length = len(byte.encode_prompt(msgs, tools))
                timed = length >= ctx
                if timed:
                    sizes.append(length)
                prompts = {}
                caches["byte"] = lineages.pick(msgs)
                for name, template in (("byte", byte), ("hf", hf)):
                    if timed:
                        fresh = msgspec.json.decode(wire)
                        t0 = pt()
                        pack_ids(template.encode_prompt(fresh, tools))
                        cost[f"{name}_full"].append(pt() - t0)
                    fresh = msgspec.json.decode(wire)
                    t0 = pt()
                    prompts[name] = caches[name].encode(template, fresh, tools)
                    if timed:
                        cost[f"{name}_inc"].append(pt() - t0)
                prompt = prompts["byte"]
                call = {"id": f"call_{k}", "name": "bash", "arguments": {"command": f"cat f{k}.py"}}
                response = assistant_message("Looking.", [call])
                out = byte.encode_text("Looking.\n" + byte.parser.render("bash", call["arguments"])) + [byte.EOS]
                t0, m0, w0 = pt(), time.thread_time(), time.perf_counter()
                pending = _record(h, prompt, response, out)
                await pending.durable
                lineages.remember(pending.lineage, caches["byte"], prompt, response)
                if timed:
                    cost["capture"].append(pt() - t0)
                    cost["wall"].append(time.perf_counter() - w0)
                    cost["main"].append(time.thread_time() - m0)
                caches["hf"].remember(prompts["hf"], response)
                if timed and len(cost["capture"]) >= args.cpu_turns:
                    break
                grow = max(20, ctx // 400) if timed else step  # timed turns add little: the context stays near its size
                msgs = msgs + [response, {"role": "tool", "content": text(grow, f"{sid} out {k}"), "tool_call_id": call["id"]}]
                k += 1
            await h.finish(reward=0.0)
            med = {key: statistics.median(v) * 1e6 for key, v in cost.items()}
            rows.append({"ctx": ctx, "tokens": int(statistics.median(sizes)), **med})
    finally:
        await engine.close()
        log.close()
        shutil.rmtree(tmp)  # a run leaves no log behind (~50 MB each)
    return rows


async def cpu_concurrent(args, ctx: int, n: int, window=None) -> dict:
    """``n`` sessions grown to ``ctx`` tokens as :func:`cpu_per_turn` grows
    one, then ``cpu_turns`` rounds in which every session records a turn at
    once (``asyncio.gather``), as a busy node's sessions do: the log's group
    commit shares one fdatasync among the turns made durable together. Per
    turn: the round's CPU (all threads; the event loop's thread alone) over
    ``n``. Each round's prompts are encoded before it, untimed. ``window``: an
    object whose ``start()`` and ``stop()`` bracket each timed round's capture
    (``bench_capture_instructions.py`` counts the instructions between them)."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog
    from agentlog.gateway import ByteChatTemplate, ToolSpec
    from agentlog.gateway.chat import assistant_message
    from agentlog.gateway.prompt_cache import LineagePrompts

    tools = [ToolSpec("bash", "run a shell command", {"type": "object", "properties": {"command": {"type": "string"}}})]
    byte = ByteChatTemplate()
    tmp = tempfile.mkdtemp(prefix="bench-capture-cpu-many-")
    log = FileLog.open(Path(tmp) / "log", fsync="batch")
    engine = await SessionEngine.open(log)
    pt = time.process_time
    step = max(100, ctx // 20)
    all_cpu, main_cpu, sizes = [], [], []
    # The collector's share of the rounds' CPU: a young collection comes every `threshold` container
    # objects allocated net, whoever allocated them (the request's decoding as much as the capture),
    # and takes longer the more young objects it must walk. Counted in the capture's window, and
    # over whole rounds (the request's decoding and encoding too), where a higher threshold cannot
    # hide a collection by moving it out of the window.
    clock = _GcClock()
    gc_capture = gc_round = 0.0
    collections = [0, 0, 0]
    gc.collect()  # each arm starts without the garbage an earlier one left for a full collection
    try:
        handles, caches, convs = [], [], []
        for i in range(n):
            sid = f"many{ctx}-{i}"
            h = await engine.open_session(sid, group_id=f"many{ctx}", group_size=n)
            await h.start(harness="bench")
            handles.append(h)
            caches.append(LineagePrompts())
            convs.append([{"role": "system", "content": text(min(ctx // 2, 8000), sid)}, {"role": "user", "content": "fix it"}])

        k = 0
        gc.callbacks.append(clock)
        while len(all_cpu) < args.cpu_turns:
            g0, c0 = clock.seconds, list(clock.collections)
            # Each request's messages arrive as fresh objects, encoded from the previous turn (untimed).
            picked = [c.pick(m) for c, m in zip(caches, convs)]
            prompts = [p.encode(byte, msgspec.json.decode(msgspec.json.encode(m)), tools) for p, m in zip(picked, convs)]
            timed = min(len(p.packed) for p in prompts) // 4 >= ctx
            call = {"id": f"call_{k}", "name": "bash", "arguments": {"command": f"cat f{k}.py"}}
            responses = [assistant_message("Looking.", [call]) for _ in range(n)]
            out = byte.encode_text("Looking.\n" + byte.parser.render("bash", call["arguments"])) + [byte.EOS]
            g1, t0, m0 = clock.seconds, pt(), time.thread_time()
            if timed and window is not None:
                window.start()
            # Each turn staged as the gateway's request handler stages it (no task of its own), then made durable together.
            staged = [_record(handles[i], prompts[i], responses[i], out) for i in range(n)]
            await asyncio.gather(*(t.durable for t in staged))
            for i, pending in enumerate(staged):
                caches[i].remember(pending.lineage, picked[i], prompts[i], responses[i])
            if timed and window is not None:
                window.stop()
            if timed:
                all_cpu.append((pt() - t0) / n)
                main_cpu.append((time.thread_time() - m0) / n)
                sizes.append(statistics.median(len(p.packed) // 4 for p in prompts))
                gc_capture += clock.seconds - g1
            grow = max(20, ctx // 400) if timed else step
            for i, conv in enumerate(convs):
                convs[i] = conv + [responses[i], {"role": "tool", "content": text(grow, f"{i} out {k}"), "tool_call_id": call["id"]}]
            if timed:  # the whole round: the request's decoding and encoding, and the conversation's growth
                gc_round += clock.seconds - g0
                collections = [a + b - c for a, b, c in zip(collections, clock.collections, c0)]
            k += 1
        for h in handles:
            await h.finish(reward=0.0)
    finally:
        if clock in gc.callbacks:
            gc.callbacks.remove(clock)
        await engine.close()
        log.close()
        shutil.rmtree(tmp)  # a run leaves no log behind (~50 MB each)
    turns = len(all_cpu) * n
    # The mean over every timed round, not the median: a round with a collection in it is as much
    # the capture's cost as one without (the median of rounds, beside it, leaves the rarer ones out).
    return {"ctx": ctx, "n": n, "tokens": int(statistics.median(sizes)),
            "capture": statistics.fmean(all_cpu) * 1e6, "main": statistics.fmean(main_cpu) * 1e6,
            "capture_median": statistics.median(all_cpu) * 1e6,
            "gc": gc_capture / turns * 1e6, "gc_round": gc_round / turns * 1e6, "turns": turns,
            "collections": "/".join(map(str, collections))}
