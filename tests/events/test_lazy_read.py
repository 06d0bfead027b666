"""The file log's readers yield LazyEnvelopes: bodies built on first use,
payloads checked as they are read.

Invariants: a lazy read equals an eager one (every record, whichever bodies
are touched and in whatever order), under both frame codecs; the read-time
check refuses exactly the payloads the decoder refuses, with the decoder's
own error; a body nobody uses is never built (a replay of one session builds
only its bodies); and the envelope pickles, compares, hashes and prints as a
plain Envelope.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, read_log, verify_log
from agentlog.events.log import framecodec
from agentlog.events.log.api import LogCorruption, SchemaError, answer
from agentlog.events.log.lazy import LazyEnvelope, staged_envelope
from agentlog.events.schema.read_check import checked_tag
from agentlog.events.schema.types import TERMINAL_EVENT_TYPES, Envelope, SessionStarted, decode_body, encode_body, event_tag
from agentlog.reducers.lifecycle import replay
from event_samples import every_event
from future_log_shim import write_frames

pytestmark = pytest.mark.usefixtures("codec")

EVENTS = every_event()
FUTURE = {"type": "checkpoint_pruned", "step": 3}  # a newer writer's event


def _write(d: Path, picks: list[tuple[int, int]], segment_bytes: int) -> None:
    lg = FileLog.open(d, fsync="never", segment_bytes=segment_bytes)
    seqs: dict[str, int] = {}
    for session, k in picks:
        sid = f"s{session}"
        lg.append_batch([(sid, seqs.get(sid, 0), EVENTS[k])])
        seqs[sid] = 0 if isinstance(EVENTS[k], TERMINAL_EVENT_TYPES) else seqs.get(sid, 0) + 1  # the writer forgets an ended session
    lg.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, len(EVENTS) - 1)), min_size=1, max_size=40),
    segment_bytes=st.sampled_from([400, 2000, 64 << 20]),
    touched=st.lists(st.integers(0, 39)),
)
def test_a_lazy_read_equals_an_eager_one(picks, segment_bytes, touched):
    d = Path(tempfile.mkdtemp(prefix="agentlog-lazy-"))
    try:
        _write(d / "log", picks, segment_bytes)
        eager = [rec.decode() for rec in read_log(d / "log", raw=True)]
        lazy = list(read_log(d / "log"))
        assert all(type(e) is LazyEnvelope and not e.decoded for e in lazy)
        assert [e.tag for e in lazy] == [event_tag(e.body) for e in eager]
        assert not any(e.decoded for e in lazy), "the tag builds no body"
        for i in touched:  # some bodies built first, in any order
            if i < len(lazy):
                assert lazy[i].body == eager[i].body
        assert lazy == eager and eager == lazy and not (lazy != eager)
        assert [repr(e) for e in lazy] == [repr(e) for e in eager]
        assert pickle.loads(pickle.dumps(lazy)) == eager
        assert all(type(e) is Envelope for e in pickle.loads(pickle.dumps(lazy)))
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def _staged(lg, picks: list[tuple[int, int]]) -> tuple[list, list[bool], list[bool]]:
    """Stage each picked event (``stage``, the engine's way in), await every acknowledgement, and
    say which envelopes held their body undecoded then (asked in the loop: a repr of the loop's
    task at its shutdown would build them) and which were not their session's first record."""
    loop = asyncio.get_running_loop()
    seqs: dict[str, int] = {}
    futs = []
    for session, k in picks:
        sid = f"s{session}"
        fut = loop.create_future()
        lg.stage(sid, seqs.get(sid, 0), EVENTS[k], functools.partial(answer, fut))
        futs.append(fut)
        seqs[sid] = 0 if isinstance(EVENTS[k], TERMINAL_EVENT_TYPES) else seqs.get(sid, 0) + 1
    envs = list(await asyncio.gather(*futs))
    return envs, [type(e) is LazyEnvelope and not e.decoded for e in envs], [e.session_seq > 0 for e in envs]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, len(EVENTS) - 1)), min_size=1, max_size=40),
    segment_bytes=st.sampled_from([400, 64 << 20]),
    touched=st.lists(st.integers(0, 39)),
)
def test_a_staged_records_envelope_keeps_the_stored_bytes_and_decodes_them_as_a_reader_does(picks, segment_bytes, touched):
    """The file log's ``stage`` acknowledges with the stored bytes, not the body decoded back
    when it was checked: nobody holds that copy while the record waits for the disk. Used, the
    body is what a reader of the log gets."""
    d = Path(tempfile.mkdtemp(prefix="agentlog-staged-"))
    try:
        lg = FileLog.open(d / "log", fsync="never", segment_bytes=segment_bytes)
        try:
            envs, undecoded, later = asyncio.run(_staged(lg, picks))
        finally:
            lg.close()
        assert all(undecoded[i] for i, e in enumerate(envs) if type(e) is LazyEnvelope), "acknowledged with a body decoded"
        if framecodec.native is not None and segment_bytes > 400:
            # The common case (the compiled codec, a session's next record in the active segment, no
            # index entry due: 40 records are under 16 kB) acknowledges with the stored bytes; a
            # session's first record goes the batch's way.
            assert undecoded == later
        stored = list(read_log(d / "log"))
        assert [e.tag for e in envs] == [e.tag for e in stored]
        for i in touched:  # some bodies built first, in any order
            if i < len(envs):
                assert envs[i].body == stored[i].body
        assert envs == stored and [repr(e) for e in envs] == [repr(e) for e in stored]
        assert all(type(e) is Envelope for e in pickle.loads(pickle.dumps(envs)))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_staged_body_that_does_not_decode_is_named_where_it_lies():
    """Never met (the writer decoded the bytes back before it staged them), but not swallowed either:
    the error a reader gives, naming the segment, the frame's offset and the LSN."""
    env = staged_envelope(7, "s", 2, 0, SessionStarted, msgspec.msgpack.encode({"no_type": 1}), "00000000000000000005.seg", 4096)
    assert env.tag == "session_started" and not env.decoded
    with pytest.raises(LogCorruption, match=r"segment 00000000000000000005\.seg, offset 4096, lsn 7: CRC-valid frame"):
        _ = env.body


def test_a_body_is_built_on_first_use_and_kept(tmp_path):
    _write(tmp_path / "log", [(0, k) for k in range(len(EVENTS))], 64 << 20)
    envs = list(read_log(tmp_path / "log"))
    env = envs[2]
    assert not env.decoded and env.tag == "turn_recorded" and not env.unknown
    body = env.body
    assert env.decoded and env.body is body and body == EVENTS[2]
    # The plain Envelope it stands for: equal, same hash where the body hashes, same msgpack bytes.
    plain = Envelope(env.lsn, env.session_id, env.session_seq, env.ts_ns, body)
    assert env.eager() == plain and type(env.eager()) is Envelope
    small = envs[3]
    assert hash(small) == hash(small.eager()) == hash(Envelope(small.lsn, small.session_id, small.session_seq, small.ts_ns, EVENTS[3]))
    assert msgspec.msgpack.encode(env) == msgspec.msgpack.encode(plain)
    assert msgspec.structs.replace(envs[4], lsn=99).body == EVENTS[4]


def test_an_encoder_refuses_an_undecoded_envelope_instead_of_writing_garbage(tmp_path):
    _write(tmp_path / "log", [(0, 0)], 64 << 20)
    (env,) = read_log(tmp_path / "log")
    with pytest.raises(TypeError, match="UndecodedStoredBody"):
        msgspec.json.encode(env)
    assert msgspec.json.decode(msgspec.json.encode(env.eager()))["body"]["group_id"] == "g-0"


def test_a_replay_of_one_session_builds_only_its_bodies(tmp_path):
    _write(tmp_path / "log", [(i % 2, k) for i, k in enumerate([0, 0, 1, 1, 2, 2, 4, 4, 6, 6])], 64 << 20)
    envs = list(read_log(tmp_path / "log"))
    steps = list(replay(envs, session_id="s1"))
    assert [s.envelope.session_id for s in steps] == ["s1"] * 5
    assert [s.event for s in steps] == ["session_opened", "session_started", "turn_recorded", "command_ran", "session_finished"]
    assert not any(e.decoded for e in envs if e.session_id == "s0")
    # The lifecycle fold builds what it counts or reports (opened, turns, the terminal event), not the rest.
    assert [e.decoded for e in envs if e.session_id == "s1"] == [True, False, True, False, True]


def test_an_unknown_event_reads_as_before(tmp_path):


    write_frames(tmp_path / "log", [("s", {"type": "session_opened", "group_id": "g", "group_size": 1}, False), ("s", FUTURE, False)])
    env = list(read_log(tmp_path / "log"))[1]
    assert env.tag == "checkpoint_pruned" and env.unknown and env.body.fields == {"step": 3}


def test_a_payload_that_does_not_decode_still_raises_during_the_read(tmp_path):
    """Checked as read, not when used: the error an eager read gave, naming segment, offset and LSN."""


    write_frames(tmp_path / "log", [("s", {"type": "session_opened", "group_id": "g", "group_size": 1}, False),
                                    ("s", {"type": "session_started", "details": ["not", "a", "map"]}, False)])
    it = read_log(tmp_path / "log")
    assert next(it).lsn == 0
    with pytest.raises(SchemaError) as info:
        next(it)
    assert (info.value.lsn, info.value.field) == (1, "details") and "offset" in str(info.value)
    write_frames(tmp_path / "bad", [("s", {"no_type": 1}, False)])
    with pytest.raises(LogCorruption, match=r"segment 0+\.seg, offset \d+, lsn 0: CRC-valid frame whose payload does not decode"):
        list(read_log(tmp_path / "bad"))


def test_a_payload_nested_deeper_than_the_decoder_follows_is_corruption_named_where_it_lies(tmp_path):
    """msgspec raises RecursionError decoding it: readers and verify report a corrupt
    record (segment, offset, LSN) instead of letting a bare RecursionError through."""
    pack = msgspec.msgpack.encode
    deep = b"\x82" + pack("type") + pack("session_started") + pack("details") + b"\x81" + pack("k") + b"\x91" * 5000 + b"\x01"
    write_frames(tmp_path / "log", [("s", {"type": "session_opened", "group_id": "g", "group_size": 1}, False), ("s", deep, False)])
    with pytest.raises(LogCorruption, match=r"segment 0+\.seg, offset \d+, lsn 1: CRC-valid frame whose payload does not decode.*nests deeper"):
        list(read_log(tmp_path / "log"))
    rep = verify_log(tmp_path / "log")
    assert rep.status == "corrupt" and rep.last_good_lsn == 0, rep.summary()


def test_a_record_from_before_a_field_with_an_empty_default_reads_lazily(tmp_path):
    """A field whose default is [] or {} (kept by msgspec as a factory) is as optional to the
    read-time check as to the decoder: an older writer's record without it is checked, not built."""
    old = {"type": "policy_updated", "step": 1, "policy_version": 1}  # before batch, frontier, low_water...
    assert checked_tag(msgspec.msgpack.encode(old)) == "policy_updated"
    write_frames(tmp_path / "log", [("learner", old, False)])
    (env,) = read_log(tmp_path / "log")
    assert not env.decoded and env.body.step == 1 and env.body.batch == []


def _outcome(fn, payload):
    try:
        return "ok", fn(payload)
    except msgspec.DecodeError as exc:
        return type(exc).__name__, str(exc)


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(0, len(EVENTS) - 1),
    field_values=st.dictionaries(
        st.sampled_from(["group_id", "group_size", "messages", "prompt_ids", "output_ids", "metadata", "details", "reward",
                         "sampling", "label", "response_message", "exit_code", "log_probs", "batch", "prompt", "type"]),
        st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False) | st.text(max_size=4) | st.binary(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=6),
        max_size=3,
    ),
    cut=st.none() | st.integers(0, 200),
)
def test_the_read_check_refuses_exactly_what_the_decoder_refuses(k, field_values, cut):
    """checked_tag (the read-time check, no body built) agrees with decode_body
    on every payload: the tag of what decodes, the UnknownEvent of a newer
    tag, and the decoder's own error for the rest."""
    stored = msgspec.msgpack.decode(encode_body(EVENTS[k]))
    stored.update(field_values)
    payload = msgspec.msgpack.encode(stored)
    if cut is not None:
        payload = payload[:cut]
    checked, decoded = _outcome(checked_tag, payload), _outcome(decode_body, payload)
    if decoded[0] == "ok" and type(checked[1]) is str:
        assert checked[1] == event_tag(decoded[1])
    else:
        assert checked == decoded


#: msgpack values msgspec's decoder refuses inside a free-form (``Any``) field although they are
#: well-formed msgpack: a str that is not UTF-8, a timestamp of a wrong length, a map as a map key.
_REFUSED_INSIDE = {"not utf-8": b"\xa2\xff\xfe", "bad timestamp": b"\xd5\xff\x00\x01", "map as key": b"\x81\x80\x01"}
#: Every free-form field of every sample event: (event index, field name, whether it is a map).
_FREE_FIELDS = [(k, f.encode_name, "dict" in str(f.type))
                for k, ev in enumerate(EVENTS) for f in msgspec.structs.fields(type(ev)) if "Any" in str(f.type)]


@settings(max_examples=80, deadline=None)
@given(where=st.sampled_from(_FREE_FIELDS), bad=st.sampled_from(sorted(_REFUSED_INSIDE)), nest=st.integers(0, 2))
def test_a_free_form_value_the_decoder_refuses_is_refused_by_the_read_check(where, bad, nest):
    """A free-form (Any) field of an event holding a value the decoder refuses: the read-time
    check refuses it too, with the decoder's error (as a Raw, it passed the check before)."""
    k, field, is_map = where
    marker = "\x00free\x00"
    stored = msgspec.msgpack.decode(encode_body(EVENTS[k]))
    stored[field] = {"k": marker} if is_map else [marker]
    value = _REFUSED_INSIDE[bad]
    for _ in range(nest):
        value = b"\x91" + value  # inside arrays
    payload = msgspec.msgpack.encode(stored).replace(msgspec.msgpack.encode(marker), value)
    checked, decoded = _outcome(checked_tag, payload), _outcome(decode_body, payload)
    assert decoded[0] != "ok" and checked == decoded, (field, bad, checked, decoded)
