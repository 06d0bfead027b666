"""How the batch check rebuilds a decoded mirror as its body: the constructor
call spelled out field by field (generated once per body type) must give what
``cls(**asdict(mirror))`` gives, run the body's checks on the decoded values,
and a body type whose field names the generated source cannot spell must get
the generic rebuild."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from agentlog.events.schema.batch_check import _MIRRORED, _REBUILD, _mirror, _rebuilder
from agentlog.events.schema.types import EventValidationError, TurnRecorded, encode_body


class _Awkward(msgspec.Struct, frozen=True, kw_only=True, tag="awkward"):
    # "from" is a keyword and "_hidden" could shadow the generated code's names.
    payload: bytes = b""
    _hidden: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise EventValidationError(f"awkward.count: expected an int >= 0, found {self.count}")


_KEYWORD = msgspec.defstruct("_Keyword", [("data", bytes, b""), ("from", int, 0)], kw_only=True, frozen=True, tag="kw")


def _decoded_mirror(cls: type, body: object) -> object:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=_MIRRORED[cls])


def test_every_body_type_gets_the_generated_rebuild():
    for cls, mirror in _MIRRORED.items():
        assert _REBUILD[mirror].__name__ == "_rebuild", cls


def test_the_generated_rebuild_keeps_the_callers_bytes_and_decodes_the_rest():
    rng = np.random.default_rng(0)
    body = TurnRecorded(
        turn_index=2,
        messages=[{"role": "user", "content": "hi"}],
        prompt_ids=rng.integers(0, 1000, 32, dtype=np.int32),
        output_ids=rng.integers(0, 1000, 8, dtype=np.int32),
        output_log_probs=np.zeros(8, np.float32),
        sampling={"temperature": 0.5},
        version_spans=((0, 1), (4, 2)),
        policy_version=1,
    )
    back = _decoded_mirror(TurnRecorded, body)
    rebuilt = _REBUILD[type(back)](back, body)
    assert rebuilt == body and encode_body(rebuilt) == encode_body(body)
    assert rebuilt.output_ids is body.output_ids and rebuilt.prompt_ids is body.prompt_ids
    assert rebuilt.messages is not body.messages  # the decoded value, not the caller's


def test_the_generated_rebuild_copies_the_view_for_a_body_of_another_type():
    body = TurnRecorded(turn_index=0, output_ids=b"\x01\x00\x00\x00")
    back = _decoded_mirror(TurnRecorded, body)
    rebuilt = _REBUILD[type(back)](back, object())
    assert rebuilt == body and type(rebuilt.output_ids) is bytes and rebuilt.output_ids is not body.output_ids


def test_the_generated_rebuild_runs_the_body_checks_on_the_decoded_values():
    body = TurnRecorded(turn_index=0)
    back = _decoded_mirror(TurnRecorded, body)
    back.finish_reason = "tool_calls"  # a decoded value the schema refuses
    with pytest.raises(EventValidationError, match="finish_reason"):
        _REBUILD[type(back)](back, body)


@pytest.mark.parametrize("cls, body", [(_Awkward, _Awkward(payload=b"ab", _hidden=3, count=1)), (_KEYWORD, _KEYWORD(data=b"x", **{"from": 5}))])
def test_field_names_the_generated_source_cannot_spell_get_the_generic_rebuild(cls, body):
    mirror, binary = _mirror(cls)
    rebuild = _rebuilder(cls, binary)
    assert rebuild.__name__ == "rebuild"
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=mirror)
    rebuilt = rebuild(back, body)
    assert rebuilt == body and rebuilt.__struct_fields__ == body.__struct_fields__


def test_the_generic_rebuild_runs_the_body_checks():
    mirror, binary = _mirror(_Awkward)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(_Awkward(count=1)), type=mirror)
    back.count = -1
    with pytest.raises(EventValidationError, match="count"):
        _rebuilder(_Awkward, binary)(back, None)


class _Tokens(bytes):
    pass


class _Index(int):
    pass


@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"turn_index": True}, "turn_index"),  # a bool is no count, though an int
        ({"turn_index": -1}, "turn_index"),
        ({"turn_index": _Index(3)}, None),  # an int subclass passes, as the full check lets it
        ({"output_ids": b"\x01\x00\x00"}, "output_ids"),  # not whole int32s
        ({"prompt_ids": b"\x01\x00"}, "prompt_ids"),
        ({"output_ids": b"\x00" * 8, "output_log_probs": b"\x00" * 6}, "output_log_probs"),
        ({"output_ids": _Tokens(b"\x01\x00\x00\x00")}, None),  # a bytes subclass goes through the full check
        ({"output_ids": [1, 2], "output_log_probs": [-0.5, -1.0]}, None),  # packed by the full check
    ],
)
def test_the_turn_checks_fast_paths_leave_every_other_value_to_the_full_check(fields, refused):
    # TurnBody.__post_init__ takes exact ints >= 0 and exact bytes of whole
    # items on a fast path; anything else must meet the checks it always met.
    if refused:
        with pytest.raises(EventValidationError, match=refused):
            TurnRecorded(**{"turn_index": 0, **fields})
    else:
        body = TurnRecorded(**{"turn_index": 0, **fields})
        assert type(body.output_ids) in (bytes, _Tokens) and len(body.output_ids) % 4 == 0
