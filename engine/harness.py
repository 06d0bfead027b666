"""The agent-harness registry.

Harnesses (the code that drives an agent through a session) register by
name; a run selects one by config or the ``AGENTLOG_AGENT`` environment
variable. An unknown or empty name fails at start-up with an error listing
the valid names, never later in the middle of a rollout (the lesson of
slime's SWE_AGENT selector, which fell through to a default on a typo).

Capabilities. A harness registered with ``resumable=True`` can continue a
session a killed worker left running (:func:`is_resumable`): its agent has
``async resume(handle, sandbox, messages, api_key)``, which takes the
conversation rebuilt from the log (ending with the last durable turn's
answer), runs that answer's tool calls in the restored sandbox and goes on as
``run`` would. A harness that is not resumable has its orphaned sessions
aborted (``engine_restart``), as every harness did before.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

from agentlog.events.errors import AgentlogError

#: The environment variable consulted by :func:`select` when no name is given.
ENV_VAR = "AGENTLOG_AGENT"

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, Callable[..., Any]] = {}
#: Names of the registered harnesses that can resume a session (see the module docstring).
_RESUMABLE: set[str] = set()


class UnknownHarness(AgentlogError, LookupError):
    """No harness is registered under the requested name."""

    def __init__(self, name: str | None, valid: list[str], source: str) -> None:
        self.name = name
        self.valid = valid
        self.source = source
        shown = ", ".join(valid) if valid else "(none registered)"
        what = "an empty harness name" if not name else f"unknown harness {name!r}"
        super().__init__(f"{what} (from {source}); expected one of: {shown}")


def register(name: str, *, resumable: bool = False) -> Callable[[F], F]:
    """Decorator: ``@register("swe")`` registers a harness factory under ``name``;
    ``resumable=True`` declares that its agents can resume a session (the module docstring).

    Registering a different factory under a taken name is an error; the same
    factory again (a module re-import) is accepted.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"harness name: expected a non-empty str, found {name!r}")

    def deco(factory: F) -> F:
        old = _REGISTRY.get(name)
        if old is not None and old is not factory and _ident(old) != _ident(factory):
            raise ValueError(f"harness {name!r} is already registered to {old!r}; refusing {factory!r}")
        _REGISTRY[name] = factory
        if resumable:
            _RESUMABLE.add(name)
        else:
            _RESUMABLE.discard(name)
        return factory

    return deco


def _ident(factory: Callable[..., Any]) -> tuple[Any, Any]:
    return getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)


def unregister(name: str) -> None:
    """Remove a harness (tests); unknown names raise UnknownHarness."""
    if name not in _REGISTRY:
        raise UnknownHarness(name, names(), "unregister")
    del _REGISTRY[name]
    _RESUMABLE.discard(name)


def is_resumable(name: str) -> bool:
    """Whether the harness registered under ``name`` can resume a session; UnknownHarness for an unknown name."""
    get(name)
    return name in _RESUMABLE


def names() -> list[str]:
    """Registered harness names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> Callable[..., Any]:
    """The factory registered under ``name``; UnknownHarness lists the valid names."""
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise UnknownHarness(name, names(), "argument")
    return factory


def select(name: str | None = None) -> Callable[..., Any]:
    """The factory for ``name``, or for ``$AGENTLOG_AGENT`` when ``name`` is None.

    An unknown or empty name raises UnknownHarness naming where it came from
    and listing the valid names.
    """
    source = "argument"
    if name is None:
        name = os.environ.get(ENV_VAR)
        source = f"${ENV_VAR}" if name is not None else f"neither an argument nor ${ENV_VAR}"
    name = name.strip() if isinstance(name, str) else name
    if not name:
        raise UnknownHarness(name, names(), source)
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UnknownHarness(name, names(), source)
    return factory
