"""End to end from a recorded log: events -> reducers -> released groups -> Learner.step."""

from __future__ import annotations

import copy

import torch

from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import SessionAborted, SessionDropped, SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner
from agentlog.learner.model import GPT
from agentlog.reducers.pipeline import reduce_log

SYSTEM = {"role": "system", "content": "find the value"}


def _finished(sid, group, size, index, key, value, reward):
    """Two generated turns with a tool result between them (tool tokens are context, mask 0)."""
    m1 = [SYSTEM, {"role": "user", "content": f"key {key}"}]
    p1 = [1, 2, key]
    o1 = [10, key, 11]
    m2 = m1 + [{"role": "assistant", "content": f"lookup {key}"}, {"role": "tool", "content": f"{value}"}]
    p2 = p1 + o1 + [12, value, 13]
    o2 = [14, value, 15]
    return [
        (sid, 0, SessionOpened(group_id=group, group_size=size, sample_index=index)),
        (sid, 1, SessionStarted()),
        (sid, 2, TurnRecorded(turn_index=0, messages=m1, prompt_ids=p1, output_ids=o1,
                              output_log_probs=[-0.5, -1.0, -0.25], finish_reason="stop",
                              response_message={"role": "assistant", "content": f"lookup {key}"})),
        (sid, 3, TurnRecorded(turn_index=1, messages=m2, prompt_ids=p2, output_ids=o2,
                              output_log_probs=[-0.75, -2.0, -0.5], finish_reason="stop",
                              response_message={"role": "assistant", "content": f"answer {value}"})),
        (sid, 4, SessionFinished(reward=reward)),
    ]


def _log(with_failures: bool) -> MemoryLog:
    log = MemoryLog(clock=lambda: 0)
    size = 5 if with_failures else 3
    records = []
    for i, (key, value, reward) in enumerate([(3, 20, 1.0), (4, 21, 0.0), (5, 22, 1.0)]):
        records += _finished(f"s{i}", "g0", size, i, key, value, reward)
    if with_failures:
        records += [("ab", 0, SessionOpened(group_id="g0", group_size=size, sample_index=3)),
                    ("ab", 1, SessionStarted()),
                    ("ab", 2, SessionAborted(reason="timeout")),
                    ("dr", 0, SessionOpened(group_id="g0", group_size=size, sample_index=4)),
                    ("dr", 1, SessionDropped(reason="cancelled"))]
    log.append_batch(records)
    return log


def test_a_group_with_aborted_and_dropped_members_trains_as_if_they_were_absent():
    full = reduce_log(_log(with_failures=True))
    clean = reduce_log(_log(with_failures=False))
    assert len(full.groups) == len(clean.groups) == 1
    assert any(s.remove_sample for s in full.groups[0].samples)
    torch.manual_seed(0)
    model = GPT(vocab_size=32, max_seq_len=32, n_layer=1, d_model=32, n_head=2)
    a = Learner(copy.deepcopy(model), LearnerConfig(kl_coef=0.05, tis_cap=2.0))
    b = Learner(copy.deepcopy(model), LearnerConfig(kl_coef=0.05, tis_cap=2.0))
    ma, mb = a.step(full.groups), b.step(clean.groups)
    assert ma["rollout/removed"] == 1.0 and mb["rollout/removed"] == 0.0
    assert ma["loss/policy"] == mb["loss/policy"] and ma["rollout/reward_mean"] == mb["rollout/reward_mean"] == 2 / 3
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    # tool-result tokens were context only: 6 generated tokens per finished session are trained
    assert ma["perf/trained_tokens"] == 3 * 6
