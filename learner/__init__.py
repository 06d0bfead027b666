"""learner: torch batching, advantages, policy losses, optimisers and the training step."""

from agentlog.learner.advantages import compute_advantages
from agentlog.learner.batching import Batch, make_batches
from agentlog.learner.config import LearnerConfig
from agentlog.learner.learner import Learner, load_weights, save_weights
from agentlog.learner.loss import TERMS, LossInputs, kl_penalty, total_loss
from agentlog.learner.model import GPT, Generation, GPTConfig, token_log_probs
from agentlog.learner.optim import StatelessAdam, make_optimizer

__all__ = [
    "Batch", "GPT", "GPTConfig", "Generation", "Learner", "LearnerConfig", "LossInputs", "StatelessAdam", "TERMS",
    "compute_advantages", "kl_penalty", "load_weights", "make_batches", "make_optimizer",
    "save_weights", "token_log_probs", "total_loss",
]
