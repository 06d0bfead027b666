"""The root of agentlog's errors, and the families shared by several layers.

Every exception class the package defines derives from :class:`AgentlogError`
(``tests/packaging/test_error_root.py`` walks the package and fails on one
that does not), so an application can tell agentlog's refusals from any other
failure with one ``except AgentlogError``, and the CLI turns any of them that
a command did not handle into a one-line ``agentlog: error: ...`` and exit 2.
The root lives in ``events``, the lowest layer, so every layer can derive from
it without importing upwards.

Beneath the root, each family lives with the module that owns its concept:

- :class:`ConfigError` (here): a configuration value out of range or unknown,
  raised by the reducers' ``ReduceConfig`` and the loop's ``LoopConfig`` alike;
- ``events.log.api.LogError``: the log (its ``SchemaError``, ``LogCorruption``,
  ``LogLocked``, ``LogClosed``, ...);
- ``events.schema.lifecycle.LifecycleError``: a session's lifecycle (``IllegalTransition``,
  ``SessionClosed``; the engine's ``DuplicateSession``, ``StragglerRefused``);
- ``reducers.errors.ReduceError``, ``engine.errors``, ``engine.tasks.TaskError``,
  ``loop.run.LoopError``, ``tools.cli.CliError`` and the rest of each layer's own.

A class that was also a builtin exception (``ValueError``, ``RuntimeError``,
``TimeoutError``, ``LookupError``) stays one, so callers' ``except ValueError``
keep working: it derives from both, the root first.
"""

from __future__ import annotations


class AgentlogError(Exception):
    """Any error agentlog raises on purpose: its message names what was wrong, where, and what was expected."""


class ConfigError(AgentlogError, ValueError):
    """A configuration value is out of range or unknown; the message names the field."""
