"""Rollouts through the gateway: a text task's session, played by an agent harness.

For a :class:`~agentlog.engine.tasks.TextTask` the worker does not sample
tokens itself. Each rollout session

1. opens in the engine (the task's messages as its prompt);
2. has its sandbox set up by the task, then starts the agent harness
   (``[agent] harness``: ``python-agent``, ``claude-code`` or ``codex``)
   with the session's key, pointed at a gateway on loopback
   (:class:`~agentlog.gateway.Gateway` over the same engine);
3. lets every model call arrive at the gateway as a recorded turn, generated
   by the gateway's backend (the loop's policy in-process, or an SGLang /
   vLLM server);
4. runs the task's verifier in the sandbox (its commands are recorded as
   ``command_ran`` too);
5. finishes with the verifier's reward.

How a session ends otherwise, as every session does:

* its wall-clock budget (the smaller of ``task.session_budget_s`` and
  ``[agent] budget_s``) runs out: aborted, ``wall_clock_timeout`` (the
  engine's timer; in-flight turns and commands are cancelled); a CLI that
  hits its own budget first is aborted with the same reason;
* the agent crashes: aborted, ``agent_crashed:<exception type>`` for the
  Python agent (with the message and traceback), ``agent_crashed:exit_<n>``
  for a CLI that exits non-zero (with its output tail); but a CLI that gave
  up on the model's own answers (Claude Code, when they keep running past
  the task's ``max_new_tokens``) is the policy's doing: the verifier judges
  it and the session finishes with that reward (``agent.stop_reason``);
* the sandbox set-up or the verifier raises: aborted,
  ``setup_failed:<type>`` / ``verifier_failed:<type>``;
* the session is cancelled (shutdown, a cancelled batch): dropped,
  ``cancelled``.

The template that turns messages into token ids is a parameter: the built-in
GPT's :class:`~agentlog.gateway.ByteChatTemplate` by default, a
:class:`~agentlog.gateway.HFChatTemplate` (tokenizer) for a Hugging Face model.
"""

from __future__ import annotations

import asyncio
import copy
import math
import random
import shutil
import traceback as _traceback
from pathlib import Path
from typing import Any, Sequence

from agentlog._logging import get_logger
from agentlog.engine import LocalSandbox, harness
from agentlog.engine.core import TIMEOUT_REASON, SessionEngine
from agentlog.engine.sandbox import CommandResult
from agentlog.engine.tasks import TextEpisode, TextTask, Verdict
from agentlog.events.schema.lifecycle import TERMINAL_STATES, SessionClosed
from agentlog.events.schema.packing import tokens_view
from agentlog.reducers.resume import ResumePoint
from agentlog.gateway import Backend, ByteChatTemplate, ChatTemplate, Gateway, GatewayConfig, HermesToolParser, ToolCallParser

from .config import AgentConfig, InferenceConfig, LoopConfig
from .teacher import TurnToScore, score_session

log = get_logger("agentlog.loop.gateway_rollout")


def build_text_model(cfg: LoopConfig) -> Any:
    """The built-in GPT for text tasks: the byte-level chat template's
    vocabulary, ``[inference] context_length`` positions, the loop's width
    and depth (seeded from ``cfg.seed``). The worker and the learner build
    the same one."""
    import torch

    from agentlog.learner.model import GPT, GPTConfig

    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig(vocab_size=ByteChatTemplate.VOCAB_SIZE, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                         max_seq_len=cfg.inference.context_length, tie_embeddings=cfg.tie_embeddings))


class _RecordedSandbox:
    """A sandbox whose commands are recorded in the session (``command_ran``)
    and cancelled with it: what the verifier runs shows in replay."""

    def __init__(self, inner: Any, handle: Any) -> None:
        self.inner = inner
        self.handle = handle
        self.name = inner.name
        self.workdir = getattr(inner, "workdir", None)

    async def run_command(self, cmd: str, budget_s: float) -> CommandResult:
        return await self.handle.run_command(self.inner, cmd, budget_s)

    async def close(self) -> None:
        await self.inner.close()


def crash_reason(result: Any) -> tuple[str, str] | None:
    """``(reason, error)`` when an agent's result says it crashed or ran out
    of time (a CLI's CommandResult), else None (the Python agent's
    AgentResult never does: it raises)."""
    if not isinstance(result, CommandResult):
        return None
    if result.budget_exceeded:
        return TIMEOUT_REASON, f"the agent CLI ran past its budget ({result.duration_s:.1f}s): {result.output_tail[-500:]}"
    if result.exit_code is None:
        return "agent_crashed:no_exit_code", f"the agent CLI reported no exit code: {result.output_tail[-500:]}"
    if result.exit_code != 0:
        return f"agent_crashed:exit_{result.exit_code}", result.output_tail[-2000:]
    return None


class GatewayRollout:
    """A loopback gateway over the worker's engine, and the sessions it plays.

    ``backend`` serves the model calls (e.g. a TorchBackend over the loop's
    policy, or a GatedBackend over an SGLang/vLLM client); ``template`` and
    ``parser`` render and read them.
    """

    def __init__(self, engine: SessionEngine, backend: Backend, *, agent: AgentConfig, sandbox_root: Path,
                 temperature: float = 1.0, template: ChatTemplate | None = None, parser: ToolCallParser | None = None,
                 keep_sandboxes: bool = False, teachers: Sequence[Any] = (), distill: Any = None,
                 route_by: str = "session", snapshots: Any = None) -> None:
        self.engine = engine
        #: The worker's sandbox snapshots (loop.resume.SessionSnapshots), None: no snapshots, no resume.
        self.snapshots = snapshots
        #: The turns' routing key (GatewayConfig.route_by): a fleet routes on it.
        self.route_by = route_by
        self.backend = backend
        self.agent = agent
        self.parser = parser or HermesToolParser()
        self.template = template or ByteChatTemplate(self.parser)
        self.temperature = temperature
        self.sandbox_root = Path(sandbox_root)
        self.keep_sandboxes = keep_sandboxes
        self.gateway: Gateway | None = None
        self.counts: dict[str, int] = {}
        #: Teachers that score each finished session's turns before its terminal event (on-policy distillation).
        self.teachers = list(teachers)
        #: Their [distill] settings (topk, timeout_s); required with teachers.
        self.distill = distill
        if self.teachers and distill is None:
            raise ValueError("GatewayRollout: teachers need their [distill] settings (topk, timeout_s)")
        #: One harness per (task, budget): the Python agent keeps one HTTP client for all its sessions.
        self._agents: dict[tuple[str, float], Any] = {}

    async def start(self) -> str:
        """Listen on 127.0.0.1 (any free port); returns the gateway's URL."""
        # Output allowances come from each task (the agent asks for max_new_tokens); the cap only bounds clients.
        self.gateway = Gateway(self.engine, self.backend, template=self.template, parser=self.parser,
                               config=GatewayConfig(temperature=self.temperature, route_by=self.route_by))
        return await self.gateway.start("127.0.0.1", 0)

    async def close(self) -> None:
        """Close the harnesses and stop listening (the engine and the backend belong to the caller)."""
        agents, self._agents = list(self._agents.values()), {}
        for agent in agents:
            await agent.close()
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway = None

    def preflight(self) -> None:
        """Fail at start-up, naming what is missing (the openai client, the agent CLI), when
        the configured harness cannot run here; otherwise every session would be aborted
        ``agent_crashed`` one by one while the run trained on nothing."""
        kw = {"cli": self.agent.cli} if self.agent.cli and self.agent.harness != "python-agent" else {}
        harness.get(self.agent.harness)("http://127.0.0.1:1", **kw).check_ready()

    @property
    def resumable(self) -> bool:
        """Whether the configured harness can resume a session (engine.harness.is_resumable)."""
        return harness.is_resumable(self.agent.harness)

    def harness_for(self, task: TextTask, budget_s: float) -> Any:
        """The configured agent harness, pointed at the gateway and sized for ``task`` (one per task and budget)."""
        assert self.gateway is not None, "GatewayRollout.start() first"
        key = (task.name, budget_s)
        agent = self._agents.get(key)
        if agent is None:
            agent = self._agents[key] = self._make_harness(task, budget_s)
        return agent

    def _make_harness(self, task: TextTask, budget_s: float) -> Any:
        a = self.agent
        kw: dict[str, Any] = {"budget_s": budget_s}
        if a.harness == "python-agent":
            max_tokens = min(a.max_tokens, task.max_new_tokens) if a.max_tokens else task.max_new_tokens
            kw.update(max_turns=task.max_turns, max_tool_calls=a.max_tool_calls, max_tokens=max_tokens,
                      command_budget_s=min(a.command_budget_s, task.command_budget_s))
        else:
            if a.cli:
                kw["cli"] = a.cli
            if a.harness == "claude-code":
                kw.update(tools=a.cli_tools, system_prompt=a.system_prompt, max_output_tokens=task.max_new_tokens)
        return harness.get(a.harness)(self.gateway.url, **kw)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def run_session(self, task: TextTask, episode: TextEpisode, *, session_id: str, group_id: str, group_size: int,
                          sample_index: int, policy_version: int = 0, metadata: dict[str, Any] | None = None,
                          replaces: str = "") -> None:
        """Play one session to its terminal state (see the module docstring).
        ``replaces``: the session is the replacement of that aborted member (per-sample refill).
        Raises SessionTimeout after a budget abort and CancelledError after a
        drop, as ``engine.session`` does; returns after finish or abort."""
        assert self.gateway is not None, "GatewayRollout.start() first"
        budget = self.budget_of(task)
        sandbox = LocalSandbox(self.sandbox_root / session_id)
        try:
            async with self.engine.session(
                session_id, group_id=group_id, group_size=group_size, sample_index=sample_index, prompt=episode.messages,
                label=episode.label, agent=self.agent.harness, policy_version=policy_version,
                metadata={**(metadata or {}), "task": task.name}, budget_s=budget, replaces=replaces,
            ) as h:
                ok, _ = await self._step(h, "setup_failed", task.setup(episode, sandbox))
                if not ok:
                    return
                await h.start(harness=self.agent.harness, sandbox=sandbox.name, details={"gateway": self.gateway.url, "task": task.name})
                await self.play(h, task, episode, sandbox, budget)
        finally:
            await self.release_session(session_id, sandbox)

    def budget_of(self, task: TextTask) -> float:
        """A session's wall-clock budget: the smaller of the task's and ``[agent] budget_s``."""
        return min(float(task.session_budget_s), float(self.agent.budget_s))

    async def release_session(self, session_id: str, sandbox: Any) -> None:
        """A session ended (or could not be played): its snapshots and its sandbox go."""
        if self.snapshots is not None:
            await self.snapshots.session_ended(session_id, self.engine.status(session_id))
        if not self.keep_sandboxes:
            await asyncio.to_thread(_remove_tree, sandbox.workdir)

    async def play(self, h: Any, task: TextTask, episode: TextEpisode, sandbox: Any, budget: float,
                   resumed: ResumePoint | None = None) -> None:
        """Run the agent on the running session ``h``, verify, score and finish (or abort).
        ``resumed``: a resumed session's resume point (loop/resume.py): the harness's ``resume``
        continues its conversation (with no durable turn, ``run`` starts it again), and the
        teachers score its turns before the resume too (but those the log holds a result of;
        with teachers, the point must keep its turns). None: a new session."""
        assert self.gateway is not None, "GatewayRollout.start() first"
        session_id = h.session_id
        earlier: list[TurnToScore] = []
        if resumed is not None and self.teachers:
            if len(resumed.turns) != resumed.durable_turns:
                raise ValueError(f"session {session_id!r}: resumed with {resumed.durable_turns} durable turns but "
                                 f"{len(resumed.turns)} kept; the teachers need them all (resume_points(keep_turns=True))")
            temps = resumed.turn_temperatures
            earlier = [TurnToScore(t.turn_index, tokens_view(t.prompt_ids).tolist(), tokens_view(t.output_ids).tolist(),
                                   None if math.isnan(temps[t.turn_index]) else temps[t.turn_index]) for t in resumed.turns]
        agent = self.harness_for(task, budget)
        # The task's output allowance holds whatever the agent asks for (Claude Code asks for 64000).
        before_turn = self.snapshots.before_turn(h, sandbox) if self.snapshots is not None and self.resumable else None
        self.gateway.configure_session(session_id, sampling={"temperature": self.temperature}, max_turns=task.max_turns,
                                       max_new_tokens=task.max_new_tokens, keep_turns=bool(self.teachers), before_turn=before_turn)
        key = self.gateway.session_key(session_id)
        try:
            if resumed is None or not resumed.durable_turns:
                # A resumed session without a durable turn starts again from the prompt, on the sandbox as set up.
                result = await agent.run(h, sandbox, episode.messages, key)
            else:
                result = await agent.resume(h, sandbox, resumed.conversation(), key)
        except Exception as exc:  # noqa: BLE001 - the crash is the session's outcome, recorded with its traceback
            await self._abort_for(h, f"agent_crashed:{type(exc).__name__}", exc)
            return
        calls = self.gateway.session_calls(session_id)
        crash = crash_reason(result)
        # A CLI that gave up on the model's own answers (Claude Code after over-long outputs) was not a crash:
        # the policy did it, so the verifier judges it (aborting would hide it from training).
        judge = getattr(agent, "model_stopped", None)
        stopped = judge(result) if judge is not None and crash is not None and crash[0].startswith("agent_crashed:exit_") else None
        if crash is not None and stopped is None:
            await self._end(h, crash[0].split(":")[0], h.abort(crash[0], error=crash[1]))
            return
        ok, verdict = await self._step(h, "verifier_failed", _verify(task, episode, _RecordedSandbox(sandbox, h)))
        if not ok:
            return
        if hasattr(result, "summary"):
            summary = result.summary()
        else:  # a CLI: how it exited, and (non-zero) why that was the model's doing
            summary = {"exit_code": result.exit_code, **({"stop_reason": stopped} if stopped else {})}
        if self.teachers:
            # Before the terminal event: the learner releases the group only with its scores in the log.
            turns = earlier + [TurnToScore(*t) for t in self.gateway.session_turns(session_id)]
            for what, n in (await score_session(h, turns, self.teachers, top_k=self.distill.topk, timeout_s=self.distill.timeout_s,
                                                skip=resumed.scored if resumed is not None else ())).items():
                self.counts[f"teacher_{what}"] = self.counts.get(f"teacher_{what}", 0) + n
        await self._end(h, "finished", h.finish(reward=verdict.reward, metadata={
            "success": verdict.success, **verdict.detail, "agent": summary, "gateway": calls}))

    async def _end(self, h: Any, outcome: str, ending: Any) -> bool:
        """Await the session's own ending (``h.finish`` or ``h.abort``) and count ``outcome``.
        SessionClosed from a session the engine ended first (``h.ended_by_engine``: a drop at
        shutdown or its budget, while the agent or the verifier ran, not yet acknowledged when
        the rollout looked) is that ending's doing: its terminal event says why, and the rollout
        returns as it left it, uncounted (False). Any other SessionClosed is a second ending of
        the rollout's own side (an agent that finished its session itself) and raises."""
        try:
            await ending
        except SessionClosed:
            if not h.ended_by_engine:
                raise
            h.log.info("rollout.ended_under_us", state=str(h.state), wanted=outcome)
            return False
        self._count(outcome)
        return True

    async def _step(self, h: Any, reason: str, coro: Any) -> tuple[bool, Any]:
        """Run a task step: ``(True, its result)``, or on an exception abort
        with ``reason:<type>`` and return ``(False, None)``."""
        try:
            return True, await coro
        except Exception as exc:  # noqa: BLE001 - recorded as the session's abort reason, with the traceback
            await self._abort_for(h, f"{reason}:{type(exc).__name__}", exc)
            return False, None

    async def _abort_for(self, h: Any, reason: str, exc: BaseException) -> None:
        if h.state not in TERMINAL_STATES:
            tb = "".join(_traceback.format_exception(type(exc), exc, exc.__traceback__))
            if await self._end(h, reason.split(":")[0], h.abort(reason, error=f"{type(exc).__name__}: {exc}", traceback=tb)):
                h.log.warning("rollout.session_failed", reason=reason, error=f"{type(exc).__name__}: {exc}")
                return
        # It ended under us: its budget ran out (the engine's session context raises
        # SessionTimeout on exit) or the engine dropped it at shutdown. The session's own
        # terminal event says why; the agent's error that followed is logged, not re-raised.
        h.log.info("rollout.error_after_end", state=str(h.state), error=f"{type(exc).__name__}: {exc}")


async def _verify(task: TextTask, episode: TextEpisode, sandbox: Any) -> Verdict:
    """The task's verdict; anything but a Verdict raises naming the task."""
    verdict = await task.verify(episode, sandbox)
    if not isinstance(verdict, Verdict):
        raise TypeError(f"task {task.name!r}: verify() returned {type(verdict).__name__}; expected an engine.tasks.Verdict")
    return verdict


def _remove_tree(path: Any) -> None:
    """Remove a finished session's sandbox; a failure is logged, never hidden, and does not end the run."""

    def report(_fn: Any, p: str, exc: Any) -> None:
        log.warning("rollout.sandbox_not_removed", path=p, error=str(exc[1] if isinstance(exc, tuple) else exc))

    if path is not None:
        shutil.rmtree(path, onerror=report)


def make_backend(cfg: LoopConfig, model: Any) -> tuple[Backend, Any]:
    """``(backend, weight_sync)`` for ``[inference]``: the in-process
    TorchBackend over ``model`` (sync None: the worker swaps its weights),
    a gated SGLang / vLLM client and its weight-sync client, or, when
    ``servers`` lists a fleet, a :class:`~agentlog.gateway.fleet.Fleet` of
    those (sync None: the fleet's ``reload_weights`` updates every server)."""
    inf: InferenceConfig = cfg.inference
    if not inf.servers:
        return _server_backend(cfg, model, {"url": inf.url, "served_dir": inf.served_dir})
    from agentlog.gateway.fleet import Fleet, FleetMember

    members = []
    for i, spec in enumerate(inf.servers):
        # In process, every replica but the first serves its own copy of the policy, and
        # samples from its own seed: replicas serving one group must not draw alike.
        backend, sync = _server_backend(cfg, model if i == 0 else copy.deepcopy(model), spec, replica=i)
        members.append(FleetMember(spec["name"], backend, sync))
    return Fleet(members, policy=inf.route_policy, load_factor=inf.load_factor, probe_interval_s=inf.probe_interval_s), None


def _server_backend(cfg: LoopConfig, model: Any, spec: dict[str, str], replica: int = 0) -> tuple[Backend, Any]:
    """One server's ``(backend, weight_sync)``: ``spec["url"]`` is "in-process" or its base URL;
    ``replica``: its place in a fleet (an in-process replica's sampling seed)."""
    inf: InferenceConfig = cfg.inference
    if inf.backend == "in-process":
        from agentlog.gateway import TorchBackend

        seed = cfg.seed * 1_000_003 + 11 + replica * 7_919
        return TorchBackend(model, seed=seed, weight_update=cfg.rollout.weight_update), None
    from agentlog.gateway import OpenAICompletionsBackend, SGLangBackend
    from agentlog.gateway.backends import ROUTING_HEADER_DEFAULT
    from agentlog.gateway.weight_sync import GatedBackend, SGLangWeightSync, VLLMWeightSync

    url = spec["url"]
    header = ROUTING_HEADER_DEFAULT if inf.routing_header is None else inf.routing_header
    if inf.backend == "sglang":
        backend = GatedBackend(SGLangBackend(url, context_length=inf.context_length, routing_header=header),
                               weight_update=cfg.rollout.weight_update)
        return backend, SGLangWeightSync(url, gate=backend.gate)
    backend = GatedBackend(OpenAICompletionsBackend(url, inf.model, context_length=inf.context_length, routing_header=header),
                           weight_update=cfg.rollout.weight_update)
    return backend, VLLMWeightSync(url, spec["served_dir"], gate=backend.gate)


def draw_members(task: TextTask, seed_rng: random.Random, groups: int, group_size: int) -> list[list[TextEpisode]]:
    """The episodes of one batch: ``groups`` prompts, each played by ``group_size`` members."""
    out = []
    for _ in range(groups):
        ep = task.new_episode(seed_rng)
        out.append([task.group_member(ep, seed_rng) for _ in range(group_size)])
    return out


__all__ = ["GatewayRollout", "build_text_model", "crash_reason", "draw_members", "make_backend"]
