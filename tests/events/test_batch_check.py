"""The batch write-time check (``check_bodies``) decodes bodies with bytes
fields through mirrors that take those fields as zero-copy views: what it
hands back must be what a strict decode gives, its bytes fields the caller's
own ``bytes`` (no copy) and every other field a decoded copy, and a body
whose constructor checks were bypassed must still be refused."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from agentlog.events.schema.batch_check import _MIRRORED, check_bodies
from agentlog.events.schema.types import EVENT_TYPES, EventValidationError, TurnRecorded, check_body, decode_body, encode_body
from event_samples import every_event


def turn(i: int = 0) -> TurnRecorded:
    rng = np.random.default_rng(i)
    return TurnRecorded(
        turn_index=i,
        messages=[{"role": "user", "content": "hi"}],
        prompt_ids=rng.integers(0, 1000, 64, dtype=np.int32),
        output_ids=rng.integers(0, 1000, 16, dtype=np.int32),
        output_log_probs=(-rng.exponential(0.5, 16)).astype(np.float32),
        sampling={"temperature": 0.7},
    )


def test_every_event_type_with_bytes_fields_has_a_mirror_of_the_same_fields():
    with_bytes = [c for c in EVENT_TYPES if any(f.type is bytes for f in msgspec.structs.fields(c))]
    assert with_bytes and set(with_bytes) == set(_MIRRORED)
    for cls, mirror in _MIRRORED.items():
        ours = [(f.name, f.type) for f in msgspec.structs.fields(cls)]
        theirs = [(f.name, bytes if f.type is memoryview else f.type) for f in msgspec.structs.fields(mirror)]
        assert sorted(ours, key=str) == sorted(theirs, key=str)
        assert mirror.__struct_config__.tag == cls.__struct_config__.tag


def test_a_batch_decodes_as_a_strict_decode_does_sharing_only_the_bytes():
    bodies = every_event() + [turn(1), turn(2)]
    payloads, decoded = check_bodies(bodies)
    assert [bytes(p) for p in payloads] == [encode_body(b) for b in bodies]
    for body, back in zip(bodies, decoded):
        assert type(back) is type(body) and back == body == decode_body(encode_body(body))
        assert back is not body
        for f in msgspec.structs.fields(body):
            if f.type is bytes:
                assert getattr(back, f.name) is getattr(body, f.name)  # the caller's bytes, not a copy
    t, back = bodies[-1], decoded[-1]
    assert back.messages == t.messages and back.messages is not t.messages  # a decoded copy
    assert back.sampling is not t.sampling


@pytest.mark.parametrize(
    "field, value",
    [
        ("output_log_probs", np.array([math.nan] * 16, dtype=np.float32).tobytes()),
        ("output_log_probs", np.array([-math.inf] + [0.0] * 15, dtype=np.float32).tobytes()),
        ("prompt_ids", b"\x00\x01\x02"),
        ("output_ids", bytearray(16 * 4)),
        ("finish_reason", "eos"),
        ("turn_index", -1),
        ("prompt_ids", "abcd"),
    ],
    ids=["nan-log-prob", "inf-log-prob", "ragged-tokens", "bytearray-tokens", "finish-reason", "turn-index", "str-tokens"],
)
def test_a_turn_whose_checks_were_bypassed_is_refused_in_a_batch(field, value):
    bad = turn(3)
    msgspec.structs.force_setattr(bad, field, value)
    try:
        check_body(bad)
    except EventValidationError:
        with pytest.raises(EventValidationError, match="a batch of 3 bodies"):
            check_bodies([turn(1), bad, turn(2)])
    else:
        # What the one-body check takes (a bytearray is stored as bin), the batch takes too, as the same value.
        _, decoded = check_bodies([turn(1), bad, turn(2)])
        assert decoded[1] == check_body(bad)[1] and type(decoded[1].output_ids) is bytes


def test_a_refused_batch_leaves_every_body_scanning_its_own_log_probs():
    """The batch scans its turns' log-probs at once; afterwards (refused or
    not) a body built anywhere scans its own again."""
    bad = turn(4)
    msgspec.structs.force_setattr(bad, "output_log_probs", np.array([math.nan] * 16, dtype=np.float32).tobytes())
    with pytest.raises(EventValidationError):
        check_bodies([turn(1), bad])
    check_bodies([turn(1), turn(2)])
    with pytest.raises(EventValidationError, match=r"turn_recorded\.output_log_probs\[0\]: expected a finite float"):
        TurnRecorded(turn_index=0, output_ids=[1], output_log_probs=[math.inf])
