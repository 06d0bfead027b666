"""Command execution with time budgets: the Sandbox interface and LocalSandbox.

The done-marker protocol: a wrapper runs the command and then writes its
exit code to a marker file (written to a temporary name and renamed, so a
reader normally sees all or nothing). The marker is read with
:func:`read_done_marker`, which returns an exit code only for a complete
integer; an empty, missing or non-integer marker means "not done yet" and is
never parsed (slime crashed on ``int('')`` there). When the budget runs out
the command's whole process group is killed and the result says
``budget_exceeded`` with ``exit_code=None``.
"""

from __future__ import annotations

import abc
import asyncio
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from agentlog._logging import get_logger
from agentlog.events.schema.validation import is_number

if TYPE_CHECKING:  # engine.snapshots imports this module (CONTROL_DIR)
    from .snapshots import SnapshotInfo, SnapshotStore

_log = get_logger("agentlog.engine.sandbox")

#: The directory inside a LocalSandbox's workdir where it keeps its own markers
#: and output files; never part of a snapshot.
CONTROL_DIR = ".agentlog-cmd"

#: Default cap on the output tail kept in a CommandResult (characters).
OUTPUT_TAIL_CHARS = 4096

_MARKER_RE = re.compile(rb"\s*(-?[0-9]{1,10})\s*")


class CommandResult(msgspec.Struct, frozen=True):
    """How a command ended. ``exit_code`` is None when the command did not
    report one (budget exceeded, or no valid done marker)."""

    command: str
    exit_code: int | None
    budget_exceeded: bool
    duration_s: float
    output_tail: str


def read_done_marker(path: str | os.PathLike[str]) -> int | None:
    """The exit code in a done marker, or None if the marker is missing,
    empty or not a complete integer (meaning: not done yet)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    m = _MARKER_RE.fullmatch(raw)
    if m is None:
        return None
    return int(m.group(1))


class Sandbox(abc.ABC):
    """Where a session's commands run."""

    #: A short description recorded in session_started.sandbox.
    name: str = ""
    #: Whether :meth:`snapshot` and :meth:`restore` work (a resumed session needs them).
    snapshottable: bool = False

    @abc.abstractmethod
    async def run_command(self, cmd: str, budget_s: float) -> CommandResult:
        """Run ``cmd`` with a wall-clock budget; never raises for a failing
        or overrunning command (that is in the result)."""

    async def close(self) -> None:
        """Release the sandbox (default: nothing to release)."""

    async def snapshot(self, store: "SnapshotStore", session_id: str, turn_index: int | None = None) -> "SnapshotInfo":
        """Save the sandbox's files to ``store`` as ``session_id``'s newest snapshot (the
        one before turn ``turn_index``, for the logs), durable on return (engine.snapshots)."""
        raise NotImplementedError(f"{type(self).__name__} cannot snapshot its files (snapshottable is False); LocalSandbox can")

    async def restore(self, store: "SnapshotStore", digest: str) -> "SnapshotInfo":
        """Make the sandbox's files exactly snapshot ``digest`` of ``store``."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore a snapshot (snapshottable is False); LocalSandbox can")


def _check_budget(budget_s: float) -> float:
    if not is_number(budget_s, above=0):
        raise ValueError(f"run_command budget_s: expected a finite number > 0, found {budget_s!r}")
    return float(budget_s)


# The wrapper: run the command in its own bash, then publish its exit code.
_WRAPPER = 'bash -c "$1"; rc=$?; printf "%d\\n" "$rc" > "$2.tmp" && mv -f "$2.tmp" "$2"'


class LocalSandbox(Sandbox):
    """A working directory on this machine; each command runs with ``bash -c``
    in its own process group (session), output captured to a file."""

    def __init__(self, workdir: str | os.PathLike[str], *, tail_chars: int = OUTPUT_TAIL_CHARS, env: dict[str, str] | None = None) -> None:
        # Absolute: the done marker is written by the command from inside the workdir, so a
        # relative path would point below itself and the marker would never land.
        self.workdir = Path(workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tail_chars = tail_chars
        self.env = env
        self.name = f"local:{self.workdir}"
        self._ctl = self.workdir / CONTROL_DIR

    snapshottable = True

    async def snapshot(self, store: "SnapshotStore", session_id: str, turn_index: int | None = None) -> "SnapshotInfo":
        """The workdir (but its control dir) into ``store``, on a worker thread."""
        return await asyncio.to_thread(store.snapshot, self.workdir, session_id, turn_index=turn_index)

    async def restore(self, store: "SnapshotStore", digest: str) -> "SnapshotInfo":
        """The workdir replaced by snapshot ``digest`` (checked as it is copied), on a worker thread.
        Cancelled (a restore timeout), the thread is told to stop and awaited, so nothing writes
        the workdir or its staging sibling once this returns: the workdir is as it was, or restored."""
        stop = threading.Event()
        job = asyncio.ensure_future(asyncio.to_thread(store.restore, digest, self.workdir, cancel=stop))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait([job])
            exc = None if job.cancelled() else job.exception()
            _log.info("sandbox.restore_stopped", workdir=str(self.workdir), digest=digest,
                      outcome="restored before it could stop" if exc is None else f"{type(exc).__name__}: {exc}")
            raise

    async def run_command(self, cmd: str, budget_s: float) -> CommandResult:
        """Run ``cmd``; on budget exhaustion or cancellation kill its whole
        process group. Leftover background processes are killed too, so no
        command outlives its run."""
        if not isinstance(cmd, str) or not cmd.strip():
            raise ValueError(f"run_command cmd: expected a non-empty str, found {cmd!r}")
        budget = _check_budget(budget_s)
        self._ctl.mkdir(exist_ok=True)
        run_id = uuid.uuid4().hex[:16]
        marker = self._ctl / f"{run_id}.done"
        out_path = self._ctl / f"{run_id}.out"
        t0 = time.monotonic()
        with open(out_path, "wb") as out:
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", _WRAPPER, "agentlog-cmd", cmd, str(marker),
                cwd=self.workdir, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, env=self.env,
            )
        pgid = proc.pid  # start_new_session: the wrapper leads its own group
        exit_code: int | None = None
        exceeded = False
        waiter = asyncio.ensure_future(proc.wait())
        try:
            poll = 0.002
            while True:
                code = read_done_marker(marker)
                if code is not None:
                    exit_code = code
                    break
                if waiter.done():
                    # The wrapper is gone; the marker (if any) was written before it exited.
                    exit_code = read_done_marker(marker)
                    break
                remaining = budget - (time.monotonic() - t0)
                if remaining <= 0:
                    exceeded = True
                    break
                await asyncio.wait({waiter}, timeout=min(poll, remaining))
                poll = min(poll * 2, 0.05)
        finally:
            _kill_group(pgid)
            if not waiter.done():
                # Reap the wrapper even if we are being cancelled: no zombie, no survivor.
                try:
                    await asyncio.shield(waiter)
                except asyncio.CancelledError:
                    await _wait_quietly(waiter)
                    raise
            duration = time.monotonic() - t0
        tail = _read_tail(out_path, self.tail_chars)
        for p in (marker, out_path, marker.with_name(marker.name + ".tmp")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        return CommandResult(cmd, None if exceeded else exit_code, exceeded, duration, tail)


async def _wait_quietly(fut: asyncio.Future) -> None:
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _read_tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            # 4 bytes per char bounds the UTF-8 we need for `chars` characters.
            f.seek(max(0, size - 4 * chars))
            data = f.read()
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", "replace")
    return text[-chars:] if len(text) > chars else text
