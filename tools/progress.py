"""Progress display: the one place that draws progress bars (tqdm, on stderr).

The library stays quiet: a long step reports its progress through a callback
(the engine's restart fold and ``verify_log`` call ``progress(done, total)``;
``run_loop`` calls a :class:`agentlog.loop.run.RunProgress`), and the
commands pass one of the bars below. A bar on a stream that is not a
terminal draws nothing (tqdm's ``disable=None``)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from agentlog.events.schema.types import PolicyUpdated
    from agentlog.loop.config import LoopConfig


def new_bar(total: int, desc: str, *, unit: str = "it", unit_scale: bool = False, file: TextIO | None = None,
            leave: bool = False, disable: bool | None = None, **options: Any) -> Any:
    """A tqdm bar on ``file`` (stderr by default); ``disable=None``: drawn only on a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=file or sys.stderr, leave=leave,
                disable=disable, **options)


class ProgressBar:
    """A ``progress(done, total)`` callback for the library that draws a bar.

    The bar is made at the first call, and only when ``total`` is at least
    ``min_total`` (a short step shows none). Use it as a context manager, or
    call :meth:`close`."""

    def __init__(self, desc: str, *, unit: str = "it", unit_scale: bool = False, min_total: int = 0) -> None:
        self.desc, self.unit, self.unit_scale, self.min_total = desc, unit, unit_scale, min_total
        self._bar: Any = None
        self._decided = False

    def __call__(self, done: int, total: int) -> None:
        if not self._decided:
            self._decided = True
            if total >= self.min_total:
                self._bar = new_bar(total, self.desc, unit=self.unit, unit_scale=self.unit_scale)
        if self._bar is not None:
            self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Close the bar (it leaves no line behind)."""
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LoopProgress:
    """The run's progress bar, in two phases. The warm-up: the learner's
    supervised steps, read from the ``warmup.progress`` events of its process
    log (``logs/learner.jsonl``). Then RL, measured against the stop rule: the
    bar is the share of the nearer hard limit used up (``steps`` versions, or
    ``time_budget_s`` seconds of RL), so it fills when one of them stops the
    run, and it is filled at once when the reward target stops it earlier;
    the postfix shows each limit and the reward window against its target.
    A :class:`agentlog.loop.run.RunProgress`: ``run_loop`` feeds it."""

    def __init__(self, cfg: LoopConfig, run_dir: Path, label: str, console: TextIO) -> None:
        from agentlog.loop.run import process_name  # torch: only where a loop runs

        self.cfg = cfg
        self.label = label
        self.learner_log = Path(run_dir) / "logs" / f"{process_name('learner')}.jsonl"
        self._offset = 0
        self._partial = b""
        self.phase = "warm-up" if cfg.warmup_steps > 0 else "start"
        self.t_rl: float | None = None
        self.version = 0
        self.rewards: list[float] = []
        self.stats = ""
        # disable=False: the caller chose the console; draw on it even when it is not a terminal.
        self.bar = new_bar(max(1, cfg.warmup_steps), f"{label} warm-up", unit="step", file=console,
                           dynamic_ncols=True, leave=True, disable=False)
        if self.phase == "start":
            self._to_rl()

    def _to_rl(self) -> None:
        self.phase = "RL"
        self.t_rl = time.monotonic()
        self.bar.reset(total=100)
        self.bar.bar_format = "{desc}{percentage:3.0f}%|{bar}| {elapsed}{postfix}"
        self.bar.set_description(f"{self.label} RL")

    def _warmup_step(self) -> int | None:
        """The newest warm-up step the learner logged since the last look (None: none)."""
        from agentlog.loop.demo.warmup import WARMUP_PROGRESS_EVENT

        try:
            with open(self.learner_log, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return None
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line: read again with the rest
        newest = None
        for line in lines:
            if WARMUP_PROGRESS_EVENT.encode() in line:
                try:
                    newest = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # not a progress record after all (the name inside another event's text)
        return newest

    def policy(self, rec: PolicyUpdated, stats: str) -> None:
        """A learner record: step 0 (the warm-up's end) starts RL; others move it."""
        if rec.step == 0:
            if self.phase != "RL":
                self._to_rl()
            return
        if self.phase != "RL":
            self._to_rl()
        self.version = rec.policy_version
        if rec.groups:
            self.rewards.append(rec.metrics.get("rollout/reward_mean", math.nan))
        self.stats = stats
        if rec.metrics.get("loop/final", 0.0) >= 1.0:
            self.phase = "done"
        self.tick()

    def fraction(self) -> float:
        """The share of the stop rule's nearer hard limit used up (1 once the run stopped)."""
        if self.phase == "done":
            return 1.0
        if self.phase != "RL":
            return 0.0
        used = self.version / self.cfg.steps
        if self.cfg.time_budget_s > 0 and self.t_rl is not None:
            used = max(used, (time.monotonic() - self.t_rl) / self.cfg.time_budget_s)
        return min(used, 0.99)  # full only once the learner says it stopped

    def limits(self) -> str:
        """``v12/400 steps, 31/150 s, reward(10) 0.41 -> 0.9``: where the run stands against each stop rule."""
        cfg = self.cfg
        parts = [f"v{self.version}/{cfg.steps} steps"]
        if cfg.time_budget_s > 0 and self.t_rl is not None:
            parts.append(f"{min(time.monotonic() - self.t_rl, cfg.time_budget_s):.0f}/{cfg.time_budget_s:.0f} s")
        if cfg.stop_reward > 0:
            window = [r for r in self.rewards[-cfg.stop_window:] if not math.isnan(r)]
            mean = f"{sum(window) / len(window):.2f}" if window else "-"
            parts.append(f"reward({cfg.stop_window}) {mean} -> {cfg.stop_reward:g}")
        return ", ".join(parts)

    def tick(self) -> None:
        """Redraw: the warm-up's newest step, or RL's share of the stop rule."""
        if self.phase == "warm-up":
            step = self._warmup_step()
            if step is not None and step != self.bar.n:
                self.bar.n = min(step, self.bar.total)
                self.bar.refresh()
            return
        n = round(100 * self.fraction())
        if n != self.bar.n or self.phase == "done":
            self.bar.n = n
        self.bar.set_postfix_str(self.limits() + (f" | {self.stats}" if self.stats else ""), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        """Close the bar (it stays on the terminal)."""
        self.bar.close()


__all__ = ["LoopProgress", "ProgressBar", "new_bar"]
