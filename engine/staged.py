"""A record the engine staged, waiting for the log's acknowledgement: :class:`StagedRecord`,
and what a caller of ``begin_turn`` holds of its turn meanwhile: :class:`PendingTurn`.

The engine applies each of its records when the log acknowledges it, at its
LSN, never when a caller's wait is cancelled (:meth:`SessionEngine._stage
<agentlog.engine.core.SessionEngine._stage>`). What it needs then (the
session, the body, the state it moves to, the context a turn leaves, whom to
answer) waits in one object a record, not in closures: each cell of a
closure is one more object for the garbage collector while the record waits,
and with a thousand sessions in flight that cost the engine a third more CPU
a record (three times the collections; ``tools/bench/bench_engine.py``).
It is the file log's waiter itself (a :class:`DurableCallback`, called by its
writer's acknowledgement), and ``on_durable`` for a log that stages in a task.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

from agentlog.events.log.api import DurableCallback, answer
from agentlog.events.schema.types import Envelope
from agentlog.events.schema.lifecycle import TERMINAL_STATES, State
from agentlog.events.schema.turn import TurnDelta, TurnRecorded, scored_against
from agentlog.events.schema.turn_delta import EncodingContext

from .session_lock import release

if TYPE_CHECKING:
    from .core import SessionEngine
    from .handle import SessionHandle


class PendingTurn:
    """A turn :meth:`SessionHandle.begin_turn` staged: ``durable`` (a future of its envelope) is what
    a caller awaits, and may cancel; :meth:`settled` waits for the record itself, whatever became of
    that wait. ``turn_index`` and ``lineage`` (its id, as ``turn_lineage`` gives it) are set once the
    turn is built (at once, unless it queued for the lock): no need to decode the envelope's body."""

    __slots__ = ("durable", "_settled", "_env", "_exc", "_tb", "turn_index", "lineage")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.durable: asyncio.Future[Envelope] = loop.create_future()
        # The record's outcome is kept once it settles; a future for it is made only when settled()
        # waits before then. Most callers never ask: one future (and one tracked object) less a turn.
        self._settled: asyncio.Future[Envelope] | None = None
        self._env: Any = _UNSETTLED
        self._exc: BaseException | None = None
        self._tb: Any = None  # the failure's traceback as it settled: raised with it each time, as a future does
        self.turn_index, self.lineage = -1, ""

    def built(self, turn_index: int, lineage: str) -> None:
        """Note the turn the engine built for this pending turn: its index and the id of the lineage
        the engine placed it in (what ``turn_lineage`` reads back from its body)."""
        self.turn_index, self.lineage = turn_index, lineage

    def settle(self, env: Envelope | None, exc: BaseException | None) -> None:
        """Called once (on the loop) with the durable envelope or the failure."""
        answer(self.durable, env, exc)
        self._env, self._exc = env, exc
        if exc is not None:
            self._tb = exc.__traceback__
        waiting = self._settled
        if waiting is not None:
            answer(waiting, env, exc)
            if exc is not None:
                waiting.exception()  # retrieved here: settled() raises it, and its wait may be cancelled

    #: Called as ``(env, exc)`` it settles (an :data:`~agentlog.events.log.api.OnDurable`): the engine
    #: answers the pending turn itself, no bound method made a turn.
    __call__ = settle

    async def settled(self) -> Envelope:
        """The durable envelope (raises what recording it raised)."""
        try:
            if self._env is _UNSETTLED:
                if self._settled is None:
                    self._settled = asyncio.get_running_loop().create_future()
                return await asyncio.shield(self._settled)
            if self._exc is not None:
                raise self._exc.with_traceback(self._tb)
            return self._env
        finally:
            if self.durable.done() and not self.durable.cancelled():
                self.durable.exception()  # retrieved: raised here instead


#: :attr:`PendingTurn._env` until the turn settles (its envelope, or None with the failure).
_UNSETTLED = object()


class StagedRecord(DurableCallback):
    """One record of session ``h`` the engine staged, its lock held: once the log acknowledges
    it, apply it (``dest``: the state it moves to, or None; ``context``: the one a turn the
    engine built leaves), release the lock, call ``settled`` and answer ``waiter``."""

    __slots__ = ("engine", "h", "body", "dest", "context", "seq", "ender", "waiter", "settled", "n_out", "temperature")

    def __init__(self, engine: "SessionEngine", h: "SessionHandle", body: Any, dest: State | None,
                 context: EncodingContext | None, waiter: Any, settled: Callable[[], None] | None = None) -> None:
        self.engine, self.h, self.body, self.dest, self.context = engine, h, body, dest, context
        self.seq, self.end = h._seq, DurableCallback.NOT_QUEUED  # DurableCallback's end (its __init__ is not called: no fn)
        # An ending cancels the session's in-flight work, never the task that ends it (applied from a
        # callback); a record that ends nothing needs no task looked up.
        self.ender = asyncio.current_task() if dest in TERMINAL_STATES else None
        self.waiter, self.settled = waiter, settled
        if type(body) is TurnDelta or type(body) is TurnRecorded:
            # What a teacher's scores of the turn are checked against, read as it is staged (and, by
            # a log that stages synchronously, encoded): a caller may change the sampling dict it
            # handed over once this returns. Two slots, not a tuple: no object more per turn.
            self.n_out, self.temperature = scored_against(body)

    def run(self, env: Any, exc: BaseException | None) -> None:
        """Apply the record the log acknowledged (``env``), or not (``exc``, a failure), release the
        lock, and answer. What raises here is reported by :class:`DurableCallback`, and the flush's
        other records are still answered."""
        engine, h = self.engine, self.h
        try:
            if env is not None:
                # The body as stored when the envelope holds it decoded; a LazyEnvelope's decodes on first use.
                engine._apply(h, self, env.lsn, env.body if type(env) is Envelope else None)
            elif isinstance(exc, asyncio.CancelledError) and engine.log.next_seq(h.session_id) != self.seq:
                # A log that stages in a task had it cancelled after the record went out (SessionEngine._stage).
                engine._apply(h, self, None)
        except Exception as failure:  # handed to the waiter, logged and in health: never swallowed
            env, exc = None, engine._not_applied(h, env, failure)
        finally:
            release(h)
        if self.settled is not None:
            self.settled()
        answer(self.waiter, env, exc)


class StagedOpening(StagedRecord):
    """A ``session_opened`` the engine staged: once acknowledged the session is open (and dropped,
    ``cancelled``, when its caller gave up waiting: nobody holds its handle); refused, it is forgotten."""

    __slots__ = ("budget", "hashes")

    def __init__(self, engine: "SessionEngine", h: "SessionHandle", body: Any, waiter: asyncio.Future,
                 budget: float | None, hashes: tuple[int, int]) -> None:
        super().__init__(engine, h, body, None, None, waiter)
        self.budget, self.hashes = budget, hashes

    def run(self, env: Any, exc: BaseException | None) -> None:
        engine, h, done = self.engine, self.h, self.waiter
        try:
            if env is not None or (isinstance(exc, asyncio.CancelledError) and engine.log.next_seq(h.session_id) == 1):
                engine._opened(h, self.budget, self.hashes, None if env is None else env.lsn)
                if done.cancelled():
                    engine._background(h.drop("cancelled"))
            else:
                engine._unopened(h)
        except Exception as failure:  # handed to the waiter, logged and in health: never swallowed
            env, exc = None, engine._not_applied(h, env, failure)
        finally:
            release(h)
        answer(done, env, exc)
