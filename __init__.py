"""agentlog: an event-sourced engine for reinforcement learning on LLM agents.

The repository root is this package: the build maps ``engine/``, ``events/``,
``reducers/``, ``learner/``, ``gateway/``, ``loop/`` and ``tools/`` to
``agentlog.engine``, ``agentlog.events`` and so on (see ``pyproject.toml``),
so the installed wheel has exactly one top-level module, ``agentlog``.
Layers and the direction of their dependencies: ``docs/design.md``.
"""

from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("agentlog")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
