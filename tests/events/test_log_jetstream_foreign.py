"""The JetStream log's error paths (a server that cannot be
reached, a stream made by someone else with other settings, a gap met by a read
from a later LSN). One local nats-server per module (conftest)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from agentlog.events.log.api import LogCorruption, LogError
from agentlog.events.schema.types import SessionOpened
from event_samples import small_event

nats = pytest.importorskip("nats", reason="JetStreamLog needs the nats extra: pip install 'agentlog[nats]'")

from agentlog.events.log.jetstream import JetStreamLog  # noqa: E402
from nats_cluster import free_ports  # noqa: E402
from nats_helpers import raw  # noqa: E402

_names = itertools.count()


@pytest.fixture
def stream():
    return f"rv{next(_names)}"


def opened() -> SessionOpened:
    return SessionOpened(group_id="g", group_size=1)


def in_thread(fn, timeout_s: float):
    """``fn()``'s outcome ("ok", value) / ("raised", exc), or ("hung", None) past ``timeout_s``."""
    box: list = []

    def target():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box.append(("raised", exc))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else ("hung", None)


# -- 1. a server that cannot be reached: open hangs forever -------------------------------


@pytest.mark.parametrize("opener", ["writer", "reader"])
def test_open_against_an_unreachable_server_fails_naming_it_instead_of_hanging(opener):
    from agentlog.events.log.jetstream_read import JetStreamRun

    (port,) = free_ports(1)  # nothing listens there
    url = f"nats://127.0.0.1:{port}"
    if opener == "writer":
        fn = lambda: JetStreamLog.open(url, "nowhere", 0, connect_timeout_s=1).close()  # noqa: E731
    else:
        fn = lambda: JetStreamRun.open(url, "nowhere", connect_timeout_s=1).close()  # noqa: E731
    t0 = time.monotonic()
    outcome, value = in_thread(fn, 20)
    assert outcome != "hung", f"{opener} open of {url} still connecting after 20 s (nats-py retries a first connect forever)"
    assert outcome == "raised" and isinstance(value, LogError), (outcome, value)
    assert f"127.0.0.1:{port}" in str(value) and time.monotonic() - t0 < 20


# -- 2. a stream made by someone else with other settings ---------------------------------


@pytest.mark.parametrize(
    "setting, field",
    [
        ({"subjects": ["elsewhere.>"]}, "subjects"),
        ({"allow_direct": False}, "allow_direct"),
        ({"max_msgs_per_subject": 3}, "max_msgs_per_subject"),
        ({"max_age": 3600.0}, "max_age"),
        ({"retention": "workqueue"}, "retention"),
        ({"storage": "memory"}, "storage"),
    ],
)
def test_a_foreign_stream_whose_settings_cannot_hold_a_log_is_refused_at_open_naming_the_setting(nats_server, stream, setting, field):
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    kw = {"subjects": [f"{stream}.>"], "allow_direct": True, "allow_atomic": True, **setting}
    kw["subjects"] = [s.replace("elsewhere", f"elsewhere{stream}") for s in kw["subjects"]]
    if "retention" in setting:
        kw["retention"] = RetentionPolicy(setting["retention"])
    if "storage" in setting:
        kw["storage"] = StorageType(setting["storage"])

    async def make(js):
        await js.add_stream(StreamConfig(name=stream, **kw))

    raw(nats_server.url, make)
    t0 = time.monotonic()
    with pytest.raises(LogError, match=rf"stream '{stream}'.*{field}"):
        with JetStreamLog.open(nats_server.url, stream, 0, failover_timeout_s=2) as lg:
            # What happens without the check: records the server drops, reads that hang.
            lg.append_batch([("a", 0, opened())] + [("a", i, small_event(i)) for i in range(1, 6)])
            assert [e.lsn for e in lg.read(0)] == list(range(6))
            assert [e.lsn for e in lg.read(2)] == list(range(2, 6))
    assert time.monotonic() - t0 < 10


# -- 3. a read from a later LSN over a gap ------------------------------------------------


@pytest.mark.parametrize("reader", ["writer", "read-only"])
def test_a_read_from_an_lsn_whose_record_is_gone_is_corruption_not_a_shorter_log(nats_server, stream, reader):
    from agentlog.events.log.jetstream_read import JetStreamRun

    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])
        for i in range(1, 6):
            lg.append_batch([("a", i, small_event(i))])

        async def delete_lsn_3(js):
            last = await js.get_msg(stream, subject=lg.subject)  # lsn 5
            await js.delete_msg(stream, last.seq - 2)  # lsn 3
            return last.seq - 2

        seq = raw(nats_server.url, delete_lsn_3)
        with pytest.raises(LogCorruption, match=r"expected 3"):
            list(lg.read(0))  # from the start the gap is found
        if reader == "writer":
            got = lambda: list(lg.read(3))  # noqa: E731
        else:
            run = JetStreamRun.open(nats_server.url, stream)
            got = lambda: list(run.log(0).read(3))  # noqa: E731
        try:
            with pytest.raises(LogCorruption, match=rf"seq {seq + 1}: lsn 4, expected 3"):
                got()
        finally:
            if reader != "writer":
                run.close()


# -- 4. a subject that ends in a torn chunked record --------------------------------------


def test_a_writer_does_not_open_after_a_torn_chunked_record_and_bury_it_under_acknowledged_records(nats_server, stream):
    """Chunks of a record whose last chunk never came (another client, or a
    publisher that is not atomic) end the subject. A reader holds them back; a
    writer that opens there and appends acknowledges records that no reader can
    then read (a whole message inside the chunks begun earlier)."""
    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])
        subject = lg.subject

    async def torn(js):
        for i in (1, 2):
            await js.publish(subject, b"x" * 100, headers={"Agentlog-Chunk": f"{i}/3"})

    raw(nats_server.url, torn)
    acked = None
    try:
        with JetStreamLog.open(nats_server.url, stream, 0) as lg:
            acked = lg.append_batch([("a", 1, small_event(1))])
            read = [e.lsn for e in lg.read()]
    except LogCorruption as exc:
        assert acked is None, f"the append was acknowledged, then: {exc}"
        assert f"subject '{subject}'" in str(exc) and "chunk" in str(exc)
        return
    pytest.fail(f"opened past the torn chunks and acknowledged lsn 1; read back {read}")


# -- 5. settings of open() that are not checked --------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("duplicate_window_s", float("inf")),  # raw OverflowError
        ("duplicate_window_s", 1e12),  # passes [log]'s 0 < x < inf; raw BadRequestError from the server
        ("duplicate_window_s", "5"),  # raw TypeError
        ("connect_timeout_s", "x"),  # raw TypeError
        ("connect_timeout_s", -1),  # accepted
    ],
)
def test_bad_settings_of_open_are_refused_naming_them(nats_server, stream, name, value):
    outcome, exc = in_thread(lambda: JetStreamLog.open(nats_server.url, stream, 0, **{name: value}).close(), 15)
    assert outcome == "raised" and isinstance(exc, ValueError), (outcome, exc)
    assert str(exc).startswith(f"{name}: expected seconds > 0") and repr(value) in str(exc)


# -- 6. a server without JetStream ----------------------------------------------------------


@pytest.fixture
def plain_server():
    """A nats-server without JetStream (no -js), stopped by PID."""
    import subprocess

    from nats_cluster import find_nats_server

    (port,) = free_ports(1)
    proc = subprocess.Popen([str(find_nats_server()), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_a_server_without_jetstream_is_named_by_the_writer_and_the_cli_not_a_raw_nats_error(plain_server):
    from agentlog.events.log.source import SourceError, open_source

    with pytest.raises(LogError, match=r"nats stream 'run'.*JetStream enabled"):
        JetStreamLog.open(plain_server, "run", 0, failover_timeout_s=2)
    with pytest.raises(SourceError, match=rf"{plain_server}/run: .*JetStream enabled"):  # what the CLI turns into exit 2
        open_source(f"{plain_server}/run")


def test_a_reader_of_a_foreign_stream_without_direct_gets_is_told_at_open(nats_server, stream):
    """Without the check: a read from a later LSN waits 10..30 s, then names a timeout."""
    from nats.js.api import StreamConfig

    from agentlog.events.log.jetstream_read import JetStreamRun

    async def make(js):
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], allow_direct=False))
        await js.publish(f"{stream}.p0000", b"x")

    raw(nats_server.url, make)
    t0 = time.monotonic()

    def read():
        with JetStreamRun.open(nats_server.url, stream) as run:
            return list(run.log(0).read(1))

    outcome, exc = in_thread(read, 40)
    assert outcome == "raised" and isinstance(exc, LogError) and "allow_direct" in str(exc), (outcome, exc)
    assert time.monotonic() - t0 < 5


def test_a_last_message_whose_epoch_header_is_not_a_number_is_named_at_open(nats_server, stream):
    """A fence another client published with a non-numeric epoch header, at the end of the subject:
    the writer's open read it with int() (a raw ValueError naming nothing)."""
    from agentlog.events.log.jetstream_append import HDR_EPOCH
    from agentlog.events.log.jetstream_msg import HDR_KIND, HDR_NEXT_LSN, KIND_FENCE

    with JetStreamLog.open(nats_server.url, stream, 0) as lg:
        lg.append_batch([("a", 0, opened())])
        subject = lg.subject

    async def foreign(js):
        await js.publish(subject, b"", headers={HDR_KIND: KIND_FENCE, HDR_NEXT_LSN: "1", HDR_EPOCH: "seven"})

    raw(nats_server.url, foreign)
    with pytest.raises(LogCorruption, match=rf"subject '{subject}'.* seq \d+: header {HDR_EPOCH} is 'seven', expected a whole number"):
        JetStreamLog.open(nats_server.url, stream, 0, failover_timeout_s=2)


def test_follow_after_close_is_log_closed_as_read_is(nats_server, stream):
    """follow() of a closed writer reached its connection's stopped loop (a RuntimeError)."""
    from agentlog.events.log.api import LogClosed

    lg = JetStreamLog.open(nats_server.url, stream, 0)
    lg.close()
    with pytest.raises(LogClosed, match=rf"stream '{stream}'.*closed"):
        lg.read(0)

    async def first():
        async for env in lg.follow(0):
            return env

    with pytest.raises(LogClosed, match=rf"stream '{stream}'.*closed"):
        asyncio.run(first())
