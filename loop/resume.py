"""Resuming the sessions a killed rollout worker left running, instead of aborting them.

While a text task's session runs (``[resume] enabled``, a resumable harness),
:class:`SessionSnapshots` saves its sandbox in the worker's snapshot store
(:class:`~agentlog.engine.snapshots.SnapshotStore`, ``<run>/snapshots/<worker>``)
each time a turn's request reaches the gateway, before the turn is generated,
and records ``sandbox_snapshotted`` once the snapshot is durable. The
snapshot's event always precedes its turn's, so an acknowledged turn always
has the snapshot it was generated on.

When the worker restarts, its engine adopts the orphans
(``SessionEngine.open(adopt_orphans=True)``) and :func:`resume_orphans`
decides each one: it resumes the session when

* the harness that played it is resumable (:func:`engine.harness.is_resumable`),
* the log names the snapshot taken before its last durable turn
  (:meth:`reducers.resume.ResumePoint.snapshot_to_resume`),
* it was resumed fewer than ``[resume] max_resumes`` times,
* its wall-clock budget is not spent (the time before the crash counts),
* its episode can be drawn again as its batch drew it (the verifier needs
  the episode's hidden state) and its prompt is the recorded one,
* and the snapshot restores, every file checked against its hash, within
  ``[resume] restore_timeout_s``.

Otherwise the session is aborted ``engine_restart`` with the reason in its
error. A resumed session continues in :meth:`GatewayRollout.play`: the harness's
``resume`` gets the conversation rebuilt from the log, runs the last durable
turn's tool calls again in the restored sandbox, and asks for the next turn.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from agentlog._logging import get_logger
from agentlog.engine import LocalSandbox, harness
from agentlog.engine.core import SessionEngine, SessionTimeout
from agentlog.engine.snapshots import SnapshotError, SnapshotStore
from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import SessionOpened
from agentlog.reducers.resume import ResumePoint

from . import group_play
from .dynamic_sampling import oversampled, wants_redraw
from .naming import batch_prefix, group_id, redraw_id

log = get_logger("agentlog.loop.resume")

_GROUP_RE = re.compile(r"^b(\d+)-g(\d+)(?:-r(\d+))?$")
_MEMBER_RE = re.compile(r"-s(\d+)$")

#: How often (session ends) the store's garbage is collected.
COLLECT_EVERY = 16


class SessionSnapshots:
    """One worker's snapshot store and what the rollout does with it (see the module docstring)."""

    def __init__(self, root: Path, *, keep_aborted_s: float) -> None:
        self.store = SnapshotStore(Path(root), keep_aborted_s=keep_aborted_s)
        self.counts: dict[str, int] = {"snapshots": 0, "snapshot_failures": 0, "collected_objects": 0}
        self._ended = 0

    def before_turn(self, h: Any, sandbox: Any) -> Callable[[int], Awaitable[None]]:
        """The gateway's ``before_turn`` hook for session ``h``: snapshot ``sandbox`` as the
        turn's request finds it, then record ``sandbox_snapshotted`` (the snapshot is durable
        first). A snapshot that fails is logged as ``sandbox.snapshot_failed`` (an error: the
        turn it precedes cannot be resumed from) and counted; the turn goes on without it."""

        async def snapshot(turn_index: int) -> None:
            if h.state is not State.RUNNING:
                return
            t0 = time.perf_counter()
            try:
                info = await sandbox.snapshot(self.store, h.session_id, turn_index)
            except (SnapshotError, OSError) as exc:
                self.counts["snapshot_failures"] += 1
                h.log.error("sandbox.snapshot_failed", turn_index=turn_index, error=f"{type(exc).__name__}: {exc}",
                            effect="a crash before the next snapshot aborts the session instead of resuming it")
                return
            await h.record_snapshot(turn_index, info.digest, files=info.files, bytes=info.bytes, new_bytes=info.new_bytes,
                                    seconds=round(time.perf_counter() - t0, 6))
            self.counts["snapshots"] += 1

        return snapshot

    async def session_ended(self, session_id: str, state: State | None) -> None:
        """Release the session's snapshots (an aborted session keeps its last one for
        ``keep_aborted_s``); every :data:`COLLECT_EVERY` ends, collect the store's garbage."""
        await asyncio.to_thread(self.store.session_ended, session_id, keep=state is State.ABORTED)
        self._ended += 1
        if self._ended % COLLECT_EVERY == 0:
            report = await asyncio.to_thread(self.store.collect)
            self.counts["collected_objects"] += report.objects


def snapshots_of(worker: Any) -> SessionSnapshots | None:
    """The worker's snapshot store (``<run>/snapshots/<worker id>``), None with ``[resume] enabled = false``."""
    cfg = worker.cfg.resume
    if not cfg.enabled:
        return None
    return SessionSnapshots(worker.run_dir / "snapshots" / worker.worker_id, keep_aborted_s=cfg.keep_aborted_s)


async def resume_orphans(worker: Any, engine: SessionEngine) -> dict[str, int]:
    """A restarted worker's orphans (:attr:`SessionEngine.orphans`), each resumed and played
    to its end or aborted (see the module docstring); returns the counts."""
    cfg = worker.cfg.resume
    return await decide_orphans(engine, worker.rollout, lambda point: episode_of(worker, point),
                                max_resumes=cfg.max_resumes, restore_timeout_s=cfg.restore_timeout_s, worker=worker.worker_id)


def episode_of(worker: Any, point: ResumePoint) -> Any:
    """``(task, episode)`` that session ``point`` played, drawn again as its batch drew it
    (loop/naming.py: ``b<batch>-g<g>[-r<k>]``, member ``i`` or a replacement of member ``i``),
    or a str saying why it cannot be drawn."""
    m = _GROUP_RE.match(point.group_id)
    if m is None:
        return f"group id {point.group_id!r} is not one of this loop's (expected b<batch>-g<group>[-r<redraw>])"
    batch, g, k = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    slot = point.sample_index
    if slot >= point.group_size:  # a replacement plays the prompt of the member it replaces
        replaced = _MEMBER_RE.match(point.replaces)
        slot = int(replaced.group(1)) if replaced else slot
        if slot >= point.group_size:
            return f"a replacement of {point.replaces!r}, itself a replacement: its episode is not drawn again"
    members = worker.draw(batch)(g, k)
    return worker.task, members[slot]


async def complete_interrupted(worker: Any, engine: SessionEngine, batch: int) -> None:
    """Open and abort (``engine_restart``) the sessions of ``batch`` that a
    killed worker never opened, so all its groups complete."""
    if batch < 0:
        return
    cfg = worker.cfg
    opened: set[str] = set()
    for env in engine.log.read(0):
        if isinstance(env.body, SessionOpened) and env.body.group_id.startswith(batch_prefix(batch)):
            opened.add(env.session_id)
    n = 0
    meta = {"batch": batch, "worker": worker.worker_id}
    for g in range(cfg.groups.groups_started(cfg.groups_per_step)):
        if not worker.owns(g):
            continue
        k = 0
        while True:  # each group of the chain: the base, then each redraw its predecessor wanted
            gid = redraw_id(group_id(batch, g), k)
            n += await group_play.end_unplayed(engine, gid, cfg.group_size, opened, agent=worker.task.name, metadata=meta)
            if not cfg.groups.dynamic_sampling:
                break
            group = await worker.released_group(engine, gid)
            # A redraw follows only what wanted one: never an over-sampled leftover, never past max_redraws.
            if oversampled(group) or not wants_redraw(group, cfg.groups):
                break
            k += 1
    if n:
        worker.log.warning("worker.interrupted_batch_completed", batch=batch, aborted_unopened=n)


async def decide_orphans(engine: SessionEngine, rollout: Any, episode_of: Callable[[ResumePoint], Any], *,
                         max_resumes: int, restore_timeout_s: float, worker: str) -> dict[str, int]:
    """Resume or abort every orphan ``engine`` adopted (see the module docstring), playing the
    resumed ones to their end concurrently; returns counts (``resumed``, ``resume_refused``).
    ``episode_of(point)``: ``(task, episode)`` for the session, or a str saying why it cannot be drawn."""
    counts = {"resumed": 0, "resume_refused": 0}

    async def one(point: ResumePoint) -> None:
        why, task_episode = _why_not(point, rollout, episode_of, max_resumes)
        if why is not None:
            counts["resume_refused"] += 1
            log.warning("session.not_resumed", session_id=point.session_id, why=why)
            await engine.abort_orphan(point.session_id, f"not resumed: {why}")
            return
        task, episode = task_episode
        counts["resumed"] += await _resume(engine, rollout, point, task, episode, restore_timeout_s, worker)

    await asyncio.gather(*(one(p) for p in list(engine.orphans.values())))
    if counts["resumed"] or counts["resume_refused"]:
        log.info("worker.orphans_decided", worker=worker, **counts)
    return counts


def _why_not(point: ResumePoint, rollout: Any, episode_of: Callable[[ResumePoint], Any],
             max_resumes: int) -> tuple[str | None, Any]:
    """Why ``point`` cannot resume (one line) and None, or None and its ``(task, episode)``."""
    if rollout is None or rollout.snapshots is None:
        return "this worker keeps no sandbox snapshots ([resume] enabled = false, or not a text task)", None
    name = point.harness or rollout.agent.harness
    try:
        resumable = harness.is_resumable(name)
    except harness.UnknownHarness as exc:
        return f"its harness cannot be found here: {exc}", None
    if not resumable:
        return f"harness {name!r} is not resumable (engine.harness: register it with resumable=True)", None
    why = point.why_not_resumable()
    if why is not None:
        return why, None
    if point.resumes >= max_resumes:
        return f"resumed {point.resumes} times already ([resume] max_resumes = {max_resumes})", None
    drawn = episode_of(point)
    if isinstance(drawn, str):
        return drawn, None
    task, episode = drawn
    if [dict(m) for m in episode.messages] != point.prompt:
        return "its episode, drawn again, has another prompt than the one recorded (the task or its seed changed)", None
    spent = max(0.0, (point.last_ns - point.opened_ns) / 1e9)
    if spent >= rollout.budget_of(task):
        return f"its wall-clock budget of {rollout.budget_of(task):.1f} s was spent before the crash ({spent:.1f} s)", None
    return None, (task, episode)


async def _resume(engine: SessionEngine, rollout: Any, point: ResumePoint, task: Any, episode: Any,
                  restore_timeout_s: float, worker: str) -> int:
    """Restore the sandbox and play the session on; 1 when it was resumed, 0 when it was aborted instead."""
    sid = point.session_id
    digest = point.snapshot_to_resume()
    assert digest is not None, "checked by _why_not"
    sandbox = LocalSandbox(rollout.sandbox_root / sid)
    try:
        try:
            await asyncio.wait_for(sandbox.restore(rollout.snapshots.store, digest), restore_timeout_s)
        except (SnapshotError, OSError, asyncio.TimeoutError) as exc:
            what = f"restoring snapshot {digest[:16]} took over {restore_timeout_s} s" if isinstance(exc, asyncio.TimeoutError) \
                else f"{type(exc).__name__}: {exc}"
            log.warning("session.not_resumed", session_id=sid, why=what)
            await engine.abort_orphan(sid, f"not resumed: the sandbox could not be restored: {what}")
            return 0
        budget = rollout.budget_of(task) - max(0.0, (point.last_ns - point.opened_ns) / 1e9)
        try:
            async with engine.resumed(sid, digest, worker=worker, budget_s=budget) as h:
                # No turn was durable: the agent starts again from the prompt, on the sandbox as set up.
                conversation = point.conversation() if point.durable_turns else None
                await rollout.play(h, task, episode, sandbox, budget, resumed_from=conversation)
        except SessionTimeout:
            pass  # aborted wall_clock_timeout by the engine: it was resumed, and ended as any session may
        return 1
    finally:
        await rollout.release_session(sid, sandbox)


__all__ = ["COLLECT_EVERY", "SessionSnapshots", "complete_interrupted", "decide_orphans", "episode_of", "resume_orphans",
           "snapshots_of"]
