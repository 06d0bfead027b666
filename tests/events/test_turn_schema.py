"""The turn schema has one home: the fields a turn carries besides its prompt
are declared once (events/schema/turn.py, ``TurnBody``) and both stored
encodings, the delta conversions, the engine and the statistics projection
follow them.

The one-place test edits a copy of the package the way a developer adding a
turn field would (one line at the end of ``TurnBody``) and shows the field
written by the engine, stored in the log, expanded from its delta and
declared by the statistics projection, with no other edit. The properties
check that any accepted turn, inline or delta, decodes back equal and that a
delta expands to its inline form."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.events.schema.turn import TURN_BODY_FIELDS, TurnBody
from agentlog.events.schema.turn_delta import TurnContext, full_turns
from agentlog.events.schema.types import (
    EventValidationError,
    Envelope,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TurnDelta,
    TurnRecorded,
    check_body,
    decode_body,
    encode_body,
)

ROOT = Path(__file__).resolve().parents[2]

#: The stored layout of schema v1's turn bodies, field by field: what every
#: existing log holds, so what the shared declaration must reproduce.
V1_LAYOUT = {
    "turn_recorded": ("turn_index", "messages", "prompt_ids", "output_ids", "output_log_probs", "finish_reason",
                      "response_message", "ill_formed", "policy_version", "generate_s", "sampling"),
    "turn_delta": ("turn_index", "shared_tokens", "new_prompt_ids", "shared_messages", "new_messages", "output_ids",
                   "output_log_probs", "finish_reason", "response_message", "ill_formed", "policy_version",
                   "generate_s", "sampling"),
}


#: Turn fields added since v1, each UNSET by default: a turn that does not use
#: one is stored without it, in the v1 layout.
ADDED_SINCE_V1 = ("version_spans",)


def test_both_bodies_keep_the_v1_layout_with_the_shared_fields_declared_once():
    assert TurnRecorded.__struct_fields__ == V1_LAYOUT["turn_recorded"] + ADDED_SINCE_V1
    assert TurnDelta.__struct_fields__ == V1_LAYOUT["turn_delta"] + ADDED_SINCE_V1
    for body in (TurnRecorded, TurnDelta):
        defaults = {f.name: f.default for f in msgspec.structs.fields(body)}
        assert all(defaults[name] is msgspec.UNSET for name in ADDED_SINCE_V1)
        assert tuple(msgspec.msgpack.decode(encode_body(body(turn_index=0))))[1:] == V1_LAYOUT[body.__struct_config__.tag]
    assert issubclass(TurnRecorded, TurnBody) and issubclass(TurnDelta, TurnBody)
    # The shared fields: turn_index, then the tail both bodies end with.
    assert TURN_BODY_FIELDS[0] == "turn_index"
    tail = TURN_BODY_FIELDS[1:]
    for body in (TurnRecorded, TurnDelta):
        assert body.__struct_fields__[-len(tail):] == tail
        own = set(body.__struct_fields__) - set(TURN_BODY_FIELDS)
        assert own == {k for k in body.__annotations__}, body  # each body declares its prompt only


#: A turn_delta as schema v1 encodes it (written by the version before the
#: shared declaration): the bytes a log holds for it may never change.
_V1_DELTA_BYTES = bytes.fromhex(
    "8ea474797065aa7475726e5f64656c7461aa7475726e5f696e64657803ad7368617265645f746f6b656e7302ae6e65775f70726f6d70745f"
    "696473c4080700000008000000af7368617265645f6d6573736167657301ac6e65775f6d657373616765739182a4726f6c65a4746f6f6ca7"
    "636f6e74656e74a174aa6f75747075745f696473c40409000000b06f75747075745f6c6f675f70726f6273c404000000bfad66696e697368"
    "5f726561736f6ea66c656e677468b0726573706f6e73655f6d65737361676582a4726f6c65a9617373697374616e74a7636f6e74656e74a1"
    "61aa696c6c5f666f726d6564c3ae706f6c6963795f76657273696f6e04aa67656e65726174655f73cb3fd0000000000000a873616d706c69"
    "6e6781ab74656d7065726174757265cb3fe6666666666666"
)


def test_the_stored_bytes_of_both_turn_bodies_are_unchanged():
    delta = TurnDelta(
        turn_index=3, shared_tokens=2, new_prompt_ids=[7, 8], shared_messages=1, new_messages=[{"role": "tool", "content": "t"}],
        output_ids=[9], output_log_probs=[-0.5], finish_reason="length", response_message={"role": "assistant", "content": "a"},
        ill_formed=True, policy_version=4, generate_s=0.25, sampling={"temperature": 0.7},
    )
    assert encode_body(delta) == _V1_DELTA_BYTES
    # The golden file's turn_recorded (never regenerated) re-encodes to the very bytes it holds.
    raw = (ROOT / "tests" / "fixtures" / "schema_v1_events.msgpack").read_bytes()
    stored = msgspec.msgpack.decode(raw, type=list[dict[str, msgspec.Raw]])
    envs = msgspec.msgpack.decode(raw, type=list[Envelope])
    turns = [(env.body, bytes(rec["body"])) for env, rec in zip(envs, stored) if type(env.body) is TurnRecorded]
    assert turns and all(encode_body(body) == payload for body, payload in turns)


# ---------------------------------------------------------------- one place


#: Run in a copy of the package whose TurnBody has one more field. It writes a
#: session through the engine into a FileLog and reports what each stage saw.
_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import msgspec
    import agentlog
    from agentlog.engine.core import SessionEngine
    from agentlog.events import FileLog, read_log
    from agentlog.events.schema.turn_delta import TurnContext, full_turns
    from agentlog.reducers.runstats import PROJECTED_FIELDS, RunStats, decode_projection

    path = sys.argv[1]

    async def write():
        log = FileLog.open(path)
        eng = await SessionEngine.open(log)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        msgs = [{"role": "user", "content": "task"}]
        await h.record_turn(messages=msgs, prompt_ids=[1, 2, 3], output_ids=[4, 5], output_log_probs=[-0.1, -0.2],
                            response_message={"role": "assistant", "content": "a"}, latency_ms=12.5)
        msgs = msgs + [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
        await h.record_turn(messages=msgs, prompt_ids=[1, 2, 3, 4, 5, 6], output_ids=[7], latency_ms=30.0)
        await h.finish(reward=1.0)
        await eng.close()
        log.close()

    asyncio.run(write())
    raw = list(read_log(path, raw=True))
    envs = [r.decode() for r in raw]
    turns = [(r, e) for r, e in zip(raw, envs) if e.body.__struct_config__.tag in ("turn_recorded", "turn_delta")]
    full = [e.body for e in full_turns(envs) if e.body.__struct_config__.tag == "turn_recorded"]
    ctx, again = TurnContext(), []
    for turn in full:
        again.append(ctx.delta_of(turn))
        ctx = TurnContext.after(turn)
    by_body, by_projection = RunStats(), RunStats()
    for r, e in zip(raw, envs):
        by_body.feed(e)
        by_projection.feed_record(r.lsn, r.session_id, r.session_seq, r.ts_ns, decode_projection(bytes(r.payload)), payload=bytes(r.payload))
    print(json.dumps({
        "package": agentlog.__file__,
        "tags": [e.body.__struct_config__.tag for _, e in turns],
        "last_stored_key": [list(msgspec.msgpack.decode(bytes(r.payload)))[-1] for r, _ in turns],
        "stored": [e.body.latency_ms for _, e in turns],
        "shared_tokens": [e.body.shared_tokens for _, e in turns],
        "expanded": [t.latency_ms for t in full],
        "delta_of_expanded_is_stored": [a == e.body for a, (_, e) in zip(again, turns)],
        "projected": [("latency_ms" in PROJECTED_FIELDS[tag]) for tag in ("turn_recorded", "turn_delta")],
        "stats_agree": msgspec.json.encode(by_body.snapshot()) == msgspec.json.encode(by_projection.snapshot()),
        "turns_counted": by_projection.snapshot()["turns"]["total"],
    }))
    """
)

_NEW_FIELD = "    latency_ms: float = 0.0\n"


def _package_with_one_more_turn_field(dest: Path) -> Path:
    """A copy of the package with ``latency_ms`` appended to TurnBody, the
    one edit a new turn field takes. Returns the copied turn.py."""
    pkg = dest / "agentlog"
    shutil.copytree(ROOT, pkg, ignore=shutil.ignore_patterns(".*", "tests", "docs", "examples", "__pycache__", "*.egg-info"))
    turn_py = pkg / "events" / "schema" / "turn.py"
    lines = turn_py.read_text(encoding="utf-8").splitlines(keepends=True)
    (cls,) = [n for n in ast.parse("".join(lines)).body if isinstance(n, ast.ClassDef) and n.name == "TurnBody"]
    last_field = [n for n in cls.body if isinstance(n, ast.AnnAssign)][-1]
    lines.insert(last_field.end_lineno, _NEW_FIELD)
    turn_py.write_text("".join(lines), encoding="utf-8")
    return turn_py


def test_a_new_turn_field_is_a_one_place_change(tmp_path):
    turn_py = _package_with_one_more_turn_field(tmp_path / "pkg")
    # The copy differs from the package by that one line and nothing else.
    original = (ROOT / "events" / "schema" / "turn.py").read_text(encoding="utf-8").splitlines(keepends=True)
    edited = turn_py.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(edited) == len(original) + 1 and [ln for ln in edited if ln not in original] == [_NEW_FIELD]

    log_dir = tmp_path / "log"
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(log_dir)],
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "pkg"), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["package"].startswith(str(tmp_path / "pkg")), seen["package"]  # the copy, not the worktree
    # engine -> log: the engine wrote deltas, the field stored last (a new field goes at the end).
    assert seen["tags"] == ["turn_delta", "turn_delta"]
    assert seen["shared_tokens"] == [0, 5]  # the second turn really is a delta against the first
    assert seen["last_stored_key"] == ["latency_ms", "latency_ms"]
    assert seen["stored"] == [12.5, 30.0]
    # delta -> full turn and back.
    assert seen["expanded"] == [12.5, 30.0]
    assert seen["delta_of_expanded_is_stored"] == [True, True]
    # The statistics projection declares it (delimited, not decoded) and agrees with the full bodies.
    assert seen["projected"] == [True, True]
    assert seen["stats_agree"] and seen["turns_counted"] == 2


# ---------------------------------------------------------------- properties

_messages = st.sampled_from([
    {"role": "user", "content": "task"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"},
    {"role": "user", "content": "task", "n": 1.0}, {"role": "system", "content": "s", "tools": [1, 2]},
])
_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def turns(draw, turn_index: int, before: TurnRecorded | None) -> TurnRecorded:
    """An accepted inline turn; often one that continues ``before`` (its
    prompt + output, then new tokens), as an agent's next turn does."""
    if before is not None and draw(st.booleans()):
        keep = draw(st.integers(0, len(before.prompt_ids + before.output_ids) // 4))
        prompt = np.frombuffer(before.prompt_ids + before.output_ids, dtype="<i4")[:keep].tolist()
        kept = draw(st.integers(0, len(before.messages)))
        messages = list(before.messages[:kept])
        if before.response_message is not None and kept == len(before.messages) and draw(st.booleans()):
            messages.append(before.response_message)
    else:
        prompt, messages = [], []
    prompt += draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6))
    messages += draw(st.lists(_messages, max_size=3))
    out = draw(st.lists(st.integers(0, 2**31 - 1), max_size=5))
    log_probs = draw(st.one_of(st.just([]), st.lists(_floats, min_size=len(out), max_size=len(out)))) if out else []
    return TurnRecorded(
        turn_index=turn_index, messages=messages, prompt_ids=prompt, output_ids=out, output_log_probs=log_probs,
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        response_message=draw(st.one_of(st.none(), _messages)), ill_formed=draw(st.booleans()),
        policy_version=draw(st.integers(0, 2**40)), generate_s=draw(st.floats(0, 1e6)),
        sampling=draw(st.sampled_from([{}, {"temperature": 0.7}, {"temperature": 1.0, "ignored": ["temperature"]}])),
    )


@st.composite
def sessions(draw) -> list[TurnRecorded]:
    out: list[TurnRecorded] = []
    for i in range(draw(st.integers(1, 5))):
        out.append(draw(turns(i, out[-1] if out else None)))
    return out


def _accepted(body):
    """The body as the log's write path stores it and a reader decodes it."""
    payload, checked = check_body(body)
    assert checked == body and payload == encode_body(body)
    read = decode_body(payload)
    assert read == body and encode_body(read) == payload
    return read


@settings(max_examples=200, deadline=None)
@given(sessions())
def test_every_accepted_turn_decodes_back_equal_and_every_delta_expands_to_its_inline_form(session):
    ctx = TurnContext()
    envs = [Envelope(0, "s", 0, 0, SessionOpened(group_id="g", group_size=1)), Envelope(1, "s", 1, 0, SessionStarted())]
    for turn in session:
        assert _accepted(turn) == turn  # inline
        delta = ctx.delta_of(turn)
        stored = _accepted(delta)  # as a delta
        for name in TURN_BODY_FIELDS:
            assert getattr(stored, name) == getattr(turn, name), name
        full = ctx.expand(stored)
        assert full == turn and encode_body(full) == encode_body(turn)
        envs.append(Envelope(len(envs), "s", len(envs), 0, stored))
        ctx = TurnContext.after(turn)
    envs.append(Envelope(len(envs), "s", len(envs), 0, SessionFinished()))
    assert [e.body for e in full_turns(envs) if type(e.body) is TurnRecorded] == session


@st.composite
def deltas_against(draw):
    """A previous turn and any turn_delta the schema accepts after it, not
    only the longest-prefix one the engine writes."""
    before = draw(turns(0, None))
    ctx = TurnContext.after(before)
    held_tokens, held_messages = len(ctx.tokens) // 4, len(ctx.messages)
    body = draw(turns(1, None))
    fields = {name: getattr(body, name) for name in TURN_BODY_FIELDS}
    delta = TurnDelta(
        shared_tokens=draw(st.integers(0, held_tokens)), new_prompt_ids=draw(st.lists(st.integers(0, 99), max_size=4)),
        shared_messages=draw(st.integers(0, held_messages)), new_messages=draw(st.lists(_messages, max_size=2)), **fields,
    )
    return ctx, delta


@settings(max_examples=200, deadline=None)
@given(deltas_against())
def test_any_accepted_delta_decodes_back_equal_and_re_encodes_to_the_same_full_turn(case):
    ctx, delta = case
    stored = _accepted(delta)
    full = ctx.expand(stored)
    assert _accepted(full) == full
    # The engine's delta of that full turn may share more than the drawn one,
    # but it stands for the same turn.
    assert ctx.expand(_accepted(ctx.delta_of(full))) == full


def test_the_shared_checks_name_the_body_they_run_on():
    for body, tag in ((TurnRecorded, "turn_recorded"), (TurnDelta, "turn_delta")):
        for kw, where in (({"turn_index": -1}, "turn_index"), ({"turn_index": 0, "finish_reason": "x"}, "finish_reason"),
                          ({"turn_index": 0, "output_ids": [1], "output_log_probs": [0.0, 0.0]}, "output_log_probs")):
            try:
                body(**kw)
            except EventValidationError as exc:
                assert str(exc).startswith(f"{tag}.{where}: expected"), exc
            else:
                raise AssertionError(f"{tag} accepted {kw}")
    assert msgspec.structs.fields(TurnBody)[0].required  # turn_index: no default, set by the engine
