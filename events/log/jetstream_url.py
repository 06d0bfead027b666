"""``nats://`` URLs and the names inside them: a run's stream and its logs.

``nats://host:port/stream`` names a run's stream (several servers:
``nats://h1:4222,h2:4222/stream``), ``nats://host:port/stream/p0003`` one
log of it. :func:`parse_nats_url` splits a URL into the server list
nats-py takes, the stream and the log name; :data:`STREAM_RE` and
:func:`log_name` check the names. Pure text: nats-py is not imported here,
so config checks and location dispatch can use it without the extra.
"""

from __future__ import annotations

import re
from typing import Any

from .partitions import partition_name

STREAM_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
#: A log's name inside its run's stream: a partition (p0003) or a named log (learner).
LOG_NAME_RE = re.compile(r"[a-z][a-z0-9_-]{0,63}")


def is_nats_url(text: Any) -> bool:
    """Whether ``text`` names a JetStream log (``nats://...``) rather than a directory."""
    return isinstance(text, str) and text.startswith("nats://")


def parse_nats_url(text: str) -> tuple[str, str, str | None]:
    """``nats://host:port[,host:port...]/stream[/name]`` -> (server URLs as
    nats-py takes them, stream, log name or None). ValueError naming the
    part that is wrong and what was expected."""
    if not is_nats_url(text):
        raise ValueError(f"{text!r}: expected nats://host:port/stream")
    rest = text[len("nats://"):]
    hosts, _, path = rest.partition("/")
    parts = path.split("/") if path else []
    if not hosts or not parts or not 1 <= len(parts) <= 2 or not all(parts):
        raise ValueError(f"{text!r}: expected nats://host:port/stream or nats://host:port/stream/<log> (p0003, learner)")
    for host in hosts.split(","):
        host_name, _, port = host.rpartition(":")
        if not host_name or not port.isdigit():
            raise ValueError(f"{text!r}: server {host!r} is not host:port")
    if not STREAM_RE.fullmatch(parts[0]):
        raise ValueError(f"{text!r}: stream {parts[0]!r}: expected letters, digits, '-' or '_' (1..200)")
    name = parts[1] if len(parts) == 2 else None
    if name is not None and not LOG_NAME_RE.fullmatch(name):
        raise ValueError(f"{text!r}: log {name!r}: expected a partition (p0003) or a name such as 'learner'")
    return ",".join(f"nats://{h}" for h in hosts.split(",")), parts[0], name


def log_name(log: int | str) -> str:
    """The subject suffix of a log: a partition id as ``p%04d``, or a checked name."""
    if isinstance(log, str):
        if not LOG_NAME_RE.fullmatch(log):
            raise ValueError(f"log name: expected lowercase letters, digits, '-' or '_' starting with a letter, found {log!r}")
        return log
    return partition_name(log)
