"""Adopting the sessions a killed process left open or running, to resume them.

By default :meth:`engine.core.SessionEngine.open` aborts every orphan
(``engine_restart``, :func:`engine.restart.abort_orphans`). Opened with
``adopt_orphans=True`` it adopts them instead: each becomes a live session
of this engine again (its handle in the state, sequence and group the log
gives it), held in :attr:`SessionEngine.orphans` with its
:class:`~agentlog.reducers.resume.ResumePoint`, until the caller decides:

* :meth:`SessionEngine.resume` appends ``session_resumed`` (running ->
  running: a new incarnation) and hands back the handle, its turn count,
  delta-encoding context and per-turn outputs restored from the log, so the
  next turn continues the session as if nothing had happened;
* :meth:`SessionEngine.abort_orphan` aborts it (``engine_restart``, with why
  it could not resume), as the default would have.

An orphan the caller leaves undecided is still a live session: closing the
engine drops it (``shutdown``), so every session still ends exactly once.
The orphans are taken from the log's exact open-session map (as the default
does), and read in one pass over the log (:func:`reducers.resume.resume_points`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentlog._logging import get_logger
from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.turn_delta import EncodingContext
from agentlog.events.schema.types import SessionResumed
from agentlog.reducers.resume import ResumePoint, resume_points

from .handle import TURN_SCORE, SessionHandle
from .lineages import LineageTracker

if TYPE_CHECKING:
    from .core import SessionEngine
    from .restart import RestartFold

_log = get_logger("agentlog.engine.adopt")


def adopt_orphans(engine: "SessionEngine", fold: "RestartFold") -> dict[str, ResumePoint]:
    """Make every session the log holds open or running a live, undecided session of
    ``engine`` (see the module docstring); returns their resume points by id. A session
    the restart fold does not track (its open was refused) is left out, for the
    caller to abort as the default does."""
    log = engine.log
    orphans = log.open_sessions()
    if not orphans:
        return {}
    folded = fold.check.open_sessions()
    tracked = {sid for sid in orphans if sid in folded}
    points = resume_points(log.read(0), tracked)
    for sid in sorted(tracked):
        point = points.get(sid)
        if point is None:
            continue
        state, _ = folded[sid]
        h = SessionHandle(engine, sid, point.group_id, None)
        h.sample_index = point.sample_index
        h.state = State(str(state))
        h._seq = orphans[sid]
        h.opened_lsn = point.opened_lsn
        h.turns = point.durable_turns
        engine._live[sid] = h
        _log.info("session.adopted", session_id=sid, state=str(state), durable_turns=point.durable_turns,
                  resumes=point.resumes)
    return {sid: points[sid] for sid in sorted(tracked) if sid in points}


async def resume(engine: "SessionEngine", point: ResumePoint, snapshot: str, *, worker: str = "",
                 budget_s: float | None = None) -> SessionHandle:
    """Append ``session_resumed`` for the adopted ``point`` (which must be running), with
    ``snapshot`` the digest restored, and return its handle ready for the next turn."""
    h = engine._live[point.session_id]
    # Set afresh, never added to: a resume the log refuses (a bad snapshot digest) leaves the orphan
    # undecided, and a retry must find the handle as the first try would have.
    if point.last_turn is not None:
        # The context the last durable turn left: the next turn is stored as a delta against it.
        _, h._context = EncodingContext().encode(point.last_turn)
        h._lineages = LineageTracker()
        h._lineages.rebuild(point.lineage_turns.values(), point.lineage_origins, point.lineage_history)
    h._turn_scores = bytearray(b"".join(map(TURN_SCORE.pack, point.turn_outputs, point.turn_temperatures)))
    body = SessionResumed(incarnation=point.resumes + 1, durable_turns=point.durable_turns, snapshot=snapshot,
                          snapshot_turn=point.snapshot_turn, worker=worker)
    await engine._transition(h, "resume", body)
    h.budget_s = budget_s  # the engine's default already applied (SessionEngine.resume)
    engine._opened_again(h)
    h.log.info("session.resumed", incarnation=body.incarnation, durable_turns=point.durable_turns, snapshot=snapshot[:16])
    return h
