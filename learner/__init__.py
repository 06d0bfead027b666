"""learner: torch batching, advantages, policy losses, optimisers and the training step.

The names below are imported from their modules on first use (PEP 562), not
when the package is: ``agentlog.learner.config`` is plain data that the CLI
and the loop's config read, and importing it must not import torch (about
two seconds of every ``agentlog`` command's start)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Each public name -> the module of this package that defines it.
_DEFINED_IN = {
    "compute_advantages": "advantages",
    "Batch": "batching", "make_batches": "batching",
    "LearnerConfig": "config",
    "Learner": "learner", "load_weights": "learner", "save_weights": "learner",
    "TERMS": "loss", "LossInputs": "loss", "kl_penalty": "loss", "total_loss": "loss",
    "GPT": "model", "Generation": "model", "GPTConfig": "model", "token_log_probs": "model",
    "StatelessAdam": "optim", "make_optimizer": "optim",
}

__all__ = sorted(_DEFINED_IN)


def __getattr__(name: str) -> Any:
    module = _DEFINED_IN.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value  # the next lookup is a plain module attribute
        return value
    if not name.startswith("__"):
        # A submodule reached as an attribute (``agentlog.learner.loss``), as the eager imports made it reachable.
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the names, re-exported for type checkers (`x as x`), not imported at run time
    from agentlog.learner.advantages import compute_advantages as compute_advantages
    from agentlog.learner.batching import Batch as Batch, make_batches as make_batches
    from agentlog.learner.config import LearnerConfig as LearnerConfig
    from agentlog.learner.learner import Learner as Learner, load_weights as load_weights, save_weights as save_weights
    from agentlog.learner.loss import TERMS as TERMS, LossInputs as LossInputs, kl_penalty as kl_penalty, total_loss as total_loss
    from agentlog.learner.model import GPT as GPT, Generation as Generation, GPTConfig as GPTConfig, token_log_probs as token_log_probs
    from agentlog.learner.optim import StatelessAdam as StatelessAdam, make_optimizer as make_optimizer
