"""learner: torch batching, advantages, policy losses, optimisers and the training step."""
