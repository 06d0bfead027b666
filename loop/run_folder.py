"""A run folder and its logs: :class:`Run`, the one owner of the layout.

::

    <run>/config.json     the LoopConfig every process reads (Run.config)
    <run>/rollout/        the rollout log, or its partitions pNNNN/ (file backend)
    <run>/learner/        the learner log (file backend)
    <run>/checkpoints/    the policy checkpoints (Run.checkpoints)
    <run>/weights-cache/  versions a worker fetched from the object store (nats; Run.weights_cache)

With ``[log] backend = "nats"`` the logs are the subjects ``<stream>.pNNNN``
(a single rollout log is partition 0) and ``<stream>.learner`` of one
JetStream stream; the folder still holds ``config.json`` and the checkpoints,
and each version also goes to the stream's object store bucket
(:meth:`Run.weight_store`), from which a worker on a host without the
folder's checkpoints fetches it (:mod:`agentlog.loop.weight_store`).
Either way :attr:`Run.rollout` and :attr:`Run.learner` are
:class:`~agentlog.events.log.source.LogSource` objects (opened by
:func:`~agentlog.events.log.source.open_source` from the location the
config names), and the writers are opened through them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentlog.events.log.api import EventLog
from agentlog.events.log.source import RUN_CONFIG, RUN_LEARNER_LOG, RUN_ROLLOUT_LOG, LogSource, LogTail, open_source

from .config import LoopConfig

if TYPE_CHECKING:
    from .weight_store import WeightStore

#: The checkpoints folder inside a run folder.
RUN_CHECKPOINTS = "checkpoints"
#: The default folder of the versions workers fetched from the object store.
RUN_WEIGHTS_CACHE = "weights-cache"


class Run:
    """One run folder: its typed config, its logs and where its checkpoints go.

    ``Run.open(run_dir)`` reads ``config.json``; close it when done (or use
    ``with``): on JetStream it holds one read-only connection, opened on
    first use, and the learner tails it handed out."""

    def __init__(self, run_dir: str | Path, config: LoopConfig) -> None:
        self.dir = Path(run_dir)
        self.config = config
        #: The rollout partition ids, or None for a run with a single rollout log.
        self.partitions: list[int] | None = config.rollout.partitions() if config.rollout.partitioned else None
        #: The rollout logs: a log or partition root (file), or the run's stream (nats: every partition).
        self.rollout: LogSource = open_source(self.logs_location(), check=False, partitioned=self.partitions is not None)
        #: The learner log: ``<run>/learner``, or the subject ``<stream>.learner``.
        self.learner: LogSource = self.rollout.sibling(RUN_LEARNER_LOG)
        self.rollout.run_dir = self.learner.run_dir = self.dir
        self._tails: list[LogTail] = []
        self._weights: WeightStore | None = None

    @classmethod
    def open(cls, run_dir: str | Path, config: LoopConfig | None = None) -> "Run":
        """The run at ``run_dir`` (``config``: its LoopConfig; default: read from its ``config.json``)."""
        return cls(run_dir, config if config is not None else cls.load_config(run_dir))

    @classmethod
    def at(cls, path: str | Path) -> "Run | None":
        """The run whose folder is ``path``, or None when ``path`` holds no
        ``config.json`` (a bare log). A config that does not load raises ConfigError naming it."""
        return cls.open(path) if cls.has_config(path) else None

    @staticmethod
    def load_config(run_dir: str | Path) -> LoopConfig:
        """The typed config of the run at ``run_dir`` (its ``config.json``; ConfigError naming it otherwise)."""
        return LoopConfig.load(Run.config_file(run_dir))

    @staticmethod
    def save_config(run_dir: str | Path, config: LoopConfig) -> None:
        """Write ``config`` as the run's ``config.json`` (atomically), what every process of the run reads."""
        config.save(Run.config_file(run_dir))

    @staticmethod
    def config_file(run_dir: str | Path) -> Path:
        """``<run_dir>/config.json``."""
        return Path(run_dir) / RUN_CONFIG

    @staticmethod
    def folder_of_checkpoint(checkpoint: str | Path) -> Path | None:
        """The run folder a checkpoint file sits in (``<run>/checkpoints/policy-vNNNNN.pt``), or None."""
        parent = Path(checkpoint).resolve().parent
        return parent.parent if parent.name == RUN_CHECKPOINTS else None

    @staticmethod
    def has_config(run_dir: str | Path) -> bool:
        """Whether ``run_dir`` holds a run's ``config.json``."""
        return Run.config_file(run_dir).is_file()

    # -- layout ---------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        """``<run>/config.json``."""
        return self.config_file(self.dir)

    @property
    def checkpoints(self) -> Path:
        """``<run>/checkpoints``: the policy checkpoints the learner saves."""
        return self.dir / RUN_CHECKPOINTS

    def weights_cache(self, worker_id: str) -> Path:
        """Where worker ``worker_id`` keeps the versions it fetched from the object
        store: ``<[log] weights_cache, default <run>/weights-cache>/<stream>/<worker_id>``."""
        root = Path(self.config.log.weights_cache) if self.config.log.weights_cache else self.dir / RUN_WEIGHTS_CACHE
        return root / self.stream / worker_id

    @property
    def stream(self) -> str:
        """The run's JetStream stream (as its config pins it, or named after the folder)."""
        return self.config.log.stream_for(self.dir)

    def logs_location(self) -> str:
        """Where the rollout logs live: ``<run>/rollout``, or the stream's URL
        (the one place a run's ``[log]`` backend is looked at; the source opened from it does the rest)."""
        log = self.config.log
        if log.backend == "nats":
            return f"{log.url}/{self.stream}"
        return str(self.dir / RUN_ROLLOUT_LOG)

    @property
    def logs_elsewhere(self) -> bool:
        """Whether the logs live outside the run folder (on JetStream), so that the folder itself holds no log."""
        return self.logs_location() != str(self.dir / RUN_ROLLOUT_LOG)

    def describe(self) -> str:
        """Where the logs are, in words (for a summary line)."""
        parts = f"{len(self.partitions)} partitions, one per worker" if self.partitions is not None else "rollout"
        return f"{self.rollout} ({parts}), {self.learner} (learner)"

    def open_rollout_view(self, *, allow_empty: bool = False) -> LogSource:
        """The rollout logs opened and checked for reading (what a command
        given this run folder reads), with one-line errors naming the folder
        and, when they live on JetStream, the stream (see
        :func:`~agentlog.events.log.source.open_source`); close it."""
        label = f"{self.dir} (its logs: {self.logs_location()})" if self.logs_elsewhere else None
        source = open_source(self.logs_location() if label else self.dir, allow_empty=allow_empty, label=label)
        source.run_dir = self.dir
        return source

    # -- sources --------------------------------------------------------------

    def rollout_log(self, partition: int | None) -> LogSource:
        """The rollout log a worker writes (``partition`` None: the run's single rollout log)."""
        if partition is None:
            return self.rollout.partition(0) if self.rollout.partitioned else self.rollout
        return self.rollout.partition(partition)

    def rollout_logs(self) -> dict[int, LogSource]:
        """Partition id -> rollout log: ``{0: the single log}`` or one entry per partition."""
        if self.partitions is None:
            return {0: self.rollout_log(None)}
        return {pid: self.rollout_log(pid) for pid in self.partitions}

    def existing_rollout_logs(self) -> dict[int, LogSource]:
        """The rollout logs that have been created."""
        return {pid: src for pid, src in self.rollout_logs().items() if src.exists()}

    def weight_store(self) -> "WeightStore | None":
        """The run's bucket of policy weights in the JetStream object store (connected
        on first use, closed with this Run), or None when the weights travel through
        the run folder only (``[log] backend = "file"``, or ``weights = "folder"``)."""
        log = self.config.log
        if log.backend != "nats" or log.weights == "folder":
            return None
        if self._weights is None:
            from .weight_store import WeightStore

            self._weights = WeightStore.for_run(self)
        return self._weights

    def learner_tail(self) -> LogTail:
        """A :class:`~agentlog.events.log.source.LogTail` of the learner log
        (closed with this Run). On JetStream the stream must exist (a worker
        opens its own log first, which creates it)."""
        tail = self.learner.tail()
        self._tails.append(tail)
        return tail

    # -- writers --------------------------------------------------------------

    def open_rollout(self, partition: int | None, *, fence: bool) -> EventLog:
        """Open the rollout log of ``partition`` (None: the single log) as its one writer.
        ``fence`` takes a new writer epoch (a JetStream writer always does)."""
        return self._open(self.rollout_log(partition), fence=fence)

    def open_learner(self) -> EventLog:
        """Open the learner log as its one writer."""
        return self._open(self.learner, fence=False)

    def _open(self, source: LogSource, *, fence: bool) -> EventLog:
        c = self.config
        return source.open_writer(fsync=c.fsync, fence=fence, replicas=c.log.replicas, duplicate_window_s=c.log.duplicate_window_s,
                                  compression=c.log.compression)

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Close the tails, the read-only connection and the weights' (nothing to close for files)."""
        tails, self._tails = self._tails, []
        weights, self._weights = self._weights, None
        try:
            for tail in tails:
                tail.close()
        finally:
            try:
                self.rollout.close()
            finally:
                if weights is not None:
                    weights.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
