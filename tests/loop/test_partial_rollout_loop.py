"""Partial rollouts in the loop: with ``[rollout] weight_update`` continue or
resubmit, the worker loads each new version while its batch generates (no
drain), turns record the versions that made their tokens, and the offline
reconstruction still equals every online digest."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agentlog.engine.tasks import TextEpisode, TextTask, register_task
from agentlog.engine.tasks.text import verdict_of_command
from agentlog.events import read_log
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import TurnRecorded
from agentlog.loop import LoopConfig
from agentlog.loop.check import check_run
from agentlog.loop.config_sections import FaultConfig
from agentlog.loop.trainer import LoopLearner
from agentlog.loop.worker import RolloutWorker


class LongEchoTask(TextTask):
    """Write the asked word into answer.txt. Turns of up to 400 tokens: a batch generates for longer
    than the learner trains a step, so each new version lands mid-generation."""

    name = "long-echo-test"
    max_turns = 2
    max_new_tokens = 400
    session_budget_s = 60.0
    command_budget_s = 10.0

    def new_episode(self, rng: random.Random) -> TextEpisode:
        word = rng.choice(["alpha", "beta", "gamma"])
        return TextEpisode(messages=[{"role": "user", "content": f"Write {word} into answer.txt"}], label=word, state={"word": word})

    async def setup(self, episode: TextEpisode, sandbox: Any) -> None:
        (Path(sandbox.workdir) / "README").write_text("put the word in answer.txt\n")

    async def verify(self, episode: TextEpisode, sandbox: Any):
        return verdict_of_command(await sandbox.run_command(f"grep -qx {episode.state['word']} answer.txt", self.command_budget_s))


register_task("long-echo-test")(LongEchoTask)


def _train(run_dir: Path, mode: str) -> LoopConfig:
    """Train a run, the learner on a thread and event loop of its own, as it runs in a process of its
    own under ``agentlog train``. On the worker's loop its synchronous step would stop the worker's
    sessions until it published: every new version would come before the next batch's first request,
    and a turn would be interrupted only when the weight load lost a race of milliseconds against that
    request (on a loaded machine it never did). On its own thread, the step (of a model large enough
    to take longer than a batch takes to start) overlaps the next batch's generation."""
    cfg = LoopConfig(task="long-echo-test", steps=5, groups_per_step=2, group_size=2, warmup_steps=0, faults=FaultConfig.none(),
                     stop_reward=0, time_budget_s=0, max_lag=2, d_model=64, n_layer=2, n_head=2,
                     agent={"harness": "python-agent", "budget_s": 60}, inference={"context_length": 2048},
                     rollout={"weight_update": mode})

    async def train() -> None:
        await asyncio.wait_for(asyncio.gather(_learner_on_its_own_thread(run_dir, cfg), RolloutWorker(run_dir, cfg).run()), 240)

    asyncio.run(train())
    return cfg


async def _learner_on_its_own_thread(run_dir: Path, cfg: LoopConfig) -> None:
    """Run the learner on a thread and event loop of its own. Cancelled (the worker failed, or the
    time ran out), it cancels the learner there and waits for its thread: a learner left waiting for
    batches that will never come would hold this process's exit forever."""
    started: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        async def learn() -> None:
            started.set_result((asyncio.get_running_loop(), asyncio.current_task()))
            await LoopLearner(run_dir, cfg).run()

        asyncio.run(learn())

    thread = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        await asyncio.shield(thread)
    except asyncio.CancelledError:
        loop, task = await asyncio.wrap_future(started)
        with contextlib.suppress(RuntimeError):  # its loop already closed: the learner had finished
            loop.call_soon_threadsafe(task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await thread
        raise


@pytest.mark.parametrize("mode", ["continue", "resubmit"])
def test_a_run_with_partial_rollouts_reconstructs_equal(tmp_path: Path, mode: str) -> None:
    """Every run's offline check is EQUAL on every step, and turns were
    interrupted by weight updates. The learner publishes on its own clock, so
    a run could still see every publish fall between generations (its turns
    all ended early on a sampled end token): up to three runs, until one has."""
    interrupted = []
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        cfg = _train(run_dir, mode)
        check = check_run(run_dir, cfg)
        assert check.ok, (check.mismatches, check.duplicates, check.missing, check.unknown)
        assert check.digests_equal == check.steps == cfg.steps
        turns = [e.body for e in full_turns(list(read_log(run_dir / "rollout", 0))) if isinstance(e.body, TurnRecorded)]
        interrupted = [t for t in turns if t.version_spans is not msgspec.UNSET]
        if interrupted:
            break
    assert interrupted, "no turn of three runs was interrupted by a weight update"
    assert all(t.sampling["weight_update"] == mode for t in interrupted)
