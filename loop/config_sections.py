"""The tables of a run's config: ``[faults]`` (:class:`FaultConfig`), ``[agent]`` (:class:`AgentConfig`),
``[inference]`` (:class:`InferenceConfig`), ``[metrics]`` (:class:`MetricsConfig`), ``[rollout]`` (:class:`RolloutConfig`),
``[log]`` (:class:`LogConfig`: where the logs live, files or a JetStream stream, and how file logs compress),
``[groups]`` (:class:`GroupsConfig`: abort classes, dynamic sampling) and ``[distill]`` (:class:`DistillConfig`, with its
``[[distill.teachers]]``, :class:`TeacherSpec`): each a dataclass that checks
its own values. And how a table is built from plain data (JSON, TOML):
:func:`check_field_types` and ``_from_mapping``, which name the table, the
field and the value that is wrong.

:class:`agentlog.loop.config.LoopConfig` holds one of each; it and its
load, save and validation are :mod:`agentlog.loop.config`, which re-exports
the tables it holds.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

# A loop configuration value out of range or unknown raises the package's one ConfigError.
from agentlog.events.errors import ConfigError
from agentlog.events.schema.turn import WEIGHT_UPDATE_MODES
from agentlog.events.schema.validation import is_number
from agentlog.reducers.abort_classes import ABORT_CLASSES, RUN_OUTCOMES, check_abort_settings


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
        if not is_number(self.timeout_budget_s, above=0):
            raise ConfigError(f"FaultConfig.timeout_budget_s: expected a finite number of seconds > 0, found {self.timeout_budget_s!r}")

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
            if not is_number(v, above=0):
                raise ConfigError(f"[agent] {name}: expected a number of seconds > 0, found {v!r}")
        if type(self.max_tool_calls) is not int or self.max_tool_calls < 1:
            raise ConfigError(f"[agent] max_tool_calls: expected an int >= 1, found {self.max_tool_calls!r}")
        if type(self.max_tokens) is not int or self.max_tokens < 0:
            raise ConfigError(f"[agent] max_tokens: expected an int >= 1 (0: the task's max_new_tokens), found {self.max_tokens!r}")


def _check_base_url(where: str, url: str) -> None:
    from agentlog.gateway.http_json import base_url_problem

    if problem := base_url_problem(url):
        raise ConfigError(f"{where}: expected the server's http(s) base URL (http://host:port), found {url!r}: {problem}")


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
    servers: list[Any] = field(default_factory=list)
    """A fleet instead of one server: each entry a base URL (sglang / vllm), a table {url, served_dir, name}, or "in-process" (one more replica of the policy in the worker). Each session is routed to one server (route_by); every new version goes to every server."""
    route_by: str = "session"
    """Fleet routing key, also sent upstream in routing_header: session (each session keeps one server's prefix cache) or group (a group's members share one server and their common prompt prefix)."""
    route_policy: str = "affinity"
    """Fleet: affinity (consistent hashing on the routing key with bounded load) or round_robin (no affinity; a baseline)."""
    load_factor: float = 1.25
    """Fleet: a server holds up to this times its share of the sessions (routing keys used within the last 10 minutes) before a new one goes on to the next server."""
    probe_interval_s: float = 2.0
    """Fleet: seconds between health probes of every server (GET /health); a failing server is taken out of routing."""
    routing_header: str | None = None
    """Header that carries each request's routing key to an HTTP server or the user's own router (unset: X-SMG-Routing-Key, which sglang-router's consistent_hashing policy hashes; "": none)."""

    def __post_init__(self) -> None:
        if self.backend not in INFERENCE_BACKENDS:
            raise ConfigError(f"[inference] backend: expected one of {INFERENCE_BACKENDS}, found {self.backend!r}")
        if self.servers:
            self.servers = self._fleet_servers()
        elif self.backend != "in-process" and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"[inference] url: backend {self.backend!r} needs the server's http(s) base URL, found {self.url!r}")
        elif self.backend == "vllm" and not self.served_dir:
            raise ConfigError("[inference] served_dir: backend 'vllm' needs the directory its server was launched on (vLLM reloads from there)")
        if not self.servers and self.backend != "in-process":
            _check_base_url("[inference] url", self.url)
        if type(self.context_length) is not int or self.context_length < 64:
            raise ConfigError(f"[inference] context_length: expected an int >= 64, found {self.context_length!r}")
        from agentlog.gateway.backends import HEADER_NAME
        from agentlog.gateway.fleet import ROUTE_POLICIES
        from agentlog.gateway.server import ROUTE_BY

        for name, allowed in (("route_by", ROUTE_BY), ("route_policy", ROUTE_POLICIES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"[inference] {name}: expected one of {allowed}, found {getattr(self, name)!r}")
        for name, expected, ok in (("load_factor", "a number >= 1", is_number(self.load_factor, at_least=1)),
                                   ("probe_interval_s", "seconds > 0", is_number(self.probe_interval_s, above=0))):
            v = getattr(self, name)
            if not ok:
                raise ConfigError(f"[inference] {name}: expected {expected}, found {v!r}")
        if self.routing_header is not None and (not isinstance(self.routing_header, str)
                                                or (self.routing_header and not HEADER_NAME.fullmatch(self.routing_header))):
            raise ConfigError(f"[inference] routing_header: expected an HTTP header name (letters, digits, '-') or \"\", found {self.routing_header!r}")

    def _fleet_servers(self) -> list[dict[str, str]]:
        """``servers`` as tables {name, url, served_dir}, checked: one kind of server, unique names."""
        if not isinstance(self.servers, (list, tuple)):
            raise ConfigError(f"[inference] servers: expected a list of server URLs, tables or \"in-process\", found {self.servers!r}")
        if self.url:
            raise ConfigError(f"[inference] url and servers: give one server in url, or a fleet in servers, not both (url is {self.url!r})")
        out: list[dict[str, str]] = []
        for i, entry in enumerate(self.servers):
            where = f"[inference] servers[{i}]"
            spec = {"url": entry} if isinstance(entry, str) else entry
            if not isinstance(spec, Mapping) or not set(spec) <= {"url", "served_dir", "name"} or not isinstance(spec.get("url"), str):
                raise ConfigError(f"{where}: expected a URL, \"in-process\" or a table {{url, served_dir, name}}, found {entry!r}")
            url = spec["url"]
            if (url == "in-process") != (self.backend == "in-process"):
                raise ConfigError(f"{where}: backend {self.backend!r} takes " + ("\"in-process\" entries" if self.backend == "in-process"
                                  else "http(s) base URLs") + f", found {url!r}")
            if url != "in-process" and not url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}: expected the server's http(s) base URL, found {url!r}")
            if url != "in-process":
                _check_base_url(where, url)
            served_dir = spec.get("served_dir", self.served_dir if len(self.servers) == 1 else "")
            if self.backend == "vllm" and not served_dir:
                raise ConfigError(f"{where}: backend 'vllm' needs served_dir, the directory this server was launched on")
            default_name = f"in-process-{i}" if url == "in-process" else url.split("://", 1)[1].rstrip("/")
            name = spec.get("name", default_name)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}: name: expected a non-empty str, found {name!r}")
            out.append({"name": name, "url": url, "served_dir": str(served_dir)})
        names = [s["name"] for s in out]
        if len(set(names)) != len(names):
            raise ConfigError(f"[inference] servers: names must be unique (give each a name), found {names}")
        return out


@dataclass
class MetricsConfig:
    """Where the learner's metrics go besides its log (the source of truth): the ``[metrics]`` table."""

    tensorboard: bool = True
    """Write TensorBoard event files under ``<run>/tensorboard`` (needs the tensorboard extra; a note in the log when missing)."""
    wandb_project: str = ""
    """Log to this Weights & Biases project when ``wandb`` is installed ("" : $WANDB_PROJECT, if set; else off)."""


@dataclass
class ResumeConfig:
    """Resuming the sessions a killed rollout worker left running (the ``[resume]`` table; text tasks with a
    resumable harness: loop/resume.py)."""

    enabled: bool = True
    """Snapshot each session's sandbox before every turn, and resume orphaned sessions on restart instead of aborting them."""
    max_resumes: int = 2
    """Most resumes of one session; an orphan resumed this often already is aborted (engine_restart)."""
    restore_timeout_s: float = 120.0
    """Longest a sandbox restore may take before the session is aborted instead."""
    keep_aborted_s: float = 86400.0
    """How long an aborted session's last snapshot is kept (for debugging; 0: not kept)."""

    def __post_init__(self) -> None:
        if type(self.enabled) is not bool:
            raise ConfigError(f"[resume] enabled: expected true or false, found {self.enabled!r}")
        if type(self.max_resumes) is not int or self.max_resumes < 0:
            raise ConfigError(f"[resume] max_resumes: expected an int >= 0, found {self.max_resumes!r}")
        for name, zero_ok in (("restore_timeout_s", False), ("keep_aborted_s", True)):
            v = getattr(self, name)
            if not (is_number(v, at_least=0) if zero_ok else is_number(v, above=0)):
                raise ConfigError(f"[resume] {name}: expected a number of seconds {'>= 0' if zero_ok else '> 0'}, found {v!r}")


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
    weight_update: str = "drain"
    """How a new policy version meets generation in flight in the in-process policy: drain (it finishes under the old
    weights; new ones load between batches / turns), continue (applied at the next token, the KV cache kept) or resubmit
    (applied at the next token, the partial output resubmitted as prompt); both partial modes record each token's version."""

    def __post_init__(self) -> None:
        from agentlog.events.log.partitions import MAX_PARTITIONS

        if type(self.workers) is not int or not 1 <= self.workers <= MAX_PARTITIONS:
            raise ConfigError(f"[rollout] workers: expected an int in 1..{MAX_PARTITIONS} (one log partition "
                              f"p0000..p{MAX_PARTITIONS - 1} each), found {self.workers!r}")
        if self.weight_update not in WEIGHT_UPDATE_MODES:
            raise ConfigError(f"[rollout] weight_update: expected one of {WEIGHT_UPDATE_MODES}, found {self.weight_update!r}")
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
        builtin = sorted(k for k in self.resources if k in ("CPU", "GPU"))
        if builtin:
            raise ConfigError(f"[rollout] resources: expected custom resource names, found Ray's built-in {builtin[0]!r} "
                              "(Ray refuses CPU and GPU there; CPUs are [rollout] num_cpus, and a GPU node can be "
                              "given a custom resource, e.g. ray start --resources='{\"agentlog_rollout\": 1}')")
        self.resources = {k: float(v) for k, v in self.resources.items()}
        for name in ("num_cpus", "lost_after_s"):
            v = getattr(self, name)
            if not is_number(v, at_least=0):
                raise ConfigError(f"[rollout] {name}: expected a number >= 0, found {v!r}")
        # Ray refuses fractional amounts finer than 1/10000 (ValueError from ray.remote(...).options()).
        for name, v in [("num_cpus", self.num_cpus), *(("resources", a) for a in self.resources.values())]:
            if abs(v * 10_000 - round(v * 10_000)) > 1e-6:
                raise ConfigError(f"[rollout] {name}: expected an amount in steps of 0.0001 (Ray's precision), found {v!r}")

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
#: How rollout workers get a version's weights on a nats run ([log] weights; loop/weight_store.py).
WEIGHTS_MODES = ("auto", "store", "folder")


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
    compression: str = "none"
    """file: none, or zstd (each flush's records in zstd batches of up to 256 KiB, read back transparently)."""
    weights: str = "auto"
    """nats: how rollout workers get each version's weights: auto (the run folder's checkpoint when their host sees it,
    else fetched from the run's JetStream object store), store (always fetched), folder (a shared folder only)."""
    weights_chunk_kib: int = 128
    """nats: chunk size of the weights in the object store (KiB; at most the server's max_payload, 1 MiB by default)."""
    weights_timeout_s: float = 60.0
    """nats: longest a version's put (learner) or fetch (worker) may go without moving a chunk (seconds)."""
    weights_cache: str = ""
    """nats: where workers keep fetched versions ("": <run>/weights-cache), in <cache>/<stream>/<worker>."""

    def __post_init__(self) -> None:
        from agentlog.events.log.format import COMPRESSIONS
        from agentlog.events.log.jetstream_url import STREAM_RE, parse_nats_url

        if self.backend not in LOG_BACKENDS:
            raise ConfigError(f"[log] backend: expected one of {LOG_BACKENDS}, found {self.backend!r}")
        for name in ("url", "stream"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"[log] {name}: expected a str, found {getattr(self, name)!r}")
        given = [name for name in ("url", "stream") if getattr(self, name)]
        if self.backend == "file" and given:
            raise ConfigError(f"[log] {given[0]}: only the nats backend takes it (backend is 'file')")
        if self.backend == "nats":
            if not self.url:
                raise ConfigError("[log] url: backend 'nats' needs the servers' URL, e.g. nats://127.0.0.1:4222")
            if not self.url.startswith("nats://"):
                raise ConfigError(f"[log] url: expected nats://host:port[,host:port], found {self.url!r}")
            if "/" in self.url.removeprefix("nats://"):
                raise ConfigError(f"[log] url: expected nats://host:port[,host:port] without a path (the stream goes in [log] stream), found {self.url!r}")
            try:
                parse_nats_url(f"{self.url}/stream")
            except ValueError as exc:
                raise ConfigError(f"[log] url: expected nats://host:port[,host:port], found {self.url!r} ({exc})") from None
            if self.stream and not STREAM_RE.fullmatch(self.stream):
                raise ConfigError(f"[log] stream: expected letters, digits, '-' or '_' (1..200 of them), found {self.stream!r}")
        if type(self.replicas) is not int or not 1 <= self.replicas <= 5:
            raise ConfigError(f"[log] replicas: expected an int in 1..5, found {self.replicas!r}")
        if self.weights not in WEIGHTS_MODES:
            raise ConfigError(f"[log] weights: expected one of {WEIGHTS_MODES}, found {self.weights!r}")
        if self.backend == "file" and self.weights == "store":
            raise ConfigError("[log] weights: 'store' needs backend 'nats' (the JetStream object store); with backend 'file' the weights are in <run>/checkpoints")
        if type(self.weights_chunk_kib) is not int or not 1 <= self.weights_chunk_kib <= 65536:
            raise ConfigError(f"[log] weights_chunk_kib: expected an int in 1..65536 (KiB), found {self.weights_chunk_kib!r}")
        if not is_number(self.weights_timeout_s, above=0):
            raise ConfigError(f"[log] weights_timeout_s: expected a number of seconds > 0, found {self.weights_timeout_s!r}")
        if not isinstance(self.weights_cache, str):
            raise ConfigError(f"[log] weights_cache: expected a folder path (str), found {self.weights_cache!r}")
        if not is_number(self.duplicate_window_s, above=0):
            raise ConfigError(f"[log] duplicate_window_s: expected a number of seconds > 0, found {self.duplicate_window_s!r}")
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"[log] compression: expected one of {COMPRESSIONS}, found {self.compression!r}")
        if self.backend == "nats" and self.compression != "none":
            raise ConfigError(f"[log] compression: {self.compression!r} needs backend 'file' (nats stores each record as a message of its own); expected 'none'")

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
        if not is_number(self.coef, at_least=0):
            raise ConfigError(f"[distill] coef: expected a number >= 0, found {self.coef!r}")
        if self.coef > 0 and not self.teachers:
            raise ConfigError(f"[distill] coef is {self.coef}, and no teachers are configured; add [[distill.teachers]]")
        if type(self.topk) is not int or self.topk < 0:
            raise ConfigError(f"[distill] topk: expected an int >= 0, found {self.topk!r}")
        if not is_number(self.timeout_s, above=0):
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
class GroupsConfig:
    """How groups spend rollouts: what each class of abort gets, dynamic sampling and
    over-sampling (the ``[groups]`` table; :mod:`agentlog.reducers.abort_classes`)."""

    infrastructure: str = RUN_OUTCOMES["infrastructure"]
    """What an abort of the infrastructure class gets (engine_restart, setup_failed, agent_crashed, exception, empty_done_marker, server_error): exclude (out of the baseline, zero gradient), fail (in the baseline with fail_reward, its turns trained) or refill (excluded, and a replacement session for the same prompt joins the group)."""
    policy: str = RUN_OUTCOMES["policy"]
    """What an abort of the policy class gets (wall_clock_timeout, too_many_tool_calls, max_turns, context_exceeded): fail by default, since the policy caused it and refilling would hide that cost from training."""
    task: str = RUN_OUTCOMES["task"]
    """What an abort of the task class gets (verifier_failed)."""
    other: str = RUN_OUTCOMES["other"]
    """What an abort whose reason no table names gets."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Abort reason (exact, or its head before ":") -> class, over the built-in table: {"my_sandbox_died" = "infrastructure"}."""
    fail_reward: float = 0.0
    """The reward of an aborted member counted as a failure."""
    max_refills: int = 2
    """Replacements one group may get; past it, an abort of a refill class is excluded."""
    dynamic_sampling: bool = False
    """Filter groups whose valid rewards have no spread (DAPO's dynamic sampling): all their advantages are 0, so such a group is recorded as skipped (reason ``zero spread``) instead of trained, and the worker draws a new prompt in its place (up to max_redraws). The metrics count the filtered ones (``rollout/groups_filtered``)."""
    spread_tolerance: float = 0.0
    """With dynamic_sampling: a group whose valid rewards differ by at most this has no spread."""
    max_redraws: int = 2
    """With dynamic_sampling: new prompts drawn in place of one filtered group; a step then has at most groups_per_step x (1 + max_redraws) groups, and trains what it has (its shortfall recorded)."""
    oversample: float = 0.0
    """Over-sampling: start groups_per_step x (1 + oversample) groups per batch, train the first groups_per_step that complete, and cancel the rest (dropped, reason ``oversampled``). Favours short episodes: see ``rollout/len_trained`` against ``rollout/len_started``."""

    def __post_init__(self) -> None:
        problem = check_abort_settings(self.outcomes(), self.reasons, self.fail_reward, self.max_refills, "[groups]")
        if problem:
            raise ConfigError(problem)
        if type(self.max_redraws) is not int or self.max_redraws < 0:
            raise ConfigError(f"[groups] max_redraws: expected an int >= 0, found {self.max_redraws!r}")
        if not is_number(self.oversample, at_least=0) or self.oversample > 10:
            raise ConfigError(f"[groups] oversample: expected a fraction of extra groups in [0, 10], found {self.oversample!r}")
        if not isinstance(self.dynamic_sampling, bool):
            raise ConfigError(f"[groups] dynamic_sampling: expected true or false, found {self.dynamic_sampling!r}")
        if (not isinstance(self.spread_tolerance, (int, float)) or isinstance(self.spread_tolerance, bool)
                or not 0 <= self.spread_tolerance < math.inf):
            raise ConfigError(f"[groups] spread_tolerance: expected a finite number >= 0, found {self.spread_tolerance!r}")

    def outcomes(self) -> dict[str, str]:
        """Abort class -> its outcome."""
        return {cls: getattr(self, cls) for cls in ABORT_CLASSES}

    def groups_started(self, groups_per_step: int) -> int:
        """Base groups a batch starts: ``groups_per_step``, plus the over-sampled ones."""
        return math.ceil(groups_per_step * (1 + self.oversample) - 1e-9)


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
