"""A crash during an interrupted turn (partial rollouts): a child process records turns that a
weight update interrupted, and is SIGKILLed while another interrupted turn is still generating.
Nothing acknowledged is lost (the interrupted turns it recorded keep their version spans), the
unfinished turn was never acknowledged and is not in the log, the restarted engine aborts its
session ``engine_restart``, and that aborted member contributes exactly zero to a learner step
over its group, bit for bit."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from agentlog.engine import SessionEngine
from agentlog.events import FileLog, read_log
from agentlog.events.schema.turn import turn_version_spans
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import SessionAborted, TurnRecorded
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import GPT
from agentlog.reducers.pipeline import reduce_log

MODEL = dict(vocab_size=32, max_seq_len=256, n_layer=1, d_model=16, n_head=2, tie_embeddings=False)

CHILD = textwrap.dedent(
    """
    import asyncio, sys, threading, time
    import torch
    from agentlog.events import FileLog
    from agentlog.engine import SessionEngine
    from agentlog.gateway import SamplingParams, TorchBackend
    from agentlog.learner.model import GPT

    class SlowGPT(GPT):
        # 2 ms a token, and a flag once a generation is past its 3rd token.
        def sample(self, prompts, max_new_tokens, temperature=1.0, stop_ids=(), generator=None, between_steps=None):
            def hook(n):
                time.sleep(0.002)
                if n >= 3:
                    self.going.set()
                return between_steps(n) if between_steps is not None else False
            return super().sample(prompts, max_new_tokens, temperature, stop_ids, generator, between_steps=hook)

    async def main(path, mode):
        torch.manual_seed(0)
        model = SlowGPT(**MODEL)
        model.going = threading.Event()
        backend = TorchBackend(model, seed=3, weight_update=mode)
        log = FileLog.open(path, fsync="batch")
        eng = await SessionEngine.open(log)
        version = 0

        async def turn(h, n_tokens):
            # One generation that a weight update interrupts after its 3rd token.
            nonlocal version
            model.going.clear()
            call = asyncio.ensure_future(backend.generate([1, 2, 3], SamplingParams(max_new_tokens=n_tokens)))
            await asyncio.to_thread(model.going.wait, 30)
            version += 1
            state = {k: v + 0.01 * version for k, v in model.state_dict().items()}
            await backend.load_weights(state, version)
            if n_tokens is None:
                return call
            gen = await call
            await h.record_turn(prompt_ids=[1, 2, 3], output_ids=gen.output_ids, output_log_probs=gen.log_probs,
                                finish_reason=gen.finish_reason, policy_version=gen.policy_version,
                                version_spans=gen.version_spans, sampling={"weight_update": gen.weight_update})

        handles = [await eng.open_session(f"s{i}", group_id="g", group_size=3) for i in range(3)]
        for h in handles:
            await h.start()
            await turn(h, 24)
        await handles[0].finish(reward=1.0)
        await handles[2].finish(reward=0.0)
        # s1's second turn: interrupted, then killed while it generates.
        model.going.clear()
        call = asyncio.ensure_future(backend.generate([1, 2, 3], SamplingParams(max_new_tokens=200)))
        await asyncio.to_thread(model.going.wait, 30)
        await backend.load_weights({k: v * 1.0 for k, v in model.state_dict().items()}, version + 1)
        print("READY", log.next_lsn, flush=True)
        await call
        print("FINISHED: the kill came too late", flush=True)

    MODEL = dict(vocab_size=32, max_seq_len=256, n_layer=1, d_model=16, n_head=2, tie_embeddings=False)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


@pytest.mark.parametrize("mode", ["continue", "resubmit"])
def test_a_crash_during_an_interrupted_turn_loses_nothing_acknowledged_and_the_abort_trains_nothing(tmp_path, mode):
    path = tmp_path / "log"
    err = tmp_path / "child.stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, cwd=os.getcwd())
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), f"child failed: {line!r}; stderr: {err.read_text()[-3000:]}"
        acked = int(line.split()[1])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL

    async def restart() -> None:
        log = FileLog.open(path)
        try:
            assert log.next_lsn == acked  # every acknowledged record, and nothing else (no turn was in a write)
            eng = await SessionEngine.open(log)
            assert eng.stats["restart_aborted"] == 1
            await eng.close()
        finally:
            log.close()

    asyncio.run(restart())
    envs = list(read_log(path, 0))
    turns = {e.session_id: [] for e in envs}
    for e in full_turns(envs):
        if isinstance(e.body, TurnRecorded):
            turns[e.session_id].append(e.body)
    # Each session recorded its one interrupted turn, with the spans of the two versions that made it.
    for sid in ("s0", "s1", "s2"):
        (t,) = turns[sid]
        spans = turn_version_spans(t)
        assert len(spans) == 2 and spans[0][0] == 0 and spans[1][1] == spans[0][1] + 1, (sid, spans)
        assert len(t.output_tokens) == 24 and t.sampling["weight_update"] == mode
    last = [e.body for e in envs if e.session_id == "s1"][-1]
    assert isinstance(last, SessionAborted) and last.reason == "engine_restart"

    # The aborted member trains nothing: a learner step over the group equals one without it.
    samples = reduce_log(read_log(path, 0)).samples
    by_sid = {s.session_id: s for s in samples}
    assert by_sid["s1"].remove_sample and not by_sid["s0"].remove_sample and not by_sid["s2"].remove_sample
    assert len(by_sid["s0"].token_versions) > 0  # the kept samples carry per-token versions
    torch.manual_seed(0)
    model = GPT(**MODEL)
    cfg = LearnerConfig(tis_cap=2.0, num_steps_per_rollout=2)
    a, b = Learner(copy.deepcopy(model), cfg), Learner(copy.deepcopy(model), cfg)
    ma = a.step([s for s in samples if s.session_id != "s1"])
    mb = b.step(samples)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(next(a.model.parameters()), next(model.parameters()))  # the step did train
    assert mb["rollout/removed"] == 1 and ma["rollout/removed"] == 0
