"""The text-level task interface: chat messages in, a sandbox to work in, a verifier.

This is the level users think in when they train an agent on their own
problems (a repository to fix, a question to answer with tools). A
:class:`TextTask` provides

- the prompt, as chat messages (:meth:`TextTask.new_episode`);
- the sandbox set-up (:meth:`TextTask.setup`), e.g. writing a small
  repository into the sandbox's working directory;
- the verifier (:meth:`TextTask.verify`), which returns the reward, e.g. by
  running a test command in the sandbox (:func:`verdict_of_command`).

The agent between set-up and verification is not the task's business: the
online loop starts an agent harness (the built-in Python tool-calling agent,
Claude Code or Codex) with the session's key pointed at the gateway, and the
gateway records every model call as a turn. The token-level :class:`~.base.Task`
stays beside this interface for the built-in demo, whose policy reads token
ids and no tokenizer.

Text tasks register with the same :func:`~.base.register_task` decorator and
are selected by name like token-level ones.
"""

from __future__ import annotations

import abc
import base64
import posixpath
import random
import shlex
from dataclasses import dataclass, field
from typing import Any

from agentlog.engine.sandbox import CommandResult, Sandbox
from agentlog.events.schema.validation import is_number

from .base import Verdict


@dataclass
class TextEpisode:
    """One instance of a text task: the prompt and what set-up and verifier need."""

    #: The prompt as chat messages (OpenAI shape: role and content).
    messages: list[dict[str, Any]]
    #: What the verifier expects, recorded as the session's label.
    label: Any = None
    #: Hidden per-episode state for set-up and verifier (never shown to the agent).
    state: dict[str, Any] = field(default_factory=dict)


class TextTask(abc.ABC):
    """An environment for an agent that works in a sandbox, scored by a verifier."""

    #: Registry name (``task = "NAME"`` in the loop config).
    name: str = ""
    #: Most model calls (recorded turns) per session; more are refused by the loop.
    max_turns: int = 8
    #: Most tokens generated per model call.
    max_new_tokens: int = 256
    #: Wall-clock budget of one whole session, agent and verifier included (seconds).
    session_budget_s: float = 300.0
    #: Wall-clock budget of one sandbox command, the verifier's included (seconds).
    command_budget_s: float = 60.0

    @abc.abstractmethod
    def new_episode(self, rng: random.Random) -> TextEpisode:
        """Draw a fresh episode (prompt and hidden state) from ``rng``."""

    def group_member(self, episode: TextEpisode, rng: random.Random) -> TextEpisode:
        """The episode one member of a GRPO group plays (default: the same one)."""
        return episode

    async def setup(self, episode: TextEpisode, sandbox: Sandbox) -> None:
        """Prepare the sandbox for ``episode`` before the agent starts (default: nothing)."""

    @abc.abstractmethod
    async def verify(self, episode: TextEpisode, sandbox: Sandbox) -> Verdict:
        """Score the agent's work in ``sandbox`` once the agent has stopped."""


def check_text_task(task: TextTask) -> TextTask:
    """``task`` if its numbers are sound, else a TaskError naming the task, the field and what
    was expected (a zero budget would abort every session, a NaN one fail each mid-batch)."""
    from .base import TaskError

    for name, kind, finite in (("max_turns", int, True), ("max_new_tokens", int, True),
                                ("session_budget_s", float, False), ("command_budget_s", float, True)):
        v = getattr(task, name, None)
        if kind is int:
            ok = type(v) is int and v >= 1
            want = "an int >= 1"
        else:
            ok = is_number(v, above=0, finite=finite)
            want = "a finite number of seconds > 0" if finite else "a number of seconds > 0"
        if not ok:
            raise TaskError(f"task {task.name!r} ({type(task).__qualname__}): {name}: expected {want}, found {v!r}")
    return task


def verdict_of_command(result: CommandResult) -> Verdict:
    """The verdict of a test command: reward 1 when it exited 0, else 0.

    A command that reported no exit code (budget exceeded, no done marker)
    is a failure, and the detail says why; it is never read as a pass.
    """
    passed = result.exit_code == 0
    detail: dict[str, Any] = {
        "command": result.command,
        "exit_code": result.exit_code,
        "budget_exceeded": result.budget_exceeded,
        "duration_s": round(result.duration_s, 3),
    }
    if result.exit_code is None:
        detail["why"] = "the test command reported no exit code (budget exceeded or no done marker)"
    return Verdict(reward=1.0 if passed else 0.0, success=passed, detail=detail)


def write_files_command(files: dict[str, str]) -> str:
    """A shell command that writes ``files`` (relative path -> text) under the
    command's working directory, creating parent directories.

    The contents travel base64-encoded inside the command, so it works
    through any :class:`Sandbox` (a remote one too), whatever the text holds
    (quotes, ``$``, newlines, a heredoc terminator). Meant for small files:
    one command line holds about 100 kB."""
    parts = []
    for rel, text in files.items():
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"write_files_command: expected a relative path inside the working directory, found {rel!r}")
        quoted = shlex.quote(rel)
        data = base64.b64encode(text.encode("utf-8")).decode("ascii")
        parent = posixpath.dirname(rel)
        if parent:
            parts.append(f"mkdir -p {shlex.quote(parent)}")
        parts.append(f"printf %s {data} | base64 -d > {quoted}")
    if not parts:
        raise ValueError("write_files_command: expected at least one file")
    return " && ".join(parts)


async def write_files(sandbox: Sandbox, files: dict[str, str], budget_s: float = 30.0) -> None:
    """Write ``files`` into ``sandbox``'s working directory (see
    :func:`write_files_command`); TaskError with the command's output when
    it did not exit 0."""
    from .base import TaskError

    result = await sandbox.run_command(write_files_command(files), budget_s)
    if result.exit_code != 0:
        raise TaskError(f"writing {sorted(files)} into sandbox {sandbox.name!r} failed "
                        f"(exit code {result.exit_code}, budget exceeded {result.budget_exceeded}): {result.output_tail[-500:]}")
