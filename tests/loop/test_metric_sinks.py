"""Metric sinks that fail to start are logged and switched off; the learner's log is closed whatever happens."""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agentlog.events import FileLog
from agentlog.loop.config import LoopConfig, MetricsConfig
from agentlog.loop.metric_sinks import TENSORBOARD_DIR, MetricSinks

from loop_helpers import small_config


def test_an_unwritable_tensorboard_dir_is_an_error_event_and_the_sink_is_off(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    (tmp_path / TENSORBOARD_DIR).write_text("a file where the folder should be")
    with capture_logs() as events:
        sinks = MetricSinks(tmp_path, LoopConfig(metrics=MetricsConfig(tensorboard=True)))
        assert sinks.tb is None
        sinks.log(1, {"loss/policy": 0.5})  # a switched-off sink is a no-op
        sinks.close()
    (failed,) = [e for e in events if e["event"] == "metrics.tensorboard_failed"]
    assert failed["log_level"] == "error" and failed["sink"] == "tensorboard" and failed["during"] == "start"
    assert "Error" in failed["error"] and failed["logdir"] == str(tmp_path / TENSORBOARD_DIR)
    assert not [e for e in events if e["event"] == "metrics.tensorboard"]


def test_a_wandb_init_that_raises_is_an_error_event_and_the_sink_is_off(tmp_path: Path, monkeypatch) -> None:
    """wandb without a login raises from ``wandb.init``; a stand-in module whose init raises the same way."""

    def init(**kw):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    with capture_logs() as events:
        sinks = MetricSinks(tmp_path, LoopConfig(metrics=MetricsConfig(tensorboard=False)))
        assert sinks.wandb is None
        sinks.log(1, {"loss/policy": 0.5})
        sinks.close()
    (failed,) = [e for e in events if e["event"] == "metrics.wandb_failed"]
    assert failed["log_level"] == "error" and failed["sink"] == "wandb" and failed["project"] == "proj"
    assert failed["error"].startswith("RuntimeError: api_key not configured")


def test_the_learner_log_is_closed_when_the_sinks_cannot_be_built(tmp_path: Path, monkeypatch) -> None:
    from agentlog.loop import trainer

    class Broken:
        def __init__(self, *a, **kw):
            raise RuntimeError("sinks broke")

    ll = trainer.LoopLearner(tmp_path, small_config(steps=1))
    monkeypatch.setattr(trainer, "MetricSinks", Broken)
    with pytest.raises(RuntimeError, match="sinks broke"):
        asyncio.run(ll.run())
    FileLog.open(tmp_path / "learner").close()  # the writer lock was released: the log was closed
