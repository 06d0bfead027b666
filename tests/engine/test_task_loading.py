"""Loading user task modules (engine/tasks/loading.py): module names, import
directories, the ``agentlog.tasks`` entry point group, and the errors that
say what could not be imported and why."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from agentlog.engine.harness import unregister
from agentlog.engine.tasks import ENTRY_POINT_GROUP, TaskError, TaskImportError, load_tasks, select_task, task_names
from agentlog.engine.tasks import base as task_base
from agentlog.engine.tasks.loading import add_import_dirs, load_entry_point_tasks

TASK_SOURCE = '''
import random
from agentlog.engine.tasks import Episode, Task, Verdict, register_task


class {cls}(Task):
    name = "{name}"
    vocab_size = 4
    eos_id = 1
    max_new_tokens = 1

    def new_episode(self, rng: random.Random) -> Episode:
        return Episode(prompt_ids=(0,), messages=[], state={{}})

    def tool_step(self, episode, turn_index, output_ids):
        return None

    def verify(self, episode, outputs) -> Verdict:
        return Verdict(reward=0.0, success=False)
'''


@pytest.fixture
def sandboxed(monkeypatch, tmp_path: Path):
    """sys.path restored after the test; the task names it registers and the modules it imported from ``tmp_path`` removed."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before_tasks = set(task_base._TASKS)
    yield
    for name in set(task_base._TASKS) - before_tasks:
        task_base._TASKS.pop(name)
        unregister(name)
    for mod in [m for m, v in sys.modules.items() if str(getattr(v, "__file__", None) or "").startswith(str(tmp_path))]:
        del sys.modules[mod]
    importlib.invalidate_caches()


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_a_module_from_an_import_dir_registers_its_task(tmp_path: Path, sandboxed) -> None:
    mod, name = _unique("usertask"), _unique("user-task")
    (tmp_path / f"{mod}.py").write_text(TASK_SOURCE.format(cls="T", name=name) + f"\nregister_task({name!r})(T)\n")
    with pytest.raises(TaskError, match=f"no task is registered under the name '{name}'"):
        select_task(name)
    assert load_tasks([mod], [tmp_path], entry_points=False) == [mod]
    assert sys.path[0] == str(tmp_path)
    assert select_task(name).name == name
    # Idempotent: a second load (another LoopLearner in this process) re-registers nothing.
    assert load_tasks([mod], [tmp_path], entry_points=False) == [mod]
    assert sys.path.count(str(tmp_path)) == 1


def test_a_missing_module_names_itself_and_the_path_searched(tmp_path: Path, sandboxed) -> None:
    mod = _unique("absent")
    with pytest.raises(TaskImportError) as info:
        load_tasks([mod], [tmp_path], entry_points=False)
    err = info.value
    assert f"task module {mod!r} not found" in str(err) and str(tmp_path) in str(err)
    assert err.module == mod and str(tmp_path) in err.search_path
    assert isinstance(err.cause, ModuleNotFoundError) and isinstance(err, TaskError)


def test_a_module_that_raises_is_told_apart_from_a_missing_one(tmp_path: Path, sandboxed) -> None:
    mod = _unique("raising")
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent('''
        def load_data():
            return {}["train.jsonl"]

        DATA = load_data()
    '''))
    with pytest.raises(TaskImportError) as info:
        load_tasks([mod], [tmp_path], entry_points=False)
    text = str(info.value)
    assert f"task module {mod!r} raised KeyError: 'train.jsonl' while being imported" in text
    # The traceback tail shows the user's lines, not importlib's.
    assert f"{mod}.py\", line 3, in load_data" in text and "DATA = load_data()" in text
    assert "<frozen" not in text and "importlib" not in text.split("\n", 1)[1]
    assert isinstance(info.value.cause, KeyError)


def test_a_missing_dependency_of_the_module_is_reported_as_raised(tmp_path: Path, sandboxed) -> None:
    mod, dep = _unique("needsdep"), _unique("missingdep")
    (tmp_path / f"{mod}.py").write_text(f"import {dep}\n")
    with pytest.raises(TaskImportError, match=f"task module '{mod}' raised ModuleNotFoundError: No module named '{dep}'"):
        load_tasks([mod], [tmp_path], entry_points=False)


def test_a_missing_submodule_of_a_package_is_not_found(tmp_path: Path, sandboxed) -> None:
    pkg = _unique("pkg")
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    with pytest.raises(TaskImportError, match=f"task module '{pkg}.tasks' not found"):
        load_tasks([f"{pkg}.tasks"], [tmp_path], entry_points=False)


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_an_import_dir_that_is_not_a_directory_is_refused(tmp_path: Path, sandboxed, kind: str) -> None:
    target = tmp_path / "nope"
    if kind == "file":
        target.write_text("x")
    with pytest.raises(TaskError, match=f"task path .*nope.*expected an existing directory.*found {'a file' if kind == 'file' else 'nothing'}"):
        add_import_dirs([target])


def test_an_empty_module_name_is_refused(sandboxed) -> None:
    with pytest.raises(TaskError, match="expected a non-empty module name"):
        load_tasks([" "], entry_points=False)


@pytest.mark.parametrize("bad, hint", [("my_tasks.py", "give 'my_tasks' and its folder in \\[task\\] path"),
                                       ("src/my_tasks", "give 'my_tasks'"), ("1abc", "dotted module name")])
def test_a_file_name_given_as_a_module_is_refused_with_a_hint(sandboxed, bad: str, hint: str) -> None:
    with pytest.raises(TaskError, match=hint) as info:
        load_tasks([bad], entry_points=False)
    assert not isinstance(info.value, TaskImportError) and bad in str(info.value)


# -- the agentlog.tasks entry point group ------------------------------------------------------


def _dist(site: Path, dist: str, entry_points: str) -> None:
    """A minimal installed distribution on ``site``: METADATA and entry_points.txt."""
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_points}\n")


def test_entry_points_register_their_tasks(tmp_path: Path, sandboxed) -> None:
    mod, own, by_ep = _unique("eptasks"), _unique("self-registered"), _unique("by-entry-point")
    # One task registers itself on import; the other is a bare class registered under the entry point's name.
    (tmp_path / f"{mod}.py").write_text(
        TASK_SOURCE.format(cls="Own", name=own) + f"\nregister_task({own!r})(Own)\n" + TASK_SOURCE.format(cls="Bare", name=by_ep)
    )
    _dist(tmp_path, _unique("user_dist"), f"{own} = {mod}\n{by_ep} = {mod}:Bare")
    sys.path.insert(0, str(tmp_path))
    assert own not in task_names() and by_ep not in task_names()
    loaded = load_entry_point_tasks()
    assert {own, by_ep} <= set(loaded)
    assert select_task(own).name == own and select_task(by_ep).name == by_ep
    assert f"entry_point:{by_ep}" in load_tasks(entry_points=True)


def test_entry_points_load_lazily_when_their_name_is_selected(tmp_path: Path, sandboxed) -> None:
    mod, own, by_ep, other = _unique("lazytasks"), _unique("self-registered"), _unique("by-entry-point"), _unique("other")
    (tmp_path / f"{mod}.py").write_text(
        TASK_SOURCE.format(cls="Own", name=own) + f"\nregister_task({own!r})(Own)\n" + TASK_SOURCE.format(cls="Bare", name=by_ep)
    )
    (tmp_path / f"{other}.py").write_text("raise AssertionError('an unselected entry point was loaded')\n")
    _dist(tmp_path, _unique("lazy_dist"), f"{own} = {mod}\n{by_ep} = {mod}:Bare\n{other} = {other}:T")
    sys.path.insert(0, str(tmp_path))
    assert load_tasks() == []  # loads no entry point
    assert mod not in sys.modules and own not in task_names()
    assert select_task(by_ep).name == by_ep  # its module loaded now: `own` registered itself on the way
    assert select_task(own).name == own
    assert other not in sys.modules


def test_a_broken_entry_point_does_not_break_selecting_another_task(tmp_path: Path, sandboxed) -> None:
    dist, mod = _unique("broken_dist"), _unique("brokenep")
    (tmp_path / f"{mod}.py").write_text("raise ImportError('needs a GPU build')\n")
    _dist(tmp_path, dist, f"broken = {mod}:Task")
    sys.path.insert(0, str(tmp_path))
    load_tasks()  # what every process of the loop does first
    assert select_task("lookup").name == "lookup"
    with pytest.raises(TaskImportError) as info:
        select_task("broken")
    text = str(info.value)
    assert f"entry point broken = {mod}:Task (group {ENTRY_POINT_GROUP}, distribution {dist})" in text
    assert "raised ImportError: needs a GPU build" in text
    with pytest.raises(TaskError, match="no task is registered under the name 'nothing-declares-this'"):
        select_task("nothing-declares-this")


def test_a_broken_entry_point_names_itself_its_distribution_and_the_cause(tmp_path: Path, sandboxed) -> None:
    dist, mod = _unique("broken_dist"), _unique("brokenep")
    (tmp_path / f"{mod}.py").write_text("raise ImportError('needs a GPU build')\n")
    _dist(tmp_path, dist, f"broken = {mod}:Task")
    sys.path.insert(0, str(tmp_path))
    with pytest.raises(TaskImportError) as info:
        load_entry_point_tasks()
    text = str(info.value)
    assert f"entry point broken = {mod}:Task (group {ENTRY_POINT_GROUP}, distribution {dist})" in text
    assert "raised ImportError: needs a GPU build" in text and f"{mod}.py" in text


def test_an_entry_point_whose_module_is_missing_is_not_found(tmp_path: Path, sandboxed) -> None:
    dist, mod = _unique("gone_dist"), _unique("gone")
    _dist(tmp_path, dist, f"gone = {mod}:Task")
    sys.path.insert(0, str(tmp_path))
    with pytest.raises(TaskImportError, match=f"entry point gone = {mod}:Task .*module not found: No module named '{mod}'"):
        load_entry_point_tasks()
