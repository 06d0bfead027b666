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
from agentlog.engine.checkpointer import Checkpointer
from agentlog.engine.restart import (
    CHECKPOINT_NAME,
    CheckpointError,
    RestartFold,
    load_checkpoint,
    write_checkpoint,
)
from agentlog.events import FileLog
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
        used = sorted({e.session_id for e in log.read(0)})
        state = {
            "violations": eng.stats["violations"],
            "restart_aborted": eng.stats["restart_aborted"],
            "appended": appended,
            "status": {sid: eng.status(sid) for sid in used},
            "groups": eng._groups.to_snapshot(),
            "ids": eng._ids.to_snapshot(),
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


# -- the fold the engine feeds (Checkpointer.note) ------------------------------------------------


def _fold_state(fold: RestartFold):
    """A fold's whole state, without what differs by how it was reached (the time, an anchor not read yet)."""
    return msgspec.structs.replace(fold.to_checkpoint(), anchor=b"", written_ns=0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=scripts(), order=st.randoms(use_true_random=False), never_noted=st.sets(st.integers(0, 60), max_size=4),
       pending_max=st.sampled_from([1, 3, Checkpointer.PENDING_MAX]))
def test_noted_records_in_any_order_with_gaps_fold_as_reading_the_log_does(script, order, never_noted, pending_max):
    """The records the engine saw acknowledged, noted in any order, some never
    (another writer's, a cancelled caller's): the fold equals the fold of the
    whole log read from LSN 0, reads the log only for what was never noted,
    and its checkpoint proves it belongs to the log (the anchor, read back).
    Noted records are folded ``pending_max`` at a time, and whenever the fold is read."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "log"
        end = _write(path, script)
        log = FileLog.open(path, fsync="never")
        try:
            ref = RestartFold()
            ref.catch_up(log)
            envs = [e for e in log.read(0) if e.lsn not in never_noted]
            order.shuffle(envs)
            ckpt = Checkpointer(log, RestartFold(), path / CHECKPOINT_NAME, every=1)
            ckpt.PENDING_MAX = pending_max
            for env in envs:
                ckpt.note(env)
            assert len(ckpt._pending) < pending_max  # never more wait than that
            if not never_noted & set(range(end)):
                assert ckpt.fold.next_lsn == end and ckpt.noted == end
            assert asyncio.run(ckpt.checkpoint(final=True)) == end
            assert _fold_state(ckpt.fold) == _fold_state(ref)
            assert ckpt.noted + ckpt.read_back == end
            assert ckpt.read_back <= end - min(never_noted & set(range(end)), default=end)
            assert load_checkpoint(path / CHECKPOINT_NAME, log).next_lsn == end
        finally:
            log.close()


def test_a_running_engine_folds_what_it_appended_without_reading_the_log_back(tmp_path):
    """The engine's checkpoints come from the records it saw acknowledged; a
    record another writer appended is read from the log, and the checkpoint
    still equals a fold of the whole log."""
    path = tmp_path / "log"

    async def go():
        log = FileLog.open(path, fsync="never")
        try:
            eng = await SessionEngine.open(log, checkpoint_every=16, checkpoint_poll_s=0.002)
            for i in range(12):
                h = await eng.open_session(f"s{i}", group_id=f"g{i // 4}", group_size=4)
                await h.start()
                await h.record_turn(prompt_ids=[1, 2], output_ids=[3], output_log_probs=[-0.1])
                if i == 5:  # another writer's record, which the engine never sees
                    log.append_batch([("learner", 0, PolicyUpdated(step=1, policy_version=1))])
                await h.finish(reward=1.0)
                await asyncio.sleep(0.005)  # the checkpointer's turn
            ckpt = eng._checkpointer
            during = ckpt.written, ckpt.noted, ckpt.read_back
            await eng.close()
            ref = RestartFold()
            ref.catch_up(log)
            return during, ckpt, ref, log.next_lsn
        finally:
            log.close()

    (written, noted, read_back), ckpt, ref, end = asyncio.run(go())
    assert written >= 2
    assert ckpt.noted == end - 1 and ckpt.read_back == 1  # only the other writer's record was read
    assert noted > 0 and read_back <= 1
    assert _fold_state(ckpt.fold) == _fold_state(ref)
    log = FileLog.open(path, fsync="never")
    try:
        assert load_checkpoint(path / CHECKPOINT_NAME, log).next_lsn == end
    finally:
        log.close()


def test_records_noted_while_a_cancelled_read_runs_wait_for_it(tmp_path):
    """A checkpoint's caller cancelled during its read of the log (the engine
    closing): the read goes on, the records noted meanwhile wait, and the next
    checkpoint equals the fold of the whole log."""
    path = tmp_path / "log"
    records = [(f"s{i}", 0, SessionOpened(group_id=f"g{i}", group_size=1)) for i in range(400)]
    end = _write(path, records)

    async def go(log):
        ckpt = Checkpointer(log, RestartFold(), path / CHECKPOINT_NAME, every=1)
        first = asyncio.get_running_loop().create_task(ckpt.checkpoint(final=True))
        await asyncio.sleep(0)  # the read is submitted to a worker thread
        first.cancel()
        envs = list(log.read(0))
        for env in envs[:200]:
            ckpt.note(env)  # while the read may still run: they wait, or are behind the fold's end
        with pytest.raises(asyncio.CancelledError):
            await first
        for env in envs[200:]:
            ckpt.note(env)
        await ckpt.checkpoint(final=True)
        return ckpt

    log = FileLog.open(path, fsync="never")
    try:
        ckpt = asyncio.run(go(log))
        ref = RestartFold()
        ref.catch_up(log)
        assert _fold_state(ckpt.fold) == _fold_state(ref) and ckpt.fold.next_lsn == end
        assert ckpt.noted + ckpt.read_back == end
    finally:
        log.close()


def _opens_and_a_checkpointer(tmp_path: Path, n: int, every: int):
    """A log of ``n`` sessions that only opened, open for reading, and a checkpointer over it that has noted nothing."""
    path = tmp_path / "log"
    end = _write(path, [(f"s{i}", 0, SessionOpened(group_id=f"g{i}", group_size=1)) for i in range(n)])
    log = FileLog.open(path, fsync="never")
    return path, end, log, Checkpointer(log, RestartFold(), path / CHECKPOINT_NAME, every=every)


def test_a_fold_stuck_at_many_gaps_reads_past_all_of_them_at_once(tmp_path):
    """Every tenth record never noted: one checkpoint reads the log to its end
    (not one gap per checkpoint, which would leave the fold ever further behind)."""
    path, end, log, ckpt = _opens_and_a_checkpointer(tmp_path, 500, every=64)
    try:
        for env in log.read(0):
            if env.lsn % 10 != 9:
                ckpt.note(env)
        assert ckpt.fold.next_lsn == 9 and ckpt.due()
        assert asyncio.run(ckpt.checkpoint()) == end
        assert ckpt.fold.next_lsn == end and not ckpt._ahead
    finally:
        log.close()


class _FoldFailingAt(RestartFold):
    """A fold whose step raises at one LSN (a bug in the fold, as the engine would meet it)."""

    def __init__(self, lsn: int) -> None:
        super().__init__()
        self.failing = lsn

    def fold_noted(self, rec) -> None:
        if rec.lsn == self.failing:
            raise KeyError("a bug in the fold")
        super().fold_noted(rec)


def test_a_fold_that_raises_on_a_noted_record_breaks_the_checkpoint_not_the_engines_next_record(tmp_path):
    """Noted records are folded later, in runs: an error there must not surface in whichever
    record's note came next. The fold is broken instead: no checkpoint is written from it, and
    the checkpoint's error names the record."""
    path, end, log, _ = _opens_and_a_checkpointer(tmp_path, 40, every=8)
    try:
        ckpt = Checkpointer(log, _FoldFailingAt(17), path / CHECKPOINT_NAME, every=8)
        ckpt.PENDING_MAX = 4
        for env in log.read(0):
            ckpt.note(env)  # never raises: the run holding lsn 17 breaks the fold
        assert ckpt.fold.next_lsn == 17
        with pytest.raises(CheckpointError, match=r"not written: folding the noted record at lsn 17 \(session 's17'\) failed: KeyError"):
            asyncio.run(ckpt.checkpoint())
        with pytest.raises(CheckpointError, match="lsn 17"):
            asyncio.run(ckpt.checkpoint(final=True))
        assert not (path / CHECKPOINT_NAME).exists()
    finally:
        log.close()


def test_an_engine_whose_fold_breaks_reports_it_as_its_background_failure_and_at_close(tmp_path, monkeypatch):
    """The same fault inside a running engine: its periodic checkpoint fails loudly (the engine's
    background_failure, which health reports), and close raises it, naming the record."""
    folded = RestartFold.fold_noted

    def failing(self, rec):  # fault injection into the fold, not into what reports it
        if rec.lsn == 5:
            raise KeyError("a bug in the fold")
        folded(self, rec)

    monkeypatch.setattr(RestartFold, "fold_noted", failing)

    async def go():
        log = FileLog.open(tmp_path / "log", fsync="never")
        try:
            eng = await SessionEngine.open(log, checkpoint_every=4, checkpoint_poll_s=0.01)
            for i in range(10):
                h = await eng.open_session(f"s{i}", group_id=f"g{i}", group_size=1)
                await h.start(harness="bench")
                await h.finish(reward=1.0)
            for _ in range(200):
                if eng.background_failure is not None:
                    break
                await asyncio.sleep(0.01)
            assert eng.background_failure is not None and "folding the noted record at lsn 5" in eng.background_failure
            with pytest.raises(CheckpointError, match="lsn 5"):
                await eng.close()
        finally:
            log.close()

    asyncio.run(go())


def test_the_final_checkpoint_is_written_after_a_failed_one_even_with_nothing_new(tmp_path):
    """A periodic checkpoint that could not be written (a directory in its
    place) does not make the final one think it has nothing to write."""
    path, end, log, ckpt = _opens_and_a_checkpointer(tmp_path, 100, every=16)
    try:
        for env in log.read(0):
            ckpt.note(env)
        (path / CHECKPOINT_NAME).mkdir()
        assert asyncio.run(ckpt.checkpoint()) == -1 and ckpt.write_error is not None
        (path / CHECKPOINT_NAME).rmdir()
        assert asyncio.run(ckpt.checkpoint(final=True)) == end
        assert ckpt.write_error is None and load_checkpoint(path / CHECKPOINT_NAME, log).next_lsn == end
    finally:
        log.close()


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


def test_a_noted_record_keeps_nothing_of_its_envelope_while_it_waits(tmp_path):
    """Noted records wait to be folded (up to PENDING_MAX, or behind a gap); what waits is what
    the fold reads of each, never the envelope or its body (a prompt or a teacher's scores,
    up to 255 of them, would stay in memory until the next fold)."""
    import sys

    path, end, log, ckpt = _opens_and_a_checkpointer(tmp_path, 4, every=64)
    try:
        envs = list(log.read(0))
        held = [sys.getrefcount(env) for env in envs]
        list(map(ckpt.note, envs[1:]))  # waiting to be folded (fewer than PENDING_MAX), then behind a gap
        assert [sys.getrefcount(env) for env in envs] == held
        assert ckpt.fold.next_lsn == 0 and len(ckpt._ahead) == end - 1
        assert [sys.getrefcount(env) for env in envs] == held
        ckpt.note(envs[0])
        assert ckpt.fold.next_lsn == end
    finally:
        log.close()


def test_a_fold_that_raises_on_a_record_waiting_behind_a_gap_breaks_the_checkpoint_too(tmp_path):
    """Records noted behind a gap are folded when the read of the gap ends (in its done
    callback): a fold error there breaks the fold as it does anywhere else, and the
    checkpoint's error names the record, instead of escaping to the event loop's handler."""
    path, end, log, _ = _opens_and_a_checkpointer(tmp_path, 40, every=8)
    try:
        ckpt = Checkpointer(log, _FoldFailingAt(30), path / CHECKPOINT_NAME, every=8)
        for env in log.read(0):
            if env.lsn != 5:  # a gap: what follows it waits
                ckpt.note(env)
        assert ckpt.fold.next_lsn == 5 and len(ckpt._ahead) == end - 6
        with pytest.raises(CheckpointError, match=r"not written: folding the noted record at lsn 30 \(session 's30'\)"):
            asyncio.run(ckpt.checkpoint())
        assert not (path / CHECKPOINT_NAME).exists()
    finally:
        log.close()
