"""agentlog.reducers.runstats: the projection fold behind `stats` and `tail --summary`."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

import agentlog.events.schema.types as ev
from cli_helpers import ROOT
from agentlog.events.schema.types import (
    CommandRan,
    Envelope,
    PolicyUpdated,
    RewardAssigned,
    SessionAborted,
    SessionDropped,
    SessionFinished,
    SessionOpened,
    SessionStarted,
    TurnRecorded,
    TurnUndelivered,
    encode_body,
)
from agentlog.reducers.lifecycle import LifecycleReducer, SessionSummary
from agentlog.reducers.runstats import PROJECTED_FIELDS, RunStats, decode_projection


def test_every_projected_field_exists_in_schema_v1():
    by_tag = {t.__struct_config__.tag: t for t in ev.EVENT_TYPES}
    assert set(PROJECTED_FIELDS) == set(by_tag)
    for tag, fields in PROJECTED_FIELDS.items():
        assert set(fields) <= set(by_tag[tag].__struct_fields__), tag


@st.composite
def runs(draw):
    """A legal interleaving of a few sessions in groups of 2, with random fates."""
    n = draw(st.integers(1, 6))
    plans = []
    for i in range(n):
        fate = draw(st.sampled_from(["finish", "finish_dict", "abort", "drop_open", "drop_running", "live"]))
        turns = draw(st.integers(0, 3))
        plans.append((f"s{i}", i // 2, i % 2, fate, turns, draw(st.floats(0, 1))))
    queues = []
    for sid, g, idx, fate, turns, reward in plans:
        size = 2 if (g * 2 + 1) < n else 1
        q = [SessionOpened(group_id=f"g{g}", group_size=size, sample_index=idx)]
        if fate != "drop_open":
            q.append(SessionStarted())
            for t in range(turns):
                q.append(TurnRecorded(turn_index=t, prompt_ids=[1] * (t + 2), output_ids=[2] * (t + 1), output_log_probs=[-0.1] * (t + 1)))
                q.append(CommandRan(command="ls", exit_code=t % 2))
            if turns:
                q.append(TurnUndelivered(turn_index=0, reason="gone"))
        if fate == "finish":
            q += [RewardAssigned(reward=reward), SessionFinished()]
        elif fate == "finish_dict":
            q.append(SessionFinished(reward={"score": reward}))
        elif fate == "abort":
            q.append(SessionAborted(reason=draw(st.sampled_from(["timeout", "exception:X"]))))
        elif fate in ("drop_open", "drop_running"):
            q.append(SessionDropped(reason="cancelled"))
        queues.append((sid, q))
    envs, seqs, lsn = [], {sid: 0 for sid, _ in queues}, 0
    pending = [list(q) for _, q in queues]
    while any(pending):
        i = draw(st.sampled_from([k for k, q in enumerate(pending) if q]))
        sid = queues[i][0]
        envs.append(Envelope(lsn, sid, seqs[sid], 1_000 + lsn, pending[i].pop(0)))
        seqs[sid] += 1
        lsn += 1
        if draw(st.booleans()) and lsn % 7 == 0:
            envs.append(Envelope(lsn, "learner", 0, 1_000 + lsn, PolicyUpdated(step=lsn, policy_version=lsn)))
            lsn += 1
    return envs


@settings(max_examples=60, deadline=None)
@given(runs())
def test_projection_and_full_bodies_give_identical_stats_matching_lifecycle_summaries(envs):
    full, proj = RunStats(), RunStats()
    for env in envs:
        full.feed(env)
        payload = encode_body(env.body)  # a turn's projection comes with its stored bytes (the drift flag may need them)
        proj.feed_record(env.lsn, env.session_id, env.session_seq, env.ts_ns, decode_projection(payload), payload)
    a, b = full.snapshot(), proj.snapshot()
    assert msgspec.json.encode(a) == msgspec.json.encode(b)
    # Cross-check against the lifecycle reducer, an independent fold.
    summaries = [o for o in LifecycleReducer().feed_many(envs) if isinstance(o, SessionSummary)]
    for status in ("finished", "aborted", "dropped"):
        assert a["sessions"][status] == sum(1 for s in summaries if s.status == status)
    assert a["turns"]["total"] == sum(1 for e in envs if isinstance(e.body, TurnRecorded))
    assert a["tokens"]["output"] == sum(len(e.body.output_ids) // 4 for e in envs if isinstance(e.body, TurnRecorded))
    assert a["violations"]["count"] == 0
    assert a["sessions"]["open"] + a["sessions"]["running"] == len({e.session_id for e in envs if not isinstance(e.body, PolicyUpdated)}) - len(summaries)


def test_illegal_records_are_counted_with_their_lsn_not_applied():
    s = RunStats()
    s.feed(Envelope(0, "a", 0, 1, SessionOpened(group_id="g", group_size=1)))
    s.feed(Envelope(1, "a", 1, 2, TurnRecorded(turn_index=0)))  # not running yet
    s.feed(Envelope(2, "b", 0, 3, SessionFinished(reward=1.0)))  # never opened
    snap = s.snapshot()
    assert snap["violations"]["count"] == 2
    assert [v["lsn"] for v in snap["violations"]["first"]] == [1, 2]
    assert snap["turns"]["total"] == 0 and snap["sessions"]["open"] == 1


def test_reading_commands_never_import_torch(run_log, tmp_path):
    path, _ = run_log
    code = (
        "import sys, io, contextlib\n"
        "from agentlog.tools.cli import main\n"
        f"log = {str(path)!r}\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for argv in (['stats', log], ['replay', log, '--json'], ['show', log, 'fin-0'],\n"
        f"                 ['reconstruct', log, '-o', {str(tmp_path / 's.jsonl')!r}], ['verify', log]):\n"
        "        assert main(argv) == 0, argv\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'learner')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().replace("'", '"')) == []
