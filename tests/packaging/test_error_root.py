"""One error root: every exception class agentlog defines derives from
``agentlog.events.errors.AgentlogError`` (docs/design.md, "Errors").

Every module of every layer folder is imported and every exception class
defined in it is checked, so a new one that forgets the root fails here.
"""

from __future__ import annotations

import importlib
import inspect

from packaging_helpers import ROOT, layer_folders, tracked_files

from agentlog.events.errors import AgentlogError, ConfigError


def package_modules() -> list[str]:
    """``agentlog.<layer>...`` for each Python file of a layer folder."""
    layers = set(layer_folders(ROOT))
    names = []
    for rel in tracked_files(ROOT, "*.py"):
        if rel.parts[0] not in layers:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(["agentlog", *parts]))
    return names


def defined_exceptions() -> dict[str, type[BaseException]]:
    """'module.Class' -> class, for every exception class the package's modules define."""
    found: dict[str, type[BaseException]] = {}
    for name in package_modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_of_the_package_derives_from_agentlog_error():
    found = defined_exceptions()
    # The walk reaches every layer (a broken walk must not pass vacuously).
    for expected in ("agentlog.events.log.api.LogError", "agentlog.reducers.errors.ReduceError",
                     "agentlog.engine.errors.DuplicateSession", "agentlog.loop.run.LoopError", "agentlog.tools.cli.CliError"):
        assert expected in found, expected
    stray = sorted(name for name, cls in found.items() if not issubclass(cls, AgentlogError))
    assert not stray, f"exception classes outside the AgentlogError root (derive from it, keeping any builtin base): {stray}"


def test_the_config_errors_of_every_layer_are_one_class_that_stays_a_value_error():
    from agentlog.learner.config import LearnerConfig
    from agentlog.loop.config import ConfigError as LoopConfigError
    from agentlog.loop.config import LoopConfig
    from agentlog.reducers.config import ConfigError as ReduceConfigError
    from agentlog.reducers.config import ReduceConfig

    assert LoopConfigError is ReduceConfigError is ConfigError
    assert issubclass(ConfigError, ValueError)
    for build in (lambda: ReduceConfig(min_valid=0), lambda: LoopConfig(min_valid=0),
                  lambda: LearnerConfig(lr=0), lambda: LearnerConfig.from_dict({"no_such_field": 1})):
        try:
            build()
        except ConfigError as exc:
            assert isinstance(exc, AgentlogError) and isinstance(exc, ValueError)
        else:
            raise AssertionError("a bad configuration value was accepted")


def test_the_engine_errors_keep_their_builtin_and_lifecycle_bases_and_old_import_paths():
    from agentlog.engine import core, errors
    from agentlog.events.schema.lifecycle import IllegalTransition, LifecycleError

    assert issubclass(errors.DuplicateSession, LifecycleError)
    assert issubclass(errors.StragglerRefused, IllegalTransition)
    assert issubclass(errors.SessionTimeout, TimeoutError)
    assert issubclass(errors.EngineClosed, RuntimeError)
    for name in ("DuplicateSession", "StragglerRefused", "SessionTimeout", "EngineClosed", "TIMEOUT_REASON"):
        assert getattr(core, name) is getattr(errors, name), name
