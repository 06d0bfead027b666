"""`agentlog verify`'s lifecycle check and the id filter's false positives."""

from __future__ import annotations

from agentlog.events import FileLog
from agentlog.events.schema.types import SessionDropped, SessionFinished, SessionOpened, SessionStarted
from agentlog.reducers.lifecycle import LifecycleCheck
from agentlog.tools.cli_common import check_log_path
from agentlog.tools.cmd_verify import check_lifecycle


def _write(path, records) -> None:
    log = FileLog.open(path, fsync="never")
    try:
        for rec in records:
            log.append_batch([rec])
    finally:
        log.close()


def _seeded(*false_positives: str):
    """A check whose id filter answers "maybe used" for these fresh ids (what a false positive
    answers) and whose window forgets every ended session, so the filter alone answers."""

    def make() -> LifecycleCheck:
        check = LifecycleCheck(recent_window=0, id_capacity=64)
        for sid in false_positives:
            check.ids.add(sid)
        return check

    return make


def test_a_filter_false_positive_is_no_reused_id_and_a_real_reuse_still_is(tmp_path):
    path = tmp_path / "log"
    _write(path, [
        ("old", 0, SessionOpened(group_id="O", group_size=1)), ("old", 1, SessionDropped(reason="y")),
        ("ghost", 0, SessionOpened(group_id="G", group_size=1)), ("ghost", 1, SessionStarted(harness="t")),
        ("ghost", 2, SessionFinished(reward=1.0)),
        ("old", 0, SessionOpened(group_id="O2", group_size=1)),  # a real reuse, at lsn 5
    ])
    count, shown = check_lifecycle(check_log_path(str(path)), new_check=_seeded("ghost"))
    assert count == 1, [v.describe() for v in shown]
    assert (shown[0].lsn, shown[0].session_id, shown[0].kind.value) == (5, "old", "reused_id")


def test_only_real_reuses_are_reported_as_they_are_without_a_second_check(tmp_path):
    path = tmp_path / "log"
    _write(path, [
        ("a", 0, SessionOpened(group_id="A", group_size=1)), ("a", 1, SessionDropped(reason="y")),
        ("a", 0, SessionOpened(group_id="A2", group_size=1)), ("a", 1, SessionDropped(reason="y")),
    ])
    made = []

    def make() -> LifecycleCheck:
        made.append(LifecycleCheck(recent_window=0))
        return made[-1]

    count, shown = check_lifecycle(check_log_path(str(path)), new_check=make)
    # The reuse at lsn 2 is refused; its drop at lsn 3 then belongs to no session in flight.
    assert [(v.lsn, v.kind.value) for v in shown][:1] == [(2, "reused_id")] and count == len(shown) >= 1
    assert len(made) == 1  # the scan proved it real: the first pass's answer stands
