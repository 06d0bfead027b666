"""The groups benchmark at a tiny size, the demo runs left out (minutes each, even at one step): 20 groups
played through the engine with and without refill, and a 1,200-session run folder re-reduced
counterfactually against its learner records; its two lines of figures and its two GOAL lines."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_groups

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)( s)? \(goal (<=) ([\d.]+)( s)?\) (PASS|MISS)(  \[[^\]]+\])?$", re.M)


def test_the_benchmark_plays_groups_and_rereduces_a_run_and_prints_its_goal_lines_last(capsys, tmp_path):
    assert bench_groups.main(["--skip-demo", "--groups", "20", "--sessions", "1200", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["wasted_rollouts_refill_at_5pct_aborts_n8", "counterfactual_rereduce_1200_sessions_s"], out
    assert out.rstrip().splitlines()[-2:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    wasted, counterfactual = goals
    assert all(math.isfinite(float(g[1])) and float(g[1]) > 0 for g in goals), out
    # Seeded, no clock: the sessions each arm generated, the share wasted (so the wasted goal's verdict too).
    assert ("20 groups of 8, 5% infrastructure aborts: refill 0.075 of 173 sessions; "
            "group_drop 0.450 of 160 sessions (arithmetic: 0.337)") in out, out
    assert (wasted[1], wasted[6], wasted[7]) == ("0.075", "MISS", "  [group_drop 0.450]"), out
    # The 150 groups' five learner steps all agree with a re-reduction under the same config; one group
    # changes under min_valid 6.
    assert re.search(r"^counterfactual over 1,200 sessions: [\d.]+ s \(1 groups change under min_valid 6, "
                     r"5 steps equal to their records\); one offline reduction: [\d.]+ s$", out, re.M), out
    assert counterfactual[5] == " s" and re.fullmatch(r"  \[one reduction [\d.]+ s\]", counterfactual[7]), out
    assert list(tmp_path.iterdir()) == [], "the run folders are removed"
