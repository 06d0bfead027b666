"""The engine's background work: the wall-clock budget of each session (its
timer, and the abort when it runs out), a session's in-flight work (drained
before it ends), the periodic restart checkpoint, and the set of background
tasks they run in, whose first crash is kept in ``background_failure`` for
health checks.

:class:`BackgroundWork` is a part of :class:`engine.core.SessionEngine` (its
base class): the engine creates the task set in its constructor, starts the
budget timer when a session opens and cancels what is left at close.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Coroutine

from agentlog._logging import get_logger
from agentlog.events.schema.lifecycle import TERMINAL_STATES, SessionClosed
from agentlog.events.schema.types import Envelope, SessionAborted

from .errors import TIMEOUT_REASON, RecordNotApplied
from .handle import InFlightMarker, SessionHandle
from .checkpointer import Checkpointer

_log = get_logger("agentlog.engine")


def own_work(work: Any, cur: asyncio.Task | None) -> bool:
    """Whether in-flight ``work`` (a task, or the InFlightMarker of a task's scope) is ``cur``'s
    own: a task never waits for or cancels itself when it ends its own session."""
    return (work.task if isinstance(work, InFlightMarker) else work) is cur


class BackgroundWork:
    """Budget expiry, the checkpoint loop and the background tasks of a :class:`engine.core.SessionEngine`."""

    # Set by SessionEngine.__init__; declared here for the type checker.
    _bg: set[asyncio.Task]
    background_failure: str | None
    _checkpointer: Checkpointer | None
    checkpoint_poll_s: float
    drain_s: float

    if TYPE_CHECKING:
        async def _transition(self, h: SessionHandle, trigger: str, body: Any, *, drain: bool = True,
                              stop_owner: bool = False) -> Envelope | None: ...

    def _on_budget(self, h: SessionHandle) -> None:
        h._timer = None
        if h.state in TERMINAL_STATES:
            return
        self._background(self._expire(h))

    async def _checkpoint_loop(self) -> None:
        """Write a restart checkpoint each time ``checkpoint_every`` records
        have been appended since the last one (served from the engine's state
        in the event loop's thread; the file is written in a worker thread)."""
        ckpt = self._checkpointer
        assert ckpt is not None
        while True:
            await asyncio.sleep(self.checkpoint_poll_s)
            if ckpt.due():
                # A cache: a failed write is a warning (the next due one tries again); only a fold that can no
                # longer be trusted raises (CheckpointError), and that is a background failure.
                await ckpt.checkpoint()

    def _not_applied(self, h: SessionHandle, env: Envelope | None, exc: BaseException) -> RecordNotApplied:
        """A record of ``h`` the log acknowledged that applying failed: logged at critical,
        kept in ``background_failure`` (health: the engine's state may disagree with its log),
        and returned as the error its waiter gets, which says the record is in the log."""
        lsn = None if env is None else env.lsn
        h.log.critical("engine.apply_failed", lsn=lsn, error=repr(exc), exc_info=exc)
        failure = RecordNotApplied(h.session_id, lsn, exc)
        if self.background_failure is None:
            self.background_failure = str(failure)
        return failure

    def _background(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> None:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._bg.add(t)
        t.add_done_callback(self._bg_done)

    def _bg_done(self, t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            exc = t.exception()
            _log.error("engine.background_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            if self.background_failure is None:
                self.background_failure = f"background task {t.get_name()} crashed: {type(exc).__name__}: {exc}"
        self._bg.discard(t)
        if not self._bg:
            self._bg = set()  # sets never shrink either; see SessionEngine._release

    async def _expire(self, h: SessionHandle) -> None:
        """The wall-clock budget ran out: cancel in-flight work, abort, stop the owner."""
        if h.state in TERMINAL_STATES:
            return
        h._expired = True
        for t in list(h._inflight or ()):
            if not t.done():
                t.cancel()
        body = SessionAborted(reason=TIMEOUT_REASON, error=f"wall-clock budget of {h.budget_s}s exhausted")
        try:
            await self._transition(h, "abort", body, drain=False, stop_owner=True)
        except SessionClosed:
            # It ended on its own while we waited for its lock: nothing to abort.
            h._expired = False

    async def _drain(self, h: SessionHandle) -> None:
        """Wait up to drain_s for the session's in-flight work, then cancel the rest."""
        cur = asyncio.current_task()
        tasks = {t for t in (h._inflight or ()) if not own_work(t, cur) and not t.done()}
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=self.drain_s)
        if pending:
            h.log.info("session.inflight_cancelled", count=len(pending))
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=self.drain_s)
