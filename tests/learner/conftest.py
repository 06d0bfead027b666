"""Learner tests: few threads (CI has two cores shared with other suites)."""

from __future__ import annotations

import pytest
import torch

from agentlog.reducers.samples import Sample, aborted_placeholder

# CI has two cores shared with other suites; small tensors gain nothing from more.
torch.set_num_threads(1)


@pytest.fixture
def placeholder():
    """Factory for the aborted placeholder row of a group."""
    def make(group_id: str, session_id: str = "aborted", sample_index: int = 99) -> Sample:
        return aborted_placeholder(group_id, session_id, sample_index, "timeout")
    return make
