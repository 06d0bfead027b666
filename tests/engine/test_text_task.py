"""The text-level task interface (engine/tasks/text.py): the test-command
verdict, writing files through a sandbox, a TextTask in the registry, and
the copyable example task (examples/repo_fix)."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from agentlog.engine import LocalSandbox
from agentlog.engine.harness import unregister
from agentlog.engine.sandbox import CommandResult
from agentlog.engine.tasks import (
    TaskError, TextEpisode, TextTask, Verdict, load_tasks, register_task, select_task, verdict_of_command,
    write_files, write_files_command,
)
from agentlog.engine.tasks import base as task_base

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "repo_fix"


def _result(exit_code, exceeded=False) -> CommandResult:
    return CommandResult(command="python3 test_x.py", exit_code=exit_code, budget_exceeded=exceeded, duration_s=0.25, output_tail="")


def test_verdict_of_a_passing_command_is_reward_1() -> None:
    v = verdict_of_command(_result(0))
    assert (v.reward, v.success) == (1.0, True)
    assert v.detail["exit_code"] == 0 and v.detail["command"] == "python3 test_x.py" and "why" not in v.detail


@pytest.mark.parametrize("exceeded", [True, False])
def test_a_command_without_exit_code_is_never_a_pass(exceeded: bool) -> None:
    v = verdict_of_command(_result(None, exceeded))
    assert (v.reward, v.success) == (0.0, False)
    assert v.detail["exit_code"] is None and v.detail["budget_exceeded"] is exceeded
    assert "no exit code" in v.detail["why"]


@given(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), st.booleans())
def test_reward_is_1_exactly_when_the_exit_code_is_0(code, exceeded) -> None:
    v = verdict_of_command(_result(code, exceeded))
    assert v.reward == (1.0 if code == 0 else 0.0) and v.success is (code == 0)


# The written text comes back byte for byte, whatever it holds (quotes, $, newlines, heredoc terminators).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@settings(max_examples=15, deadline=None)
@given(st.dictionaries(st.sampled_from(["a.py", "sub/b.txt", "d e/c'.md", "x/y/z"]), _TEXT, min_size=1, max_size=3))
def test_write_files_through_a_sandbox_round_trips(tmp_path_factory, files) -> None:
    sandbox = LocalSandbox(tmp_path_factory.mktemp("wf"))
    asyncio.run(write_files(sandbox, files))
    for rel, text in files.items():
        assert (sandbox.workdir / rel).read_bytes() == text.encode("utf-8")


@pytest.mark.parametrize("bad", ["/etc/passwd", "../up.py", "a/../../b", ""])
def test_write_files_refuses_paths_outside_the_workdir(bad: str) -> None:
    with pytest.raises(ValueError, match="relative path inside the working directory"):
        write_files_command({bad: "x"})


def test_write_files_names_the_files_when_the_command_fails(tmp_path: Path) -> None:
    sandbox = LocalSandbox(tmp_path)
    (tmp_path / "blocker").write_text("a file, not a folder")
    with pytest.raises(TaskError, match=r"writing \['blocker/x.py'\] into sandbox 'local:.*' failed \(exit code 1"):
        asyncio.run(write_files(sandbox, {"blocker/x.py": "x"}))


@pytest.fixture
def registered():
    """Task names registered by a test, removed afterwards."""
    names: list[str] = []
    yield names
    for n in names:
        task_base._TASKS.pop(n, None)
        unregister(n)


def test_a_text_task_registers_and_is_selected_by_name(registered, tmp_path: Path) -> None:
    @register_task("t-exists")
    class ExistsTask(TextTask):
        name = "t-exists"

        def new_episode(self, rng: random.Random) -> TextEpisode:
            return TextEpisode(messages=[{"role": "user", "content": "create done.txt"}], label="done.txt")

        async def verify(self, episode: TextEpisode, sandbox) -> Verdict:
            return verdict_of_command(await sandbox.run_command(f"test -f {episode.label}", self.command_budget_s))

    registered.append("t-exists")
    task = select_task("t-exists")
    assert isinstance(task, ExistsTask)
    ep = task.new_episode(random.Random(0))
    assert task.group_member(ep, random.Random(1)) is ep
    sandbox = LocalSandbox(tmp_path)

    async def play() -> tuple[Verdict, Verdict]:
        await task.setup(ep, sandbox)  # the default: nothing
        before = await task.verify(ep, sandbox)
        await sandbox.run_command("touch done.txt", 5)
        return before, await task.verify(ep, sandbox)

    before, after = asyncio.run(play())
    assert (before.reward, after.reward) == (0.0, 1.0)


# -- the copyable example: examples/repo_fix/repo_fix_task.py -------------------------------------


@pytest.fixture
def repo_fix(monkeypatch):
    """The example module, imported the way the loop does (its directory on sys.path)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    load_tasks(["repo_fix_task"], [EXAMPLE_DIR], entry_points=False)
    return sys.modules["repo_fix_task"]


def test_the_example_task_is_registered_as_repo_fix(repo_fix) -> None:
    task = select_task("repo-fix")
    assert isinstance(task, repo_fix.RepoFixTask) and isinstance(task, TextTask)
    drawn = {task.new_episode(random.Random(s)).label for s in range(40)}
    assert drawn == {b.name for b in repo_fix.BUGS}
    ep = task.new_episode(random.Random(0))
    roles = [m["role"] for m in ep.messages]
    assert roles == ["system", "user"] and "`bash`" in ep.messages[0]["content"]
    bug = task.bug(ep)
    assert bug.module in ep.messages[1]["content"] and bug.test_file in ep.messages[1]["content"]


@pytest.mark.parametrize("relative", [False, True])
def test_the_example_unfixed_scores_0_and_fixed_scores_1(repo_fix, tmp_path: Path, monkeypatch, relative: bool) -> None:
    task = repo_fix.RepoFixTask()
    if relative:  # a relative sandbox directory works as well (LocalSandbox resolves it)
        monkeypatch.chdir(tmp_path)

    async def play(bug) -> list[float]:
        ep = TextEpisode(messages=[], label=bug.name, state={"bug": bug.name})
        sandbox = LocalSandbox(Path(bug.name) if relative else tmp_path / bug.name)
        await task.setup(ep, sandbox)
        unfixed = await task.verify(ep, sandbox)
        assert unfixed.detail["exit_code"] not in (0, None), unfixed.detail
        fixed = await sandbox.run_command(bug.fix, 10)
        assert fixed.exit_code == 0, fixed.output_tail
        return [unfixed.reward, (await task.verify(ep, sandbox)).reward]

    for bug in repo_fix.BUGS:
        assert asyncio.run(play(bug)) == [0.0, 1.0], bug.name


def test_the_example_restores_the_tests_before_verifying(repo_fix, tmp_path: Path) -> None:
    """Editing the test file into a pass earns nothing: the verifier runs the pristine tests."""
    task = repo_fix.RepoFixTask()
    bug = repo_fix.BUGS[0]
    ep = TextEpisode(messages=[], label=bug.name, state={"bug": bug.name})
    sandbox = LocalSandbox(tmp_path)

    async def play() -> Verdict:
        await task.setup(ep, sandbox)
        await sandbox.run_command(f"echo 'print(\"ok\")' > {bug.test_file}", 5)
        return await task.verify(ep, sandbox)

    assert asyncio.run(play()).reward == 0.0
