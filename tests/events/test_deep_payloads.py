"""Payloads nested close to, or past, what the decoder follows.

msgspec's encoder and decoder recurse once per nesting level and count against the
interpreter's recursion limit *from the caller's current depth*. The write-time check
(check_body) decodes the payload back at the writer's depth; a reader that decodes the
stored record from a deeper stack (a CLI command, a reducer inside a fold) has less
budget. A body the writer accepted must read back all the same (a reader retries on a
fresh stack), and one nested past any budget is a DecodeError naming where it lies,
never a bare RecursionError out of a reading command."""

from __future__ import annotations

import threading

import msgspec
import pytest

from agentlog.events import FileLog, read_log
from agentlog.events.schema.types import EventValidationError, SessionOpened
from agentlog.reducers.runstats import decode_projection
from agentlog.tools.cli import main
from future_log_shim import write_frames


def _pack(x):
    return msgspec.msgpack.encode(x)


#: A session_started whose free-form ``details`` nests 5000 levels deep (a foreign writer's, or corruption).
DEEP = b"\x82" + _pack("type") + _pack("session_started") + _pack("details") + b"\x81" + _pack("k") + b"\x91" * 5000 + b"\x01"


def test_the_stats_projection_reports_a_too_deep_payload_as_a_decode_error():
    """decode_body turns msgspec's RecursionError into a DecodeError (types.too_deep); the
    projection the reading commands decode with let it through bare."""
    with pytest.raises(msgspec.DecodeError, match="nests deeper"):
        decode_projection(DEEP)


@pytest.mark.parametrize("argv", [["stats"], ["replay", "--status", "open"]])
def test_reading_commands_name_a_too_deep_payload_instead_of_crashing(tmp_path, capsys, argv):
    log = tmp_path / "log"
    write_frames(log, [("s", {"type": "session_opened", "group_id": "g", "group_size": 1}, False), ("s", DEEP, False)])
    rc = main([argv[0], str(log), "--quiet", *argv[1:]])  # a bare RecursionError escaped main() before the fix
    assert rc == 1
    err = capsys.readouterr().err
    assert "lsn 1" in err and "'s'" in err and "nests deeper" in err


def _nest(n: int) -> object:
    v: object = 1
    for _ in range(n):
        v = [v]
    return v


def _deeper(levels: int, fn):
    return fn() if levels == 0 else _deeper(levels - 1, fn)


def test_a_deeply_nested_body_the_writer_accepts_reads_back_from_a_deeper_stack(tmp_path):
    d = tmp_path / "log"
    accepted: list[int] = []

    def write() -> None:  # a writer near the bottom of its stack (a worker thread, an event loop's callback)
        log = FileLog.open(d)
        try:
            for n in range(1000, 0, -1):  # the deepest body this writer's check accepts
                try:
                    log.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1, metadata={"k": _nest(n)}))])
                except EventValidationError:
                    continue
                accepted.append(n)
                return
        finally:
            log.close()

    t = threading.Thread(target=write)
    t.start()
    t.join()
    assert accepted, "the writer accepted no depth at all"
    # The same record, read by a reader 60 frames deeper than a bare thread.
    envs = _deeper(60, lambda: [e.eager() for e in read_log(d)])
    assert len(envs) == 1
    v, depth = envs[0].body.metadata["k"], 0
    while isinstance(v, list):  # compared iteratively: == on it would recurse as deep as the decoder
        v, depth = v[0], depth + 1
    assert (v, depth) == (1, accepted[0])
