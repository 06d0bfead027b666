"""An example text-level task to copy: fix a bug in a tiny Python repository.

Each episode draws one small module with a known bug (an off-by-one, a wrong
bound...) and its test file. :meth:`RepoFixTask.setup` writes both into the
session's sandbox, the agent works there with its ``bash`` tool, and
:meth:`RepoFixTask.verify` restores the pristine test file (so editing the
tests earns nothing) and runs it: reward 1 when it exits 0, else 0.

Train it from this directory, where the module imports like under ``python -m``
(``config.toml`` names it: ``[task] module = "repo_fix_task"``; the config
file's directory is importable, ``[task] path = [...]`` adds others)::

    agentlog train --config config.toml

With a config of your own that does not name it, add ``--import repo_fix_task``.
Everything goes through ``Sandbox.run_command``, so the task works with a
remote sandbox as well as with ``LocalSandbox``.
"""

from __future__ import annotations

import random
import textwrap
from dataclasses import dataclass

from agentlog.engine.sandbox import Sandbox
from agentlog.engine.tasks import TextEpisode, TextTask, Verdict, register_task, verdict_of_command, write_files


@dataclass(frozen=True)
class Bug:
    """One tiny buggy repository: a module, its tests, and the known fix."""

    #: Short id, recorded as the episode's label.
    name: str
    #: File name of the module to fix.
    module: str
    #: The module's buggy source.
    source: str
    #: File name of the test file (runs with plain ``python``, no pytest needed).
    test_file: str
    #: The test file's source.
    tests: str
    #: What the user reports, shown to the agent.
    report: str
    #: A shell command that fixes the bug (for tests and for demonstrations).
    fix: str


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip()


BUGS: tuple[Bug, ...] = (
    Bug(
        name="sum-off-by-one",
        module="stats.py",
        source=_src('''
            def total(xs):
                """The sum of the numbers in xs."""
                s = 0
                for i in range(len(xs) - 1):
                    s += xs[i]
                return s
            '''),
        test_file="test_stats.py",
        tests=_src('''
            from stats import total

            def test_total():
                assert total([]) == 0
                assert total([5]) == 5
                assert total([1, 2, 3]) == 6

            if __name__ == "__main__":
                test_total()
                print("ok")
            '''),
        report="total([1, 2, 3]) returns 3 instead of 6.",
        fix="sed -i 's/range(len(xs) - 1)/range(len(xs))/' stats.py",
    ),
    Bug(
        name="inclusive-range",
        module="ranges.py",
        source=_src('''
            def inclusive_range(a, b):
                """The integers from a to b, both included."""
                return list(range(a, b))
            '''),
        test_file="test_ranges.py",
        tests=_src('''
            from ranges import inclusive_range

            def test_inclusive_range():
                assert inclusive_range(1, 3) == [1, 2, 3]
                assert inclusive_range(4, 4) == [4]

            if __name__ == "__main__":
                test_inclusive_range()
                print("ok")
            '''),
        report="inclusive_range(1, 3) leaves out 3.",
        fix="sed -i 's/list(range(a, b))/list(range(a, b + 1))/' ranges.py",
    ),
    Bug(
        name="clamp-upper-bound",
        module="clamp.py",
        source=_src('''
            def clamp(x, lo, hi):
                """x limited to the interval [lo, hi]."""
                return max(lo, min(x, lo))
            '''),
        test_file="test_clamp.py",
        tests=_src('''
            from clamp import clamp

            def test_clamp():
                assert clamp(5, 0, 10) == 5
                assert clamp(-1, 0, 10) == 0
                assert clamp(11, 0, 10) == 10

            if __name__ == "__main__":
                test_clamp()
                print("ok")
            '''),
        report="clamp(5, 0, 10) returns 0 instead of 5.",
        fix="sed -i 's/min(x, lo)/min(x, hi)/' clamp.py",
    ),
)

_BY_NAME = {b.name: b for b in BUGS}

SYSTEM_PROMPT = (
    "You are a coding agent working in a small Python repository (the current directory). "
    "You have a `bash` tool: call it with a shell command and it returns the command's output. "
    "Find and fix the bug, then stop."
)


@register_task("repo-fix")
class RepoFixTask(TextTask):
    """Fix a one-line bug so that the repository's test file passes."""

    name = "repo-fix"
    max_turns = 8
    max_new_tokens = 256
    session_budget_s = 120.0
    command_budget_s = 30.0

    def __init__(self, python: str = "python3") -> None:
        #: The interpreter the test command runs with, inside the sandbox.
        self.python = python

    def new_episode(self, rng: random.Random) -> TextEpisode:
        """One of :data:`BUGS`, drawn from ``rng``."""
        bug = rng.choice(BUGS)
        user = (f"Bug report: {bug.report}\n"
                f"The test `{self.python} {bug.test_file}` fails. Fix {bug.module} so that it passes; "
                f"do not edit {bug.test_file}.")
        return TextEpisode(
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
            label=bug.name,
            state={"bug": bug.name},
        )

    def bug(self, episode: TextEpisode) -> Bug:
        """The bug an episode plays."""
        return _BY_NAME[episode.state["bug"]]

    async def setup(self, episode: TextEpisode, sandbox: Sandbox) -> None:
        """Write the buggy module and its test file into the sandbox's working directory."""
        bug = self.bug(episode)
        await write_files(sandbox, {bug.module: bug.source, bug.test_file: bug.tests}, self.command_budget_s)

    async def verify(self, episode: TextEpisode, sandbox: Sandbox) -> Verdict:
        """Restore the pristine tests, run them: reward 1 when they pass."""
        bug = self.bug(episode)
        await write_files(sandbox, {bug.test_file: bug.tests}, self.command_budget_s)
        result = await sandbox.run_command(f"{self.python} {bug.test_file}", self.command_budget_s)
        return verdict_of_command(result)
