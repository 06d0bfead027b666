"""`agentlog export-dataset`: every row matches what `agentlog show` prints for its
session, the filters, the errors, and one TRL SFT step on the exported `sft` data."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import statistics
from pathlib import Path

import pytest

from agentlog.tools.cli import main
from agentlog.tools.cmd_show import _message, mask_runs
from hf_helpers import tiny_hf_dir  # noqa: F401  (a fixture)


def load_from_disk(path: Path):
    """``datasets.load_from_disk`` (a skip naming the extra where datasets is missing: a run-time skip, so
    the required test below fails under CI=true instead of vanishing at collection)."""
    datasets = pytest.importorskip("datasets", reason="export-dataset hf/sft needs the export extra: pip install -e '.[dev]'")
    return datasets.load_from_disk(str(path))


ALL = "finished,aborted,dropped,open,running"

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}
SYSTEM = {"role": "system", "content": "You are a coding agent."}


async def _write_tool_log(path: Path) -> None:
    """Sessions with tool calls in both recorded forms, recorded tool definitions, content
    blocks, a rewritten history, a length finish, a session without a turn and a skipped group."""
    from agentlog.engine import SessionEngine
    from agentlog.events import FileLog

    log = FileLog.open(path)
    eng = await SessionEngine.open(log, drain_s=0.1)
    user = {"role": "user", "content": "List the files."}
    # The gateway's canonical form: arguments parsed into an object (keys kept in their order).
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "bash", "arguments": {"command": "ls", "all": True}}]}
    h = await eng.open_session("tc-0", group_id="g-tools", group_size=2, sample_index=0, prompt=[SYSTEM, user], metadata={"tools": [BASH]})
    await h.start()
    await h.record_turn(messages=[SYSTEM, user], prompt_ids=[1, 2, 3], output_ids=[4, 5], output_log_probs=[-0.1, -0.2], response_message=call)
    await h.record_command("ls", 0, False, 0.01, "a.py")
    result = {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}
    await h.record_turn(messages=[SYSTEM, user, call, result], prompt_ids=[1, 2, 3, 4, 5, 6], output_ids=[7],
                        output_log_probs=[-0.3], response_message={"role": "assistant", "content": "There is a.py."})
    await h.finish(reward=1.0)

    # A rewritten history, then the OpenAI form (arguments as text, kept verbatim), content blocks, a length finish.
    blocks = {"role": "user", "content": [{"type": "text", "text": "Write"}, {"type": "image"}, {"type": "text", "text": "a file."}]}
    call2 = {"role": "assistant", "content": "Writing.", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.py", "content": "x = 1\\n"}'}}]}
    h = await eng.open_session("tc-1", group_id="g-tools", group_size=2, sample_index=1)
    await h.start()
    await h.record_turn(messages=[SYSTEM, {"role": "user", "content": "Start.\nTwo lines."}], prompt_ids=[1, 3], output_ids=[10],
                        output_log_probs=[-0.25], response_message={"role": "assistant", "content": "Sure"})
    await h.record_turn(messages=[SYSTEM, blocks], prompt_ids=[1, 2], output_ids=[8, 9], output_log_probs=[-0.5, -0.5], response_message=call2)
    done = {"role": "tool", "tool_call_id": "call_2", "content": "written"}
    await h.record_turn(messages=[SYSTEM, blocks, call2, done], prompt_ids=[1, 2, 8, 9, 6], output_ids=[11, 12],
                        output_log_probs=[-0.25, -0.25], finish_reason="length", response_message={"role": "assistant", "content": "Wri"})
    await h.finish(reward=0.0)

    # A group of one: released as skipped (min_valid 2); no turn, so its messages are its prompt.
    h = await eng.open_session("solo-0", group_id="g-solo", group_size=1, prompt=[SYSTEM, user])
    await h.start()
    await h.finish(reward=0.5)
    await eng.close()
    log.close()


@pytest.fixture(scope="module")
def tool_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("export") / "tools.log"
    asyncio.run(_write_tool_log(path))
    return path


def cli(*args: str) -> tuple[int, str, str]:
    """``agentlog ARGS`` in process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def export(log: Path, out: Path, *args: str) -> str:
    rc, stdout, stderr = cli("export-dataset", str(log), "-o", str(out), "-q", *args)
    assert rc == 0, stderr
    return stdout


def hf_rows(log: Path, out: Path, *args: str) -> list[dict]:
    export(log, out, "--format", "hf", *args)
    return list(load_from_disk(out))


# ---------------------------------------------------------------- show, parsed

_OUTCOME = re.compile(r"^outcome  (?:still (\w+)|(\w+)(?: \((.*?)\))?(?:  reward (\S+))?  turns)")
_ROW = re.compile(r"^  row \d+: (\w+)(?: remove_sample)?, reward (\S+), (\d+) tokens = (\d+) prompt \+ (\d+) response")
#: The lineage a transcript turn or a row of a session with subagents names.
_LINEAGE = re.compile(r"  lineage (\S+)")


def show(log: Path, session: str) -> dict:
    """What ``agentlog show --full`` prints of a session: status, reason, reward, health
    flags, the conversation its transcript adds up to per lineage (its session_opened prompt
    when it recorded no turn), and its rows' prompt and response lines per lineage and rewards."""
    rc, out, err = cli("show", str(log), session, "--full", "-q")
    assert rc == 0, err
    lines = out.splitlines()
    m = next(_OUTCOME.match(line) for line in lines if line.startswith("outcome  "))
    facts: dict = {"status": m.group(1) or m.group(2), "reason": m.group(3) or "",
                   "reward": None if m.group(4) is None else float(m.group(4)), "conversation": {}, "rows": {}, "row_rewards": []}
    flags = next(line for line in lines if line.startswith("flags    ")).removeprefix("flags    ").split("  (")[0]
    facts["flags"] = [] if flags == "(none)" else flags.split(", ")
    facts["raw_flags"] = next(line for line in lines if line.startswith("flags    "))
    section, lineage = "", "main"
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            section = line.split()[0]
        elif section == "transcript":
            if line.startswith("  turn "):
                lineage = _LINEAGE.search(line).group(1) if _LINEAGE.search(line) else "main"
                if "(history rewritten" in line:
                    facts["conversation"][lineage] = []
            elif line.startswith("    -> "):
                facts["conversation"].setdefault(lineage, []).append(line[len("    -> "):])
            elif line.startswith("    ["):
                facts["conversation"].setdefault(lineage, []).append(line[4:])
        elif section == "rows" and _ROW.match(line):
            prompt = lines[i + 1].removeprefix("    prompt    ").strip()
            row_lineage = _LINEAGE.search(line).group(1) if _LINEAGE.search(line) else "main"
            facts["rows"].setdefault(row_lineage, []).append(
                (int(_ROW.match(line).group(4)), prompt, lines[i + 2].removeprefix("    response  ")))
            facts["row_rewards"].append(float(_ROW.match(line).group(2)))
    return facts


def rendered(row: dict) -> list[str]:
    """The row's messages as ``show`` renders a message (the keys Arrow filled with null left out)."""
    return [_message({k: v for k, v in m.items() if v is not None}, True) for m in row["messages"]]


_CALL = re.compile(r"^(.*)tool call (\w+)\((.*)\)(.*)$")


def same_lines(exported: list[str], shown: list[str]) -> bool:
    """Equal message lines; a tool call's arguments compared as JSON values (``show`` prints
    an object's keys sorted, the export keeps the order they were recorded in)."""
    if len(exported) != len(shown):
        return False
    for a, b in zip(exported, shown):
        if a == b:
            continue
        ma, mb = _CALL.match(a), _CALL.match(b)
        if not (ma and mb) or ma.group(1, 2, 4) != mb.group(1, 2, 4) or json.loads(ma.group(3)) != json.loads(mb.group(3)):
            return False
    return True


def assert_matches_show(log: Path, row: dict) -> None:
    """Every column ``show`` prints of the row's session agrees with the row: outcome, reward (a
    finished session's, and an abort's its class counts as a failure: its rows'), flags, the
    conversation (the prompt of a session without a turn) and, with --tokens, the token rows."""
    sid = row["session_id"]
    facts = show(log, sid)
    assert row["status"] == facts["status"], sid
    assert row["reason"] == facts["reason"], sid
    assert row["health_flags"] == facts["flags"], sid
    if row["status"] == "finished":
        assert row["reward"] == facts["reward"], sid
    elif row["status"] == "aborted" and row["in_baseline"]:  # a failure: its rows carry the run's failure reward
        assert facts["row_rewards"] and all(r == row["reward"] for r in facts["row_rewards"]), (sid, facts["row_rewards"])
    else:
        assert row["reward"] is None, sid
    conversation = facts["conversation"].get(row["lineage"], [])
    assert same_lines(rendered(row), conversation), (sid, row["lineage"], rendered(row), conversation)
    if "token_ids" not in row:
        return
    # The token rows are the rows show prints, prompt then response runs; a member out of the
    # baseline by its abort class or its flags has none (its placeholder is no data).
    placeholder = (row["status"] == "aborted" and not row["in_baseline"]) or "untrainable by" in facts["raw_flags"]
    expected_rows = [] if placeholder else facts["rows"].get(row["lineage"], [])
    assert len(row["token_ids"]) == len(expected_rows), sid
    for ids, mask, lps, (n_prompt, prompt, response) in zip(row["token_ids"], row["loss_mask"], row["log_probs"], expected_rows):
        assert len(ids) == len(mask) == len(lps)
        assert " ".join(map(str, ids[:n_prompt])) == prompt
        assert not any(mask[:n_prompt]) and not any(lps[:n_prompt])
        runs = " ".join(("train[" if m else "ctx[") + " ".join(map(str, t)) + "]" for m, t in mask_runs(_np(ids[n_prompt:]), _np(mask[n_prompt:])))
        assert runs == response


#: A run's settings where a policy abort counts as a failure (reward -1) and a truncated member is untrainable.
FAILING_CONFIG = """untrainable_flags = ["truncated"]
min_valid = 1

[groups]
fail_reward = -1.0

[learner]
estimator = "dr_grpo"
"""


def failing_run(log: Path, tmp_path: Path) -> Path:
    """A run folder holding a copy of ``log`` with :data:`FAILING_CONFIG` as its config."""
    import shutil

    from agentlog.loop.config import LoopConfig
    from agentlog.loop.run_folder import Run

    run = tmp_path / f"{log.name}-run"
    shutil.copytree(log, run / "rollout", ignore=shutil.ignore_patterns("LOCK"))
    (tmp_path / "failing.toml").write_text(FAILING_CONFIG)
    Run.save_config(run, LoopConfig.load(tmp_path / "failing.toml"))
    return run


def test_every_row_matches_show(run_log, tool_log, tmp_path):
    rows = {}
    for log in (run_log[0], tool_log, failing_run(run_log[0], tmp_path), failing_run(tool_log, tmp_path)):
        every = hf_rows(log, tmp_path / f"{log.name}.out", "--status", ALL, "--tokens")
        rows[log.name] = {r["session_id"]: r for r in every}
        assert rows[log.name]
        for row in every:  # one per lineage of a session
            assert_matches_show(log, row)
    # The rows cover a session without a turn, a failure abort, an excluded abort and an untrainable member.
    failed, tools = rows[f"{run_log[0].name}-run"], rows[f"{tool_log.name}-run"]
    assert not rows[tool_log.name]["solo-0"]["turns"] and not failed["drop-2"]["turns"]
    assert failed["abort-0"]["in_baseline"] and failed["abort-0"]["reward"] == -1.0  # wall_clock_timeout: a policy abort
    assert not failed["exc-1"]["in_baseline"] and failed["exc-1"]["reward"] is None  # an infrastructure abort: excluded
    assert "truncated" in tools["tc-1"]["health_flags"] and not tools["tc-1"]["in_baseline"] and tools["tc-1"]["token_ids"] == []


def _np(values):
    import numpy as np

    return np.asarray(values)


def test_run_log_outcomes_and_advantages(run_log, tmp_path):
    from cli_helpers import EXPECTED

    rows = {r["session_id"]: r for r in hf_rows(run_log[0], tmp_path / "x", "--status", ALL)}
    assert set(rows) == set(EXPECTED["sessions"])
    for sid, want in EXPECTED["sessions"].items():
        assert (rows[sid]["group_id"], rows[sid]["status"], rows[sid]["reason"], rows[sid]["turns"]) == (
            want["group"], want["status"], want["reason"], want["turns"]), sid
    # g-ok: rewards 1, 0, 1, all valid: GRPO (r - mean) / (unbiased std + 1e-6), in float32.
    rewards = [1.0, 0.0, 1.0]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    for sid, r in zip(("fin-0", "fin-1", "fork-2"), rewards):
        assert rows[sid]["advantage"] == pytest.approx((r - mean) / (std + 1e-6), rel=1e-6)
        assert rows[sid]["in_baseline"] and rows[sid]["group_skip_reason"] == ""
    # g-bad: two aborted (out of the baseline), one dropped, one finished: released as skipped.
    assert rows["strag-3"]["advantage"] == 0.0 and rows["abort-0"]["advantage"] == 0.0
    assert rows["drop-2"]["advantage"] is None and "min_valid" in rows["strag-3"]["group_skip_reason"]
    assert not rows["abort-0"]["in_baseline"] and rows["abort-0"]["reward"] is None
    # g-live: still in flight, so no advantage; the running member has no reward.
    assert rows["live-0"]["advantage"] is None and rows["live-0"]["reward"] is None
    assert all(r["policy_versions"] == [0] for r in rows.values() if r["turns"])
    assert rows["fin-0"]["health_flags"] == ["complete"] and "drift" in rows["fork-2"]["health_flags"]


def test_tool_calls_tools_and_outcome_columns(tool_log, tmp_path):
    rows = {r["session_id"]: r for r in hf_rows(tool_log, tmp_path / "x")}
    tc0, tc1, solo = rows["tc-0"], rows["tc-1"], rows["solo-0"]
    call = tc0["messages"][2]["tool_calls"][0]
    assert call == {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls", "all": true}'}}
    assert tc0["messages"][3] == {"role": "tool", "content": "a.py", "tool_calls": None, "tool_call_id": "call_1", "name": None}
    assert (json.loads(tc0["tools"]), tc0["tools_source"]) == ([BASH], "recorded")
    # The second turn rewrote the history; the OpenAI form keeps its argument text; the last turn stopped at its token limit.
    assert [m["content"] for m in tc1["messages"]] == ["You are a coding agent.", "Write <image> a file.", "Writing.", "written", "Wri"]
    assert tc1["messages"][2]["tool_calls"][0]["function"] == {"name": "write_file", "arguments": '{"path": "a.py", "content": "x = 1\\n"}'}
    assert tc1["truncated"] and tc1["finish_reason"] == "length" and "truncated" in tc1["health_flags"] and not tc0["truncated"]
    assert tc1["tools_source"] == "inferred" and [t["function"]["name"] for t in json.loads(tc1["tools"])] == ["write_file"]
    assert json.loads(tc1["tools"])[0]["function"]["parameters"]["required"] == ["content", "path"]
    assert (solo["messages"][1]["content"], solo["turns"], solo["reward"], solo["advantage"]) == ("List the files.", 0, 0.5, 0.0)
    assert "min_valid" in solo["group_skip_reason"]
    assert tc0["advantage"] > 0 > tc1["advantage"]


def test_a_member_its_flags_make_untrainable_is_out_of_the_baseline(tool_log, tmp_path):
    import shutil

    from agentlog.loop.config import LoopConfig
    from agentlog.loop.run_folder import Run

    run = tmp_path / "run"
    shutil.copytree(tool_log, run / "rollout", ignore=shutil.ignore_patterns("LOCK"))
    Run.save_config(run, LoopConfig(untrainable_flags=["truncated"]))
    rows = {r["session_id"]: r for r in hf_rows(run, tmp_path / "x", "--tokens")}
    tc0, tc1 = rows["tc-0"], rows["tc-1"]
    assert "truncated" in tc1["health_flags"] and not tc1["in_baseline"] and tc1["advantage"] == 0.0 and tc1["token_ids"] == []
    assert tc1["reward"] == 0.0  # what it scored, though the learner leaves it out
    # tc-0 is its group's only valid member now: no signal, advantage 0, but it keeps its rows.
    assert tc0["in_baseline"] and tc0["advantage"] == 0.0 and len(tc0["token_ids"]) == 1
    assert "untrainable" in show(run, "tc-1")["raw_flags"]


def test_tools_are_inferred_from_the_calls_when_none_were_recorded(tool_log, tmp_path):
    from agentlog.tools.dataset_rows import export_message, infer_tools, session_tools

    msgs = [export_message({"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "name": "edit", "arguments": {"path": "a.py", "line": 3}},
        {"id": "b", "type": "function", "function": {"name": "edit", "arguments": '{"path": "b.py"}'}},
        {"id": "c", "name": "note", "arguments": "free text"}]})]
    assert json.loads(msgs[0]["tool_calls"][0]["function"]["arguments"]) == {"path": "a.py", "line": 3}
    tools = infer_tools(msgs)
    assert [t["function"]["name"] for t in tools] == ["edit", "note"]
    assert tools[0]["function"]["parameters"] == {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                                                  "required": ["path"]}
    assert session_tools({}, msgs) == (tools, "inferred") and session_tools({"tools": [BASH]}, msgs) == ([BASH], "recorded")


def test_jsonl_holds_the_same_rows(tool_log, run_log, tmp_path):
    for log in (run_log[0], tool_log):
        hf = hf_rows(log, tmp_path / f"{log.name}.hf", "--tokens")
        export(log, tmp_path / f"{log.name}.jsonl", "--format", "jsonl", "--tokens")
        lines = (tmp_path / f"{log.name}.jsonl" / "sessions.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        for a, b in zip(hf, rows, strict=True):
            a["messages"] = [{k: v for k, v in m.items() if v is not None} for m in a["messages"]]
            assert _same(a, b), a["session_id"]
        manifest = json.loads((tmp_path / f"{log.name}.jsonl" / "export.json").read_text())
        assert manifest["rows"] == len(rows) and manifest["format"] == "jsonl" and manifest["advantage"]["estimator"] == "grpo"


def _same(a: dict, b: dict) -> bool:
    """Equal, float32 columns (log-probs) compared as float32."""
    if a.keys() != b.keys():
        return False
    for k in a:
        if k == "log_probs":
            if [[float(f"{x:.7g}") for x in r] for r in a[k]] != [[float(f"{x:.7g}") for x in r] for r in b[k]]:
                return False
        elif a[k] != b[k]:
            return False
    return True


def test_filters(run_log, tmp_path):
    log = run_log[0]
    every = hf_rows(log, tmp_path / "all", "--status", ALL)
    finished = hf_rows(log, tmp_path / "fin", "--status", "finished")
    assert [r["session_id"] for r in finished] == [r["session_id"] for r in every if r["status"] == "finished"]
    assert {r["status"] for r in hf_rows(log, tmp_path / "two", "--status", "aborted", "--status", "dropped")} == {"aborted", "dropped"}
    assert {r["status"] for r in hf_rows(log, tmp_path / "default")} == {"finished", "aborted", "dropped"}
    rich = hf_rows(log, tmp_path / "rich", "--min-reward", "0.5")
    assert sorted(r["session_id"] for r in rich) == ["fin-0", "fork-2", "strag-3"]
    bad = hf_rows(log, tmp_path / "bad", "--group", "g-bad", "--group", "g-live", "--status", ALL)
    assert sorted(r["session_id"] for r in bad) == ["abort-0", "drop-2", "exc-1", "live-0", "strag-3"]
    first = hf_rows(log, tmp_path / "first", "--sessions", "2", "--status", ALL)
    assert [r["session_id"] for r in first] == [r["session_id"] for r in every[:2]]
    both = hf_rows(log, tmp_path / "both", "--group", "g-ok", "--min-reward", "1")
    assert sorted(r["session_id"] for r in both) == ["fin-0", "fork-2"]
    assert "0 sessions" in export(log, tmp_path / "none", "--group", "g-none")
    assert len(load_from_disk(tmp_path / "none")) == 0


def test_bad_input_gets_a_clear_error(run_log, tmp_path):
    log = str(run_log[0])
    rc, _, err = cli("export-dataset", str(tmp_path / "nope"), "-o", str(tmp_path / "o"))
    assert rc == 2 and "nope" in err and "agentlog: error: " in err
    rc, _, err = cli("export-dataset", log, "-o", str(tmp_path / "o"), "--format", "csv")
    assert rc == 2 and "--format" in err and "'csv'" in err and "hf" in err
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    rc, _, err = cli("export-dataset", log, "-o", str(full))
    assert rc == 2 and f"{full}: exists and is not empty" in err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    rc, _, err = cli("export-dataset", log, "-o", str(tmp_path / "file"))
    assert rc == 2 and "exists and is not a directory" in err
    rc, _, err = cli("export-dataset", log, "-o", str(tmp_path / "o"), "--status", "finished,done")
    assert rc == 2 and "--status" in err and "'done'" in err
    rc, _, err = cli("export-dataset", log, "-o", str(tmp_path / "o"), "--min-reward", "nan")
    assert rc == 2 and "--min-reward" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("export-dataset", log, "-o", str(empty), "-q")[0] == 0  # an empty directory is taken
    assert (empty / "state.json").is_file()


def test_a_log_the_reducers_refuse_exits_1_and_leaves_nothing(tmp_path):
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionFinished, SessionOpened

    log = FileLog.open(tmp_path / "bad.log")
    log.append_batch([("s", 0, SessionOpened(group_id="g", group_size=1)), ("s", 1, SessionFinished(reward=1.0))])
    log.close()
    rc, _, err = cli("export-dataset", str(tmp_path / "bad.log"), "-o", str(tmp_path / "out"))
    assert rc == 1 and "lsn 1, session 's'" in err and "illegal" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.log"]  # no output, no temporary


def test_a_run_folder_exports_with_its_settings(short_demo_run, tmp_path):
    cwd, _ = short_demo_run
    run = cwd / "runs" / "demo"
    rows = hf_rows(run, tmp_path / "demo", "--tokens")
    assert rows and all(r["status"] in ("finished", "aborted", "dropped") for r in rows)
    manifest = json.loads((tmp_path / "demo" / "export.json").read_text())
    assert manifest["rows"] == len(rows) and manifest["reduce_config_digest"].startswith("sha256:")
    # The token rows are the samples reconstruct rebuilds, less the placeholders of excluded aborts.
    rc, _, err = cli("reconstruct", str(run), "-o", str(tmp_path / "samples.jsonl"), "-q")
    assert rc in (0, 1), err
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    kept = [s for s in samples if "turn_indices" in s["metadata"]]
    assert sum(len(r["token_ids"]) for r in rows) == len(kept) > 0
    for row in rows:
        assert_matches_show(run, row)
    # Each released group's advantages are the learner's function over that group alone, exactly
    # (the export computes them for many groups in one call, as a learner batch does).
    import torch

    from agentlog.learner.advantages import compute_advantages

    by_group: dict = {}
    for r in rows:
        if r["status"] != "dropped" and r["advantage"] is not None and not r["group_skip_reason"]:
            by_group.setdefault(r["group_id"], []).append(r)
    assert by_group
    for members in by_group.values():
        want = compute_advantages(torch.tensor([m["reward"] if m["in_baseline"] else 0.0 for m in members], dtype=torch.float64),
                                  torch.zeros(len(members), dtype=torch.long), torch.tensor([m["in_baseline"] for m in members]),
                                  estimator=manifest["advantage"]["estimator"], eps=manifest["advantage"]["eps"])
        assert [m["advantage"] for m in members] == want.to(torch.float32).tolist()


@pytest.mark.required
def test_sft_export_trains_one_trl_step_on_the_tiny_model(tool_log, run_log, tiny_hf_dir, tmp_path):  # noqa: F811
    trl = pytest.importorskip("trl", reason="the SFT check needs TRL (the dev extra): pip install -e '.[dev]'")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "sft"
    line = export(tool_log, out, "--format", "sft", "--status", "finished")
    assert "1 without an assistant message left out" in line  # solo-0: no turn
    ds = load_from_disk(out)
    # tc-0, and tc-1's two lineages (its second turn opens another conversation: another first user message).
    assert ds.column_names == ["messages", "tools"] and len(ds) == 3
    assert json.loads(ds[0]["tools"]) == [BASH]
    tok = AutoTokenizer.from_pretrained(tiny_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # TRL turns gradient checkpointing on by default, a name transformers 5.25 deprecates for activation_checkpointing
    # (a FutureWarning): the tiny model needs neither, so it is turned off under the name this transformers has.
    fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    no_checkpointing = {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": False}
    args = trl.SFTConfig(output_dir=str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-3,
                         report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, assistant_only_loss=True, disable_tqdm=True,
                         **no_checkpointing)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    result = trainer.train()
    assert result.global_step == 1 and math.isfinite(result.training_loss)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    # The rendered text holds the recorded tool call and the tool definition.
    text = tok.apply_chat_template(ds[0]["messages"], tools=json.loads(ds[0]["tools"]), tokenize=False)
    assert '<tool_call>{"name": "bash", "arguments": {"command": "ls", "all": true}}</tool_call>' in text and '"name": "bash"' in text


def test_estimator_option_sets_the_advantage(run_log, tmp_path):
    rows = {r["session_id"]: r for r in hf_rows(run_log[0], tmp_path / "x", "--estimator", "dr_grpo")}
    # Dr. GRPO: r - mean, no std scaling (g-ok's rewards 1, 0, 1).
    assert [rows[s]["advantage"] for s in ("fin-0", "fin-1", "fork-2")] == pytest.approx([1 / 3, -2 / 3, 1 / 3], rel=1e-6)
    assert json.loads((tmp_path / "x" / "export.json").read_text())["advantage"]["estimator"] == "dr_grpo"


def test_a_big_log_shows_progress_and_quiet_silences_it(tmp_path):
    from agentlog.tools.bench.bench_export import write_log
    from cli_helpers import on_a_terminal

    write_log(tmp_path / "big.log", 2500)  # ~6 MB: over the commands' 4 MB threshold for a bar
    code, err = on_a_terminal("export-dataset", str(tmp_path / "big.log"), "-o", str(tmp_path / "a"), "--format", "jsonl")
    assert code == 0 and "export-dataset:" in err and "B/s" in err, err
    code, err = on_a_terminal("export-dataset", str(tmp_path / "big.log"), "-o", str(tmp_path / "b"), "--format", "jsonl", "--quiet")
    assert code == 0 and err == "", err


def _open_files_under(root: Path) -> list[str]:
    """The files under ``root`` this process holds open (Linux: /proc/self/fd)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("needs /proc/self/fd to see open files")
    held = []
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith(str(root)):
                held.append(target)
    return held


@pytest.mark.parametrize("fmt", ["hf", "jsonl"])
def test_an_export_the_reducers_end_closes_its_files_and_leaves_nothing(tmp_path, fmt):
    """A log refused after rows were written: exit 1, no DIR, no temporary, no file left open."""
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted

    log = FileLog.open(tmp_path / "bad.log")
    log.append_batch([(f"s{i}", n, b) for i in range(3) for n, b in enumerate(
        (SessionOpened(group_id=f"g{i}", group_size=1), SessionStarted(), SessionFinished(reward=1.0)))])
    log.append_batch([("late", 0, SessionOpened(group_id="g", group_size=1)), ("late", 1, SessionFinished(reward=1.0))])
    log.close()
    out = tmp_path / "deep" / "er" / "out"
    rc, _, err = cli("export-dataset", str(tmp_path / "bad.log"), "-o", str(out), "--format", fmt, "-q")
    assert rc == 1 and "session 'late'" in err and "illegal" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.log"]  # no DIR, no parents made for it, no temporary
    assert _open_files_under(tmp_path / "deep") == []


@pytest.mark.parametrize("fmt", ["hf", "jsonl"])
def test_an_export_that_cannot_place_its_output_closes_its_files_and_leaves_dir_as_it_was(tool_log, tmp_path, monkeypatch, fmt):
    from agentlog.tools import cmd_export_dataset

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cmd_export_dataset.os, "replace", full)
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = cli("export-dataset", str(tool_log), "-o", str(empty), "--format", fmt, "-q")
    assert rc == 2 and f"{empty}: cannot write: No space left on device" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and list(empty.iterdir()) == []  # as it was
    assert _open_files_under(tmp_path) == []


def _log_with(path: Path, opened: dict, response: dict | None = None) -> Path:
    from agentlog.events import FileLog
    from agentlog.events.schema.types import SessionFinished, SessionOpened, SessionStarted, TurnRecorded

    bodies = [SessionOpened(group_id="g", group_size=1, **opened), SessionStarted()]
    if response is not None:
        bodies.append(TurnRecorded(turn_index=0, messages=[SYSTEM], prompt_ids=[1], output_ids=[2], output_log_probs=[-0.5],
                                   response_message=response))
    log = FileLog.open(path)
    log.append_batch([("s", i, b) for i, b in enumerate(bodies + [SessionFinished(reward=1.0)])])
    log.close()
    return path


@pytest.mark.parametrize("fmt", ["hf", "jsonl"])
def test_a_recorded_value_json_has_no_form_for_is_refused_naming_the_session_and_field(tmp_path, fmt):
    bad_tools = _log_with(tmp_path / "tools.log", {"metadata": {"tools": [{"type": "function", "function": {"name": "f", "blob": b"\x00"}}]}})
    rc, out, err = cli("export-dataset", str(bad_tools), "-o", str(tmp_path / "a"), "--format", fmt, "-q")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert ("lsn 0, session 's': session_opened metadata 'tools': expected JSON values (a list of function tools), "
            "found Object of type bytes is not JSON serializable") in err
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "upload", "arguments": {"data": b"\x01"}}]}
    bad_args = _log_with(tmp_path / "args.log", {}, response=call)
    rc, out, err = cli("export-dataset", str(bad_args), "-o", str(tmp_path / "b"), "--format", fmt, "-q")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert ("lsn 2, session 's': its last turn's messages[1]: tool_calls[0].function.arguments: expected JSON values, "
            "found Object of type bytes is not JSON serializable") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["args.log", "tools.log"]


def test_config_gives_a_copy_of_a_runs_log_the_runs_settings_and_estimator(run_log, tmp_path):
    """A run's log without its config.json (a copy, or its JetStream stream) folds with --config FILE
    exactly as the run folder does: reduce settings and the learner's estimator."""
    import shutil

    run = failing_run(run_log[0], tmp_path)
    copy = tmp_path / "copy.log"  # the run's log alone, no config beside it
    shutil.copytree(run / "rollout", copy)
    as_run = hf_rows(run, tmp_path / "run", "--status", ALL)
    given = hf_rows(copy, tmp_path / "given", "--status", ALL, "--config", str(tmp_path / "failing.toml"))
    bare = hf_rows(copy, tmp_path / "bare", "--status", ALL)
    assert given == as_run != bare
    by_sid = {r["session_id"]: r for r in given}
    assert by_sid["abort-0"]["in_baseline"] and by_sid["abort-0"]["reward"] == -1.0
    # Dr. GRPO over g-bad's valid members (strag-3 0.5, abort-0 -1): r - mean, no std scaling.
    assert by_sid["strag-3"]["advantage"] == pytest.approx(0.75) and by_sid["abort-0"]["advantage"] == pytest.approx(-0.75)
    manifest = json.loads((tmp_path / "given" / "export.json").read_text())
    assert manifest["config_file"] == str(tmp_path / "failing.toml") and manifest["advantage"]["estimator"] == "dr_grpo"
    assert manifest["reduce_config_digest"] == json.loads((tmp_path / "run" / "export.json").read_text())["reduce_config_digest"]
    rc, _, err = cli("export-dataset", str(copy), "-o", str(tmp_path / "x"), "--config", str(tmp_path / "nope.toml"))
    assert rc == 2 and "--config" in err and "nope.toml" in err and not (tmp_path / "x").exists()


def test_small_buffers_write_the_same_rows(tool_log, run_log, tmp_path, monkeypatch):
    """Rows flushed and groups settled by size, however small, give the same dataset."""
    from agentlog.tools import cmd_export_dataset, dataset_rows

    for log in (run_log[0], tool_log):
        want = hf_rows(log, tmp_path / f"{log.name}.big", "--status", ALL, "--tokens")
        with monkeypatch.context() as m:
            m.setattr(cmd_export_dataset._ArrowRows, "FLUSH_BYTES", 1)
            m.setattr(dataset_rows, "SETTLE_BYTES", 1)
            got = hf_rows(log, tmp_path / f"{log.name}.small", "--status", ALL, "--tokens")
        assert got == want


@pytest.fixture(scope="module")
def partitioned_run(tmp_path_factory) -> Path:
    from test_partitioned_views import write_run

    run = tmp_path_factory.mktemp("export-parts") / "run"
    write_run(run)
    return run


def test_a_partitioned_run_folder_exports_every_partitions_sessions(partitioned_run, tmp_path):
    from test_partitioned_views import OUTCOMES

    rows = hf_rows(partitioned_run, tmp_path / "x", "--status", ALL, "--tokens")
    # A session makes one row per lineage (p0-a's second turn opens another conversation: two rows).
    assert sorted({(r["partition"], r["session_id"], r["status"]) for r in rows}) == sorted(
        (pid, sid, status) for pid, sessions in OUTCOMES.items() for sid, status in sessions.items())
    for row in rows:
        assert row["group_id"].startswith(f"g{row['partition']}")
        assert_matches_show(partitioned_run, row)
    by_sid = {r["session_id"]: r for r in rows}
    for pid in (0, 2):  # rewards 1 and 0: GRPO gives +-(0.5 / (std 0.7071 + 1e-6))
        assert by_sid[f"p{pid}-a"]["advantage"] == pytest.approx(0.7071, abs=1e-3) == -by_sid[f"p{pid}-b"]["advantage"]
    assert "min_valid" in by_sid["p1-a"]["group_skip_reason"]  # p1-b aborted: one valid member
    assert by_sid["p2-live"]["advantage"] is None


def test_replay_flag_selects_across_the_partitions(partitioned_run):
    """``replay --flag`` over a partitioned run: the sessions each partition's own reducer flags."""
    from agentlog.events import read_log
    from agentlog.events.log.partitions import partition_dir
    from agentlog.reducers.pipeline import Reducer
    from test_partitioned_views import OUTCOMES

    flagged: dict[str, set[str]] = {}
    for pid in OUTCOMES:
        for sid, flags in Reducer().feed_many(read_log(partition_dir(partitioned_run / "rollout", pid))).flags.items():
            for f in flags:
                flagged.setdefault(f, set()).add(sid)
    assert flagged["complete"] and any(len({s[:2] for s in sids}) > 1 for sids in flagged.values())  # flags in several partitions
    for flag, sids in flagged.items():
        rc, out, err = cli("replay", str(partitioned_run), "--flag", flag, "--json", "-q")
        assert rc == 0, err
        assert {json.loads(line)["session_id"] for line in out.splitlines()} == sids, flag
