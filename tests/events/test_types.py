"""Schema v1: every event round-trips; every bad input is refused with a clear error."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from agentlog.events.schema.types import (
    MAX_ID_BYTES,
    EVENT_TYPES,
    Envelope,
    TeacherScored,
    SandboxSnapshotted,
    SessionResumed,
    EventValidationError,
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    TurnDelta,
    TurnRecorded,
    UnknownEvent,
    check_body,
    decode_body,
    encode_body,
    event_tag,
    validate_id,
)
from event_samples import every_event

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("body", every_event(), ids=lambda b: event_tag(b))
def test_every_event_type_round_trips_through_the_codec(body):
    raw = encode_body(body)
    back = decode_body(raw)
    assert type(back) is type(body)
    assert back == body
    env = Envelope(5, "s", 1, 123, body)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(env), type=Envelope) == env


def test_event_tags_are_unique_snake_case():
    tags = [t.__struct_config__.tag for t in EVENT_TYPES]
    assert len(set(tags)) == len(tags)
    assert all(t == t.lower() and " " not in t for t in tags)


def test_token_arrays_are_stored_as_raw_little_endian_bytes_and_read_as_views():
    t = TurnRecorded(turn_index=0, output_ids=[1, 2, 300000], output_log_probs=np.array([-0.5, -1.0, -2.0]))
    assert t.output_ids == np.array([1, 2, 300000], dtype="<i4").tobytes()
    assert t.output_log_probs == np.array([-0.5, -1.0, -2.0], dtype="<f4").tobytes()
    back = decode_body(encode_body(t))
    assert back.output_tokens.tolist() == [1, 2, 300000]
    assert back.log_probs.dtype == np.float32 and back.log_probs.tolist() == [-0.5, -1.0, -2.0]
    assert back.output_tokens.base is not None  # a view over the stored bytes, not a copy


# ---------------------------------------------------------------- validation


def _raises(match: str, fn, *args, **kwargs):
    with pytest.raises(EventValidationError, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_log_prob_count_must_match_output_tokens():
    msg = _raises("output_log_probs", TurnRecorded, turn_index=0, output_ids=[1, 2, 3], output_log_probs=[-0.1, -0.2])
    assert "expected 3 log-probs" in msg and "2 log-probs" in msg
    # Empty log-probs are allowed (not recorded).
    assert TurnRecorded(turn_index=0, output_ids=[1, 2, 3]).log_probs.size == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_log_probs_are_refused_naming_the_position(bad):
    msg = _raises(r"output_log_probs\[1\]", TurnRecorded, turn_index=0, output_ids=[1, 2, 3], output_log_probs=[-0.1, bad, -0.3])
    assert "expected a finite float" in msg


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.0", None, [1.0]])
def test_non_finite_or_non_numeric_rewards_are_refused(bad):
    msg = _raises("reward_assigned.reward", RewardAssigned, reward=bad)
    assert repr(bad)[:10] in msg


@pytest.mark.parametrize("bad", [{"a": math.nan}, {"a": "x"}, {"a": None}, {1: 1.0}])
def test_dict_rewards_must_hold_finite_floats_under_str_keys(bad):
    _raises(r"reward\[", RewardAssigned, reward=bad)


def test_int_and_bool_rewards_become_floats():
    assert RewardAssigned(reward=1).reward == 1.0 and type(RewardAssigned(reward=1).reward) is float
    assert RewardAssigned(reward=True).reward == 1.0
    assert RewardAssigned(reward={"a": 2, "b": False}).reward == {"a": 2.0, "b": 0.0}
    assert SessionFinished(reward=0).reward == 0.0
    _raises("session_finished.reward", SessionFinished, reward=math.nan)


def test_finish_reason_must_be_stop_length_or_abort():
    msg = _raises("finish_reason", TurnRecorded, turn_index=0, finish_reason="eos")
    assert "stop/length/abort" in msg and "'eos'" in msg


@pytest.mark.parametrize(
    "bad, why",
    [
        ("", "non-empty"),
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        ("a\nb", "control character"),
        ("a\x00b", "control character"),
        ("a\ud800b", "lone surrogate"),  # no UTF-8: the file log raised a bare UnicodeEncodeError, MemoryLog kept it
        ("..", "other than '.' or '..'"),  # the ui's page asked for /api/session/.. and the browser made it /api/
        (".", "other than '.' or '..'"),
        ("x" * (MAX_ID_BYTES + 1), "at most"),
        (42, "non-empty str"),
    ],
)
def test_ids_are_bounded_in_length_and_charset(bad, why):
    msg = _raises(why, validate_id, "session_id", bad)
    assert msg.startswith("session_id")
    _raises(why, SessionOpened, group_id=bad, group_size=1)


def test_other_bad_fields_name_field_and_value():
    assert "group_size" in _raises("group_size", SessionOpened, group_id="g", group_size=0)
    assert "turn_index" in _raises("turn_index", TurnRecorded, turn_index=-1)
    _raises("int32 range", TurnRecorded, turn_index=0, output_ids=[2**31])
    _raises("reason", SessionAborted, reason="")
    _raises("reason", SessionDropped, reason="")


def test_stored_records_decode_without_the_write_checks():
    """A newer writer may allow what this version's checks refuse (a new
    finish reason, a relaxed bound): reading takes the stored values as they are."""
    raw = msgspec.msgpack.encode({"type": "turn_recorded", "turn_index": 0, "finish_reason": "tool_calls"})
    assert decode_body(raw).finish_reason == "tool_calls"
    raw = msgspec.msgpack.encode({"type": "session_opened", "group_id": "g", "group_size": 0})
    assert decode_body(raw).group_size == 0


def test_building_an_event_still_runs_the_checks_after_a_decode():
    """The read path switches the checks off for its own decode only, also
    when that decode fails."""
    decode_body(msgspec.msgpack.encode({"type": "turn_recorded", "turn_index": 0, "finish_reason": "eos"}))
    with pytest.raises(msgspec.ValidationError):
        decode_body(msgspec.msgpack.encode({"type": "turn_recorded", "turn_index": "x"}))
    _raises("stop/length/abort", TurnRecorded, turn_index=0, finish_reason="eos")
    _raises("group_size", SessionOpened, group_id="g", group_size=0)


def test_the_write_check_refuses_what_a_reader_could_not_decode():
    msg = _raises(r"session_opened\.metadata: expected `object`, got `array`", check_body, SessionOpened(group_id="g", group_size=1, metadata=[1]))
    assert "$" not in msg
    bypassed = SessionOpened(group_id="g", group_size=1)
    msgspec.structs.force_setattr(bypassed, "group_size", 0)
    _raises(r"session_opened\.group_size: expected an int >= 1, found 0", check_body, bypassed)
    _raises(r"session_opened: cannot be encoded", check_body, SessionOpened(group_id="g", group_size=1, label=2**70))


def test_the_write_check_hands_back_the_payload_and_the_body_readers_get():
    body = SessionOpened(group_id="g", group_size=1, prompt=({"role": "user", "content": "hi"},))
    payload, decoded = check_body(body)
    assert payload == encode_body(body)
    assert decoded.prompt == [{"role": "user", "content": "hi"}] and decoded == decode_body(payload)


def test_an_unknown_tag_decodes_to_an_unknown_event():
    raw = msgspec.msgpack.encode({"type": "turn_scored", "turn_index": 3, "score": 0.5})
    ev = decode_body(raw)
    assert ev == UnknownEvent("turn_scored", {"turn_index": 3, "score": 0.5})
    assert event_tag(ev) == "turn_scored"


def test_a_known_tag_with_fields_of_other_types_does_not_decode():
    with pytest.raises(msgspec.ValidationError, match=r"\$\.metadata"):
        decode_body(msgspec.msgpack.encode({"type": "session_finished", "metadata": ["x"]}))


def test_aborted_traceback_is_capped_keeping_the_end():
    tb = "x" * 50_000 + "END"
    ev = SessionAborted(reason="exception", traceback=tb)
    assert len(ev.traceback) <= 8192 and ev.traceback.endswith("END")


# ---------------------------------------------------------------- schema evolution


def test_golden_schema_v1_records_still_decode():
    """The committed golden file (never regenerated by tests) decodes to the same events."""
    import make_golden_shim

    raw = (FIXTURES / "schema_v1_events.msgpack").read_bytes()
    envs = msgspec.msgpack.decode(raw, type=list[Envelope])
    # Every type but those added after the file was written.
    assert {type(e.body) for e in envs} == set(EVENT_TYPES) - {TurnDelta, TeacherScored, SandboxSnapshotted, SessionResumed}
    assert envs == make_golden_shim.golden_envelopes()
    turn = next(e.body for e in envs if isinstance(e.body, TurnRecorded))
    assert turn.output_tokens.tolist() == [10, -1, 2**31 - 1]


def test_golden_v1_log_directory_still_reads():
    """A log written in format v1 (segment + DURABLE) still reads, record for record."""
    import make_golden_shim

    from agentlog.events import read_log, verify_log

    assert list(read_log(FIXTURES / "golden_log_v1")) == make_golden_shim.golden_envelopes()
    assert verify_log(FIXTURES / "golden_log_v1").status == "ok"


def test_new_fields_in_a_newer_writer_are_tolerated():
    raw = msgspec.msgpack.encode({"type": "session_dropped", "reason": "x", "added_in_v2": [1, 2]})
    assert decode_body(raw) == SessionDropped(reason="x")


def test_a_value_encoded_as_malformed_msgpack_is_refused_naming_the_event():
    """msgspec.Raw is written verbatim: bytes that are not one msgpack value make the
    payload undecodable (msgspec.DecodeError, not its ValidationError subclass): refused
    as EventValidationError like any other body a reader could not decode."""
    body = SessionOpened(group_id="g", group_size=1, metadata={"k": msgspec.Raw(b"\x92\x01")})
    with pytest.raises(EventValidationError, match=r"session_opened: a reader could not decode it: .*truncated"):
        check_body(body)
    from agentlog.events.log.api import check_record_body

    with pytest.raises(EventValidationError, match=r"session 's' seq 0: session_opened: a reader could not decode it"):
        check_record_body("s", 0, body)


@pytest.mark.parametrize("body", every_event(), ids=lambda b: event_tag(b))
def test_event_bodies_are_never_walked_by_the_cyclic_collector(body):
    """A body holds plain data (its lists and dicts are tracked themselves): untracked, the tens of
    thousands a busy engine holds in flight (each kept past its batch's fsync, so into the old
    generation) cost the collector nothing; written or read back alike."""
    import gc

    assert not gc.is_tracked(body)
    assert not gc.is_tracked(check_body(body)[1])


def test_a_body_that_contains_itself_is_refused_never_stored():
    """Why an untracked body is safe: a cycle through one would need a container inside it to hold it
    back, and the write check refuses such a body (msgpack cannot hold a cycle), so none is ever stored."""
    messages: list = []
    body = TurnRecorded(turn_index=0, messages=messages)
    messages.append({"role": "user", "content": "x", "self": body})
    _raises(r"turn_recorded: cannot be encoded", check_body, body)
