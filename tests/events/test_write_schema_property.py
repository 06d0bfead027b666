"""Validated on write, as a property: any event the writer accepts decodes
back equal, in every log. Bodies of every event type get hostile field values
of the wrong type, either through the constructor (whose checks may refuse
them) or forced in past it; each append is either refused with
EventValidationError, nothing written, or its record reads back equal; and the
log stays readable end to end (read_log, verify_log) whatever was refused."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import msgspec
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog, read_log, verify_log
from agentlog.events.log.api import MemoryLog
from agentlog.events.schema.types import EventValidationError, decode_body, encode_body
from event_samples import every_event

BASES = every_event()

#: Values of every msgpack shape and some no msgpack can hold.
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["", "\udc80", "a/b", "eos", "tool_calls"]),
    st.binary(max_size=9),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=2), st.floats(allow_nan=False)), max_size=3),
    st.tuples(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
    st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=3),
    st.dictionaries(st.integers(-2, 2), st.text(max_size=2), min_size=1, max_size=2),
    st.sets(st.integers(0, 3), max_size=2),
)


@st.composite
def bodies(draw):
    """``(how, body)``: a sample event as is ("sample"), or with some fields
    replaced by hostile values through the constructor ("built") or past it
    ("forced"). ``body`` is None when the constructor refused (that must be
    an EventValidationError)."""
    base = draw(st.sampled_from(BASES))
    cls = type(base)
    how = draw(st.sampled_from(["sample", "built", "forced"]))
    if how == "sample":
        return how, base
    names = draw(st.lists(st.sampled_from(cls.__struct_fields__), unique=True, min_size=1, max_size=3))
    values = {n: draw(HOSTILE) for n in names}
    if how == "built":
        try:
            return how, cls(**{**msgspec.structs.asdict(base), **values})
        except EventValidationError:
            return how, None
    body = msgspec.structs.replace(base)
    for name, value in values.items():
        msgspec.structs.force_setattr(body, name, value)
    return how, body


#: Stands for NaN in :func:`plain`: equal to itself, unlike NaN (msgpack keeps NaN bit for bit).
NAN = object()


def plain(payload: bytes):
    """A payload as plain data, with NaN made comparable."""

    def walk(x):
        if isinstance(x, float) and math.isnan(x):
            return NAN
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(msgspec.msgpack.decode(payload))


def scratch_dir() -> tempfile.TemporaryDirectory:
    shm = Path("/dev/shm")
    return tempfile.TemporaryDirectory(prefix="agentlog-prop-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None)


@settings(max_examples=150, deadline=None)
@given(st.lists(bodies(), min_size=1, max_size=6))
def test_any_event_the_writer_accepts_decodes_back_equal(drawn):
    with scratch_dir() as tmp:
        path = Path(tmp) / "log"
        file_log = FileLog.open(path, fsync="never")
        memory_log = MemoryLog()
        accepted = []
        try:
            for i, (how, body) in enumerate(drawn):
                if body is None:
                    event("built: refused by the constructor")
                    continue
                outcomes = []
                for lg in (file_log, memory_log):
                    before = lg.next_lsn
                    try:
                        outcomes.append(lg.append_batch([(f"s{i}", 0, body)])[0])
                    except EventValidationError as exc:
                        assert f"session 's{i}' seq 0: " in str(exc)
                        assert lg.next_lsn == before  # nothing written
                        outcomes.append(None)
                file_env, memory_env = outcomes
                assert (file_env is None) == (memory_env is None), f"{how} {body!r}: the logs disagree"
                assert how != "sample" or file_env is not None, f"a well-formed sample was refused: {body!r}"
                if file_env is None:
                    event(f"{how}: refused by the writer")
                    continue
                accepted.append((body, file_env))
                event(f"{how}: accepted")
                if how == "sample":
                    # A well-formed event reads back as the very same value (hostile
                    # ones may change representation: a tuple is stored as an array).
                    assert file_env.body == body and memory_env.body == body
                assert plain(encode_body(memory_env.body)) == plain(encode_body(file_env.body))
        finally:
            file_log.close()
        stored = list(read_log(path))
        assert [e.lsn for e in stored] == [env.lsn for _, env in accepted] == list(range(len(accepted)))
        for (body, env), back in zip(accepted, stored):
            assert type(back.body) is type(body)
            assert plain(encode_body(back.body)) == plain(encode_body(env.body)) == plain(encode_body(body))
            assert plain(encode_body(decode_body(encode_body(back.body)))) == plain(encode_body(back.body))
        assert verify_log(path).status == "ok"


def test_a_reward_int_a_float_cannot_hold_is_refused_naming_it():
    """An int past 2**53 would be stored as another number (the writer converts rewards to floats)."""
    import pytest as _pytest

    from agentlog.events.schema.types import EventValidationError, RewardAssigned

    assert RewardAssigned(reward=2**53, source="v").reward == float(2**53)
    for bad in (2**53 + 1, {"score": -(2**53) - 1}):
        with _pytest.raises(EventValidationError, match=r"reward.*beyond 2\*\*53"):
            RewardAssigned(reward=bad, source="v")
