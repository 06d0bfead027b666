"""learner: torch batching, advantages, policy losses, optimisers and the training step."""

from learner.advantages import compute_advantages
from learner.batching import Batch, make_batches
from learner.config import LearnerConfig
from learner.learner import Learner, load_weights, save_weights
from learner.loss import kl_penalty, policy_loss
from learner.model import GPT, Generation, GPTConfig, token_log_probs
from learner.optim import StatelessAdam, make_optimizer

__all__ = [
    "Batch", "GPT", "GPTConfig", "Generation", "Learner", "LearnerConfig", "StatelessAdam",
    "compute_advantages", "kl_penalty", "load_weights", "make_batches", "make_optimizer",
    "policy_loss", "save_weights", "token_log_probs",
]
