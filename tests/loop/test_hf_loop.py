"""The loop with a Hugging Face policy: HF checkpoints per version, the worker's reload, metric sinks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import tiny_hf_dir  # noqa: F401  (fixture)
from loop_helpers import small_config

from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import TurnRecorded
from agentlog.events import read_log
from agentlog.loop.check import check_run
from agentlog.loop.config import ConfigError, FaultConfig, LoopConfig
from agentlog.loop.metric_sinks import TENSORBOARD_DIR
from agentlog.loop.publish import hf_checkpoint_dir
from agentlog.loop.learner_records import read_learner_records
from agentlog.loop.run import run_loop

pytestmark = pytest.mark.required


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    """A 2-step loop run of the lookup task with the in-code tiny Llama as the policy. The random
    model earns reward 0 everywhere (zero advantages): the entropy bonus is what moves its weights."""
    run_dir = tmp_path_factory.mktemp("hf-run") / "run"
    cfg = small_config(steps=2, groups_per_step=2, group_size=2, hf_model="tiny-llama", stop_reward=0.0,
                       learner={"lr": 1e-2, "warmup_steps": 0, "entropy_coef": 0.01}, max_lag=1, faults=FaultConfig.none())
    run_loop(cfg, run_dir, timeout_s=240)
    return run_dir


def test_each_version_is_published_as_an_hf_directory_transformers_loads(hf_run):
    """config.json + model.safetensors + tokenizer beside every checkpoint; from_pretrained loads the
    newest, and its weights differ from those of version 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = read_learner_records(hf_run / "learner")
    assert [r.policy_version for r in records] == [0, 1, 2]
    dirs = [hf_checkpoint_dir(r.checkpoint) for r in records]
    for d in dirs:
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in d.iterdir()}
    first = AutoModelForCausalLM.from_pretrained(dirs[0], local_files_only=True).state_dict()
    last = AutoModelForCausalLM.from_pretrained(dirs[-1], local_files_only=True).state_dict()
    assert first.keys() == last.keys()
    assert any(not torch.equal(first[k], last[k]) for k in first)
    tok = AutoTokenizer.from_pretrained(dirs[-1], local_files_only=True)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    # The tiny model was built once into the run folder, and version 0 is it.
    initial = AutoModelForCausalLM.from_pretrained(hf_run / "hf-model" / "tiny-llama", local_files_only=True).state_dict()
    assert all(torch.equal(initial[k], first[k]) for k in first)


def test_the_worker_reloads_published_versions_and_records_them(hf_run):
    """Turns generated after the worker loaded version 1 record policy_version 1; its log says it
    loaded the HF directories; the online digests equal the offline reconstruction."""
    turns = [e.body for e in full_turns(read_log(hf_run / "rollout", 0)) if isinstance(e.body, TurnRecorded)]
    versions = {t.policy_version for t in turns}
    assert {0, 1} <= versions
    worker_log = [json.loads(line) for line in (hf_run / "logs" / "worker-w0.jsonl").read_text().splitlines()]
    loaded = [e["policy_version"] for e in worker_log if e["event"] == "worker.weights_loaded"]
    assert 1 in loaded
    check = check_run(hf_run)
    assert check.ok and check.digests_equal == check.steps == 2


def test_learner_metrics_are_in_tensorboard_event_files(hf_run):
    """The event file holds the learner log's scalars, step by step (read back with EventAccumulator)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(hf_run / TENSORBOARD_DIR))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/policy", "rollout/reward_mean", "learner/policy_version"} <= tags
    records = {r.step: r for r in read_learner_records(hf_run / "learner")}
    events = acc.Scalars("learner/policy_version")
    assert [(e.step, e.value) for e in events] == [(s, float(records[s].metrics["learner/policy_version"])) for s in (1, 2)]
    loss = {e.step: e.value for e in acc.Scalars("loss/policy")}
    assert loss[1] == pytest.approx(records[1].metrics["loss/policy"], rel=1e-6)


def test_a_missing_tensorboard_is_a_note_in_the_log_not_an_error(tmp_path, monkeypatch):
    import importlib.util

    from structlog.testing import capture_logs

    from agentlog.loop.metric_sinks import MetricSinks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with capture_logs() as logs_:
        sinks = MetricSinks(tmp_path, LoopConfig())
        sinks.log(1, {"loss/policy": 0.5})
        sinks.close()
    (note,) = [e for e in logs_ if e["event"] == "metrics.tensorboard_missing"]
    assert "pip install 'agentlog[tensorboard]'" in note["note"]
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_hf_model_config_is_checked_and_resolved(tmp_path, tiny_hf_dir):  # noqa: F811
    from agentlog.loop.policy import build_model, resolve_hf_model

    with pytest.raises(ConfigError, match="not a local Hugging Face model directory.*nothing is downloaded"):
        resolve_hf_model(LoopConfig(hf_model="Qwen/Qwen2.5-0.5B"))
    with pytest.raises(ConfigError, match=r"\[metrics\] unknown key\(s\) \['tensorbord'\]"):
        LoopConfig.from_dict({"metrics": {"tensorbord": False}})
    cfg = LoopConfig.from_dict({"hf_model": str(tiny_hf_dir), "gradient_checkpointing": True,
                                "metrics": {"tensorboard": False}})
    assert resolve_hf_model(cfg) == tiny_hf_dir.resolve()
    model = build_model(cfg, task=None)
    assert type(model).__name__ == "HFCausalLM" and model.checkpointing
    assert LoopConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # config.json round trip
