"""The engine's bounded restart (engine/restart.py): a restart from a
checkpoint equals a restart from LSN 0, and an unusable checkpoint is never
used."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.engine import DuplicateSession, SessionEngine
from agentlog.engine.restart import (
    CHECKPOINT_NAME,
    CheckpointError,
    RestartFold,
    load_checkpoint,
    write_checkpoint,
)
from agentlog.events import FileLog
from agentlog.events.schema.lifecycle import State
from agentlog.events.schema.types import (
    PolicyUpdated,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TurnRecorded,
)
from agentlog.reducers.errors import UnknownEventError

# -- generated logs ---------------------------------------------------------------------------

_TURN = TurnRecorded(turn_index=0, prompt_ids=b"\x01\x00\x00\x00", output_ids=b"\x02\x00\x00\x00",
                     output_log_probs=b"\x00\x00\x00\xbf")


@st.composite
def scripts(draw):
    """Records of a log: groups of sessions that open, start, take turns and
    end (or stay in flight), interleaved at random; sometimes a reused id or a
    member that contradicts its group (the restart must count those alike)."""
    n_groups = draw(st.integers(1, 6))
    sessions = []  # per session: its records in order
    ended: list[str] = []
    for g in range(n_groups):
        size = draw(st.integers(1, 4))
        for i in range(size):
            sid = f"g{g}-s{i}"
            declared = size + 1 if draw(st.integers(0, 19)) == 0 else size  # now and then a conflicting member
            recs = [SessionOpened(group_id=f"g{g}", group_size=declared, sample_index=i)]
            fate = draw(st.sampled_from(["open", "running", "finished", "aborted", "dropped"]))
            if fate != "open":
                recs.append(SessionStarted(harness="t"))
                recs.extend([_TURN] * draw(st.integers(0, 3)))
            if fate == "finished":
                recs.append(SessionFinished(reward=1.0))
            elif fate == "aborted":
                recs.append(SessionAborted(reason="x"))
            elif fate == "dropped":
                recs.append(SessionDropped(reason="y"))
            if fate in ("finished", "aborted", "dropped"):
                ended.append(sid)
            sessions.append([sid, recs])
    if ended and draw(st.booleans()):
        # An id reused after its session ended: the log takes it, the lifecycle step refuses it.
        sessions.append([ended[0], [SessionOpened(group_id="reused", group_size=1)]])
    out = []
    seqs: dict[str, int] = {}
    pending = [list(s) for s in sessions]
    order = draw(st.randoms(use_true_random=False))
    started: set[int] = set()
    while pending:
        # A reused id opens only after its first session's records are all out.
        ready = [k for k, (sid, _) in enumerate(pending)
                 if k in started or not any(p[0] == sid for p in pending[:k])]
        k = order.choice(ready)
        started.add(id(pending[k]))
        sid, recs = pending[k]
        body = recs.pop(0)
        seq = 0 if isinstance(body, SessionOpened) else seqs[sid]
        seqs[sid] = seq + 1
        out.append((sid, seq, body))
        if not recs:
            pending.pop(k)
    return out


def _write(path: Path, records) -> int:
    log = FileLog.open(path, fsync="never")
    try:
        for rec in records:
            log.append_batch([rec])
        return log.next_lsn
    finally:
        log.close()


async def _restart(path: Path, **options):
    """Open an engine on the log at ``path``; what the restart decided."""
    log = FileLog.open(path, fsync="never")
    try:
        before = log.next_lsn
        eng = await SessionEngine.open(log, checkpoint_poll_s=3600, **options)
        appended = [(e.session_id, e.session_seq, e.body) for e in log.read(before)]
        used = sorted({e.session_id for e in log.read(0) if isinstance(e.body, SessionOpened)})
        state = {
            "violations": eng.stats["violations"],
            "restart_aborted": eng.stats["restart_aborted"],
            "appended": appended,
            "status": {sid: eng.status(sid) for sid in used},
            "groups": eng._groups.to_snapshot(),
            "ids": eng._ids.snapshots(),
        }
        for sid in used:  # every id the log holds is refused, exactly
            with pytest.raises(DuplicateSession):
                await eng.open_session(sid, group_id=f"new-{sid}", group_size=1)
        folded = eng.stats["restart_folded"]
        await eng.close()
        return state, folded
    finally:
        log.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts(), cut=st.floats(0, 1))
def test_restart_from_a_checkpoint_equals_a_restart_from_lsn_0(script, cut):
    """A checkpoint taken at any LSN, then the records after it: the same
    aborts appended, the same violations, statuses, groups in flight and id
    filter as folding the whole log."""
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        end = _write(a, script)
        shutil.copytree(a, b)
        at = int(cut * end)
        fold = RestartFold()
        log = FileLog.open(a, fsync="never")
        try:
            fold.catch_up(log, until=at)
        finally:
            log.close()
        assert fold.next_lsn == at
        write_checkpoint(a / CHECKPOINT_NAME, fold.to_checkpoint())
        with_ckpt, folded = asyncio.run(_restart(a))
        from_zero, folded_zero = asyncio.run(_restart(b, checkpoint_every=0))
        assert with_ckpt == from_zero
        assert (folded, folded_zero) == (end - at, end)


def _some_sessions(path: Path, n: int = 12) -> int:
    return _write(path, [
        rec
        for i in range(n)
        for rec in ((f"s{i}", 0, SessionOpened(group_id=f"g{i // 2}", group_size=2, sample_index=i % 2)),
                    (f"s{i}", 1, SessionStarted(harness="t")),
                    (f"s{i}", 2, SessionFinished(reward=1.0)))
        if i < n - 2 or rec[1] == 0  # the last two stay open
    ])


def test_close_writes_a_checkpoint_and_a_clean_restart_folds_nothing(tmp_path):
    path = tmp_path / "log"
    _some_sessions(path)

    async def go():
        log = FileLog.open(path, fsync="never")
        try:
            eng = await SessionEngine.open(log)
            first = eng.stats["restart_folded"]
            h = await eng.open_session("late", group_id="late", group_size=1)
            await h.start()
            await h.finish(reward=0.5)
            await eng.close()
            eng2 = await SessionEngine.open(log)
            assert eng2.stats["restart_folded"] == 0, "the close's checkpoint covers every record"
            assert eng2.status("late") is not None and str(eng2.status("late")) == "finished"
            with pytest.raises(DuplicateSession):
                await eng2.open_session("s0", group_id="x", group_size=1)
            await eng2.close()
            return first
        finally:
            log.close()

    assert asyncio.run(go()) == 32  # the first open folded the whole log (no checkpoint yet)


def test_a_running_engine_writes_checkpoints_and_a_killed_one_restarts_from_the_last(tmp_path):
    """Without a clean close (the process dies): the restart folds only what
    came after the last periodic checkpoint, and decides as a fold from 0 does."""
    path = tmp_path / "log"

    async def run_then_die():
        log = FileLog.open(path, fsync="never")
        eng = await SessionEngine.open(log, checkpoint_every=40, checkpoint_poll_s=0.005)
        for i in range(30):
            h = await eng.open_session(f"s{i}", group_id=f"g{i // 3}", group_size=3)
            await h.start()
            await h.record_turn(prompt_ids=[1, 2], output_ids=[3], output_log_probs=[-0.1])
            if i % 3:
                await h.finish(reward=1.0)
            await asyncio.sleep(0.01)  # the checkpointer's turn
        # Die: the engine is never closed (no last checkpoint); the log stays as it was.
        return eng._checkpointer.written, log

    written, dead_log = asyncio.run(run_then_die())
    assert written >= 3, written
    ckpt_lsn = load_checkpoint(path / CHECKPOINT_NAME, dead_log).next_lsn
    end = dead_log.next_lsn
    assert 0 < ckpt_lsn < end
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / CHECKPOINT_NAME).unlink()
    dead_log.close()
    ours, folded = asyncio.run(_restart(path))
    zero, folded_zero = asyncio.run(_restart(copy, checkpoint_every=0))
    assert ours == zero
    assert ours["restart_aborted"] == 10
    assert folded == end - ckpt_lsn and folded_zero == end


@pytest.mark.parametrize("damage", ["flipped_byte", "other_log", "truncated_log", "old_format"])
def test_an_unusable_checkpoint_is_reported_and_the_restart_folds_from_0(tmp_path, damage, capsys):
    path = tmp_path / "log"
    end = _some_sessions(path)
    fold = RestartFold()
    log = FileLog.open(path, fsync="never")
    try:
        fold.catch_up(log, until=end - 3)
    finally:
        log.close()
    ckpt_file = path / CHECKPOINT_NAME
    ckpt = fold.to_checkpoint()
    if damage == "old_format":
        import msgspec

        ckpt = msgspec.structs.replace(ckpt, format=0)
    write_checkpoint(ckpt_file, ckpt)
    if damage == "flipped_byte":
        data = bytearray(ckpt_file.read_bytes())
        data[-5] ^= 0xFF
        ckpt_file.write_bytes(bytes(data))
    elif damage == "other_log":
        other = tmp_path / "other"
        _some_sessions(other)  # same shape, other timestamps
        shutil.copy(ckpt_file, other / CHECKPOINT_NAME)
        path = other
    elif damage == "truncated_log":
        fold2 = RestartFold()
        log = FileLog.open(path, fsync="never")
        try:
            fold2.catch_up(log)
        finally:
            log.close()
        write_checkpoint(ckpt_file, fold2.to_checkpoint())
        raw = ckpt_file.read_bytes()
        shutil.rmtree(path)
        _write(path, [(f"s{i}", 0, SessionOpened(group_id=f"g{i}", group_size=1)) for i in range(3)])
        ckpt_file.write_bytes(raw)
    log = FileLog.open(path, fsync="never")
    try:
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(ckpt_file if damage != "other_log" else path / CHECKPOINT_NAME, log)
        assert CHECKPOINT_NAME in str(err.value)
    finally:
        log.close()
    _, folded = asyncio.run(_restart(path))
    log = FileLog.open(path, fsync="never")
    try:
        assert folded == log.next_lsn - (2 if damage != "truncated_log" else 3)  # from 0 (minus the restart's own aborts)
    finally:
        log.close()


@pytest.mark.parametrize("checkpoint_at", [None, 3])
def test_an_unknown_event_type_stops_the_restart_with_or_without_a_checkpoint(tmp_path, checkpoint_at):
    """The fold reads tags only, and still refuses an event type this version
    does not know inside a session (its effect on the session cannot be known)."""
    path = tmp_path / "log"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "future_log", path)
    if checkpoint_at is not None:
        fold = RestartFold()
        log = FileLog.open(path, fsync="never")
        try:
            fold.catch_up(log, until=checkpoint_at)
        finally:
            log.close()
        write_checkpoint(path / CHECKPOINT_NAME, fold.to_checkpoint())

    async def go():
        log = FileLog.open(path, fsync="never")
        try:
            await SessionEngine.open(log)
        finally:
            log.close()

    with pytest.raises(UnknownEventError, match="turn_scored") as err:
        asyncio.run(go())
    assert err.value.lsn == 3 and err.value.session_id == "s-0"


def test_a_checkpoint_that_cannot_be_written_never_stops_the_engine(tmp_path):
    """The checkpoint is a cache: a directory where it goes (the write fails
    with IsADirectoryError) is a warning naming the file, at open and at each
    periodic checkpoint, never an error and never a background failure."""
    from structlog.testing import capture_logs

    path = tmp_path / "log"
    _some_sessions(path)
    (path / CHECKPOINT_NAME).mkdir()

    async def go():
        log = FileLog.open(path, fsync="never")
        try:
            with capture_logs() as logs:
                eng = await SessionEngine.open(log, checkpoint_every=4, checkpoint_poll_s=0.005)
                failed = [e for e in logs if e["event"] == "engine.checkpoint_failed"]
                assert failed and failed[0]["log_level"] == "warning" and failed[0]["path"] == str(path / CHECKPOINT_NAME)
                assert "IsADirectoryError" in failed[0]["error"]
                assert str(path / CHECKPOINT_NAME) in eng.checkpoint_problem
                for i in range(6):
                    h = await eng.open_session(f"late{i}", group_id=f"late{i}", group_size=1)
                    await h.start()
                    await h.finish(reward=1.0)
                    await asyncio.sleep(0.01)  # the periodic checkpointer's turn
                assert len([e for e in logs if e["event"] == "engine.checkpoint_failed"]) >= 2
            assert eng.background_failure is None
            await eng.close()
            eng2 = await SessionEngine.open(log)  # folds from lsn 0, as without a checkpoint
            assert str(eng2.status("late5")) == "finished"
            await eng2.close()
        finally:
            log.close()

    asyncio.run(go())


# -- checkpoints served from the engine's state ----------------------------------------------------


#: A small id filter (4 kB, not 1 MiB) for the engines of the served-checkpoint tests, which snapshot it often.
_IDS = 1024


def _fold_of(log, until=None, recent_window=4096):
    """The restart fold of ``log`` from LSN 0 (to ``until``, exclusive), as a comparable checkpoint."""
    fold = RestartFold(id_capacity=_IDS, recent_window=recent_window)
    fold.catch_up(log, until=until)
    return fold.to_checkpoint().comparable()


def _served_now(eng):
    """The checkpoint the engine's checkpointer would serve at this moment, or None when records wait past a hole."""
    ckpt = eng._checkpointer
    if ckpt._ahead or ckpt.from_log is not None:
        return None
    return ckpt._served(ckpt.frontier).comparable()


def _restart_from_the_checkpoint_and_from_0(path: Path, copy: Path, **options):
    """Restart the log at ``path`` from its checkpoint, and a copy of it without one from LSN 0:
    what each restart decided, and how many records the first folded."""
    shutil.copytree(path, copy)
    (copy / CHECKPOINT_NAME).unlink()
    ours, folded = asyncio.run(_restart(path, **options))
    zero, _ = asyncio.run(_restart(copy, checkpoint_every=0, **options))
    return ours, zero, folded


async def _cancelled_once_staged(work) -> None:
    """Start ``work`` (a coroutine), let it stage its record, then cancel the wait for it."""
    task = asyncio.ensure_future(work)
    await asyncio.sleep(0)  # staged: the log writes it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@st.composite
def workloads(draw):
    """Sessions of random groups run concurrently through one engine: they open (now and then
    with a membership the group refuses, or an id already used), start, take turns (one of them
    now and then cancelled once staged), and finish, abort (some owing a replacement, which then
    opens), drop (now and then cancelled once staged) or stay in flight; another writer's
    learner records land in between."""
    plans = []
    for g in range(draw(st.integers(1, 5))):
        size = draw(st.integers(1, 3))
        for i in range(size):
            plans.append(dict(
                sid=f"g{g}-s{i}", group=f"g{g}", size=size, turns=draw(st.integers(0, 3)),
                fate=draw(st.sampled_from(["open", "running", "finished", "aborted", "refill", "dropped"])),
                cancel_turn=draw(st.integers(0, 5)) == 0, cancel_end=draw(st.integers(0, 4)) == 0,
                conflict=draw(st.integers(0, 7)) == 0,
            ))
    return plans, draw(st.integers(0, 3)), draw(st.randoms(use_true_random=False))


async def _run_session(eng, plan, rng, compared):
    from agentlog.reducers.groups import GroupError

    async def yield_some():
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)

    await yield_some()
    h = await eng.open_session(plan["sid"], group_id=plan["group"], group_size=plan["size"])
    if plan["conflict"]:  # refused, and nothing of them kept
        with pytest.raises(GroupError):
            await eng.open_session(plan["sid"] + "-x", group_id=plan["group"], group_size=plan["size"] + 1)
        with pytest.raises(DuplicateSession):
            await eng.open_session(plan["sid"], group_id="elsewhere", group_size=1)
    await yield_some()
    if plan["fate"] == "open":
        return
    await h.start()
    for t in range(plan["turns"]):
        await yield_some()
        turn = h.record_turn(prompt_ids=[1, 2, t], output_ids=[3], output_log_probs=[-0.1])
        if plan["cancel_turn"] and t == 0:
            await _cancelled_once_staged(turn)  # the log writes it, and the engine applies it at its acknowledgement
        else:
            await turn
    await yield_some()
    if plan["cancel_end"] and plan["fate"] in ("finished", "aborted", "dropped"):
        end = h.finish(reward=1.0) if plan["fate"] == "finished" else h.abort("x") if plan["fate"] == "aborted" else h.drop("y")
        await _cancelled_once_staged(end)
    elif plan["fate"] == "finished":
        await h.finish(reward=1.0)
    elif plan["fate"] in ("aborted", "refill"):
        await h.abort("setup_failed:OSError" if plan["fate"] == "refill" else "x")
        for member in eng.owed_replacements(plan["group"]):
            r = await eng.open_session(member + "-r", group_id=plan["group"], group_size=plan["size"], replaces=member)
            await r.start()
            await r.finish(reward=0.5)
    elif plan["fate"] == "dropped":
        await h.drop("y")
    served = _served_now(eng)  # while the other sessions' records are in flight
    if served is not None:
        compared.append(served)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_a_checkpoint_served_from_the_engines_state_equals_the_fold_of_the_log_below_its_cut(workload):
    """At any moment no record past the frontier is applied, the engine's state (its ids,
    recent window, groups with their owed replacements, sessions in flight, with decisions not
    in the log yet left out) is the restart fold of the log up to the frontier, field for
    field; and a restart from the checkpoint written at close decides as one from LSN 0."""
    plans, learner_records, rng = workload
    from agentlog.reducers.config import ReduceConfig

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "log"

        async def go():
            log = FileLog.open(path, fsync="never")
            try:
                eng = await SessionEngine.open(log, checkpoint_poll_s=3600, id_capacity=_IDS, groups=ReduceConfig(
                    abort_outcomes={"infrastructure": "refill"}, max_refills=1))
                compared: list = []

                async def learner():
                    for step in range(learner_records):
                        await asyncio.sleep(0)
                        log.append_batch([("learner", step, PolicyUpdated(step=step, policy_version=step))])

                sessions = asyncio.gather(learner(), *(_run_session(eng, p, rng, compared) for p in plans))
                while not sessions.done():  # a snapshot at every turn of the event loop, decisions in flight
                    await asyncio.sleep(0)
                    served = _served_now(eng)
                    if served is not None and (not compared or served != compared[-1]):
                        compared.append(served)
                await sessions
                checked = []
                for served in compared:
                    checked.append(served == _fold_of(log, until=served.next_lsn))
                ckpt = eng._checkpointer
                for _ in range(200):  # place what waits past a hole, once the log acknowledged it
                    await ckpt.checkpoint()
                    if not ckpt._ahead:
                        break
                    await asyncio.sleep(0.005)
                now = _served_now(eng)
                assert ckpt.from_log is None, ckpt.from_log
                assert now is not None and now == _fold_of(log, until=now.next_lsn)
                await eng.close()
                assert ckpt.from_log is None and ckpt.lsn == log.next_lsn
                return checked
            finally:
                log.close()

        checked = asyncio.run(go())
        assert all(checked), checked
        ours, zero, folded = _restart_from_the_checkpoint_and_from_0(path, Path(d) / "copy", id_capacity=_IDS)
        assert ours == zero and folded == 0


def test_checkpoints_come_no_more_often_than_four_records_per_session_in_flight(tmp_path):
    """Each checkpoint snapshots every session in flight, so with many of them
    the interval stretches to four records a session: its cost per record
    stays bounded. The restart still decides as one from LSN 0."""
    path = tmp_path / "log"

    async def go():
        log = FileLog.open(path, fsync="never")
        eng = await SessionEngine.open(log, checkpoint_every=16, checkpoint_poll_s=0.001)
        handles = []
        for i in range(50):
            h = await eng.open_session(f"s{i}", group_id=f"g{i}", group_size=1)
            await h.start()
            handles.append(h)
        ckpt = eng._checkpointer
        assert ckpt.interval() == 200
        written_at = []
        for k in range(600):
            await handles[k % 50].record_turn(prompt_ids=[1], output_ids=[2], output_log_probs=[-0.1])
            await asyncio.sleep(0.0005)  # the checkpointer's turn
            if ckpt.lsn not in written_at:
                written_at.append(ckpt.lsn)
        return written_at, log

    written_at, log = asyncio.run(go())
    try:
        gaps = [b - a for a, b in zip(written_at[1:], written_at[2:])]
        # 200 records appended between tries; a checkpoint holds what was acknowledged (one turn may be in flight).
        assert len(written_at) >= 3 and all(g >= 199 for g in gaps), written_at
    finally:
        log.close()
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # each restart appends its aborts: each gets the log as the engine left it
    ours, folded = asyncio.run(_restart(path))
    zero, _ = asyncio.run(_restart(copy, checkpoint_every=0))
    assert ours == zero and 0 < folded < 250


async def _engine_with_sessions(path: Path, n: int, **options):
    """A FileLog at ``path`` and an engine on it (no periodic checkpoints unless asked) with ``n`` running sessions."""
    log = FileLog.open(path, fsync="never")
    eng = await SessionEngine.open(log, **{"checkpoint_poll_s": 3600, "id_capacity": _IDS, **options})
    handles = []
    for i in range(n):
        h = await eng.open_session(f"s{i}", group_id=f"g{i // 2}", group_size=2)
        await h.start()
        handles.append(h)
    return log, eng, handles


async def _turn(h, t: int = 0):
    return await h.record_turn(prompt_ids=[1, 2, t], output_ids=[3], output_log_probs=[-0.1])


def test_a_running_engine_serves_its_checkpoints_and_reads_only_the_records_it_did_not_write(tmp_path):
    """Periodic checkpoints come from the engine's state; another writer's learner record is a
    hole, read from the log (tags only) when records wait past it. Each checkpoint proves it
    belongs to the log (the anchor, read back), and the last equals a fold of the whole log."""
    path = tmp_path / "log"

    async def go():
        log = FileLog.open(path, fsync="never")
        try:
            eng = await SessionEngine.open(log, checkpoint_every=16, checkpoint_poll_s=0.002, id_capacity=_IDS)
            for i in range(12):
                h = await eng.open_session(f"s{i}", group_id=f"g{i // 4}", group_size=4)
                await h.start()
                await _turn(h)
                if i == 5:  # another writer's record, which the engine never applies
                    log.append_batch([("learner", 0, PolicyUpdated(step=1, policy_version=1))])
                await h.finish(reward=1.0)
                await asyncio.sleep(0.005)  # the checkpointer's turn
            ckpt = eng._checkpointer
            during = ckpt.written, ckpt.served
            await eng.close()
            return during, ckpt, _fold_of(log), log.next_lsn
        finally:
            log.close()

    (written, served), ckpt, ref, end = asyncio.run(go())
    assert written >= 3 and served >= 2 and ckpt.from_log is None
    assert ckpt.read_back < 16  # the records from the hole to the last one applied past it, once
    log = FileLog.open(path, fsync="never")
    try:
        loaded = load_checkpoint(path / CHECKPOINT_NAME, log)
        assert loaded.next_lsn == end and loaded.comparable() == ref
    finally:
        log.close()


@pytest.mark.parametrize("cancelled", ["turn", "opening", "terminal"])
def test_a_record_cancelled_once_staged_is_applied_at_its_acknowledgement_and_checkpoints_stay_served(tmp_path, cancelled):
    """A turn, an opening or a terminal event whose caller stopped waiting once the log staged it
    is applied when the log acknowledges it, at its LSN and in the log's order (the id filter's
    layers, the groups, the recent window keep that order): nothing waits past a hole, and every
    checkpoint is served from the engine's state, equal to the fold of the log below its cut.
    An opening nobody holds the handle of is dropped ("cancelled")."""

    async def go():
        log, eng, (a, b) = await _engine_with_sessions(tmp_path / "log", 2)
        try:
            ckpt = eng._checkpointer
            work = {"turn": lambda: _turn(a), "terminal": lambda: a.finish(reward=1.0),
                    "opening": lambda: eng.open_session("late", group_id="late", group_size=2)}[cancelled]
            await _cancelled_once_staged(work())
            if cancelled == "opening":
                for _ in range(200):  # the drop of the session nobody holds, in the background
                    if eng.status("late") is State.DROPPED:
                        break
                    await asyncio.sleep(0.005)
                assert eng.status("late") is State.DROPPED
            await _turn(b)  # acknowledged after the cancelled record, which is applied first
            assert not ckpt._ahead and ckpt.from_log is None
            assert _served_now(eng) == _fold_of(log)
            await ckpt.checkpoint()
            assert ckpt.served == 1 and ckpt.lsn == log.next_lsn and ckpt._last.comparable() == _fold_of(log)
            await eng.close()
            assert ckpt.from_log is None and ckpt._last.comparable() == _fold_of(log)
        finally:
            log.close()

    asyncio.run(go())


def test_another_writers_session_record_makes_checkpoints_fold_the_log_and_says_so(tmp_path):
    """A session record the engine did not apply (another writer's) means its state is not the
    log's: a warning names the record, and from then on each checkpoint is folded from the
    log in a worker thread, from the last one taken; a restart still decides as one from 0."""
    from structlog.testing import capture_logs

    path = tmp_path / "log"

    async def go():
        log, eng, handles = await _engine_with_sessions(path, 4)
        try:
            ckpt = eng._checkpointer
            await ckpt.checkpoint()
            assert ckpt.served == 1
            log.append_batch([("intruder", 0, SessionOpened(group_id="elsewhere", group_size=1))])
            for h in handles:
                await _turn(h)
            with capture_logs() as logs:
                await ckpt.checkpoint()
            warned = [e for e in logs if e["event"] == "engine.checkpoint_from_log"]
            assert len(warned) == 1 and "'intruder'" in warned[0]["reason"] and f"lsn {ckpt.lsn - 5}" in warned[0]["reason"]
            assert ckpt.from_log is not None and ckpt.served == 1 and ckpt.lsn == log.next_lsn
            assert ckpt._last.comparable() == _fold_of(log)
            await handles[0].finish(reward=1.0)
            await eng.close()
            assert ckpt.lsn == log.next_lsn and ckpt._last.comparable() == _fold_of(log)
        finally:
            log.close()

    asyncio.run(go())
    ours, zero, folded = _restart_from_the_checkpoint_and_from_0(path, tmp_path / "copy", id_capacity=_IDS)
    assert ours == zero and folded == 0


def test_a_finish_cancelled_while_an_earlier_one_waits_for_the_disk_is_applied_after_it(tmp_path):
    """Two finishes staged one after the other, the second one's wait cancelled while the first
    still waits for the disk: the second is applied when the log acknowledges it, after the
    first, so the engine's recent window and its group's release hold them in the log's order,
    and the served checkpoint is the fold of the log."""

    async def go():
        log, eng, (a, b) = await _engine_with_sessions(tmp_path / "log", 2, status_cache=2)
        try:
            first = asyncio.ensure_future(b.finish(reward=0.0))
            await asyncio.sleep(0)  # staged, waiting for the disk
            await _cancelled_once_staged(a.finish(reward=1.0))
            await first
            await eng.open_session("next", group_id="next", group_size=1)  # the cancelled finish is acknowledged before it
            assert [sid for sid, _, _ in eng._ids.snapshots()[1].ended] == ["s1", "s0"]  # the log's order
            assert dict(eng._groups.to_snapshot().recent)["g0"] == 5  # a's finish, which completed the group
            assert eng._checkpointer.from_log is None and _served_now(eng) == _fold_of(log, recent_window=2)
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


async def _a_hole_then_turns(path: Path, *, ahead_max: int, rounds: int, pause_s: float = 0.0, **options):
    """Two running sessions, another writer's learner record (a hole), then ``rounds`` turns of each
    (``pause_s`` after each: the checkpoint loop's turn), the checkpointer tracking ``ahead_max``."""
    log, eng, handles = await _engine_with_sessions(path, 2, **options)
    ckpt = eng._checkpointer
    ckpt.AHEAD_MAX = ahead_max
    log.append_batch([("learner", 0, PolicyUpdated(step=1, policy_version=1))])
    for t in range(rounds):
        for h in handles:
            await _turn(h, t)
            await asyncio.sleep(pause_s)
    return log, eng, ckpt


def test_too_many_records_past_a_hole_make_checkpoints_fold_the_log(tmp_path):
    """The applied records waiting past a hole are bounded (AHEAD_MAX): past that, no more are
    tracked, and checkpoints are folded from the log."""

    async def go():
        log, eng, ckpt = await _a_hole_then_turns(tmp_path / "log", ahead_max=3, rounds=2)
        try:
            assert ckpt.from_log is not None and "4 records applied past a hole" not in ckpt.from_log
            assert "3 records applied past a hole" in ckpt.from_log
            await ckpt.checkpoint()
            assert ckpt._last.comparable() == _fold_of(log)
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_a_checkpointer_whose_read_of_the_log_fails_is_broken_loudly(tmp_path, monkeypatch):
    """Folding the log (once the engine's state cannot be served) raises: the checkpoint is
    not written, the engine's periodic checkpoint fails loudly (its background_failure, which
    health reports), and every later one, at close too, raises naming the first error."""

    def failing(self, log, **kwargs):  # fault injection into the fold, not into what reports it
        raise OSError("a read of the log failed")

    async def go():
        log, eng, handles = await _engine_with_sessions(tmp_path / "log", 2, checkpoint_every=2, checkpoint_poll_s=0.01)
        try:
            log.append_batch([("intruder", 0, SessionOpened(group_id="elsewhere", group_size=1))])
            monkeypatch.setattr(RestartFold, "catch_up", failing)
            for t in range(6):  # a checkpoint falls due every 8 records (4 a session in flight)
                for h in handles:
                    await _turn(h, t)
            for _ in range(200):
                if eng.background_failure is not None:
                    break
                await asyncio.sleep(0.01)
            assert eng.background_failure == "background task engine.checkpointer crashed: OSError: a read of the log failed"
            with pytest.raises(CheckpointError, match="not written: reading the log failed: OSError: a read of the log failed"):
                await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_the_final_checkpoint_is_written_after_a_failed_one_even_with_nothing_new(tmp_path):
    """A periodic checkpoint that could not be written (a directory in its
    place) does not make the final one think it has nothing to write."""
    path = tmp_path / "log"

    async def go():
        log, eng, _ = await _engine_with_sessions(path, 4)
        try:
            ckpt = eng._checkpointer
            (path / CHECKPOINT_NAME).unlink()
            (path / CHECKPOINT_NAME).mkdir()
            assert await ckpt.checkpoint() == ckpt.lsn and ckpt.write_error is not None
            (path / CHECKPOINT_NAME).rmdir()
            eng._live.clear()  # nothing new at close: no drop appended
            assert await ckpt.checkpoint(final=True) == log.next_lsn
            assert ckpt.write_error is None and load_checkpoint(path / CHECKPOINT_NAME, log).next_lsn == log.next_lsn
        finally:
            log.close()

    asyncio.run(go())


def test_adopted_orphans_whose_membership_the_log_refused_leave_the_group_alone(tmp_path):
    """An orphan adopted to resume whose opening broke its group's rule (the restart fold
    counted a violation and kept it out of the group) ends without touching the group: the
    group's other members still complete it, and the served checkpoint stays the fold's."""
    path = tmp_path / "log"
    _write(path, [
        ("a", 0, SessionOpened(group_id="G", group_size=2, sample_index=0)),
        ("b", 0, SessionOpened(group_id="G", group_size=3, sample_index=1)),  # refused by the group rule
        ("c", 0, SessionOpened(group_id="G", group_size=2, sample_index=1)),
        ("a", 1, SessionStarted(harness="t")), ("b", 1, SessionStarted(harness="t")), ("c", 1, SessionStarted(harness="t")),
    ])

    async def go():
        log = FileLog.open(path, fsync="never")
        try:
            eng = await SessionEngine.open(log, adopt_orphans=True, checkpoint_poll_s=3600, id_capacity=_IDS)
            assert eng.stats["violations"] == 1 and sorted(eng.orphans) == ["a", "b", "c"]
            assert _served_now(eng) == _fold_of(log)
            for sid in ("b", "a", "c"):
                await eng.abort_orphan(sid, "no sandbox to resume")
                assert _served_now(eng) == _fold_of(log), sid
            assert eng.background_failure is None and not eng._groups.pending()  # released by a and c
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_a_filter_false_positive_is_a_fresh_id_for_the_restart_fold_too(tmp_path):
    """The id filter answers "maybe used" for ~3.4e-7 of fresh ids; the engine confirms by a scan
    of the log and opens the id. The restart fold confirms the same way instead of refusing the
    opening as a reused id (which would leave its group in flight for ever), and still refuses
    a real reuse the recent window no longer remembers."""
    path = tmp_path / "log"
    end = _write(path, [
        ("ghost", 0, SessionOpened(group_id="G", group_size=1)), ("ghost", 1, SessionStarted(harness="t")),
        ("ghost", 2, SessionFinished(reward=1.0)),
        ("old", 0, SessionOpened(group_id="O", group_size=1)), ("old", 1, SessionDropped(reason="y")),
        ("old", 0, SessionOpened(group_id="O2", group_size=1)),  # a real reuse
    ])
    log = FileLog.open(path, fsync="never")
    try:
        fold = RestartFold(recent_window=0, id_capacity=64)  # the window forgets: the filter alone answers
        fold.check.ids.add("ghost")  # what a false positive answers for this fresh id
        assert fold.catch_up(log) == end
        assert [(v.session_id, v.kind) for v in fold.first_violations] == [("old", "reused_id")]
        assert fold.groups.released == 2 and "ghost" not in fold.in_groups
    finally:
        log.close()


def test_records_waiting_past_a_hole_make_the_checkpoint_due_before_they_are_too_many(tmp_path):
    """An interval can be longer than the records the checkpointer tracks past a hole (many
    sessions in flight): half that many waiting make a checkpoint due, which reads the hole."""

    async def go():
        log, eng, ckpt = await _a_hole_then_turns(tmp_path / "log", ahead_max=16, rounds=6, pause_s=0.003,
                                                  checkpoint_every=10**9, checkpoint_poll_s=0.002)
        try:
            assert ckpt.from_log is None and ckpt.served >= 1 and len(ckpt._ahead) < 8
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_groups_and_members_decided_in_another_order_than_the_log_placed_them_are_served_in_the_logs(tmp_path):
    """An opening whose id the filter calls maybe-used waits for the exact scan of the log after
    its group was joined: another group, or another member of the same group, decided later,
    reaches the log first. The served groups and members come in the order a fold of the log
    creates and joins them."""

    async def go():
        log, eng, _ = await _engine_with_sessions(tmp_path / "log", 0)
        try:
            eng._ids._filter.add("slow")  # what a false positive answers: "slow" waits for a scan
            slow = asyncio.ensure_future(eng.open_session("slow", group_id="first", group_size=2))
            await asyncio.sleep(0)  # "first" joined, the scan running in a worker thread
            await eng.open_session("quick", group_id="second", group_size=2)
            await slow
            eng._ids._filter.add("slow2")  # the same within one group: its members in the order the log placed them
            slow = asyncio.ensure_future(eng.open_session("slow2", group_id="third", group_size=2))
            await asyncio.sleep(0)
            await eng.open_session("quick2", group_id="third", group_size=2)
            await slow
            served = _served_now(eng)
            assert [g.group_id for g in served.groups.pending] == ["second", "first", "third"]
            assert [sid for sid, _, _ in served.groups.pending[2].opened] == ["quick2", "slow2"]
            assert served.groups == _fold_of(log).groups and served.lifecycle.live == _fold_of(log).lifecycle.live
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_a_refused_replacement_leaves_the_owed_replacements_in_the_order_their_members_ended(tmp_path):
    """A replacement the engine refuses (its id was used) is withdrawn: the member it would have
    replaced is owed again, and the served checkpoint owes them in the order they ended, as a
    fold of the log does (the engine's own list has it last)."""
    from agentlog.reducers.config import ReduceConfig

    async def go():
        log, eng, _ = await _engine_with_sessions(tmp_path / "log", 0, groups=ReduceConfig(
            abort_outcomes={"infrastructure": "refill"}, max_refills=2))
        try:
            z = await eng.open_session("z", group_id="Z", group_size=1)
            await z.start()
            await z.finish(reward=1.0)
            for sid in ("a", "b"):
                h = await eng.open_session(sid, group_id="G", group_size=2)
                await h.start()
                await h.abort("setup_failed:OSError")
            assert eng.owed_replacements("G") == ["a", "b"]
            with pytest.raises(DuplicateSession):
                await eng.open_session("z", group_id="G", group_size=2, replaces="a")
            assert eng.owed_replacements("G") == ["b", "a"]
            served = _served_now(eng)
            assert served.groups.pending[0].owed == ["a", "b"] and served == _fold_of(log)
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_the_restart_folds_scans_for_reused_ids_are_bounded(tmp_path, monkeypatch):
    """Each opening the id filter alone calls a reuse costs the restart fold a scan of the log;
    a log another writer filled with reused ids gets ID_SCANS_MAX of them, then a warning, and
    the filter answers alone (every reuse is still refused)."""
    from structlog.testing import capture_logs

    from agentlog.engine import ids

    monkeypatch.setattr(ids, "ID_SCANS_MAX", 2)
    path = tmp_path / "log"
    reused = [(f"s{i}", 0, SessionOpened(group_id=f"again{i}", group_size=1)) for i in range(4)]
    end = _write(path, [(f"s{i}", k, body) for i in range(4)
                        for k, body in enumerate([SessionOpened(group_id=f"g{i}", group_size=1), SessionDropped(reason="y")])]
                 + reused)
    log = FileLog.open(path, fsync="never")
    try:
        fold = RestartFold(recent_window=0, id_capacity=64)  # the window forgets: the filter alone answers
        with capture_logs() as logs:
            assert fold.catch_up(log) == end
        assert fold.id_scans.scans == 2 and fold.violations == 4
        assert [e["event"] for e in logs if e["event"].startswith("engine.id_scans")] == ["engine.id_scans_capped"]
    finally:
        log.close()


def test_two_cancelled_finishes_in_one_group_give_the_group_the_release_lsn_of_the_second(tmp_path):
    """Both members' finishes cancelled once staged: applied in LSN order as the log acknowledges
    them, the second one completes the group and gives it its release LSN, as a fold of the log does."""

    async def go():
        log, eng, (a, b) = await _engine_with_sessions(tmp_path / "log", 2)
        try:
            tasks = []
            for h in (a, b):
                tasks.append(asyncio.ensure_future(h.finish(reward=1.0)))
                await asyncio.sleep(0)  # staged
            for task in tasks:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            await eng.open_session("next", group_id="next", group_size=1)
            assert dict(eng._groups.to_snapshot().recent)["g0"] == 5  # b's finish, at lsn 5
            assert eng._checkpointer.from_log is None and _served_now(eng) == _fold_of(log)
            await eng.close()
        finally:
            log.close()

    asyncio.run(go())


async def _statuses_after_reopen(path, sids, **kw):
    log = FileLog.open(path, fsync="never")
    try:
        eng = await SessionEngine.open(log, checkpoint_poll_s=3600, **kw)
        out = {s: eng.status(s) for s in sids}
        await eng.close()
        return out
    finally:
        log.close()


def test_a_checkpoint_with_a_smaller_recent_window_is_not_trusted_for_a_larger_one(tmp_path):
    """A checkpoint written with status_cache=2 held two ended sessions; reopened with 64, the
    engine knew only those two, where a restart from lsn 0 knows all six."""
    path = tmp_path / "log"
    sids = [f"s{i}" for i in range(6)]

    async def write():
        log = FileLog.open(path, fsync="never")
        try:
            eng = await SessionEngine.open(log, status_cache=2)
            for sid in sids:
                h = await eng.open_session(sid, group_id=sid, group_size=1)
                await h.start()
                await h.finish(reward=1.0)
            await eng.close()  # writes the checkpoint (recent window of 2)
        finally:
            log.close()

    asyncio.run(write())
    assert (path / CHECKPOINT_NAME).exists()
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    (copy / CHECKPOINT_NAME).unlink()
    ours = asyncio.run(_statuses_after_reopen(path, sids, status_cache=64))
    zero = asyncio.run(_statuses_after_reopen(copy, sids, status_cache=64, checkpoint_every=0))
    assert all(str(s) == "finished" for s in zero.values())
    assert ours == zero


def test_a_served_checkpoints_sessions_in_flight_are_untracked_by_the_collector_once_it_saw_them(tmp_path):
    """A checkpoint at 10,000 sessions in flight holds a (session, state, seq) tuple for each, kept until
    the next one: with the State itself in it (an enum member is tracked), every tuple stayed tracked into
    the collector's old generation and was walked by each full collection. Its value (a str, equal to the
    State and encoded the same) lets the first collection untrack the tuple; and a fold continued from
    such a checkpoint (folding from the log) has the State back."""
    import gc

    async def go():
        log, eng, handles = await _engine_with_sessions(tmp_path / "log", 6)
        try:
            await _turn(handles[0])
            ckpt = eng._checkpointer
            served = ckpt._served(ckpt.frontier)
            gc.collect()
            assert served.lifecycle.live and not any(gc.is_tracked(t) for t in served.lifecycle.live)
            assert {state for _sid, state, _seq in served.lifecycle.live} == {State.RUNNING}
            as_states = [(sid, State(state), seq) for sid, state, seq in served.lifecycle.live]
            assert msgspec.msgpack.encode(served.lifecycle.live) == msgspec.msgpack.encode(as_states)
            assert served.comparable() == _fold_of(log)
            continued = RestartFold.from_checkpoint(served)
            assert {type(t.life.state) for t in continued.check.fold.live.values()} == {State}
            await eng.close()
        finally:
            log.close()
    asyncio.run(go())
