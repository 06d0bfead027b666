"""A text task whose numbers (session_budget_s, command_budget_s, max_turns, max_new_tokens)
are zero, negative, NaN or not numbers is refused when it is selected, naming the task, the
field and what was expected. Before: session_budget_s = 0 aborted every session
wall_clock_timeout (a run that trains nothing), NaN raised "session 's0': budget_s ..."
from the engine mid-batch, max_turns = 0 "harness 'python-agent': max_turns"."""

from __future__ import annotations

import random

import pytest

from agentlog.engine import harness
from agentlog.engine.tasks import TaskError, TextEpisode, TextTask, Verdict, register_task, select_task
from agentlog.engine.tasks import base as task_base


class _Ok(TextTask):
    def new_episode(self, rng: random.Random) -> TextEpisode:
        return TextEpisode(messages=[{"role": "user", "content": "hi"}])

    async def verify(self, episode: TextEpisode, sandbox) -> Verdict:
        return Verdict(1.0, True)


@pytest.mark.parametrize("field,value", [
    ("session_budget_s", 0), ("session_budget_s", -1.0), ("session_budget_s", float("nan")),
    ("command_budget_s", 0.0), ("command_budget_s", float("inf")), ("max_turns", 0), ("max_turns", 2.5),
    ("max_new_tokens", 0), ("session_budget_s", "60"),
])
def test_a_text_task_with_a_bad_number_is_refused_naming_the_task_and_field(field, value) -> None:
    name = f"review-bad-{field}-{value}"
    register_task(name)(type("Bad", (_Ok,), {"name": name, field: value}))
    try:
        with pytest.raises(TaskError, match=rf"task {name!r}.*{field}.*expected"):
            select_task(name)
    finally:
        task_base._TASKS.pop(name, None)
        harness.unregister(name)


def test_a_text_task_with_sound_numbers_is_selected() -> None:
    register_task("review-good")(type("Good", (_Ok,), {"name": "review-good", "session_budget_s": 30, "max_turns": 1}))
    try:
        assert isinstance(select_task("review-good"), _Ok)
    finally:
        task_base._TASKS.pop("review-good", None)
        harness.unregister("review-good")
