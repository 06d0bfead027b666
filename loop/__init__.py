"""The online training loop: a rollout worker and a learner coupled only through logs and checkpoints."""
