"""Loading the user's task modules, in every process of the loop.

A task registers itself when its module is imported (the
:func:`~.base.register_task` decorator), so every process that selects a task
by name (the ``agentlog`` command, the rollout worker, the learner) must
import the module first. :func:`load_tasks` does that from three sources:

- module names, from ``agentlog train --import MODULE`` or the config's
  ``[task] module = "..."`` (``LoopConfig.task_modules``);
- directories put in front of ``sys.path`` first, like ``python -m`` puts the
  current directory there (``[task] path = [...]``, ``LoopConfig.task_path``;
  the command line adds the current directory and the config file's);
- the Python entry point group ``agentlog.tasks`` of installed packages,
  loaded lazily: only when :func:`~.base.select_task` does not find the name
  among the registered tasks is the entry point of that name loaded
  (:func:`load_entry_point_task`), so a broken third-party package cannot
  break selecting any other task (``agentlog demo`` included). When its
  object is a task factory not registered yet, it is registered under the
  entry point's name::

      [project.entry-points."agentlog.tasks"]
      repo-fix = "mypkg.tasks:RepoFixTask"

Anything that cannot be imported raises :class:`TaskImportError`, naming the
module, the ``sys.path`` searched, and the cause: the module was not found, or
it raised while being imported (with the tail of that traceback).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Iterable

from agentlog._logging import get_logger

from .base import TaskError, _TASKS, register_task

#: The entry point group installed packages declare their tasks in.
ENTRY_POINT_GROUP = "agentlog.tasks"

#: A dotted Python module name (``my_tasks``, ``pkg.tasks``).
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

#: Frames of the module's own traceback kept in an error message.
_TRACEBACK_FRAMES = 6

log = get_logger(__name__)


class TaskImportError(TaskError):
    """A task module (or entry point) could not be imported; the message says which, from where, and why."""

    def __init__(self, message: str, *, module: str, search_path: list[str], cause: BaseException) -> None:
        super().__init__(message)
        #: The module (or ``entry point NAME = VALUE``) that failed.
        self.module = module
        #: ``sys.path`` at the time of the import.
        self.search_path = search_path
        #: The underlying exception.
        self.cause = cause


def add_import_dirs(dirs: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Put each directory (made absolute) in front of ``sys.path``, keeping
    their order and skipping those already there; returns the added ones.

    A directory that does not exist is an error: a typo in ``[task] path``
    would otherwise only show up as a module not found."""
    added: list[str] = []
    for d in dirs:
        p = Path(d).absolute()
        if not p.is_dir():
            raise TaskError(f"task path {str(d)!r}: expected an existing directory to import task modules from, "
                            f"found {'a file' if p.exists() else 'nothing'} at {p}")
        s = str(p)
        if s not in sys.path and s not in added:
            added.append(s)
    # Front, like `python -m`: the user's module wins over an installed one of the same name.
    sys.path[:0] = added
    if added:
        importlib.invalidate_caches()
    return added


def import_task_module(name: str) -> object:
    """Import ``name``; TaskImportError tells a module that is not there from one that raised."""
    if not isinstance(name, str) or not name.strip():
        raise TaskError(f"task module: expected a non-empty module name, found {name!r}")
    name = name.strip()
    # `x.py` is a valid dotted name, but it is always a file name given by mistake.
    if not _MODULE_NAME.fullmatch(name) or name.endswith(".py"):
        hint = f"; for the file {name!r} give {Path(name).stem!r} and its folder in [task] path" if name.endswith(".py") or "/" in name else ""
        raise TaskError(f"task module {name!r}: expected a dotted module name such as 'my_tasks' or 'pkg.tasks'{hint}")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise TaskImportError(
                f"task module {name!r} not found: {exc}; searched sys.path {sys.path!r} "
                f"(run from the module's directory, or add it with [task] path = [...])",
                module=name, search_path=list(sys.path), cause=exc,
            ) from exc
        raise _raised(name, exc) from exc
    except Exception as exc:  # the module's own code failed: name it, with where
        raise _raised(name, exc) from exc


def _raised(name: str, exc: BaseException) -> TaskImportError:
    frames = traceback.extract_tb(exc.__traceback__)
    # Drop importlib's own frames: the user wants the lines of their module.
    importlib_init = str(Path(importlib.__file__))
    frames = [f for f in frames if not f.filename.startswith("<frozen") and f.filename not in (__file__, importlib_init)
              and "importlib/metadata" not in f.filename.replace("\\", "/")]
    tail = "".join(traceback.format_list(frames[-_TRACEBACK_FRAMES:])).rstrip()
    return TaskImportError(
        f"task module {name!r} raised {type(exc).__name__}: {exc} while being imported"
        f" (sys.path {sys.path!r})\n{tail}",
        module=name, search_path=list(sys.path), cause=exc,
    )


def _load_entry_point(ep: importlib.metadata.EntryPoint, group: str) -> None:
    """Load one entry point (registering its object under its name when it is
    an unregistered task factory); TaskImportError names it and its distribution."""
    what = f"entry point {ep.name} = {ep.value} (group {group}"
    dist = getattr(ep, "dist", None)
    what += f", distribution {dist.name})" if dist is not None else ")"
    try:
        obj = ep.load()
    except ModuleNotFoundError as exc:
        raise TaskImportError(f"{what}: module not found: {exc}; searched sys.path {sys.path!r}",
                              module=what, search_path=list(sys.path), cause=exc) from exc
    except Exception as exc:
        err = _raised(ep.module, exc)
        raise TaskImportError(f"{what}: {err}", module=what, search_path=list(sys.path), cause=exc) from exc
    if ep.name not in _TASKS and callable(obj) and ep.attr:
        register_task(ep.name)(obj)


def load_entry_point_task(name: str, group: str = ENTRY_POINT_GROUP) -> bool:
    """Load the entry point(s) of ``group`` named ``name``; whether there was
    one. What :func:`~.base.select_task` calls for a name not registered."""
    found = False
    for ep in importlib.metadata.entry_points(group=group, name=name):
        _load_entry_point(ep, group)
        found = True
    if found:
        log.debug("tasks.entry_point_loaded", name=name, group=group)
    return found


def load_entry_point_tasks(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Load every entry point of ``group`` now; returns their names.

    Selecting a task loads only the entry point it needs (see
    :func:`load_entry_point_task`); this eager form is for listing every
    installed task. Loading imports the entry point's module (which may
    register tasks itself). When the object loaded is a task factory and no
    task is registered under the entry point's name yet, it is registered there."""
    loaded: list[str] = []
    for ep in importlib.metadata.entry_points(group=group):
        _load_entry_point(ep, group)
        loaded.append(ep.name)
    return loaded


def load_tasks(modules: Iterable[str] = (), path: Iterable[str | os.PathLike[str]] = (), *,
               entry_points: bool = False) -> list[str]:
    """Make the user's tasks selectable in this process: put ``path`` in front
    of ``sys.path`` and import ``modules`` in order. The ``agentlog.tasks``
    entry points load lazily, when a name is selected that no task has
    (see :func:`load_entry_point_task`); ``entry_points=True`` loads them all
    now. Idempotent (imports are cached); returns the modules and entry
    points loaded."""
    modules = list(modules)
    added = add_import_dirs(path)
    loaded: list[str] = []
    for m in modules:
        import_task_module(m)
        loaded.append(m.strip())
    if entry_points:
        loaded += [f"entry_point:{n}" for n in load_entry_point_tasks()]
    if loaded or added:
        log.debug("tasks.loaded", loaded=loaded, path_added=added)
    return loaded
