"""Metrics where users look: TensorBoard event files and Weights & Biases.

The learner log (``<run>/learner``) stays the source of truth: every step's
metrics are in its ``policy_updated`` record first. :class:`MetricSinks`
then copies them, step by step, to

* TensorBoard event files under ``<run>/tensorboard`` (``tensorboard --logdir
  <run>``), when the ``tensorboard`` package is installed (the
  ``tensorboard`` extra) and ``[metrics] tensorboard`` is on (the default);
  a missing package is one clear note in the learner's log, not an error;
* a wandb run, when ``wandb`` is installed and a project is configured
  (``[metrics] wandb_project`` or ``$WANDB_PROJECT``); its id derives from the
  run folder, so a resumed learner continues the same wandb run.

A sink that fails, when it starts (an unwritable folder, wandb without a
login) or later, is logged as an error (``metrics.<sink>_failed``, naming
the sink and the exception) and switched off; training and the learner log
go on (they never depend on a sink).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Mapping

from agentlog._logging import get_logger

from .config import LoopConfig

log = get_logger("agentlog.loop.metrics")

#: Sub-folder of the run folder holding the TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"


class MetricSinks:
    """The learner's optional metric sinks for one run folder."""

    def __init__(self, run_dir: Path, cfg: LoopConfig) -> None:
        self.run_dir = Path(run_dir)
        self.tb: Any = None
        self.wandb: Any = None
        m = cfg.metrics
        if m.tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                log.warning("metrics.tensorboard_missing",
                            note="tensorboard is not installed: no event files; pip install 'agentlog[tensorboard]' "
                                 "(the metrics are in the learner log either way)")
            else:
                logdir = self.run_dir / TENSORBOARD_DIR
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(log_dir=str(logdir))
                except Exception as exc:  # noqa: BLE001 - reported, and the sink stays off; the learner log has it all
                    _sink_failed("tensorboard", "start", exc, logdir=str(logdir))
                else:
                    log.info("metrics.tensorboard", logdir=str(logdir))
        project = m.wandb_project or os.environ.get("WANDB_PROJECT", "")
        if project:
            if importlib.util.find_spec("wandb") is None:
                log.warning("metrics.wandb_missing", project=project,
                            note="a wandb project is configured but wandb is not installed: pip install wandb")
            else:
                run_id = "agentlog-" + hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:12]
                try:
                    import wandb

                    self.wandb = wandb.init(project=project, name=self.run_dir.name, id=run_id, resume="allow",
                                            dir=str(self.run_dir), config=cfg.to_dict())
                except Exception as exc:  # noqa: BLE001 - e.g. no login: reported, and the sink stays off
                    _sink_failed("wandb", "start", exc, project=project, run_id=run_id)
                else:
                    log.info("metrics.wandb", project=project, run_id=run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Copy one step's metrics (numbers only; NaN kept, as the learner log has them)."""
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            try:
                for k, v in scalars.items():
                    self.tb.add_scalar(k, v, global_step=step)
                self.tb.flush()
            except Exception as exc:  # noqa: BLE001 - reported, and the sink switched off; the learner log has it all
                _sink_failed("tensorboard", "log", exc, step=step)
                self.tb = None
        if self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)
            except Exception as exc:  # noqa: BLE001 - as above
                _sink_failed("wandb", "log", exc, step=step)
                self.wandb = None

    def close(self) -> None:
        """Flush and close the sinks."""
        tb, self.tb = self.tb, None
        if tb is not None:
            try:
                tb.close()
            except Exception as exc:  # noqa: BLE001 - a sink never takes the learner down, not even at the end
                _sink_failed("tensorboard", "close", exc)
        wb, self.wandb = self.wandb, None
        if wb is not None:
            try:
                wb.finish()
            except Exception as exc:  # noqa: BLE001 - as above
                _sink_failed("wandb", "close", exc)


def _sink_failed(sink: str, what: str, exc: BaseException, **fields: Any) -> None:
    """Log a failing sink (it is then off): ``metrics.<sink>_failed`` naming the sink, the step and the error."""
    log.error(f"metrics.{sink}_failed", sink=sink, during=what, error=f"{type(exc).__name__}: {exc}",
              note=f"the {sink} sink is off for the rest of this run; the metrics are in the learner log", **fields)
