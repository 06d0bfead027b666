"""[rollout] values that Ray, or the partition naming, refuse later must be
refused when the config is read, naming the field and what was expected:
never a raw ValueError from inside Ray or the log layer once the run folder
exists and the learner process is started."""

from __future__ import annotations

import pytest

from agentlog.events.errors import ConfigError
from agentlog.loop.config import RolloutConfig


@pytest.mark.parametrize("resources", [{"GPU": 1}, {"CPU": 2}])
def test_cpu_or_gpu_in_rollout_resources_is_refused_naming_the_field(resources) -> None:
    # Accepted today; then RayRollouts.start's ray.remote(RolloutActor).options(resources=...) raises
    # Ray's own ValueError ("Use the 'num_cpus' and 'num_gpus' keyword instead of 'CPU' and 'GPU'
    # in 'resources' keyword"), a raw traceback out of `agentlog train`.
    with pytest.raises(ConfigError, match=r"\[rollout\] resources: .*" + next(iter(resources))):
        RolloutConfig(backend="ray", resources=resources)


@pytest.mark.parametrize("field,value", [("num_cpus", 0.00001), ("resources", {"agentlog_rollout": 0.00001})])
def test_a_resource_amount_finer_than_ray_takes_is_refused_naming_the_field(field, value) -> None:
    # Ray: "The precision of the fractional quantity of resource ... cannot go beyond 0.0001" (ValueError from .options()).
    with pytest.raises(ConfigError, match=rf"\[rollout\] {field}: "):
        RolloutConfig(backend="ray", **{field: value})


def test_more_workers_than_partition_ids_is_refused_naming_the_field() -> None:
    # Partition ids are 0..9999 (p%04d); workers = 10001 is accepted today, and the driver
    # then fails in Run.rollout_logs() with "partition id: expected an int in [0, 10000), found 10000"
    # (a raw ValueError that names no config field), after the learner process was started.
    with pytest.raises(ConfigError, match=r"\[rollout\] workers: .*10000"):
        RolloutConfig(workers=10_001)
