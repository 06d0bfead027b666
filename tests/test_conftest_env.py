"""The suite runs with Weights & Biases off, whatever the environment says."""

import os


def test_wandb_is_disabled_for_the_test_session() -> None:
    assert os.environ.get("WANDB_MODE") == "disabled"
    assert "WANDB_PROJECT" not in os.environ
