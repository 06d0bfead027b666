"""The events of a session that outlives its worker: ``sandbox_snapshotted`` and
``session_resumed`` (re-exported by :mod:`.types`, where the ``Event`` union lists them).
A resume is a lifecycle transition, running -> running (:mod:`.lifecycle`); what a
new incarnation continues from is :mod:`agentlog.reducers.resume`."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from .validation import READING_STORED, fail


#: What a snapshot digest looks like: 64 lowercase hex digits (BLAKE2b-256 of the snapshot's manifest).
SNAPSHOT_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def _check_snapshot_digest(event: str, value: Any) -> None:
    if not isinstance(value, str) or not SNAPSHOT_DIGEST_RE.fullmatch(value):
        fail(event, "digest" if event == "sandbox_snapshotted" else "snapshot", "64 lowercase hex digits (a snapshot's digest)", value)


class SandboxSnapshotted(msgspec.Struct, frozen=True, gc=False, tag="sandbox_snapshotted"):
    """The session's sandbox was saved to its worker's snapshot store, as turn
    ``turn_index``'s request found it: after every command that ran before that
    turn, before the turn was generated. The snapshot's files were durable before
    this event was appended. A resume restores the snapshot taken before the last
    durable turn and runs that turn's tool calls again (engine.snapshots)."""

    turn_index: int
    #: The snapshot's manifest's BLAKE2b-256, hex: its address in the store.
    digest: str
    #: Files, and their bytes, in the snapshot.
    files: int = 0
    bytes: int = 0
    #: Bytes this snapshot added to the store (content it did not hold yet).
    new_bytes: int = 0
    #: Seconds the snapshot took (the turn waited for it).
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        if type(self.turn_index) is not int or self.turn_index < 0:
            fail("sandbox_snapshotted", "turn_index", "an int >= 0", self.turn_index)
        _check_snapshot_digest("sandbox_snapshotted", self.digest)


class SessionResumed(msgspec.Struct, frozen=True, gc=False, tag="session_resumed"):
    """running -> running: a new incarnation took over a session whose previous
    one died (its worker was killed). It keeps the session's first
    ``durable_turns`` turns (every turn acknowledged before the crash; one in
    flight then was never acknowledged and is not in the log) and restores the
    sandbox from snapshot ``snapshot`` (taken before turn ``snapshot_turn``)
    right after this event: a restore that fails aborts the session, and a
    worker that dies restoring has used this resume all the same. Then it
    rebuilds the conversation from the log, runs the last durable turn's tool
    calls again, and asks for turn ``durable_turns``."""

    #: 1 for the first resume of the session, 2 for the next, ...
    incarnation: int
    durable_turns: int
    snapshot: str
    snapshot_turn: int
    #: The worker that resumed it.
    worker: str = ""

    def __post_init__(self) -> None:
        if READING_STORED.get():
            return
        for name in ("incarnation", "durable_turns", "snapshot_turn"):
            value = getattr(self, name)
            low = 1 if name == "incarnation" else 0
            if type(value) is not int or value < low:
                fail("session_resumed", name, f"an int >= {low}", value)
        if self.snapshot_turn != max(self.durable_turns - 1, 0):
            fail("session_resumed", "snapshot_turn",
                 f"the snapshot before the last durable turn ({max(self.durable_turns - 1, 0)})", self.snapshot_turn)
        _check_snapshot_digest("session_resumed", self.snapshot)
