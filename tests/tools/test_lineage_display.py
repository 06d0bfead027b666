"""A session whose agent spawned subagents, as every reading tool shows it: `show` prints the
lineage tree with each spawning tool call, the ui's session API and the report's drill-down put
the lineages side by side, `export-dataset` writes one row per lineage with its parent, and
`reconstruct` of the run is EQUAL to the learner's digest. The log is recorded through the real
engine (:mod:`lineage_helpers`); what each tool shows is checked against the recorded turns."""

from __future__ import annotations

import contextlib
import io
import json
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentlog.events.schema.lineage import LINEAGE_KEY, Lineage, lineage_value, turn_lineage
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import TurnRecorded
from agentlog.tools.cli import main
from agentlog.tools.lineage_view import HOW_SHOWN, SessionLineages
from lineage_helpers import EXPECTED_LINEAGES, LINEAGE_SESSION, PLAIN_SESSION, write_lineage_log


@pytest.fixture(scope="module")
def lineage_log(tmp_path_factory) -> Path:
    return write_lineage_log(tmp_path_factory.mktemp("lineages") / "lin.log")


def cli(*args: str) -> str:
    """``agentlog ARGS`` in process; its stdout (exit 0 asserted)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    assert rc == 0, err.getvalue()
    return out.getvalue()


def recorded_turns(log: Path, sid: str) -> list[TurnRecorded]:
    """The session's turns as recorded (deltas expanded)."""
    from agentlog.events import read_log

    return [e.body for e in full_turns([e for e in read_log(log) if e.session_id == sid]) if isinstance(e.body, TurnRecorded)]


def test_the_engine_recorded_the_lineages_the_displays_are_checked_on(lineage_log):
    turns = recorded_turns(lineage_log, LINEAGE_SESSION)
    for lid, (indices, parent, parent_turn, call, _prompt) in EXPECTED_LINEAGES.items():
        assert [t.turn_index for t in turns if turn_lineage(t) == lid] == list(indices), lid
        first = turns[indices[0]].lineage
        if parent is not None:
            assert (first.parent, first.parent_turn, first.spawn_call) == (parent, parent_turn, call), lid
    assert {turn_lineage(t) for t in recorded_turns(lineage_log, PLAIN_SESSION)} == {"main"}


def test_show_prints_the_lineage_tree_naming_each_spawning_call(lineage_log):
    out = cli("show", str(lineage_log), LINEAGE_SESSION, "-q")
    section = out.split("\nlineages (", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0].startswith("4 conversations")
    turns = recorded_turns(lineage_log, LINEAGE_SESSION)
    expected = []
    for lid, (indices, parent, parent_turn, call, prompt) in EXPECTED_LINEAGES.items():
        row = list(EXPECTED_LINEAGES).index(lid)  # one row per lineage, in the order they began
        pad = "  " if parent is None else "    "
        expected.append(f"{pad}{lid}  {len(indices)} turn(s): {', '.join(map(str, indices))}  row(s) {row}")
        if parent is not None:
            how = HOW_SHOWN[turns[indices[0]].lineage.how]
            expected.append(f'{pad}  spawned by {parent} turn {parent_turn}, call {call} Task({{"prompt": "{prompt}"}}); {how}')
    assert section[1:] == expected
    # The transcript names each turn's lineage; a switch between lineages is no history rewrite.
    heads = re.findall(r"^  turn (\d+)  lineage (\S+)  lsn", out, re.M)
    assert [(int(t), lid) for t, lid in heads] == sorted((t, lid) for lid, e in EXPECTED_LINEAGES.items() for t in e[0])
    assert "history rewritten" not in out
    # Each row names its lineage and parent.
    assert "trained  lineage sub-2 (parent main turn 4)" in out and "trained  lineage main (a root)" in out
    # A session without subagents names none.
    assert "lineage" not in cli("show", str(lineage_log), PLAIN_SESSION, "-q")


def _turn(index: int, lineage: Lineage | None, calls: list | None = None) -> SimpleNamespace:
    body = TurnRecorded(turn_index=index, messages=[{"role": "user", "content": "x"}], prompt_ids=[1], output_ids=[2],
                        output_log_probs=[-0.1], response_message={"role": "assistant", "content": "", "tool_calls": calls or []},
                        sampling={} if lineage is None else {LINEAGE_KEY: lineage_value(lineage)})
    return SimpleNamespace(body=body)


def test_the_tree_nests_a_subagents_subagent_and_keeps_an_orphan_a_root():
    got = SessionLineages()
    for env in (_turn(0, None, [{"id": "c1", "type": "function", "function": {"name": "Task", "arguments": '{"prompt": "a"}'}}]),
                _turn(1, Lineage("s1", "main", 0, "c1", "tool_call"), [{"id": "c2", "name": "Agent", "arguments": {"task": "b"}}]),
                _turn(2, Lineage("s2", "s1", 1, "c2", "declared")),
                _turn(3, Lineage("s3", "gone", 7, "", "order")),
                _turn(4, Lineage("s4", "main", 0, "c9", "tool_call"))):
        got.feed(env)
    assert [(d, e.id) for d, e in got.tree()] == [(0, "main"), (1, "s1"), (2, "s2"), (1, "s4"), (0, "s3")]
    lines = got.lines(False)
    assert lines[2] == f'      spawned by main turn 0, call c1 Task({{"prompt": "a"}}); {HOW_SHOWN["tool_call"]}'
    assert lines[3:5] == ["      s2  1 turn(s): 2  no row", f'        spawned by s1 turn 1, call c2 Agent({{"task": "b"}}); {HOW_SHOWN["declared"]}']
    assert "call c9 (not among the parent turn's tool calls)" in lines[6]
    assert lines[7] == "  s3  1 turn(s): 3  no row" and "gone turn 7 (no tool call named)" in lines[8]
    # The report's bounded memory: only the latest turns with calls are kept per lineage.
    bounded = SessionLineages(keep_turns=1)
    for env in (_turn(0, None, [{"id": "c1", "name": "Task", "arguments": "a"}]), _turn(1, None, [{"id": "c2", "name": "Task", "arguments": "b"}]),
                _turn(2, Lineage("s1", "main", 0, "c1", "tool_call"))):
        bounded.feed(env)
    assert bounded.lineages[1].spawn.name == ""


def test_the_ui_session_api_gives_each_lineage_its_turns_rows_and_spawning_call(lineage_log, tmp_path):
    from ui_helpers import start_ui

    url, stop = start_ui(lineage_log, index_path=tmp_path / "index.sqlite")
    try:
        with urllib.request.urlopen(f"{url}/api/session/{LINEAGE_SESSION}", timeout=60) as resp:
            view = json.loads(resp.read())
        with urllib.request.urlopen(f"{url}/api/session/{PLAIN_SESSION}", timeout=60) as resp:
            plain = json.loads(resp.read())
    finally:
        stop()
    assert [lin["id"] for lin in view["lineages"]] == list(EXPECTED_LINEAGES)
    for lin in view["lineages"]:
        indices, parent, parent_turn, call, prompt = EXPECTED_LINEAGES[lin["id"]]
        assert (lin["turns"], lin["parent"], lin["parent_turn"], lin["spawn_call"]) == (list(indices), parent, parent_turn, call)
        assert lin["depth"] == (0 if parent is None else 1)
        assert [t["turn"] for t in view["turns"] if t["lineage"] == lin["id"]] == list(indices)
        assert lin["rows"] == [r["row"] for r in view["rows"] if r["lineage"] == lin["id"]] and len(lin["rows"]) == 1
        if parent is not None:
            assert lin["spawn"]["name"] == "Task" and json.loads(lin["spawn"]["arguments"]) == {"prompt": prompt}
    # Each turn's new messages are those since its own lineage's previous turn: the lead's turn 4 adds the tool result.
    turn4 = next(t for t in view["turns"] if t["turn"] == 4)
    assert [m["role"] for m in turn4["new_messages"]] == ["tool"]
    assert view["forks"]["train_once"]["ok"] and {b["lineage"] for b in view["forks"]["branches"]} == set(EXPECTED_LINEAGES)
    assert [lin["id"] for lin in plain["lineages"]] == ["main"] and {t["lineage"] for t in plain["turns"]} == {"main"}


def test_the_report_drill_down_shows_the_lineages_side_by_side(lineage_log, tmp_path):
    cli("report", str(lineage_log), "-o", str(tmp_path / "r.html"), "-q")
    page = (tmp_path / "r.html").read_text()
    lin = page.split(f'data-session="{LINEAGE_SESSION}"', 1)[1].split("</details>", 1)[0]
    assert re.findall(r'<tr data-lineage="([^"]+)">', lin) == list(EXPECTED_LINEAGES)
    cols = re.findall(r'<div class="lineage-col" data-lineage="([^"]+)">(.*?)</div></div>', lin)
    assert [c[0] for c in cols] == list(EXPECTED_LINEAGES)
    for row, (lid, col) in enumerate(cols):
        assert re.findall(r'data-row="(\d+)"', col) == [str(row)], lid
    assert "<td>main turn 4, call call_3 Task(" in lin
    plain = page.split(f'data-session="{PLAIN_SESSION}"', 1)[1].split("</details>", 1)[0]
    assert "lineage" not in plain


def test_export_dataset_writes_one_row_per_lineage_with_its_parent(lineage_log, tmp_path):
    out = cli("export-dataset", str(lineage_log), "-o", str(tmp_path / "ds"), "--format", "jsonl", "--tokens", "-q")
    assert "2 sessions (jsonl; finished 2) in 5 rows (one per lineage)" in out
    rows = [json.loads(line) for line in (tmp_path / "ds" / "sessions.jsonl").read_text().splitlines()]
    assert [(r["session_id"], r["lineage"]) for r in rows] == [(LINEAGE_SESSION, lid) for lid in EXPECTED_LINEAGES] + [(PLAIN_SESSION, "main")]
    for r in rows[:4]:
        indices, parent, parent_turn, call, prompt = EXPECTED_LINEAGES[r["lineage"]]
        assert (r["parent_lineage"], r["parent_turn"], r["spawn_call"]) == (parent or "", parent_turn, call or "")
        assert r["turns"] == len(indices) and r["reward"] == 1.0 and r["advantage"] == rows[0]["advantage"] > 0
        # Its own conversation: its first user message is the prompt its spawning call passed.
        assert next(m["content"] for m in r["messages"] if m["role"] == "user") == (prompt or "Fix the bug in foo.")
        assert len(r["token_ids"]) == 1  # its one trajectory row
    assert [m["content"] for m in rows[2]["messages"]] == ["You are a worker subagent.", "write tests for foo", "tests written", "ok", "done a"]
    assert rows[2]["token_ids"] == [[40, 41, 50, 43, 51]] and rows[2]["loss_mask"] == [[0, 0, 1, 0, 1]]
    assert (rows[4]["parent_lineage"], rows[4]["parent_turn"], rows[4]["spawn_call"]) == ("", None, "")


def test_reconstruct_of_the_run_is_equal_and_each_sample_names_its_lineage(lineage_log, tmp_path):
    import shutil

    from agentlog.events.schema.types import PolicyUpdated
    from agentlog.loop.config import LoopConfig
    from agentlog.loop.learner_records import step_digest
    from agentlog.loop.run_folder import Run
    from agentlog.reducers.partitioned import reduce_partitions

    run = tmp_path / "run"
    shutil.copytree(lineage_log, run / "rollout", ignore=shutil.ignore_patterns("LOCK"))
    config = LoopConfig(fsync="never")
    Run.save_config(run, config)
    with Run.open(run) as opened:
        released = reduce_partitions({0: opened.rollout.read()}, config.reduce_config())
        group = released[0]["g-lin"].group
        with opened.open_learner() as w:  # what the learner records of the step that trained the group
            w.append_batch([("learner", 0, PolicyUpdated(step=1, policy_version=1, checkpoint="", sample_digest=step_digest([group]),
                                                         groups=["g-lin"], lsn_end=group.lsn_released))])
    out = cli("reconstruct", str(run), "-o", str(tmp_path / "samples.jsonl"), "-q")
    assert "online per-step digests vs offline: EQUAL (1/1 steps equal" in out
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    named = [(s["session_id"], s["metadata"].get("lineage"), s["metadata"].get("parent_lineage"), s["metadata"].get("spawn_call"))
             for s in samples]
    assert named == [(LINEAGE_SESSION, lid, e[1], e[3]) for lid, e in EXPECTED_LINEAGES.items()] + [(PLAIN_SESSION, None, None, None)]
