"""The task interface: a prompt, tool steps between generated turns, and a verifier.

A task is the environment the online loop trains on. The rollout worker asks
it for an episode (the prompt and hidden state, e.g. the values a tool will
reveal), feeds it each generated turn, and appends what the tool returns to
the context of the next turn. Tool output is context: the trajectory reducer
gives it loss mask 0, because the model did not generate it. When the task
says the episode is over, its verifier scores the outputs.

Plugging in your own environment means subclassing :class:`Task` and
registering it with :func:`register_task` (and, for the loop, selecting it by
name in the config or through the harness registry).

Everything here is plain Python over token ids: no torch, no I/O. Episodes
draw their randomness from the ``random.Random`` the caller passes, so a run
is reproducible from its seed.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from agentlog.events.errors import AgentlogError
from agentlog.engine import harness

if TYPE_CHECKING:
    from .text import TextTask


class TaskError(AgentlogError, ValueError):
    """A task was asked for something it cannot do (unknown name, bad turn)."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool step returns: tokens appended to the next turn's context."""

    #: Token ids appended after the turn's output (trained with mask 0).
    ids: tuple[int, ...]
    #: The same as text, recorded as the ``tool`` message of the next turn.
    text: str
    #: The command the tool ran, as a one-line string (recorded for replay).
    command: str = ""
    #: Exit status of the tool (0 ok, non-zero: the call was malformed).
    exit_code: int = 0


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of a whole episode."""

    #: The scalar reward the learner trains on (finite).
    reward: float
    #: Whether the episode solved the task (the "solve rate" metric).
    success: bool
    #: Named parts of the judgement (recorded in the session's metadata).
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One instance of a task: the prompt, and whatever the tool and verifier need."""

    #: Prompt token ids of turn 0.
    prompt_ids: tuple[int, ...]
    #: The prompt as chat messages (routes turns in the trajectory tree).
    messages: list[dict[str, Any]]
    #: Hidden per-episode state (for the lookup task: the key and its table).
    state: dict[str, Any]
    #: What the verifier expects, recorded as the session's label.
    label: Any = None


class Task(abc.ABC):
    """An environment for multi-turn tool use with a verifiable reward."""

    #: Registry name (``agentlog demo --task NAME``).
    name: str = ""
    #: Number of token ids the policy must be able to emit and read.
    vocab_size: int = 0
    #: Token that ends a generated turn.
    eos_id: int = 0
    #: Most tokens generated per turn.
    max_new_tokens: int = 0
    #: Most generated turns per episode.
    max_turns: int = 1

    @abc.abstractmethod
    def new_episode(self, rng: random.Random) -> Episode:
        """Draw a fresh episode (prompt and hidden state) from ``rng``."""

    def group_member(self, episode: Episode, rng: random.Random) -> Episode:
        """The episode one member of a GRPO group plays: the same prompt, with
        the hidden state re-drawn when the task has any (default: the episode
        itself). Members of a group then meet different tool results for the
        same prompt, so a systematic mistake on some results still shows up
        as variance inside the group instead of a group of equal rewards,
        which carries no gradient."""
        return episode

    @abc.abstractmethod
    def tool_step(self, episode: Episode, turn_index: int, output_ids: Sequence[int]) -> ToolResult | None:
        """React to generated turn ``turn_index``: the tool's result to append
        before the next turn, or None when the episode is over."""

    @abc.abstractmethod
    def verify(self, episode: Episode, outputs: Sequence[Sequence[int]]) -> Verdict:
        """Score the generated turns of an episode."""

    def demonstration(self, episode: Episode, rng: random.Random, *, wrong_answer_rate: float = 0.0) -> list[list[int]]:
        """Target outputs of every turn for a supervised warm-up; optional."""
        raise TaskError(f"task {self.name!r} has no demonstrations; set warmup_steps = 0")

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as readable text (for messages and replay)."""
        return " ".join(str(int(i)) for i in ids)


_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: register a task factory under ``name``."""
    if not name:
        raise TaskError("register_task: expected a non-empty task name")

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _TASKS and _TASKS[name] is not factory:
            raise TaskError(f"register_task: a task named {name!r} is already registered ({_TASKS[name]!r})")
        _TASKS[name] = factory
        # The loop drives a task as its session's agent: the task is the
        # harness, selected by name (or $AGENTLOG_AGENT) like any other.
        harness.register(name)(factory)
        return factory

    return deco


def task_names() -> list[str]:
    """Names of every registered task, sorted."""
    return sorted(_TASKS)


def _unknown_task_message(name: Any, source: str) -> str:
    """Why no task could be selected under ``name``: the name, where it came
    from, the registered tasks (with the closest as "did you mean") and how a
    task of one's own gets registered."""
    import difflib

    known = task_names()
    what = f"no task is registered under the name {name!r}" if isinstance(name, str) and name.strip() else "no task name given"
    where = f" (from {source})" if source and source != "argument" else ""
    close = difflib.get_close_matches(name, known, n=1) if isinstance(name, str) and name.strip() else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{what}{where}{hint}; expected one of the registered tasks: {', '.join(known) or '(none)'} "
            "(a task of your own registers with agentlog.engine.tasks.register_task in a module named by "
            "[task] module or --import, or by an agentlog.tasks entry point)")


def _from_entry_point(unknown: LookupError) -> Callable[..., Any]:
    """The factory of a name not registered in this process, from the
    ``agentlog.tasks`` entry point of that name, loaded only now (so a broken
    third-party package breaks only selecting its own task); else the
    TaskError of ``unknown``."""
    from .loading import load_entry_point_task

    wanted = getattr(unknown, "name", None)
    if not isinstance(wanted, str) or not wanted.strip() or not load_entry_point_task(wanted.strip()):
        raise TaskError(_unknown_task_message(wanted, getattr(unknown, "source", ""))) from None
    try:
        return harness.select(wanted.strip())
    except LookupError as exc:
        raise TaskError(f"entry point {wanted.strip()!r} (group agentlog.tasks) loaded but registered no task "
                        f"under its name: {exc}") from None


def select_task(name: str | None = None, **kwargs: Any) -> "Task | TextTask":
    """The task selected through the engine's harness registry: ``name``, or
    ``$AGENTLOG_AGENT`` when ``name`` is empty. A name no task is registered
    under loads the ``agentlog.tasks`` entry point of that name, if an
    installed package declares one; else it raises TaskError listing the
    registered harnesses. The result is a token-level :class:`Task` or a
    text-level :class:`~.text.TextTask`."""
    from .text import TextTask, check_text_task

    try:
        factory = harness.select(name or None)
    except LookupError as exc:
        factory = _from_entry_point(exc)
    task = factory(**kwargs)
    if not isinstance(task, (Task, TextTask)):
        raise TaskError(f"harness {name!r} is not a task (its factory returned {type(task).__name__});"
                        " the loop needs an engine.tasks.Task or engine.tasks.TextTask")
    if isinstance(task, TextTask):
        check_text_task(task)
    return task
