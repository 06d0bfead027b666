"""The learner benchmark at a tiny size: Learner steps packed and padded on the built-in GPT and on a
one-layer HF Llama, the policy loss checked equal to its plain reference and timed; the tables and the four GOAL lines."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_learner

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x \(goal (>=|<=) ([\d.]+)x\) (PASS|MISS)$", re.M)
TINY = ["--samples", "4", "--step-repeats", "1", "--d-model", "32", "--layers", "1",
        "--loss-rows", "8", "--loss-length", "32", "--loss-repeats", "1",
        "--hf-samples", "4", "--hf-layers", "1", "--hf-width", "64", "--hf-loss-repeats", "1"]


def test_the_benchmark_steps_both_models_both_ways_and_prints_its_four_goal_lines_last(capsys):
    assert bench_learner.main(TINY) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["packing_speedup", "loss_vs_reference", "hf_packing_speedup", "hf_policy_loss_overhead"], out
    assert out.rstrip().splitlines()[-4:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    assert all(float(g[1]) > 0 and math.isfinite(float(g[1])) for g in goals), out
    assert re.search(r"^learner step: 4 samples, response length median \d+, p90 \d+, max \d+; GPT d_model 32, 1 layers", out, re.M), out
    # Each layout trains the same tokens on both models; its padding is what its batch holds beyond them,
    # and packing pads less than padding every row to the longest.
    rows = {name: re.findall(rf"^{name} +(\d+) +(\d+) +([\d.]+)% ", out, re.M) for name in ("packing", "padding")}
    assert len(rows["packing"]) == len(rows["padding"]) == 2, out
    (packed, padded) = rows["packing"][0], rows["padding"][0]
    assert rows["packing"][1] == packed and rows["padding"][1] == padded and packed[0] == padded[0], out
    for tokens, held, pct in (packed, padded):
        assert int(held) >= int(tokens) > 0 and float(pct) == round(100 * (int(held) - int(tokens)) / int(held), 1), out
    assert float(packed[2]) < float(padded[2]), out
    assert re.search(r"^HF LlamaForCausalLM \(1 layers, width 64, SDPA\): Learner.step on 4 samples$", out, re.M), out
    assert re.search(r"^default +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M) and re.search(r"^all extras +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out
