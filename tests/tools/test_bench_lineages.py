"""The lineages benchmark at a tiny size: Claude Code-shaped sessions with a subagent and two
parallel ones, recorded through the engine and reduced; its table and its three GOAL lines."""

from __future__ import annotations

import re

from agentlog.tools.bench import bench_lineages

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x? .*\(goal (==|<=) ([\d.]+)x?\) (PASS|MISS)$", re.M)


def test_the_benchmark_prints_its_three_goal_lines_last_with_their_anchors(capsys, tmp_path):
    argv = ["--sessions", "4", "--concurrency", "2", "--context-scale", "0.05", "--reps", "1", "--quiet", "--dir", str(tmp_path)]
    assert bench_lineages.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["rows_per_session_with_subagents_vs_lineages", "repeated_trained_tokens_with_subagents",
                                     "lineage_detection_cpu_us_per_turn"], out
    assert out.rstrip().splitlines()[-3:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    rows, repeated, cpu = goals
    # Deterministic figures: one row per lineage, no token trained twice (the CPU goal depends on the machine).
    assert (float(rows[1]), rows[4]) == (1.0, "PASS") and (int(repeated[1]), repeated[4]) == (0, "PASS"), out
    assert float(cpu[1]) > 0, out
    # Each GOAL line carries its anchor: the rows and repeats before lineages, the whole recording's CPU per turn.
    assert re.search(r"before lineages [\d.]+ rows/session with messages, [\d.]+ token-only", out), out
    assert re.search(r"whole recording: \d+ us CPU per turn", out), out
    assert "76/76 turns placed in their true lineage; 12/12 subagents" in out, out
    assert "not exactly the turn's: 0" in out, out


def test_the_script_holds_a_subagent_and_two_interleaved_ones_each_spawned_by_a_task_call():
    steps = bench_lineages.session_script(0, 1, 0.05)
    lineages = [s.lineage for s in steps]
    assert len(steps) == 19 and lineages.count("main") == 10 and len(set(lineages)) == 4
    spawned = [s for s in steps if s.parent]
    assert len(spawned) == 3
    for sub in spawned:
        task = steps[sub.parent_turn]
        assert task.lineage == "main"
        call = next(c for c in task.response["tool_calls"] if c["id"] == sub.spawn_call)
        assert call["name"] == "Task" and call["arguments"]["prompt"] == sub.messages[1]["content"]
        assert sub.messages[0]["role"] == "system" and sub.messages[0] is not steps[0].messages[0]
    # Each turn's prompt starts with its lineage's previous prompt and output (a chat template's rendering).
    last: dict[str, bytes] = {}
    for s in steps:
        assert s.prompt_ids.startswith(last.get(s.lineage, b""))
        last[s.lineage] = s.prompt_ids + s.output_ids
