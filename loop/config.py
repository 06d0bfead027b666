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

This module owns :class:`LoopConfig`, its validation, ``config.json`` and
TOML loading and saving, the ``[task]`` table and :func:`field_help`. The
other tables (``[faults]``, ``[agent]``, ``[inference]``, ``[metrics]``,
``[rollout]``, ``[log]``, ``[distill]``) are :mod:`agentlog.loop.config_sections`;
the ones LoopConfig holds are importable from here too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# A loop configuration value out of range or unknown raises the package's one ConfigError.
from agentlog.events.errors import ConfigError
from agentlog.events.fs import atomic_file
from agentlog.events.schema.validation import is_number
from agentlog.reducers.abort_classes import EXCLUDE_ALL
from agentlog.reducers.health import check_flag_names

from .config_sections import (
    AgentConfig,
    DistillConfig,
    FaultConfig,
    GroupsConfig,
    InferenceConfig,
    LogConfig,
    MetricsConfig,
    ResumeConfig,
    RolloutConfig,
    _from_mapping,
    check_field_types,
)
from .staleness import STALENESS_MODES


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
    mismatch_warn_abs_diff: float = 0.05
    """Warn (learner.train_rollout_mismatch; metric stats/train_rollout_mismatch_warned) when a step's mean |learner - rollout log-prob| over the trained tokens of the learner's own version exceeds this: the inference engine does not compute what the trainer does. The built-in GPT in-process gives 0; bf16 servers typically 0.01-0.03; slime's CI fails at 0.1."""
    min_valid: int = 2
    """A group with fewer valid (finished) members is skipped with its reason."""
    allow_repeated_targets: bool = False
    """Train a branching session's shared ancestor turns in every row that holds them (repeated targets), not once (the default: each generated token is a target at most once)."""
    untrainable_flags: list[str] = field(default_factory=list)
    """Health flags that make a session untrainable (drift, no_reward, teacher_missing, truncated, undelivered, version_span): a finished member carrying one is one zero-masked placeholder, out of its group's baseline (empty: none; version_span's bound is max_staleness)."""
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
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Text tasks: sandbox snapshots, and resuming a killed worker's sessions (see ResumeConfig)."""
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
    # --- how groups spend rollouts ---
    groups: GroupsConfig = field(default_factory=GroupsConfig)
    """What each class of abort gets, and dynamic sampling (see GroupsConfig)."""

    def __post_init__(self) -> None:
        if isinstance(self.faults, Mapping):
            self.faults = _from_mapping(FaultConfig, self.faults, "faults")
        # --- text tasks: [agent], [inference] ---
        if isinstance(self.agent, Mapping):
            self.agent = _from_mapping(AgentConfig, self.agent, "agent")
        if isinstance(self.inference, Mapping):
            self.inference = _from_mapping(InferenceConfig, self.inference, "inference")
        if isinstance(self.resume, Mapping):
            self.resume = _from_mapping(ResumeConfig, self.resume, "resume")
        if not isinstance(self.resume, ResumeConfig):
            raise ConfigError(f"LoopConfig.resume: expected a [resume] table, found {self.resume!r}")
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
        # --- [groups] ---
        if isinstance(self.groups, Mapping):
            self.groups = _from_mapping(GroupsConfig, self.groups, "groups")
        if not isinstance(self.groups, GroupsConfig):
            raise ConfigError(f"LoopConfig.groups: expected a [groups] table, found {self.groups!r}")
        # --- [log] ---
        if isinstance(self.log, Mapping):
            self.log = _from_mapping(LogConfig, self.log, "log")
        if not isinstance(self.log, LogConfig):
            raise ConfigError(f"LoopConfig.log: expected a [log] table, found {self.log!r}")
        if not isinstance(self.metrics, MetricsConfig):
            raise ConfigError(f"LoopConfig.metrics: expected a [metrics] table, found {self.metrics!r}")
        if not isinstance(self.hf_model, str):
            raise ConfigError(f"LoopConfig.hf_model: expected a directory or a tiny model name, found {self.hf_model!r}")
        # A server's partial modes: what it reports decides what the log can record exactly.
        server, mode = self.inference.backend, self.rollout.weight_update
        supported = {"sglang": ("drain", "resubmit"), "vllm": ("drain", "resubmit")}.get(server, (mode,))
        if mode not in supported:
            raise ConfigError(
                f"[rollout] weight_update {mode!r} with [inference] backend {server!r}: not supported (a server that keeps "
                f"its KV cache through an update reports no per-token version boundary); use one of {supported}")
        if self.inference.backend != "in-process" and not self.hf_model:
            # A server loads published HF directories and tokenises with the model's own tokenizer;
            # the built-in GPT has neither.
            raise ConfigError(f"[inference] backend {self.inference.backend!r}: needs hf_model (the HF model the server was "
                              "launched on); the built-in GPT can only be served in-process")
        for name in ("steps", "stop_window", "groups_per_step", "group_size", "d_model", "n_layer", "n_head", "warmup_batch", "torch_threads", "warmup_threads",
                     "keep_checkpoints"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"LoopConfig.{name}: expected an int >= 1, found {v!r}")
        for name in ("max_lag", "max_staleness", "max_untrainable_batches", "warmup_steps", "warmup_lr_steps", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"LoopConfig.{name}: expected an int >= 0, found {v!r}")
        if not is_number(self.temperature, above=0):
            raise ConfigError(f"LoopConfig.temperature: expected a number > 0, found {self.temperature!r}")
        if self.staleness_mode not in STALENESS_MODES:
            raise ConfigError(f"LoopConfig.staleness_mode: expected one of {STALENESS_MODES}, found {self.staleness_mode!r}")
        if not 0.0 <= self.stop_reward <= 1.0:
            raise ConfigError(f"LoopConfig.stop_reward: expected a value in [0, 1] (0 disables), found {self.stop_reward!r}")
        if not self.time_budget_s >= 0:
            raise ConfigError(f"LoopConfig.time_budget_s: expected >= 0 (0 disables), found {self.time_budget_s!r}")
        if not self.tis_cap > 0:
            raise ConfigError(f"LoopConfig.tis_cap: expected > 0, found {self.tis_cap!r}")
        v = self.mismatch_warn_abs_diff
        if not is_number(v, at_least=0):
            raise ConfigError(f"LoopConfig.mismatch_warn_abs_diff: expected a finite number >= 0, found {v!r}")
        if not 0.0 <= self.warmup_wrong_rate <= 1.0:
            raise ConfigError(f"LoopConfig.warmup_wrong_rate: expected a fraction in [0, 1], found {self.warmup_wrong_rate!r}")
        if not 1 <= self.min_valid <= self.group_size:
            raise ConfigError(f"LoopConfig.min_valid: expected 1..group_size ({self.group_size}), found {self.min_valid!r}")
        if not isinstance(self.allow_repeated_targets, bool):
            raise ConfigError(f"LoopConfig.allow_repeated_targets: expected true or false, found {self.allow_repeated_targets!r}")
        problem = check_flag_names(self.untrainable_flags, "LoopConfig.untrainable_flags")
        if problem:
            raise ConfigError(problem)
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
        (loaded through the folder's :class:`~agentlog.loop.run_folder.Run`). The health
        flags' bounds come from the run: ``version_span`` past ``max_staleness`` (such a
        session is stale whenever it is trained), ``teacher_missing`` on every finished
        session when ``[distill]`` has teachers."""
        from agentlog.reducers.config import ReduceConfig

        g = self.groups
        return ReduceConfig(min_valid=self.min_valid, abort_outcomes=g.outcomes(), abort_reasons=dict(g.reasons),
                            fail_reward=float(g.fail_reward), max_refills=g.max_refills,
                            allow_repeated_targets=self.allow_repeated_targets, max_version_span=self.max_staleness,
                            expect_teacher_scores=bool(self.distill.teachers), untrainable_flags=tuple(self.untrainable_flags))

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
        Relative directories of a ``[task]`` table's ``path``, the teachers' paths and
        ``[log] weights_cache`` are resolved against ``base_dir`` (default: the current
        directory), ``~`` expanded."""
        moved = sorted(k for k in MOVED_TO_GROUPS if k in values)
        if moved:
            raise ConfigError(f"{', '.join(moved)}: moved to the [groups] table (e.g. [groups] dynamic_sampling = true)")
        cfg = _from_mapping(cls, task_table(values, base_dir), "")
        cfg.distill.resolve_paths(base_dir)
        if cfg.log.weights_cache:  # as [task] path: against the config file's folder, so every process finds one folder
            base = Path(base_dir) if base_dir is not None else Path.cwd()
            cfg.log.weights_cache = os.path.abspath(base / os.path.expanduser(cfg.log.weights_cache))
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
            values = saved_groups_table(values)
        try:
            return cls.from_dict(values, base_dir=path.parent)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


#: Keys that sat at the top level before the [groups] table held them.
MOVED_TO_GROUPS = ("dynamic_sampling", "spread_tolerance")


def saved_groups_table(values: Any) -> Any:
    """A saved ``config.json`` with its ``[groups]`` table as this version reads it.
    One saved before the table existed (it holds every other field) ran with every abort excluded: it gets that
    (so its samples rebuild byte for byte), not the table's new defaults; one saved
    while dynamic sampling sat at the top level has those keys moved into the table."""
    if not isinstance(values, dict) or "groups" in values or "min_valid" not in values:
        return values  # a full save (every field since long before the table has min_valid), or a hand-written file
    out = dict(values)
    groups: dict[str, Any] = dict(EXCLUDE_ALL)
    for key in MOVED_TO_GROUPS:
        if key in out:
            groups[key] = out.pop(key)
    out["groups"] = groups
    return out


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


def field_help(cls=LoopConfig) -> dict[str, str]:
    """Field name -> its docstring (the text under the field in the class body).
    LookupError when the class is not defined by a class statement of its
    module (at the top level or nested in another class)."""
    docs = _class_field_docs(cls.__module__).get(cls.__qualname__)
    if docs is None:
        raise LookupError(f"field_help: no class statement of {cls.__qualname__} in the source of {cls.__module__}")
    return dict(docs)


@functools.cache
def _class_field_docs(module: str) -> dict[str, dict[str, str]]:
    """Class qualname -> {field name: docstring} for every class of ``module``,
    from one parse of its source: ``inspect.getsource`` of each class would
    parse the whole module again (the help of ``train`` reads 30 classes)."""
    import ast
    import inspect
    import sys

    out: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                docs = out.setdefault(prefix + node.name, {})
                for field_node, nxt in zip(node.body, node.body[1:]):
                    if (isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name)
                            and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                        docs[field_node.target.id] = str(nxt.value.value)
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(inspect.getsource(sys.modules[module])).body, "")
    return out
