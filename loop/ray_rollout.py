"""Rollout workers as Ray actors (``[rollout] backend = "ray"``).

One actor per log partition: :class:`RolloutActor` wraps a
:class:`~agentlog.loop.worker.RolloutWorker` for partition ``k`` (worker id
``pNNNN``), which writes only ``<run>/rollout/pNNNN``. The actors share
nothing with the learner but the run folder, exactly as local worker
processes do, so the run folder must be on a filesystem every Ray node
mounts at the same path (NFS, Lustre).

Restarts. An actor is created with ``max_restarts`` (``[rollout]
max_restarts``): when its node is lost or its process dies, Ray re-runs its
constructor on a node that offers its resources. The constructor does not
start the rollouts: :class:`RayRollouts` (the driver) sees the actor back in
state ``idle`` and calls :meth:`RolloutActor.start` again. The new
incarnation reopens its partition with a new writer epoch (``FileLog``
``fence=True``), so a stale incarnation still alive on a partitioned-off node
can append nothing more; the sessions the old one left open are resumed
from their last durable turn, or aborted with ``engine_restart`` (see
:mod:`agentlog.loop.resume`), and its interrupted batch completed (see
:mod:`agentlog.loop.worker`). Both actor methods are idempotent, because
Ray retries calls to a restarting actor (at least once).

Every ``ray.get`` here has a timeout. Ray is an optional dependency
(``pip install 'agentlog[ray]'``); this module imports it only when used.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from agentlog._logging import get_logger

from .config import LoopConfig
from .run import LoopError
from .run_folder import Run

log = get_logger("agentlog.loop.ray_rollout")

#: The Ray namespace the rollout actors live in (named ``agentlog-<run id>-pNNNN``).
RAY_NAMESPACE = "agentlog"

#: Actor states: idle (constructed, not started: a fresh or restarted
#: incarnation), running, done (the learner published its final version),
#: failed (the worker raised; ``error`` says what).
ACTOR_STATES = ("idle", "running", "done", "failed")

#: How long a new incarnation waits for a stale one to let go of its
#: partition's writer lock (it dies with its node, or its NFS lease expires).
LOCK_WAIT_S = 120.0


class ActorStatus(msgspec.Struct, frozen=True):
    """What a rollout actor reports to the driver (sent through Ray: defined here, importable)."""

    partition: int
    worker_id: str
    state: str
    """One of :data:`ACTOR_STATES`."""
    epoch: int
    """The partition's writer epoch once this incarnation opened it (0 before)."""
    restarted: bool
    """Whether Ray restarted this actor (its constructor ran again after a crash or node loss)."""
    batches_done: int
    pid: int
    node_id: str
    started_s: float
    """Wall-clock time (time.time()) this incarnation's rollouts started (0.0 if not started)."""
    error: str = ""
    counts: dict[str, int] = {}


class RayBackendError(LoopError):
    """The Ray rollout backend cannot run: Ray missing, no node offers the
    rollout resources, an actor failed or is gone for good. Names the partition
    and what was expected."""


def import_ray() -> Any:
    """``ray``, or a RayBackendError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RayBackendError(
            f"[rollout] backend = \"ray\" needs Ray, which is not installed ({exc}); install it with: pip install 'agentlog[ray]'"
        ) from None
    return ray


class RolloutActor:
    """A rollout worker for one log partition, run by Ray as an actor.

    Plain class (Ray wraps it with ``ray.remote`` in :meth:`RayRollouts.start`),
    importable as ``agentlog.loop.ray_rollout.RolloutActor`` on every node.
    The constructor builds the worker (model, task) but starts nothing;
    :meth:`start` runs ``RolloutWorker.run`` on a thread of its own, so
    :meth:`status` answers while rollouts run."""

    def __init__(self, run_dir: str, partition: int) -> None:
        from .runlog import configure_process_logging

        self.run_dir = Path(run_dir)
        if not Run.has_config(self.run_dir):
            raise RayBackendError(
                f"rollout partition {partition}: {Run.config_file(self.run_dir)} is not visible on this node (pid {os.getpid()}); "
                "the run folder must be on a filesystem every Ray node mounts at the same path"
            )
        self.cfg = Run.load_config(self.run_dir)
        self.partition = partition
        self.worker_id = f"p{partition:04d}"
        # Errors also go to stderr, which Ray forwards to the driver's console: a failed
        # worker is seen there at once (warnings, e.g. the demo's injected faults, stay in the file).
        configure_process_logging(self.run_dir, f"worker-{self.worker_id}", console=sys.stderr, console_level="error")
        self.log = log.bind(component="ray_actor", worker=self.worker_id)
        import torch

        torch.set_num_threads(self.cfg.torch_threads)
        from .worker import RolloutWorker

        self.worker = RolloutWorker(self.run_dir, self.cfg, worker_id=self.worker_id, partition=partition)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._state = "idle"
        self._error = ""
        self._counts: dict[str, int] = {}
        self._started_s = 0.0
        self._restarted, self._node_id = _runtime_facts()
        self.log.info("ray_actor.constructed", restarted=self._restarted, node_id=self._node_id, pid=os.getpid())

    def start(self) -> ActorStatus:
        """Start the worker's rollouts on a background thread, once: a second
        call (a retry, or the driver's watch loop) starts nothing and returns
        the status, so the call is safe to repeat."""
        with self._lock:
            if self._thread is None:
                self._state = "running"
                self._started_s = time.time()
                self._thread = threading.Thread(target=self._run, name=f"agentlog-rollout-{self.worker_id}", daemon=True)
                self._thread.start()
                self.log.info("ray_actor.started", restarted=self._restarted, node_id=self._node_id)
        return self.status()

    def status(self) -> ActorStatus:
        """This incarnation's state (no side effects)."""
        with self._lock:
            state, error, counts = self._state, self._error, dict(self._counts)
        if state == "idle":
            epoch = 0
        else:  # as the log keeps it (a file partition's FENCE), else the epoch this incarnation's writer took
            stored = self.worker.rollout_log.fence_epoch()
            epoch = self.worker.epoch if stored is None else stored
        return ActorStatus(
            partition=self.partition, worker_id=self.worker_id, state=state, epoch=epoch, restarted=self._restarted,
            batches_done=self.worker.batches_done, pid=os.getpid(), node_id=self._node_id,
            started_s=self._started_s, error=error, counts=counts,
        )

    def _run(self) -> None:
        """The thread: run the worker to the learner's final version; any error is
        logged and kept for :meth:`status` (never lost with the thread)."""
        try:
            counts = asyncio.run(self._run_worker())
        except BaseException as exc:  # noqa: BLE001 - reported through status(), and logged
            text = f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])
            self.log.error("ray_actor.worker_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            with self._lock:
                self._state, self._error = "failed", text
            return
        with self._lock:
            self._state = "done"
            self._counts = {k: v for k, v in counts.items() if isinstance(v, int)}
        self.log.info("ray_actor.done", batches=self.worker.batches_done)

    async def _run_worker(self) -> dict[str, int]:
        """``RolloutWorker.run``, retried while a stale incarnation still holds
        the partition's writer lock (bounded by LOCK_WAIT_S): after a node loss
        Ray may restart this actor before the old process has died."""
        from agentlog.events import LogLocked

        deadline = time.monotonic() + LOCK_WAIT_S
        waited = False
        while True:
            try:
                return await self.worker.run()
            except LogLocked as exc:
                if time.monotonic() > deadline:
                    raise LogLocked(f"{exc} (waited {LOCK_WAIT_S:.0f} s for the previous incarnation to let go)") from None
                if not waited:
                    self.log.warning("ray_actor.partition_locked", error=str(exc), wait_s=LOCK_WAIT_S)
                    waited = True
                await asyncio.sleep(0.25)


def _runtime_facts() -> tuple[bool, str]:
    """(restarted, node id) of the current Ray actor; (False, "") outside Ray."""
    import warnings

    import ray

    if not ray.is_initialized():
        return False, ""  # constructed directly, not by Ray
    ctx = ray.get_runtime_context()
    with warnings.catch_warnings():
        # Ray's own property reads its deprecated actor_id property (a RayDeprecationWarning per restart).
        warnings.simplefilter("ignore", DeprecationWarning)
        restarted = bool(ctx.was_current_actor_reconstructed)
    return restarted, str(ctx.get_node_id())


def cause_line(exc: BaseException) -> str:
    """The last line of a Ray error's text, without colour codes: for an actor
    whose constructor raised, ``Type: message`` of that exception (the whole
    remote traceback is logged, not put into a one-line error)."""
    import re

    lines = [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


#: Seconds the Ray service check at an address may take (its gRPC call).
RAY_CHECK_TIMEOUT_S = 5.0
#: Seconds to wait for a listener's first words when describing what answered.
LISTENER_WORDS_S = 1.0


def probe_address(address: str, timeout_s: float = 5.0) -> None:
    """RayBackendError when ``address`` (``host:port``, a head's GCS, or
    ``ray://host:port``, a Ray Client server; ``auto`` is left to Ray) is not
    a Ray service: nothing accepts a TCP connection there, or what does is
    not Ray (its gRPC service does not answer: the error names what answered
    instead, e.g. an HTTP server). Why: ``ray.init`` retries a dead address,
    or one where something else listens, for minutes (over 200 s measured,
    Ray 2.60) instead of failing. Takes at most about
    ``timeout_s + RAY_CHECK_TIMEOUT_S + 2 * LISTENER_WORDS_S`` seconds."""
    import socket

    target = address.removeprefix("ray://")
    if target in ("auto", "local") or ":" not in target:
        return
    host, _, port = target.rpartition(":")
    if not port.isdigit():
        raise RayBackendError(f"[rollout] address {address!r}: expected host:port, ray://host:port or auto")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise RayBackendError(
            f"[rollout] address {address!r}: nothing accepts connections there ({exc.strerror or exc}); start the head node "
            f"with `ray start --head --port={port}`, or leave address empty to start a local Ray"
        ) from None
    client = address.startswith("ray://")
    refusal = _ray_service_refusal(f"{host}:{port}", client)
    if refusal is not None:
        service = "a Ray Client server (ray://, `ray start --head` serves one on port 10001)" if client else \
            "a Ray head's GCS (`ray start --head` prints its address)"
        raise RayBackendError(
            f"[rollout] address {address!r}: not Ray: {_what_answers(host, int(port))}, and the Ray call there failed "
            f"({refusal}); expected {service}, or leave address empty to start a local Ray"
        )


def _ray_service_refusal(target: str, client: bool) -> str | None:
    """None when a Ray service answers one gRPC call at ``target`` (the GCS's
    GetClusterId, or a Ray Client server's ping) within RAY_CHECK_TIMEOUT_S,
    or refuses it as unauthenticated (a cluster with token auth: ``ray.init``
    brings the token); else the gRPC status and detail of the failure."""
    import grpc

    if client:
        from ray.core.generated import ray_client_pb2

        method = "/ray.rpc.RayletDriver/ClusterInfo"
        request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING).SerializeToString()
    else:
        method = "/ray.rpc.NodeInfoGcsService/GetClusterId"
        request = b""  # GetClusterIdRequest has no fields
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(request, timeout=RAY_CHECK_TIMEOUT_S)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            return f"{method}: {getattr(code, 'name', code)}: {' '.join(str(detail).split())[:160]}"
    return None


def _what_answers(host: str, port: int) -> str:
    """What listens at ``host:port``, in words: its greeting (a server that
    speaks first, such as SSH), its answer to an HTTP request (status line
    and Server header), or that it said nothing."""
    import socket

    def words(sock: socket.socket) -> bytes:
        try:
            return sock.recv(512)
        except TimeoutError:
            return b"-"  # silent: distinct from b"" (closed)

    try:
        with socket.create_connection((host, port), timeout=LISTENER_WORDS_S) as sock:
            sock.settimeout(LISTENER_WORDS_S)
            heard = words(sock)
            if heard == b"-":
                sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
                heard = words(sock)
    except OSError as exc:
        return f"the listener there could not be asked again ({exc.strerror or exc})"
    if heard == b"-":
        return f"something there accepts connections and says nothing (not even to an HTTP request, within {LISTENER_WORDS_S:g} s)"
    if not heard:
        return "something there accepts connections and closes them without a word"
    if heard.startswith(b"HTTP/"):
        lines = heard.decode("latin-1").split("\r\n")
        server = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith("server:")), None)
        return f"an HTTP server answers there ({lines[0].strip()}" + (f", Server: {server})" if server else ")")
    return f"a server there answers {heard[:60]!r}"


def local_ray_init_kwargs(cfg: LoopConfig) -> dict[str, Any]:
    """``ray.init`` arguments of a local, single-machine Ray for ``cfg``: on
    loopback, no dashboard, a small object store (the actors pass only small
    status structs), and enough of the rollout resources and logical CPUs for
    every actor (they share the machine's cores, as local worker processes do).

    ``address="local"`` always starts a Ray of this run's own: with no address,
    Ray joins any Ray it finds running on the machine (RAY_ADDRESS, its
    ``ray_current_cluster`` file, or a GCS process found by pgrep), and then
    refuses the resource arguments below."""
    ro = cfg.rollout
    return dict(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(ro.num_cpus * ro.workers + 0.999)),
        # A node's totals must be whole numbers (Ray refuses 0.5 x 3 = 1.5): rounded up, so that every actor fits.
        resources={k: float(math.ceil(round(v * ro.workers, 4))) for k, v in ro.resources.items()},
        include_dashboard=False,
        object_store_memory=100 * 1024 * 1024,
        _node_ip_address="127.0.0.1",
        namespace=RAY_NAMESPACE,
        logging_level="WARNING",
    )


class RayRollouts:
    """The driver side: one :class:`RolloutActor` per partition, started,
    watched and stopped; :func:`agentlog.loop.run.run_loop` uses it in place
    of local worker processes when ``cfg.rollout.backend == "ray"``, through
    the interface of :class:`agentlog.loop.run.LocalRollouts`.

    ``start()`` joins the cluster at ``cfg.rollout.address`` (or starts a
    local Ray when it is empty and this process is not connected yet),
    creates the actors and starts them; ``poll()`` watches them, starting the
    rollouts of an actor Ray restarted again, and raises RayBackendError (a
    LoopError) on a failed actor or one gone for good; ``stop()`` kills the
    actors and shuts Ray down if ``start()`` started it."""

    def __init__(self, cfg: LoopConfig, run_dir: Path, *, call_timeout_s: float = 30.0, start_timeout_s: float = 300.0,
                 unreachable_s: float = 300.0, poll_every_s: float = 0.5) -> None:
        self.cfg = cfg
        # Absolute, symlinks kept: every node must see the run folder at this path, and a
        # resolved symlink target may be where only this node mounts it.
        self.run_dir = Path(os.path.abspath(run_dir))
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.unreachable_s = unreachable_s
        self.poll_every_s = poll_every_s
        self.actors: dict[int, Any] = {}
        #: The latest status of each partition's actor.
        self.statuses: dict[int, ActorStatus] = {}
        #: Restarts seen per partition (an actor back in state idle in a new process).
        self.restarts: dict[int, int] = {}
        self._unreachable_since: dict[int, float] = {}
        self._started_ray = False
        self._last_poll = 0.0
        self._ray: Any = None
        self.log = log.bind(component="ray_driver", run_dir=str(self.run_dir))

    # -- start -----------------------------------------------------------------

    def start(self) -> None:
        """Connect to (or start) Ray, create one actor per partition and start each."""
        ro = self.cfg.rollout
        if not ro.address and "ray" not in sys.modules:
            # A local Ray stays on loopback: Ray reads this when imported and then
            # takes 127.0.0.1 as this machine's address (workers inherit it).
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            if ro.address:
                probe_address(ro.address)
                try:
                    ray.init(address=ro.address, namespace=RAY_NAMESPACE, logging_level="WARNING")
                except (ConnectionError, RuntimeError) as exc:
                    raise RayBackendError(
                        f"[rollout] address {ro.address!r}: cannot join the Ray cluster: {exc}. Is `ray start --head` running "
                        "there, and, on a cluster with token authentication (Ray's default for clusters it starts), does "
                        "this process have its token (RAY_AUTH_MODE=token and ~/.ray/auth_token or RAY_AUTH_TOKEN)?"
                    ) from None
            else:
                ray.init(**local_ray_init_kwargs(self.cfg))
            self._started_ray = True
        self._check_resources()
        actor_cls = ray.remote(RolloutActor).options(
            max_restarts=ro.max_restarts,
            # Both methods are idempotent, so a call to a restarting actor may be retried.
            max_task_retries=-1,
            num_cpus=ro.num_cpus,
            resources=dict(ro.resources),
        )
        for k in ro.partitions():
            self.actors[k] = actor_cls.remote(str(self.run_dir), k)
            self.restarts[k] = 0
        refs = {k: a.start.remote() for k, a in self.actors.items()}
        deadline = time.monotonic() + self.start_timeout_s
        for k, ref in refs.items():
            try:
                self.statuses[k] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise RayBackendError(
                    f"rollout actor p{k:04d} did not start within {self.start_timeout_s:.0f} s: is a node offering "
                    f"{dict(ro.resources)} and {ro.num_cpus:g} CPU free for it? (cluster: {ray.cluster_resources()})"
                ) from None
            except ray.exceptions.RayTaskError as exc:
                raise RayBackendError(f"rollout actor p{k:04d}: start raised {cause_line(exc)}") from None
            except ray.exceptions.RayActorError as exc:
                self.log.error("ray_driver.actor_creation_failed", partition=k, error=str(exc))
                raise RayBackendError(f"rollout actor p{k:04d} could not be created: {cause_line(exc)}") from None
        self.log.info("ray_driver.started", workers=ro.workers, address=ro.address or "local",
                      nodes=sorted({s.node_id for s in self.statuses.values()}))

    def _check_resources(self) -> None:
        """Refuse at once, naming the resource, when the cluster does not offer
        one actor's request (the actors would wait forever); warn when it cannot
        hold every actor at once."""
        ray = self._ray
        ro = self.cfg.rollout
        have = ray.cluster_resources()
        need = {"CPU": ro.num_cpus, **ro.resources}
        for name, amount in need.items():
            if amount > 0 and have.get(name, 0.0) < amount:
                raise RayBackendError(
                    f"[rollout] resources: each rollout actor requests {name}={amount:g}, but the Ray cluster offers "
                    f"{have.get(name, 0.0):g}; start rollout nodes with ray start --resources='{{\"{name}\": N}}' "
                    f"(cluster resources: {dict(sorted(have.items()))})"
                )
            if amount > 0 and have.get(name, 0.0) < amount * ro.workers:
                self.log.warning("ray_driver.resources_short", resource=name, per_actor=amount, workers=ro.workers,
                                 cluster=have.get(name, 0.0))

    # -- watch -----------------------------------------------------------------

    def watch(self, *, force: bool = False) -> dict[int, ActorStatus]:
        """Ask every actor for its status (at most every ``poll_every_s`` unless
        ``force``) and return the latest ones. An actor back in state ``idle``
        in a new process was restarted by Ray: its rollouts are started again.
        Raises RayBackendError when an actor failed, is dead for good, or has
        not answered for ``unreachable_s``."""
        now = time.monotonic()
        if not force and now - self._last_poll < self.poll_every_s:
            return dict(self.statuses)
        self._last_poll = now
        ray = self._ray
        refs = {k: a.status.remote() for k, a in self.actors.items()}
        deadline = now + self.call_timeout_s
        for k, ref in refs.items():
            try:
                st: ActorStatus = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError) as exc:
                # Restarting (its node lost) or busy: tolerated for a while.
                since = self._unreachable_since.setdefault(k, now)
                if now - since > self.unreachable_s:
                    raise RayBackendError(f"rollout actor p{k:04d} has not answered for {now - since:.0f} s ({type(exc).__name__})") from None
                continue
            except ray.exceptions.RayTaskError as exc:
                raise RayBackendError(f"rollout actor p{k:04d}: its status call raised {cause_line(exc)}") from None
            except ray.exceptions.RayActorError as exc:
                raise RayBackendError(
                    f"rollout actor p{k:04d} is dead and will not be restarted (max_restarts = {self.cfg.rollout.max_restarts}): {exc}"
                ) from None
            if k in self._unreachable_since:
                self.log.info("ray_driver.actor_reachable", partition=k, after_s=round(now - self._unreachable_since.pop(k), 2))
            if st.state == "failed":
                raise RayBackendError(f"rollout actor p{k:04d} (node {st.node_id}, pid {st.pid}) failed: {st.error}")
            prev = self.statuses.get(k)
            if prev is not None and (prev.pid, prev.node_id) != (st.pid, st.node_id):
                # A new process: Ray restarted the actor (a start() in flight at the crash may
                # have been retried on it already, so this is not only seen in state idle).
                self.restarts[k] += 1
                self.log.warning("ray_driver.actor_restarted", partition=k, node_id=st.node_id, pid=st.pid,
                                 previous_node_id=prev.node_id, restarts=self.restarts[k])
            if st.state == "idle":
                # Not awaited: the next look sees it running (start is idempotent).
                self.actors[k].start.remote()
            self.statuses[k] = st
        return dict(self.statuses)

    def done(self) -> bool:
        """Whether every actor finished its rollouts (the learner's final version was read)."""
        return bool(self.actors) and len(self.statuses) == len(self.actors) and all(s.state == "done" for s in self.statuses.values())

    def poll(self) -> int | None:
        """None while an actor runs, 0 once all are done; RayBackendError (a
        LoopError) when one failed or is gone (see :meth:`watch`)."""
        self.watch()
        return 0 if self.done() else None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every actor to be done; whether they were."""
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if time.monotonic() > deadline:
                return False
            self.watch(force=True)
            time.sleep(0.1)
        return True

    # -- stop ------------------------------------------------------------------

    def stop(self) -> None:
        """Kill the actors (no restart) and shut Ray down if :meth:`start` started it."""
        ray = self._ray
        if ray is None:
            return
        try:
            for k, a in self.actors.items():
                try:
                    ray.kill(a, no_restart=True)
                except Exception as exc:  # noqa: BLE001 - one failed kill must not leave the others running
                    self.log.warning("ray_driver.kill_failed", partition=k, error=str(exc))
            self.actors.clear()
        finally:
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False
            self.log.info("ray_driver.stopped", restarts=dict(self.restarts))
