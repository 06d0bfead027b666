"""Crash recovery's per-frame step in the compiled codec (``recovery_note``)
gives exactly what the Python loop (``recovery.note_frames``) gives: the same
sparse index entries, the same open sessions and the same last offset, for
any frames as the scanner builds them and any starting state; and it stays
memory-safe when the code of a session id's hash changes what it was given."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events import FileLog
from agentlog.events.log import framecodec, recovery, segmap
from agentlog.events.log.format import FLAG_TERMINAL, INDEX_NAME
from agentlog.events.log.recovery import note_frames, recover
from agentlog.events.log.scan import Frame, LogWalk
from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted
from log_helpers import copy_log

if not framecodec.available():
    if os.environ.get("CI") == "true":
        raise AssertionError(f"CI=true: the compiled codec must be built here ({framecodec.unavailable_reason()})")
    pytest.skip(framecodec.unavailable_reason(), allow_module_level=True)

_compiled_note = framecodec._compiled.recovery_note  # type: ignore[union-attr]


@st.composite
def _frames(draw) -> list[Frame]:
    """Frames at rising offsets (a compressed batch's frames share one), of a few sessions, some terminal."""
    n = draw(st.integers(0, 60))
    offset, out = draw(st.integers(0, 1 << 20)), []
    for lsn in range(n):
        offset += draw(st.sampled_from([0, 1, 37, 4096, 70_000]))
        flags = draw(st.sampled_from([0, FLAG_TERMINAL, 2, 2 | FLAG_TERMINAL]))
        seq = draw(st.integers(0, 2**64 - 1))  # seq + 1 past 64 bits stays exact in both
        out.append(Frame(offset, offset + 40, lsn, seq, 0, flags, draw(st.sampled_from(["a", "b", "c", "é"])), memoryview(b"")))
    return out


@settings(max_examples=300, deadline=None)
@given(frames=_frames(), every=st.sampled_from([0, 1, 4096, 64 << 10]),
       state=st.dictionaries(st.sampled_from(["a", "b", "z"]), st.integers(0, 9), max_size=3),
       as_tuple=st.booleans())
def test_the_compiled_step_gives_what_the_python_loop_gives(frames, every, state, as_tuple):
    first = frames[0].offset if frames else 0
    results = []
    for note in (note_frames, _compiled_note):
        entries, kept = [(7, first)], dict(state)
        last = note(tuple(frames) if as_tuple else list(frames), entries, first, every, kept, FLAG_TERMINAL)
        results.append((entries, kept, list(kept), last))
    assert results[0] == results[1]


def test_the_compiled_step_refuses_what_is_not_a_frame_naming_its_position():
    frame = Frame(0, 40, 0, 0, 0, 0, "a", memoryview(b""))
    with pytest.raises(TypeError, match=r"frames\[1\] is a str, expected a frame tuple of 8"):
        _compiled_note([frame, "not a frame"], [], 0, 4096, {}, FLAG_TERMINAL)
    with pytest.raises(TypeError, match=r"frames\[0\] is a tuple, expected a frame tuple of 8"):
        _compiled_note([tuple(frame)[:7]], [], 0, 4096, {}, FLAG_TERMINAL)
    with pytest.raises(ValueError, match=r"frames\[0\] is at offset -1, expected an offset >= 0"):
        _compiled_note([frame._replace(offset=-1)], [], 0, 4096, {}, FLAG_TERMINAL)
    with pytest.raises(ValueError, match="last_off -10 and every 0, expected offsets >= 0"):
        _compiled_note([frame], [], -10, 0, {}, FLAG_TERMINAL)
    from collections import OrderedDict

    with pytest.raises(TypeError, match="entries is a list and state a collections.OrderedDict, expected a list and a dict"):
        _compiled_note([frame], [], 0, 4096, OrderedDict(), FLAG_TERMINAL)
    with pytest.raises(TypeError, match="frames is a list_iterator, expected a list or tuple of frames"):
        _compiled_note(iter([frame]), [], 0, 4096, {}, FLAG_TERMINAL)


def test_a_log_rescanned_whole_recovers_alike_under_either_codec(tmp_path, monkeypatch):
    """Sessions open, running and ended across several index intervals: the
    rescan (no INDEX) finds the same open sessions, index and end."""
    d = tmp_path / "log"
    with FileLog.open(d) as lg:
        prompt = bytes(4 << 10)
        for i in range(120):
            sid = f"s{i}"
            lg.append_batch([(sid, 0, SessionOpened(group_id="g", group_size=1, prompt_ids=prompt))])
            if i % 3:
                lg.append_batch([(sid, 1, SessionStarted(harness="test"))])
            if i % 3 == 2:
                lg.append_batch([(sid, 2, SessionFinished(reward=1.0))])
    monkeypatch.setattr(framecodec, "native", framecodec.native)  # put back after the test
    results = []
    for native in (True, False):
        framecodec.use_native(native)
        copy = copy_log(d, tmp_path / f"copy-{native}")  # without its INDEX: the whole log is rescanned
        assert not (copy / INDEX_NAME).exists()
        got = recover(copy, max_record_bytes=16 << 20, salvage=False)
        results.append((got.open_sessions, got.index, got.next_lsn))
    assert results[0] == results[1]
    open_sessions, index, _ = results[0]
    assert open_sessions == {f"s{i}": 1 + (i % 3 == 1) for i in range(120) if i % 3 != 2}
    assert sum(len(entries) for entries in index.values()) > 4  # the rescan rebuilt several index entries


def test_recovery_reads_where_records_are_and_whose_not_their_payloads(tmp_path, monkeypatch):
    """Recovery's walk leaves every frame's payload unread (a view per frame was a
    quarter of the compiled walk's time): its step gets each frame with payload None,
    and it finds what a walk with the payloads finds. The log is past the size the
    scanner maps, so the mapped walk is the one checked where the CPU has CRC32C."""
    d = tmp_path / "log"
    with FileLog.open(d) as lg:
        for i in range(200):
            lg.append_batch([(f"s{i}", 0, SessionOpened(group_id="g", group_size=1, prompt_ids=bytes(2 << 10)))])
    assert sum(p.stat().st_size for p in d.glob("*.seg")) > segmap.MIN_MAPPED_BYTES
    compiled = framecodec.native
    payloads: list = []

    class Spy:
        """The compiled codec, noting what recovery's step is handed."""

        def __getattr__(self, name: str):
            return getattr(compiled, name)

        @staticmethod
        def recovery_note(frames, *args):
            payloads.extend(fr.payload for fr in frames)
            return compiled.recovery_note(frames, *args)

    monkeypatch.setattr(framecodec, "native", Spy())
    without = recover(copy_log(d, tmp_path / "copy"), max_record_bytes=16 << 20, salvage=False)
    assert len(payloads) == 200 and set(payloads) == {None}

    def walk_with_payloads(*args, **kwargs):
        return LogWalk(*args, **{**kwargs, "payloads": True})

    payloads.clear()
    monkeypatch.setattr(recovery, "LogWalk", walk_with_payloads)
    with_them = recover(copy_log(d, tmp_path / "again"), max_record_bytes=16 << 20, salvage=False)
    assert len(payloads) == 200 and all(type(p) is memoryview for p in payloads)
    assert with_them == without


class _ClearingId(str):
    """A session id whose hash empties the list of frames being walked (and its entries)."""

    victims: list = []

    def __hash__(self) -> int:
        for victim in self.victims:
            victim.clear()
        return str.__hash__(self)


def test_the_compiled_step_walks_what_it_was_given_whatever_a_session_ids_code_does():
    """The frames are walked from a tuple taken at the call: a session id whose
    hash clears the list, or entries that are the very list of frames, change
    nothing the walk reads (the Python loop's list iterator stops early there;
    the C step finishes the frames it was given, without reading freed memory)."""
    frames = [Frame(i * 100, i * 100 + 40, i, 0, 0, 0, _ClearingId(f"s{i}"), memoryview(b"")) for i in range(50)]
    _ClearingId.victims = [frames]
    state: dict = {}
    try:
        last = _compiled_note(frames, [], 0, 1000, state, FLAG_TERMINAL)
    finally:
        _ClearingId.victims = []
    assert frames == [] and last == 4000 and sorted(state) == sorted(f"s{i}" for i in range(50))
    same = [Frame(i * 100, i * 100 + 40, i, 0, 0, 0, f"s{i}", memoryview(b"")) for i in range(200)]
    walked = list(same)
    _compiled_note(same, same, 0, 1000, {}, FLAG_TERMINAL)  # appends to the list it walks
    assert same[:200] == walked and same[200:] == [(i, i * 100) for i in range(10, 200, 10)]
