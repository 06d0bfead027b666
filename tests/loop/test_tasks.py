"""The task interface, the registry and the built-in lookup task."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.engine.tasks import Task, TaskError, register_task, select_task, task_names
from agentlog.engine.tasks.lookup import (
    ANSWER, EOS, LOOKUP, RESULT, SEP, UNKNOWN, VOCAB_SIZE, LookupTask, decode, encode, key_token, value_token,
)


def test_lookup_vocabulary_has_41_tokens_and_round_trips() -> None:
    assert VOCAB_SIZE == 41 == LookupTask.vocab_size
    text = "<bos> get k7 ; lookup k7 <eos> result k7 v12 ; answer v12 <eos>"
    assert decode(encode(text)) == text
    with pytest.raises(TaskError, match="unknown word 'k99'"):
        encode("lookup k99")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_right_lookup_then_right_answer_earns_one_and_anything_else_zero(seed: int) -> None:
    """The tool reveals the looked-up key's value; only copying the prompt key's value solves it."""
    task = LookupTask()
    ep = task.new_episode(random.Random(seed))
    key, table = ep.state["key"], ep.state["table"]
    tool = task.tool_step(ep, 0, [LOOKUP, key_token(key), EOS])
    assert tool.ids == (RESULT, key_token(key), value_token(table[key]), SEP) and tool.exit_code == 0
    assert task.tool_step(ep, 1, [ANSWER, value_token(table[key]), EOS]) is None
    right = task.verify(ep, [[LOOKUP, key_token(key), EOS], [ANSWER, value_token(table[key]), EOS]])
    assert right.reward == 1.0 and right.success
    wrong_value = (table[key] + 1) % 16
    wrong = task.verify(ep, [[LOOKUP, key_token(key), EOS], [ANSWER, value_token(wrong_value), EOS]])
    assert wrong.reward == 0.0 and not wrong.success and wrong.detail["lookup_ok"]
    other = (key + 1) % 16
    revealed = task.tool_step(ep, 0, [LOOKUP, key_token(other), EOS])
    assert revealed.ids[2] == value_token(table[other])  # the wrong key reveals the wrong key's value


def test_malformed_lookup_gets_an_error_result_and_no_reward() -> None:
    task = LookupTask()
    ep = task.new_episode(random.Random(1))
    tool = task.tool_step(ep, 0, [ANSWER, EOS])
    assert tool.ids == (RESULT, UNKNOWN, UNKNOWN, SEP) and tool.exit_code == 2
    assert task.verify(ep, [[ANSWER, EOS], [EOS]]).reward == 0.0
    assert task.verify(ep, []).reward == 0.0


def test_values_are_redrawn_every_episode() -> None:
    task = LookupTask()
    rng = random.Random(0)
    tables = {tuple(task.new_episode(rng).state["table"]) for _ in range(20)}
    assert len(tables) == 20


def test_demonstrations_replace_answers_at_the_requested_rate() -> None:
    task = LookupTask()
    rng = random.Random(3)
    wrong = 0
    n = 2000
    for _ in range(n):
        ep = task.new_episode(rng)
        demo = task.demonstration(ep, rng, wrong_answer_rate=0.85)
        key = ep.state["key"]
        assert demo[0] == [LOOKUP, key_token(key), EOS]
        verdict = task.verify(ep, demo)
        wrong += not verdict.success
    assert 0.82 < wrong / n < 0.88


def test_unknown_task_lists_the_registered_ones() -> None:
    with pytest.raises(TaskError, match="no task is registered under the name 'nope'.*expected one of the registered tasks: .*lookup"):
        select_task("nope")


def test_a_user_task_registers_and_is_built_by_name() -> None:
    @register_task("echo-test")
    class Echo(Task):
        name = "echo-test"
        vocab_size = 4
        eos_id = 0
        max_new_tokens = 1

        def new_episode(self, rng):
            from agentlog.engine.tasks import Episode

            return Episode(prompt_ids=(1,), messages=[], state={})

        def tool_step(self, episode, turn_index, output_ids):
            return None

        def verify(self, episode, outputs):
            from agentlog.engine.tasks import Verdict

            return Verdict(reward=float(outputs[0][0] == 1), success=outputs[0][0] == 1)

    assert "echo-test" in task_names()
    assert isinstance(select_task("echo-test"), Echo)
    with pytest.raises(TaskError, match="already registered"):
        register_task("echo-test")(LookupTask)


def test_tasks_are_selected_through_the_engine_harness_registry(monkeypatch) -> None:
    """The built-in task is a registered harness; an empty name falls back to
    $AGENTLOG_AGENT; an unknown one lists the valid names."""
    from agentlog.engine import harness
    from agentlog.engine.tasks import select_task

    assert "lookup" in harness.names()
    monkeypatch.setenv("AGENTLOG_AGENT", "lookup")
    assert isinstance(select_task(""), LookupTask)
    monkeypatch.setenv("AGENTLOG_AGENT", "lokup")
    with pytest.raises(TaskError, match=r"no task is registered under the name 'lokup'.*from \$AGENTLOG_AGENT.*expected one of the registered tasks: .*lookup"):
        select_task(None)
