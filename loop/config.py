"""LoopConfig: every knob of the online loop, in one dataclass.

The same object drives `agentlog demo` (flags), `agentlog train --config
FILE` (a TOML file whose top-level keys are these fields, with the
``[learner]`` table passed to ``learner.config.LearnerConfig`` and the
``[faults]`` table to :class:`FaultConfig`, the ``[log]`` table (where the
logs live: files, or a JetStream stream) to :class:`LogConfig`, and the ``[task]`` table's
``name``, ``module`` and ``path`` to ``task``, ``task_modules`` and
``task_path``), and the worker and learner
processes (which read ``config.json`` from the run folder). Each field has a
docstring; ``agentlog demo --help`` prints them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# A loop configuration value out of range or unknown raises the package's one ConfigError.
from agentlog.events.errors import ConfigError
from agentlog.events.fs import atomic_file

from .staleness import STALENESS_MODES


@dataclass
class FaultConfig:
    """Faults the rollout worker injects on purpose (the demo runs with them on)."""

    exception_rate: float = 0.05
    """Fraction of sessions whose agent raises mid-episode (aborted, reason ``exception:InjectedFault``)."""
    timeout_rate: float = 0.05
    """Fraction of sessions that hang past their wall-clock budget (aborted, ``wall_clock_timeout``)."""
    drop_rate: float = 0.05
    """Fraction of sessions cancelled mid-episode (dropped, ``cancelled``)."""
    straggler_rate: float = 0.02
    """Fraction of finished sessions that then try one more turn (refused by the engine, never logged)."""
    empty_marker_rate: float = 0.01
    """Fraction of sessions whose tool runs in a LocalSandbox and dies leaving an empty done marker (aborted, ``empty_done_marker``)."""
    timeout_budget_s: float = 0.05
    """Wall-clock budget given to the sessions chosen to time out."""

    def __post_init__(self) -> None:
        rates = ("exception_rate", "timeout_rate", "drop_rate", "straggler_rate", "empty_marker_rate")
        for name in rates:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ConfigError(f"FaultConfig.{name}: expected a fraction in [0, 1], found {v!r}")
        if self.exception_rate + self.timeout_rate + self.drop_rate + self.empty_marker_rate > 1.0:
            raise ConfigError("FaultConfig: exception, timeout, drop and empty-marker rates must sum to at most 1")
        if not self.timeout_budget_s > 0:
            raise ConfigError(f"FaultConfig.timeout_budget_s: expected > 0, found {self.timeout_budget_s!r}")

    @classmethod
    def none(cls) -> "FaultConfig":
        """No injected faults at all."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0)

    def any_enabled(self) -> bool:
        """Whether any fault is injected at all."""
        return any(v > 0 for v in (self.exception_rate, self.timeout_rate, self.drop_rate, self.straggler_rate, self.empty_marker_rate))


#: Agent harnesses a text task's rollout can run (gateway/agents.py, gateway/python_agent.py).
AGENT_HARNESSES = ("python-agent", "claude-code", "codex")
#: Where the loop's model calls go: the policy in the worker process, or an inference server.
INFERENCE_BACKENDS = ("in-process", "sglang", "vllm")


@dataclass
class AgentConfig:
    """The agent a text task's rollout runs against the gateway (the ``[agent]`` table)."""

    harness: str = "python-agent"
    """Agent harness: python-agent (built in, the openai client), claude-code or codex (CLIs from npm)."""
    budget_s: float = 300.0
    """Wall-clock budget of one session (agent and verifier); the task's session_budget_s caps it too (the smaller wins)."""
    max_tool_calls: int = 16
    """python-agent: most tool calls (sandbox commands) per session."""
    max_tokens: int = 0
    """python-agent: most tokens the model generates per call (0: the task's max_new_tokens, which caps it too; the smaller wins)."""
    command_budget_s: float = 60.0
    """python-agent: wall-clock budget of one tool command (the task's command_budget_s caps it too)."""
    cli: str = ""
    """claude-code / codex: path of the CLI executable (empty: the install cache of tools/gateway_clis.sh, then PATH)."""
    cli_tools: list[str] = field(default_factory=list)
    """claude-code: the only built-in tools the CLI offers the model (`--tools`, e.g. ["Bash"]; empty: the CLI's default set). Each tool's definition is part of every prompt."""
    system_prompt: str = ""
    """claude-code: the CLI's system prompt (`--system-prompt`; empty: the CLI's own). Claude Code's default prompt and tools are ~76k characters per call; `cli_tools = ["Bash"]` with a short system prompt is ~3k."""

    def __post_init__(self) -> None:
        if self.harness not in AGENT_HARNESSES:
            raise ConfigError(f"[agent] harness: expected one of {AGENT_HARNESSES}, found {self.harness!r}")
        if isinstance(self.cli_tools, str):
            self.cli_tools = [self.cli_tools]
        if not isinstance(self.cli_tools, (list, tuple)) or not all(isinstance(t, str) and t.strip() and "," not in t for t in self.cli_tools):
            raise ConfigError(f"[agent] cli_tools: expected a list of tool names (e.g. [\"Bash\"]), found {self.cli_tools!r}")
        self.cli_tools = [t.strip() for t in self.cli_tools]
        if not isinstance(self.system_prompt, str):
            raise ConfigError(f"[agent] system_prompt: expected a str, found {self.system_prompt!r}")
        for name in ("cli_tools", "system_prompt"):
            if getattr(self, name) and self.harness != "claude-code":
                raise ConfigError(f"[agent] {name}: only the claude-code harness takes it (harness is {self.harness!r}); "
                                  "the python-agent's prompt is the task's messages, and codex has no such option here")
        for name in ("budget_s", "command_budget_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"[agent] {name}: expected a number of seconds > 0, found {v!r}")
        if type(self.max_tool_calls) is not int or self.max_tool_calls < 1:
            raise ConfigError(f"[agent] max_tool_calls: expected an int >= 1, found {self.max_tool_calls!r}")
        if type(self.max_tokens) is not int or self.max_tokens < 0:
            raise ConfigError(f"[agent] max_tokens: expected an int >= 1 (0: the task's max_new_tokens), found {self.max_tokens!r}")


@dataclass
class InferenceConfig:
    """Where a text task's model calls are served (the ``[inference]`` table)."""

    backend: str = "in-process"
    """in-process (the loop's policy in the worker, reloaded between batches), sglang or vllm (a server at url, reloaded through its weight-update API)."""
    url: str = ""
    """sglang / vllm: the server's base URL (e.g. http://127.0.0.1:30000)."""
    model: str = ""
    """vllm: the model name the server serves (sent with each completion); "" sends none: the server's one model."""
    context_length: int = 2048
    """Longest prompt + output of a turn (tokens): the built-in GPT's max_seq_len in-process, the server's context otherwise."""
    served_dir: str = ""
    """vllm: the directory the server was launched on; each new policy is copied there before the reload (vLLM reloads from it)."""

    def __post_init__(self) -> None:
        if self.backend not in INFERENCE_BACKENDS:
            raise ConfigError(f"[inference] backend: expected one of {INFERENCE_BACKENDS}, found {self.backend!r}")
        if self.backend != "in-process" and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"[inference] url: backend {self.backend!r} needs the server's http(s) base URL, found {self.url!r}")
        if self.backend == "vllm" and not self.served_dir:
            raise ConfigError("[inference] served_dir: backend 'vllm' needs the directory its server was launched on (vLLM reloads from there)")
        if type(self.context_length) is not int or self.context_length < 64:
            raise ConfigError(f"[inference] context_length: expected an int >= 64, found {self.context_length!r}")


@dataclass
class MetricsConfig:
    """Where the learner's metrics go besides its log (the source of truth): the ``[metrics]`` table."""

    tensorboard: bool = True
    """Write TensorBoard event files under ``<run>/tensorboard`` (needs the tensorboard extra; a note in the log when missing)."""
    wandb_project: str = ""
    """Log to this Weights & Biases project when ``wandb`` is installed ("" : $WANDB_PROJECT, if set; else off)."""


#: Where the rollout workers run: local processes, or Ray actors.
ROLLOUT_BACKENDS = ("local", "ray")


@dataclass
class RolloutConfig:
    """How many rollout workers run, and where (the ``[rollout]`` table).

    With more than one worker, or on Ray, each worker writes its own log
    partition ``<run>/rollout/pNNNN`` and runs the groups ``g`` of each batch
    with ``g % workers`` equal to its partition id."""

    workers: int = 1
    """Rollout workers, one log partition each."""
    backend: str = "local"
    """local (worker processes on this machine) or ray (one Ray actor per worker)."""
    address: str = ""
    """ray: the cluster to join (ray.init(address=...), e.g. "auto" or "ray://head:10001"); "" starts a local Ray on this machine."""
    max_restarts: int = 4
    """ray: how often Ray restarts a rollout actor that died (its node lost, its process killed)."""
    resources: dict[str, float] = field(default_factory=lambda: {"agentlog_rollout": 1.0})
    """ray: the custom resources each rollout actor requests (give rollout nodes `--resources='{"agentlog_rollout": N}'`)."""
    num_cpus: float = 1.0
    """ray: CPUs each rollout actor reserves."""
    lost_after_s: float = 0.0
    """Declare a partition lost once it has written nothing for this long while the learner waits for groups (0: never); recorded in the learner log."""

    def __post_init__(self) -> None:
        if type(self.workers) is not int or self.workers < 1:
            raise ConfigError(f"[rollout] workers: expected an int >= 1, found {self.workers!r}")
        if self.backend not in ROLLOUT_BACKENDS:
            raise ConfigError(f"[rollout] backend: expected one of {ROLLOUT_BACKENDS}, found {self.backend!r}")
        if not isinstance(self.address, str):
            raise ConfigError(f"[rollout] address: expected a Ray address (str), found {self.address!r}")
        if self.address and self.backend != "ray":
            raise ConfigError(f"[rollout] address: only the ray backend joins a cluster (backend is {self.backend!r})")
        if type(self.max_restarts) is not int or self.max_restarts < 0:
            raise ConfigError(f"[rollout] max_restarts: expected an int >= 0, found {self.max_restarts!r}")
        if not isinstance(self.resources, Mapping) or not all(
                isinstance(k, str) and k and not isinstance(v, bool) and isinstance(v, (int, float)) and v >= 0
                for k, v in self.resources.items()):
            raise ConfigError(f"[rollout] resources: expected a table of resource name -> amount >= 0, found {self.resources!r}")
        self.resources = {k: float(v) for k, v in self.resources.items()}
        for name in ("num_cpus", "lost_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ConfigError(f"[rollout] {name}: expected a number >= 0, found {v!r}")

    @property
    def partitioned(self) -> bool:
        """Whether the rollout log is a folder of partitions, one per worker."""
        return self.workers > 1 or self.backend == "ray"

    def partitions(self) -> list[int]:
        """The partition ids of the workers (0 .. workers-1)."""
        return list(range(self.workers))


# --- [log]: where the run's logs live ---
#: Where a run's logs live: folders under the run folder, or subjects of a JetStream stream.
LOG_BACKENDS = ("file", "nats")


@dataclass
class LogConfig:
    """Where the run's logs live (the ``[log]`` table). The run folder keeps
    ``config.json`` and the checkpoints either way; with ``nats`` the rollout
    partitions are the subjects ``<stream>.pNNNN`` and the learner log
    ``<stream>.learner`` of one JetStream stream."""

    backend: str = "file"
    """file (``<run>/rollout``, ``<run>/learner``) or nats (one JetStream stream per run)."""
    url: str = ""
    """nats: the servers, nats://host:port or nats://h1:4222,h2:4222 (no stream in it; see stream)."""
    stream: str = ""
    """nats: the run's stream ("": the run folder's name, every character outside [A-Za-z0-9_-] replaced by '_')."""
    replicas: int = 1
    """nats: copies JetStream keeps of the stream (3 on a 3-node cluster)."""
    duplicate_window_s: float = 120.0
    """nats: how long the server remembers message ids to drop a retried publish (seconds)."""

    def __post_init__(self) -> None:
        from agentlog.events.log.jetstream_read import STREAM_RE, parse_nats_url

        if self.backend not in LOG_BACKENDS:
            raise ConfigError(f"[log] backend: expected one of {LOG_BACKENDS}, found {self.backend!r}")
        for name in ("url", "stream"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"[log] {name}: expected a str, found {getattr(self, name)!r}")
        if self.backend == "file":
            given = [name for name in ("url", "stream") if getattr(self, name)]
            if given:
                raise ConfigError(f"[log] {given[0]}: only the nats backend takes it (backend is 'file')")
        else:
            if not self.url:
                raise ConfigError("[log] url: backend 'nats' needs the servers' URL, e.g. nats://127.0.0.1:4222")
            if not self.url.startswith("nats://"):
                raise ConfigError(f"[log] url: expected nats://host:port[,host:port], found {self.url!r}")
            if "/" in self.url.removeprefix("nats://"):
                raise ConfigError(f"[log] url: expected nats://host:port[,host:port] without a path (the stream goes in "
                                  f"[log] stream), found {self.url!r}")
            try:
                parse_nats_url(f"{self.url}/stream")
            except ValueError as exc:
                raise ConfigError(f"[log] url: expected nats://host:port[,host:port], found {self.url!r} ({exc})") from None
            if self.stream and not STREAM_RE.fullmatch(self.stream):
                raise ConfigError(f"[log] stream: expected letters, digits, '-' or '_' (1..200 of them), found {self.stream!r}")
        if type(self.replicas) is not int or not 1 <= self.replicas <= 5:
            raise ConfigError(f"[log] replicas: expected an int in 1..5, found {self.replicas!r}")
        if isinstance(self.duplicate_window_s, bool) or not isinstance(self.duplicate_window_s, (int, float)) \
                or not 0 < self.duplicate_window_s < math.inf:
            raise ConfigError(f"[log] duplicate_window_s: expected a number of seconds > 0, found {self.duplicate_window_s!r}")

    def servers(self) -> list[str]:
        """The server URLs of ``url``, one each (nats-py takes a list; it does not split a comma-joined string)."""
        return [f"nats://{host}" for host in self.url.removeprefix("nats://").split(",")]

    def stream_for(self, run_dir: Path) -> str:
        """The run's stream: ``stream``, or the run folder's name with every
        character outside [A-Za-z0-9_-] replaced by '_' (at most 200)."""
        if self.stream:
            return self.stream
        name = re.sub(r"[^A-Za-z0-9_-]", "_", Path(os.path.abspath(run_dir)).name)[:200]
        return name or "run"


# --- [distill]: on-policy distillation's teachers ---
#: The keys of one ``[[distill.teachers]]`` table that say where the teacher is (exactly one is given).
TEACHER_SOURCES = ("url", "checkpoint", "hf_model")


@dataclass
class TeacherSpec:
    """One teacher of on-policy distillation (a ``[[distill.teachers]]`` table)."""

    name: str
    """Name recorded with each of its scores (unique among the run's teachers)."""
    url: str = ""
    """A teacher server (slime's teacher server / SGLang's native /generate): its base URL or its /generate URL."""
    checkpoint: str = ""
    """A built-in GPT policy file (.pt: a learner checkpoint or a weights file), run in the worker process."""
    hf_model: str = ""
    """A local Hugging Face model directory, run in the worker process (nothing is downloaded)."""
    version: str = ""
    """url: the served weights' version id ("" reads the server's /get_model_info); in-process teachers use their weights' sha256."""
    scales_temperature: bool = False
    """url: the server returns input log-probs at the request's temperature (stock SGLang returns them at temperature 1, so turns sampled at another temperature are then recorded as teacher failures)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"[[distill.teachers]] name: expected a non-empty str, found {self.name!r}")
        for key in (*TEACHER_SOURCES, "version"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"[[distill.teachers]] {self.name!r}: {key}: expected a str, found {getattr(self, key)!r}")
        given = [k for k in TEACHER_SOURCES if getattr(self, k)]
        if len(given) != 1:
            raise ConfigError(f"[[distill.teachers]] {self.name!r}: expected exactly one of {list(TEACHER_SOURCES)}, found "
                              f"{given or 'none'}")
        if self.version and not self.url:
            raise ConfigError(f"[[distill.teachers]] {self.name!r}: version is for url teachers; an in-process teacher's "
                              "version is the sha256 of its weights")
        if not isinstance(self.scales_temperature, bool):
            raise ConfigError(f"[[distill.teachers]] {self.name!r}: scales_temperature: expected true or false, found {self.scales_temperature!r}")
        if self.scales_temperature and not self.url:
            raise ConfigError(f"[[distill.teachers]] {self.name!r}: scales_temperature is for url teachers; an in-process "
                              "teacher always scores at the turn's temperature")


@dataclass
class DistillConfig:
    """On-policy distillation (the ``[distill]`` table): teachers score every turn of each
    finished session before its terminal event, and the learner shapes each token's
    advantage by ``coef`` x (rollout log-prob - teacher log-prob)."""

    teachers: list[TeacherSpec] = field(default_factory=list)
    """The teachers (``[[distill.teachers]]`` tables: name and one of url / checkpoint / hf_model); empty: no distillation."""
    coef: float = 0.0
    """lambda: weight of the per-token reverse KL to the teacher in the advantage (LearnerConfig.distill_coef)."""
    topk: int = 0
    """Top-K tokens (and log-probs) each teacher returns per scored token (0: none)."""
    timeout_s: float = 60.0
    """Longest a teacher may take to score one turn; past it the turn is recorded as a teacher failure."""

    def __post_init__(self) -> None:
        if not isinstance(self.teachers, (list, tuple)):
            raise ConfigError(f"[distill] teachers: expected a list of tables, found {self.teachers!r}")
        self.teachers = [_from_mapping(TeacherSpec, t, "distill.teachers") if isinstance(t, Mapping) else t for t in self.teachers]
        if not all(isinstance(t, TeacherSpec) for t in self.teachers):
            raise ConfigError(f"[distill] teachers: expected a list of tables, found {self.teachers!r}")
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ConfigError(f"[distill] teachers: names must be unique, found {names}")
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not 0 <= self.coef < math.inf:
            raise ConfigError(f"[distill] coef: expected a number >= 0, found {self.coef!r}")
        if self.coef > 0 and not self.teachers:
            raise ConfigError(f"[distill] coef is {self.coef}, and no teachers are configured; add [[distill.teachers]]")
        if type(self.topk) is not int or self.topk < 0:
            raise ConfigError(f"[distill] topk: expected an int >= 0, found {self.topk!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s < math.inf:
            raise ConfigError(f"[distill] timeout_s: expected a number of seconds > 0, found {self.timeout_s!r}")

    def resolve_paths(self, base_dir: Path | None) -> None:
        """Make the in-process teachers' relative paths absolute against ``base_dir`` (the
        config file's directory; default the current one), so every process finds them."""
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        for t in self.teachers:
            for key in ("checkpoint", "hf_model"):
                if getattr(t, key):
                    setattr(t, key, os.path.abspath(base / os.path.expanduser(getattr(t, key))))


@dataclass
class LoopConfig:
    """The online loop: task, model, rollout shape, asynchrony bound, faults, output."""

    task: str = "lookup"
    """Task name, selected through the engine harness registry (empty: $AGENTLOG_AGENT); also the agent recorded on every session."""
    seed: int = 0
    """Seed of everything random: model init, warm-up data, episodes, sampling, faults."""
    steps: int = 400
    """Most optimiser steps of RL (policy versions 1..steps); training may stop earlier, see stop_reward and time_budget_s."""
    stop_reward: float = 0.9
    """Stop once the mean reward of the last stop_window trained steps reaches this (0 disables)."""
    stop_window: int = 10
    """Steps in the stop_reward moving window."""
    time_budget_s: float = 150.0
    """Stop RL after this many seconds (the warm-up not counted; 0 disables): keeps `make demo` under 5 minutes."""
    groups_per_step: int = 32
    """Prompts (GRPO groups) per step; the learner steps once this many groups are released."""
    group_size: int = 8
    """Samples per prompt (sessions per group)."""
    temperature: float = 1.0
    """Rollout sampling temperature; recorded with every turn, so the learner takes log-probs at it too."""
    max_lag: int = 1
    """How many learner steps the rollout worker may run ahead of the learner (a step that trained nothing publishes no version)."""
    max_staleness: int = 2
    """A group generated more than this many versions before the learner's current one is stale."""
    staleness_mode: str = "correct"
    """What happens to stale groups: correct (trained with truncated importance sampling against the rollout log-probs) or drop (skipped, reason ``stale``)."""
    tis_cap: float = 2.0
    """Truncation cap of the importance weight pi_learner / pi_rollout when staleness_mode is correct."""
    min_valid: int = 2
    """A group with fewer valid (finished) members is skipped with its reason."""
    max_untrainable_batches: int = 3
    """Stop the run with an error (exit 1) after this many batches in a row with nothing to train (every group skipped: say every session aborted), naming the main abort reason and a session to inspect (0: never stop)."""
    warmup_steps: int = 300
    """Supervised warm-up steps on task demonstrations before RL (0: start from random init)."""
    warmup_batch: int = 256
    """Demonstrations per warm-up step."""
    warmup_wrong_rate: float = 0.85
    """Fraction of warm-up answers replaced by a wrong value: teaches the protocol, not the copy."""
    warmup_lr_steps: int = 20
    """Linear lr warm-up steps of the supervised warm-up."""
    d_model: int = 64
    """Width of the built-in GPT."""
    n_layer: int = 2
    """Transformer blocks of the built-in GPT."""
    n_head: int = 4
    """Attention heads of the built-in GPT."""
    tie_embeddings: bool = True
    """Share input and output embeddings (decisive on the lookup task)."""
    embedding_init_std: float = 0.5
    """Std of the normal init of token and position embeddings (0 keeps the model's own 0.02, with which the lookup task does not learn)."""
    keep_checkpoints: int = 3
    """Newest checkpoints kept on disk (older ones are deleted; every 50th step is kept)."""
    fsync: str = "batch"
    """fsync policy of both logs: always, batch, interval or never."""
    torch_threads: int = 1
    """torch threads per process (the worker and the learner each get this many)."""
    warmup_threads: int = 2
    """torch threads of the learner during the supervised warm-up (the worker is idle then)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Injected faults (see FaultConfig)."""
    learner: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3, "warmup_steps": 10, "grad_clip": 1.0})
    """Overrides of learner.config.LearnerConfig (estimator, eps_clip, lr, ...)."""
    # --- the task's modules (the [task] table) ---
    task_modules: list[str] = field(default_factory=list)
    """Modules every loop process imports before selecting the task (they register it): `--import`, `[task] module`."""
    task_path: list[str] = field(default_factory=list)
    """Directories put in front of sys.path before importing task_modules (`[task] path`, resolved against the config file; absolute)."""
    # --- text tasks: the agent and its inference ---
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Text tasks: the agent harness each rollout session runs against the gateway (see AgentConfig)."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Text tasks: where model calls are served and how new weights reach it (see InferenceConfig)."""
    # --- the policy model and its metric sinks ---
    hf_model: str = ""
    """The policy: "" for the built-in GPT; a local Hugging Face model directory; or "tiny-llama" / "tiny-qwen2", a tiny random model built in code into the run folder (tests, examples). Each version is then published as an HF directory beside its checkpoint."""
    gradient_checkpointing: bool = False
    """Recompute the HF model's activations in the backward pass (less memory, more time)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks of the learner (the [metrics] table: tensorboard, wandb_project)."""
    # --- rollout workers ---
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout workers: how many, local processes or Ray actors (see RolloutConfig)."""
    # --- on-policy distillation ---
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: the teachers that score each finished session, and lambda (see DistillConfig)."""
    # --- where the run's logs live ---
    log: LogConfig = field(default_factory=LogConfig)
    """Where the run's logs live: files in the run folder, or a JetStream stream (see LogConfig)."""

    def __post_init__(self) -> None:
        if isinstance(self.faults, Mapping):
            self.faults = _from_mapping(FaultConfig, self.faults, "faults")
        # --- text tasks: [agent], [inference] ---
        if isinstance(self.agent, Mapping):
            self.agent = _from_mapping(AgentConfig, self.agent, "agent")
        if isinstance(self.inference, Mapping):
            self.inference = _from_mapping(InferenceConfig, self.inference, "inference")
        # --- [metrics], [rollout] ---
        if isinstance(self.metrics, Mapping):
            self.metrics = _from_mapping(MetricsConfig, self.metrics, "metrics")
        if isinstance(self.rollout, Mapping):
            self.rollout = _from_mapping(RolloutConfig, self.rollout, "rollout")
        if not isinstance(self.rollout, RolloutConfig):
            raise ConfigError(f"LoopConfig.rollout: expected a [rollout] table, found {self.rollout!r}")
        # --- [distill] ---
        if isinstance(self.distill, Mapping):
            self.distill = _from_mapping(DistillConfig, self.distill, "distill")
        if not isinstance(self.distill, DistillConfig):
            raise ConfigError(f"LoopConfig.distill: expected a [distill] table, found {self.distill!r}")
        # --- [log] ---
        if isinstance(self.log, Mapping):
            self.log = _from_mapping(LogConfig, self.log, "log")
        if not isinstance(self.log, LogConfig):
            raise ConfigError(f"LoopConfig.log: expected a [log] table, found {self.log!r}")
        if not isinstance(self.metrics, MetricsConfig):
            raise ConfigError(f"LoopConfig.metrics: expected a [metrics] table, found {self.metrics!r}")
        if not isinstance(self.hf_model, str):
            raise ConfigError(f"LoopConfig.hf_model: expected a directory or a tiny model name, found {self.hf_model!r}")
        if self.inference.backend != "in-process" and not self.hf_model:
            # A server loads published HF directories and tokenises with the model's own tokenizer;
            # the built-in GPT has neither.
            raise ConfigError(f"[inference] backend {self.inference.backend!r}: needs hf_model (the HF model the server was "
                              "launched on); the built-in GPT can only be served in-process")
        for name in ("steps", "stop_window", "groups_per_step", "group_size", "d_model", "n_layer", "n_head", "warmup_batch", "torch_threads", "warmup_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"LoopConfig.{name}: expected an int >= 1, found {v!r}")
        for name in ("max_lag", "max_staleness", "max_untrainable_batches", "warmup_steps", "warmup_lr_steps", "keep_checkpoints", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"LoopConfig.{name}: expected an int >= 0, found {v!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not 0 < self.temperature < math.inf:
            raise ConfigError(f"LoopConfig.temperature: expected a number > 0, found {self.temperature!r}")
        if self.staleness_mode not in STALENESS_MODES:
            raise ConfigError(f"LoopConfig.staleness_mode: expected one of {STALENESS_MODES}, found {self.staleness_mode!r}")
        if not 0.0 <= self.stop_reward <= 1.0:
            raise ConfigError(f"LoopConfig.stop_reward: expected a value in [0, 1] (0 disables), found {self.stop_reward!r}")
        if not self.time_budget_s >= 0:
            raise ConfigError(f"LoopConfig.time_budget_s: expected >= 0 (0 disables), found {self.time_budget_s!r}")
        if not self.tis_cap > 0:
            raise ConfigError(f"LoopConfig.tis_cap: expected > 0, found {self.tis_cap!r}")
        if not 0.0 <= self.warmup_wrong_rate <= 1.0:
            raise ConfigError(f"LoopConfig.warmup_wrong_rate: expected a fraction in [0, 1], found {self.warmup_wrong_rate!r}")
        if not 1 <= self.min_valid <= self.group_size:
            raise ConfigError(f"LoopConfig.min_valid: expected 1..group_size ({self.group_size}), found {self.min_valid!r}")
        if self.fsync not in ("always", "batch", "interval", "never"):
            raise ConfigError(f"LoopConfig.fsync: expected always, batch, interval or never, found {self.fsync!r}")
        if not isinstance(self.learner, Mapping):
            raise ConfigError(f"LoopConfig.learner: expected a table of LearnerConfig fields, found {self.learner!r}")
        # --- task modules: one name or a list ---
        for name in ("task_modules", "task_path"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x.strip() for x in v):
                raise ConfigError(f"LoopConfig.{name}: expected a list of non-empty strings, found {v!r}")
            setattr(self, name, [x.strip() for x in v])

    def reduce_config(self):
        """The reducer settings of this run (a :class:`agentlog.reducers.config.ReduceConfig`):
        what the online learner folds the rollout log with, and so what the offline check
        and every reading command of the run folder must fold it with too
        (:func:`run_reduce_config`)."""
        from agentlog.reducers.config import ReduceConfig

        return ReduceConfig(min_valid=self.min_valid)

    def learner_config(self):
        """The LearnerConfig this loop trains with (TIS switched on in correct mode)."""
        from agentlog.learner.config import LearnerConfig

        values = dict(self.learner)
        if self.staleness_mode == "correct":
            values.setdefault("tis_cap", self.tis_cap)
        # --- [distill] coef is the learner's distill_coef ---
        if self.distill.coef:
            given = values.setdefault("distill_coef", self.distill.coef)
            if given != self.distill.coef:
                raise ConfigError(f"distill_coef: [learner] says {given!r} and [distill] coef says {self.distill.coef!r}; keep one")
        check_field_types(LearnerConfig, values)
        return LearnerConfig.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe) of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, base_dir: Path | None = None) -> "LoopConfig":
        """Build from plain data; an unknown key raises and lists the known ones.
        Relative directories of a ``[task]`` table's ``path`` are resolved
        against ``base_dir`` (default: the current directory)."""
        cfg = _from_mapping(cls, task_table(values, base_dir), "")
        cfg.distill.resolve_paths(base_dir)  # teacher paths are relative to the config file
        return cfg

    def save(self, path: Path) -> None:
        """Write ``config.json`` (what the worker and learner processes read), atomically and durably."""
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> "LoopConfig":
        """Read a ``config.json`` written by :meth:`save`, or a TOML file."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from None
        if path.suffix == ".toml":
            try:
                values = tomllib.loads(raw.decode("utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        else:
            try:
                values = json.loads(raw)
            except ValueError as exc:
                raise ConfigError(f"{path}: not valid JSON: {exc}") from None
        try:
            return cls.from_dict(values, base_dir=path.parent)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


def run_reduce_config(run_dir: Path):
    """The reducer settings a run folder was trained with: :meth:`LoopConfig.reduce_config`
    of its ``config.json``, or None when ``run_dir`` holds no ``config.json`` (a bare log
    folds with the reducers' defaults). A config that cannot be read raises ConfigError
    naming the file."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    return LoopConfig.load(path).reduce_config()


# --- the [task] table ---
#: Keys of the ``[task]`` table -> the LoopConfig field each one sets.
TASK_TABLE_KEYS = {"name": "task", "module": "task_modules", "path": "task_path"}


def task_table(values: Mapping[str, Any], base_dir: Path | None) -> Mapping[str, Any]:
    """``values`` with a ``[task]`` table (``task`` given as a mapping) spread
    onto the flat fields: ``name`` -> ``task``, ``module`` (a str or a list)
    -> ``task_modules``, ``path`` -> ``task_path``, each directory made
    absolute against ``base_dir`` (the config file's directory, which is
    added to ``task_path`` itself when there are modules). Values without a
    table come back unchanged."""
    table = values.get("task")
    if not isinstance(table, Mapping):
        return values
    unknown = sorted(set(table) - set(TASK_TABLE_KEYS))
    if unknown:
        raise ConfigError(f"[task] unknown key(s) {unknown}; known keys are {sorted(TASK_TABLE_KEYS)}")
    for key in ("task_modules", "task_path"):
        if key in values:
            raise ConfigError(f"{key}: given both at the top level and in the [task] table; keep one")
    out = {k: v for k, v in values.items() if k != "task"}
    if "name" in table:
        if not isinstance(table["name"], str):
            raise ConfigError(f"[task] name: expected a task name (str), found {table['name']!r}")
        out["task"] = table["name"]
    for key in ("module", "path"):
        if key not in table:
            continue
        v = table[key]
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(x, str) and x.strip() for x in items):
            raise ConfigError(f"[task] {key}: expected a non-empty string or a list of them, found {v!r}")
        if key == "path":
            base = Path(base_dir) if base_dir is not None else Path.cwd()
            items = [os.path.abspath(base / x) for x in items]
        out[TASK_TABLE_KEYS[key]] = list(items)
    if out.get("task_modules") and base_dir is not None:
        # A module beside the config file imports without a `path` entry.
        here = os.path.abspath(base_dir)
        out["task_path"] = out.get("task_path", []) + ([here] if here not in out.get("task_path", []) else [])
    return out


#: Annotation names -> the Python types a config value of that name may have
#: (JSON and TOML hand back ints for whole floats, lists for tuples).
_ANNOTATION_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "None": (type(None),),
    "tuple": (tuple, list), "list": (list, tuple), "dict": (dict,),
}


def check_field_types(cls, values: Mapping[str, Any]) -> None:
    """Raise ConfigError naming ``cls.field``, the expected type and the value
    when a value of ``values`` does not have its field's annotated type (a
    bool is never taken for a number). Annotations this does not know are not
    checked. Without this, ``lr = "abc"`` got as far as ``"abc" > 0`` and a
    TypeError traceback."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in values.items():
        annotation = fields.get(name)
        if not isinstance(annotation, str):
            continue
        allowed: tuple[type, ...] = ()
        for part in annotation.split("|"):
            kinds = _ANNOTATION_TYPES.get(part.strip().split("[")[0])
            if kinds is None:
                allowed = ()  # an annotation we do not model: leave it to the class
                break
            allowed += kinds
        if not allowed:
            continue
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise ConfigError(f"{cls.__name__}.{name}: expected {annotation}, found {value!r}")


def _from_mapping(cls, values: Mapping[str, Any], where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        prefix = f"[{where}] " if where else ""
        raise ConfigError(f"{prefix}unknown key(s) {unknown}; known keys are {sorted(known)}")
    check_field_types(cls, values)
    try:
        return cls(**dict(values))
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def field_help(cls=LoopConfig) -> dict[str, str]:
    """Field name -> its docstring (the text under the field in the class body)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    out: dict[str, str] = {}
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
            out[node.target.id] = str(nxt.value.value)
    return out
