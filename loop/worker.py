"""The rollout worker: drives task sessions through the SessionEngine into the rollout log.

It is coupled to the learner only through its logs: it appends session events
to the rollout log and follows the learner log to learn of new policy versions,
whose weights it loads from the checkpoint each ``policy_updated`` names.

Batches. Batch ``b`` is ``groups_per_step`` prompts x ``group_size``
sessions (ids ``b00012-g07-s3``, group ``b00012-g07``), drawn from a random
stream seeded by ``(seed, b)``, so a restarted worker draws the same batch.
The worker starts batch ``b`` only once the learner has recorded step
``b - max_lag`` or later: that bounds how far rollouts run ahead of training.
Steps, not versions: a step whose every group was skipped (all aborted)
publishes no new version, and waiting for one would stall the run for good
(with ``max_lag = 0`` only the next batch could produce it).

Restart (:mod:`agentlog.loop.resume`). For a text task the engine adopts the
sessions a killed worker left open or running, and each is resumed from its
last durable turn (its sandbox restored from a snapshot) and played to its
end, or, when it cannot be, aborted (reason ``engine_restart``, saying why);
for the built-in token tasks ``SessionEngine.open`` aborts them all. Sessions of
the interrupted batch that were never opened are then opened and aborted with
the same reason, so every group of that batch completes and is released; the
worker carries on with the next batch.

Faults (``LoopConfig.faults``, demo-only: :mod:`agentlog.loop.demo.faults`)
are planned per batch and played at fixed points of :meth:`RolloutWorker.run_session`;
``FaultConfig.none()`` turns them off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import msgspec
import torch

from agentlog.events.errors import AgentlogError
from agentlog._logging import get_logger
from agentlog.engine import LocalSandbox, SessionEngine
from agentlog.engine.tasks import Episode, Task, TextTask, load_tasks, select_task
from agentlog.events.log.partitions import partition_name
from agentlog.events.schema.types import PolicyUpdated, SessionOpened
from agentlog.learner.learner import load_weights
from agentlog.reducers.groups import Group

from .config import LoopConfig
from .dynamic_sampling import OVERSAMPLED, ReleasedGroups, run_chain
from . import group_play
from . import resume as restart
from .naming import BASE_GROUP_RE, batch_prefix, batch_rng, group_id, member_id, redraw_id
from .demo import faults as demo_faults
from .policy import GenerationBatcher, build_model, load_tokenizer, resolve_hf_model
from .publish import PolicyFollower
from .run_folder import Run
from .teacher import TurnToScore, build_teachers, score_session
from .weight_store import version_source

log = get_logger("agentlog.loop.worker")

class WorkerLogFatal(AgentlogError, RuntimeError):
    """The worker's rollout log went fatal mid-batch (fenced by a newer incarnation, or a failed write)."""


class RolloutWorker:
    """One worker process: an engine over the rollout log, a model, a task."""

    def __init__(self, run_dir: Path, cfg: LoopConfig, *, worker_id: str = "", partition: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        if partition is None and cfg.rollout.partitioned:
            raise ValueError(f"RolloutWorker: this run has {cfg.rollout.workers} workers on the {cfg.rollout.backend} backend, "
                             "one log partition each; give the worker its partition id")
        if partition is not None and not 0 <= partition < cfg.rollout.workers:
            raise ValueError(f"RolloutWorker: partition {partition!r} out of range: this run has partitions 0..{cfg.rollout.workers - 1}")
        #: The log partition this worker writes (None: the run's single rollout log).
        self.partition = partition
        self.worker_id = worker_id or ("w0" if partition is None else partition_name(partition))
        #: The run folder and its logs (files in the run folder, or a JetStream stream: ``cfg.log``).
        self.run_folder = Run.open(self.run_dir, cfg)
        #: The rollout log this worker is the single writer of.
        self.rollout_log = self.run_folder.rollout_log(partition)
        #: The writer epoch this incarnation took on its log (0 before :meth:`run` opened it).
        self.epoch = 0
        # The user's task modules register their tasks on import, in this process too.
        load_tasks(cfg.task_modules, cfg.task_path)
        self.task: Task | TextTask = select_task(cfg.task)
        #: Text tasks: sessions are played by an agent harness through a gateway (loop/gateway_rollout.py).
        self.text = isinstance(self.task, TextTask)
        #: The tokenizer of a text task's HF policy served elsewhere (SGLang / vLLM); else the model's own.
        self.tokenizer: Any = None
        self.model: Any = None
        if self.text and cfg.inference.backend != "in-process":
            # The server holds the weights: this process needs only the tokenizer, not a copy
            # of the model (tens of GB for a 7B model in fp32).
            self.tokenizer = load_tokenizer(resolve_hf_model(cfg, self.run_dir))
        else:
            self.model = build_model(cfg, self.task, self.run_dir)
            self.model.eval()
        #: Follows the learner log (on JetStream, nothing to read until the worker's own
        #: log has created the run's stream).
        self.follower = PolicyFollower(self.run_folder.learner_tail())
        self.loaded_version = -1
        self.batcher: GenerationBatcher | None = None
        self.backend: Any = None
        self.weight_sync: Any = None
        self.rollout: Any = None
        if self.text:
            from .gateway_rollout import make_backend

            self.backend, self.weight_sync = make_backend(cfg, self.model)
        else:
            self.batcher = GenerationBatcher(self.model, self.task, seed=cfg.seed * 1_000_003 + 11, before_batch=self.maybe_reload,
                                              temperature=cfg.temperature, weight_update=cfg.rollout.weight_update)
        self.sandbox = LocalSandbox(self.run_dir / "sandbox" / self.worker_id)
        # --- on-policy distillation ---
        #: The teachers that score each finished session before its terminal event ([distill]).
        self.teachers = build_teachers(cfg.distill)
        self.counts: dict[str, int] = {}
        self.log = log.bind(component="worker", worker=self.worker_id)
        #: Batches this incarnation completed (status for a driver).
        self.batches_done = 0
        #: The groups its log released, for dynamic sampling's decisions (run() opens it).
        self.released: ReleasedGroups | None = None

    def owns(self, g: int) -> bool:
        """Whether group ``g`` of a batch is this worker's: groups are dealt
        round-robin over the partitions, so a group never spans two."""
        return self.partition is None or g % self.cfg.rollout.workers == self.partition

    # -- weights ----------------------------------------------------------

    def _newer_published(self) -> Iterator[tuple[PolicyUpdated, Path]]:
        """Published versions newer than ours, newest first, each with the file or HF directory
        to load it from (:meth:`_version_source`); a pruned version is passed over."""
        for rec in self._newer_records():
            source = self._version_source(rec)
            if source is not None:
                yield rec, source

    def _newer_records(self) -> list[PolicyUpdated]:
        """The published versions newer than ours, newest first."""
        self.follower.poll()
        return [rec for rec in reversed(self.follower.history) if rec.policy_version > self.loaded_version]

    def _version_source(self, rec: PolicyUpdated) -> Path | None:
        """The run folder's checkpoint of ``rec`` (an HF policy: the HF directory beside it, as a
        server loads), or, on a host without the run folder's checkpoints, the version fetched from
        the run's JetStream object store (loop/weight_store.py); None when neither holds it."""
        hf_policy = self.model is None or hasattr(self.model, "load_hf_weights")
        return version_source(self.run_folder, rec, hf_policy=hf_policy, worker_id=self.worker_id)

    def _loaded(self, rec: PolicyUpdated, source: Path, pause_s: float) -> None:
        """Record that ``rec``'s version is served; ``pause_s``: how long generation waited for it
        (the whole load in the built-in batcher, the wait for a token boundary in a partial mode)."""
        self.loaded_version = rec.policy_version
        pause_ms = round(pause_s * 1e3, 3)
        self.counts["weight_updates"] = self.counts.get("weight_updates", 0) + 1
        self.counts["update_pause_ms_max"] = max(self.counts.get("update_pause_ms_max", 0), int(pause_ms + 0.999))
        self.log.info("worker.weights_loaded", policy_version=rec.policy_version, source=str(source), pause_ms=pause_ms,
                      mode=self.cfg.rollout.weight_update)

    def maybe_reload(self) -> None:
        """Load the newest published weights if they are newer than ours."""
        for rec, source in self._newer_published():
            t0 = time.perf_counter()
            if source.is_dir():
                self.model.load_hf_weights(source)
            else:
                load_weights(self.model, str(source))
            self._loaded(rec, source, time.perf_counter() - t0)
            self.batcher.version = rec.policy_version
            return

    def chat_template(self) -> Any:
        """Text tasks: the template that renders messages into the policy's token ids: the HF
        model's own chat template (its tokenizer), or None for the built-in GPT's byte template."""
        tokenizer = self.tokenizer or getattr(self.model, "tokenizer", None)
        if tokenizer is None:
            if hasattr(self.model, "load_hf_weights"):
                raise ValueError(f"hf_model {self.cfg.hf_model!r}: the model directory has no tokenizer; a text task needs its chat template")
            return None
        from agentlog.gateway import HFChatTemplate

        return HFChatTemplate(tokenizer)

    async def reload_text(self) -> None:
        """Text tasks: bring the gateway's backend to the newest published
        version, between batches. In-process, the weights are swapped under
        the backend's model lock together with its version, so no turn
        generated after the swap records the old version (and none before
        it the new one); an SGLang / vLLM server is reloaded through its
        weight-sync client behind a ReloadGate, with the same guarantee; a
        fleet (``[inference] servers``) loads it on every server at once, and a
        server whose update fails leaves routing (gateway/fleet.py)."""
        for rec in self._newer_records():
            # A fetch from the object store can take minutes: off the event loop, where the
            # gateway, its agents and the fleet's prober run.
            source = await asyncio.to_thread(self._version_source, rec)
            if source is None:
                continue
            if self.cfg.inference.backend != "in-process" and not source.is_dir():
                continue  # a server loads HF directories only; this version has none left
            if self.weight_sync is not None:
                t0 = time.perf_counter()
                await self.weight_sync.reload(str(source), rec.policy_version)
                pause_s = time.perf_counter() - t0
            else:
                await self.backend.reload_weights(source, rec.policy_version)
                pause_s = self.backend.update_pauses_s[-1]
            self._loaded(rec, source, pause_s)
            return

    async def following_weights(self, work: Any) -> Any:
        """Run ``work`` (a batch); text tasks in a partial ``weight_update``
        mode meanwhile load each newly published version as soon as it appears
        (every ``WEIGHTS_POLL_S``): the in-process backend applies it at the
        next token of the generations in flight, an SGLang server's gate
        aborts them and resubmits their partial outputs. The worker's own
        schedule, no drain. A failed load fails the batch, loudly.
        (The built-in tasks' batcher checks at its token boundaries itself.)"""
        if not (self.text and self.cfg.rollout.weight_update != "drain"):
            return await work
        stop = asyncio.Event()

        async def follow() -> None:
            while not stop.is_set():
                await self.reload_text()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), WEIGHTS_POLL_S)

        batch, follower = asyncio.ensure_future(work), asyncio.ensure_future(follow())
        try:
            await asyncio.wait({batch, follower}, return_when=asyncio.FIRST_COMPLETED)
            if follower.done():
                follower.result()  # raises what stopped it
            return batch.result()
        finally:
            if not batch.done():  # the follower failed, or this call was cancelled
                batch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await batch
            # A reload under way when the batch ended is let finish, not cancelled: cut part
            # way it would leave the server paused and its weights unknown (a fatal gate).
            stop.set()
            if not follower.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await follower

    async def wait_for_step(self, step: int) -> bool:
        """Wait until the learner recorded ``step`` (False if the run ended first)."""
        while True:
            self.follower.poll()
            if self.follower.final_version is not None:
                return False
            if self.follower.step >= step:
                return True
            await asyncio.sleep(0.01)

    # -- batches ------------------------------------------------------------

    def next_batch(self, engine_log: Any) -> int:
        """The first batch this worker has not started (0 on a fresh log)."""
        last = -1
        for env in engine_log.read(0):
            if isinstance(env.body, SessionOpened):
                m = BASE_GROUP_RE.match(env.body.group_id)
                if m:
                    last = max(last, int(m.group(1)))
        return last + 1

    async def watch_log(self, rollout: Any, work: Any, poll_s: float = 0.1) -> Any:
        """Await ``work`` (a batch), but stop it and raise :class:`WorkerLogFatal` once the
        rollout log has gone fatal (a newer incarnation fenced it, or a write failed): no
        record can land any more, and a session waiting for a background abort that can no
        longer be written would otherwise wait forever."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                # Checked after the batch ends too: when every append failed at once
                # (fenced), the batch can end "normally" with its sessions' errors
                # collected, and the next wait could see the final version and exit 0.
                reason = rollout.fatal_reason
                if reason:
                    raise WorkerLogFatal(f"rollout worker {self.worker_id}: its log went fatal, this incarnation stops: {reason}")
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def run_batch(self, engine: SessionEngine, batch: int) -> None:
        """Run every chain of ``batch`` this worker owns concurrently (one group each, or with
        ``[groups] dynamic_sampling`` up to ``1 + max_redraws``), until each session is terminal.
        With ``oversample``, the batch starts more chains than a step needs; once this
        worker's share of ``groups_per_step`` chains has ended, the others are cancelled
        (their live sessions dropped, reason ``oversampled``)."""
        cfg = self.cfg
        started = cfg.groups.groups_started(cfg.groups_per_step)
        members = self.draw(batch)
        faults = {} if self.text else demo_faults.plan_faults(cfg.faults, batch_rng(cfg.seed, batch, "faults"), started, cfg.group_size)
        share = sum(1 for g in range(cfg.groups_per_step) if self.owns(g))
        if share == 0:
            return  # this worker owns none of the groups a step counts, so none of their over-sampled extras either
        if self.released is not None:
            self.released.retain(batch_prefix(batch))  # forget groups of earlier batches never taken
        playing: dict[int, str] = {}  # chain -> the group it plays now
        ended: list[int] = []
        cancelled: set[int] = set()

        async def cancel_leftovers() -> None:
            leftovers = [g for g in playing if g not in ended]
            cancelled.update(leftovers)  # first: no leftover opens a member, a refill or a redraw from here on
            live = [h for g in leftovers for h in engine.live_members(playing[g])]
            await asyncio.gather(*(h.cancel(OVERSAMPLED) for h in live))
            self._count("oversampled", len(leftovers))

        async def chain(g: int) -> None:
            def is_cancelled() -> bool:
                return g in cancelled

            async def play_only(k: int) -> str:
                gid = playing[g] = redraw_id(group_id(batch, g), k)
                group_faults = {i: f for (fg, i), f in faults.items() if fg == g} if k == 0 else {}
                await self.play_group(engine, batch, gid, members(g, k), group_faults, is_cancelled)
                return gid

            async def play(k: int) -> Group:  # and the group it released, for dynamic sampling's rule
                return await self.released_group(engine, await play_only(k))

            if cfg.groups.dynamic_sampling:
                played = await run_chain(play, cfg.groups, stop=is_cancelled)
                if len(played) > 1:
                    self._count("redraws", len(played) - 1)
            else:
                await play_only(0)
            if g not in cancelled:
                ended.append(g)
                if started > cfg.groups_per_step and len(ended) == share:
                    await cancel_leftovers()

        await asyncio.gather(*(chain(g) for g in range(started) if self.owns(g)))

    def draw(self, batch: int) -> Callable[[int, int], list[Any]]:
        """``members(g, k)``: the episodes of redraw ``k`` of group ``g`` of ``batch``, one per
        member, drawn as every partition (and a restarted worker) draws them."""
        cfg = self.cfg
        rng = batch_rng(cfg.seed, batch, "episodes")
        started = cfg.groups.groups_started(cfg.groups_per_step)
        base: list[list[Any]]
        if self.text:
            from .gateway_rollout import draw_members

            base = draw_members(self.task, rng, started, cfg.group_size)
        else:  # drawn for every group: each partition draws the same batch
            episodes = [self.task.new_episode(rng) for _ in range(started)]
            base = [[self.task.group_member(ep, rng) for _ in range(cfg.group_size)] for ep in episodes]

        def members(g: int, k: int) -> list[Any]:
            if k == 0:
                return base[g]
            redraw = batch_rng(cfg.seed, batch, f"redraw-g{g}-r{k}")  # a new prompt per redraw, reproducible
            if self.text:
                return draw_members(self.task, redraw, 1, cfg.group_size)[0]
            ep = self.task.new_episode(redraw)
            return [self.task.group_member(ep, redraw) for _ in range(cfg.group_size)]

        return members

    async def released_group(self, engine: SessionEngine, gid: str) -> Group:
        """Group ``gid`` of this worker's log, released (every member and replacement ended)."""
        assert self.released is not None, "run() folds the worker's log before a batch"
        group = await self.released.take(gid)
        if group is None:
            live = [h.session_id for h in engine.live_members(gid)]
            raise RuntimeError(f"rollout worker {self.worker_id}: group {gid} is not released after all its sessions "
                               f"ended; live members {live or 'none'}, replacements owed for {engine.owed_replacements(gid) or 'none'}")
        return group

    async def play_group(self, engine: SessionEngine, batch: int, gid: str, members: list[Any], faults: dict[int, str],
                         cancelled: Any = lambda: False) -> None:
        """Play every member of group ``gid`` concurrently (and the replacements it is owed),
        until each is terminal. An injected fault, a timeout or a drop ends its session; any
        other failure is raised."""
        if self.text:
            def play(i: int, slot: int, *, fault: str | None = None, replaces: str = "") -> Any:
                return self.rollout.run_session(
                    self.task, members[slot], session_id=member_id(gid, i),
                    group_id=gid, group_size=self.cfg.group_size, sample_index=i, policy_version=max(self.loaded_version, 0),
                    metadata={"batch": batch, "worker": self.worker_id}, replaces=replaces)
        else:
            def play(i: int, slot: int, *, fault: str | None = None, replaces: str = "") -> Any:
                return self.run_session(engine, batch, gid, i, member=members[slot], fault=fault, replaces=replaces)
        async def unplayed(i: int, *, replaces: str = "") -> None:
            # A cancelled chain's member that never opened: opened and dropped, so its group releases.
            h = await engine.open_session(member_id(gid, i), group_id=gid, group_size=self.cfg.group_size, sample_index=i,
                                          agent=self.task.name, metadata={"batch": batch, "worker": self.worker_id},
                                          replaces=replaces)
            await h.drop(OVERSAMPLED)

        await group_play.play_group(engine, gid, len(members), play, faults, self._refilled, cancelled, unplayed)

    def _refilled(self, replaced: str, replacement: str, slot: int) -> None:
        self._count("refills")
        self.log.info("worker.refill", replaces=replaced, session_id=replacement, slot=slot)

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    async def run_session(self, engine: SessionEngine, batch: int, gid: str, i: int, *, member: Episode, fault: str | None = None,
                          replaces: str = "") -> None:
        """One agent session: turn, tool, turn, ..., verifier reward, finish. ``replaces``: it
        replaces that aborted member of its group (per-sample refill)."""
        task, ep = self.task, member
        sid = member_id(gid, i)
        budget = self.cfg.faults.timeout_budget_s if fault == "timeout" else None
        registered = False
        try:
            async with engine.session(
                sid, group_id=gid, group_size=self.cfg.group_size, sample_index=i,
                prompt=ep.messages, prompt_ids=list(ep.prompt_ids), label=ep.label, agent=task.name,
                policy_version=max(self.loaded_version, 0), metadata={"batch": batch, "worker": self.worker_id},
                budget_s=budget, replaces=replaces,
            ) as h:
                await h.start(harness=task.name, sandbox=self.sandbox.name)
                self.batcher.register()
                registered = True
                messages = list(ep.messages)
                context = list(ep.prompt_ids)
                outputs: list[list[int]] = []
                to_score: list[TurnToScore] = []
                for turn in range(task.max_turns):
                    if turn == demo_faults.MID_SESSION_TURN and fault in demo_faults.MID_SESSION_FAULTS:
                        self.batcher.unregister()
                        registered = False
                        await demo_faults.play_mid_session_fault(fault, sid, turn)
                    gen = await self.batcher.generate(context)
                    out = [int(t) for t in gen.tokens]
                    response = {"role": "assistant", "content": task.decode(out)}
                    sampling: dict[str, Any] = {"temperature": self.batcher.temperature}
                    if gen.version_spans is not msgspec.UNSET:
                        sampling["weight_update"] = self.batcher.weight_update  # how the update met this turn
                    await h.record_turn(
                        messages=messages, prompt_ids=context, output_ids=gen.tokens, output_log_probs=gen.log_probs,
                        finish_reason=gen.finish_reason, response_message=response, policy_version=gen.policy_version,
                        version_spans=gen.version_spans, generate_s=gen.generate_s, sampling=sampling,
                    )
                    outputs.append(out)
                    to_score.append(TurnToScore(turn, context, out, self.batcher.temperature))
                    tool = task.tool_step(ep, turn, out)
                    if tool is None:
                        break
                    if fault == "empty_marker":
                        res = await demo_faults.run_dying_tool(h, self.sandbox)
                        if res.exit_code is None:
                            self.batcher.unregister()
                            registered = False
                            await h.abort(demo_faults.EMPTY_MARKER_REASON, error=demo_faults.empty_marker_error(res))
                            return
                    else:
                        await h.record_command(tool.command, tool.exit_code, False, 0.0, tool.text)
                    messages = messages + [response, {"role": "tool", "content": tool.text}]
                    context = context + out + list(tool.ids)
                self.batcher.unregister()
                registered = False
                try:
                    verdict = task.verify(ep, outputs)
                except Exception as exc:  # noqa: BLE001 - the task's crash is the session's outcome, named as on the text path
                    await h.abort(f"verifier_failed:{type(exc).__name__}", error=str(exc), traceback=traceback.format_exc())
                    return
                if self.teachers:
                    # Before the terminal event: the learner releases the group only with its scores in the log.
                    for what, n in (await score_session(h, to_score, self.teachers, top_k=self.cfg.distill.topk,
                                                        timeout_s=self.cfg.distill.timeout_s)).items():
                        self.counts[f"teacher_{what}"] = self.counts.get(f"teacher_{what}", 0) + n
                await h.finish(reward=verdict.reward, metadata={"success": verdict.success, **verdict.detail})
            if fault == "straggler":
                await demo_faults.straggle(h, context, self.task.eos_id)
                self._count("straggler_refused")
        finally:
            if registered:
                self.batcher.unregister()

    # -- main loop ------------------------------------------------------------

    async def run(self, *, max_batches: int | None = None) -> dict[str, int]:
        """Run batches until the learner publishes its final version."""
        cfg = self.cfg
        done = 0
        # Every resource is closed however start-up or a batch ends, in reverse order of
        # opening (gateway, batcher, engine, weight sync, backend, log), each close even
        # if an earlier one raised.
        async with contextlib.AsyncExitStack() as stack:
            # A partition is opened fenced: this incarnation takes a new writer epoch, and a
            # stale one (a worker presumed dead on a lost node) can append nothing more.
            stack.callback(self.run_folder.close)
            rollout = self.run_folder.open_rollout(self.partition, fence=self.partition is not None)
            stack.callback(rollout.close)
            self.epoch = getattr(rollout, "epoch", 0)
            if self.backend is not None:
                stack.push_async_callback(self.backend.close)
            if self.weight_sync is not None:
                stack.push_async_callback(self.weight_sync.close)
            # The run's abort classes: an abort of a "refill" class owes its group a replacement.
            # Text tasks adopt the sessions a killed incarnation left running, to resume them (loop/resume.py).
            engine = await SessionEngine.open(rollout, drain_s=0.2, groups=cfg.reduce_config(), adopt_orphans=self.text)
            stack.push_async_callback(engine.close)
            if cfg.groups.dynamic_sampling:
                self.released = ReleasedGroups(rollout, cfg.reduce_config())
            if self.batcher is not None:
                stack.push_async_callback(self.batcher.close)
            for teacher in self.teachers:
                stack.push_async_callback(teacher.close)
            if self.text:
                from .gateway_rollout import GatewayRollout

                if cfg.faults.any_enabled():
                    self.log.warning("worker.faults_ignored", reason="fault injection is demo-only; text tasks run without it")
                self.rollout = GatewayRollout(engine, self.backend, agent=cfg.agent, sandbox_root=self.run_dir / "sandbox" / self.worker_id,
                                              temperature=cfg.temperature, template=self.chat_template(),
                                              teachers=self.teachers, distill=cfg.distill, route_by=cfg.inference.route_by,
                                              snapshots=restart.snapshots_of(self))
                self.rollout.preflight()
                stack.push_async_callback(self.rollout.close)
                url = await self.rollout.start()
                self.log.info("worker.gateway_started", url=url, harness=cfg.agent.harness, backend=cfg.inference.backend)
            batch = self.next_batch(rollout)
            if engine.orphans:
                # A resumed session's next turns come from the newest published policy, as the next batch's would,
                # never from the weights this process started with (the backend's version 0).
                await self.reload_text()
            self.counts.update(await self.watch_log(rollout, restart.resume_orphans(self, engine)))
            await restart.complete_interrupted(self, engine, batch - 1)
            self.log.info("worker.started", first_batch=batch, restart_aborted=engine.stats.get("restart_aborted", 0))
            while max_batches is None or done < max_batches:
                if not await self.wait_for_step(max(0, batch - cfg.max_lag)):
                    break
                if self.text:
                    await self.reload_text()
                else:
                    self.maybe_reload()
                t0 = time.perf_counter()
                await self.watch_log(rollout, self.following_weights(self.run_batch(engine, batch)))
                self.log.info("worker.batch_done", batch=batch, policy_version=self.loaded_version,
                              seconds=round(time.perf_counter() - t0, 3))
                batch += 1
                done += 1
                self.batches_done = done
        counts = dict(engine.stats)
        counts.update(self.counts)
        if self.rollout is not None:
            counts.update({f"rollout_{k}": v for k, v in self.rollout.counts.items()})
            if self.rollout.snapshots is not None:  # snapshots taken, failed, and the store's garbage collected
                counts.update({f"rollout_{k}": v for k, v in self.rollout.snapshots.counts.items()})
        self.log.info("worker.stopped", batches=done, **{k: v for k, v in counts.items() if isinstance(v, int)})
        return counts


#: How often a worker in a partial ``weight_update`` mode looks for a newly published version during a batch.
WEIGHTS_POLL_S = 0.05


def main(argv: list[str] | None = None) -> int:
    """``python -m agentlog.loop.worker RUN_DIR``: run a rollout worker for a run folder."""
    p = argparse.ArgumentParser(prog="agentlog-worker", description=main.__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--worker-id", default="", help="name in logs and the sandbox folder (default: w0, or the partition's pNNNN)")
    p.add_argument("--partition", type=int, default=None, help="the log partition this worker writes (runs with several workers)")
    p.add_argument("--max-batches", type=int, default=None)
    args = p.parse_args(argv)
    cfg = Run.load_config(args.run_dir)
    from .runlog import configure_process_logging

    worker_id = args.worker_id or ("w0" if args.partition is None else partition_name(args.partition))
    configure_process_logging(args.run_dir, f"worker-{worker_id}")
    torch.set_num_threads(cfg.torch_threads)
    worker = RolloutWorker(args.run_dir, cfg, worker_id=worker_id, partition=args.partition)
    asyncio.run(worker.run(max_batches=args.max_batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
