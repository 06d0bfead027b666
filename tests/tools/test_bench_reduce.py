"""The reducer's benchmark at a tiny size: two groups of 8 generated sessions (drift, forks, aborted and
dropped ones) written as a log and as JSONL, read raw and decoded, reduced, and rebuilt by the JSONL +
lists baseline; its table, the sample digest and its GOAL line printed."""

from __future__ import annotations

import math
import re

from agentlog.events import read_log
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import reduce_log
from agentlog.tools.bench import bench_reduce


def test_the_benchmark_reduces_a_tiny_log_and_prints_its_goal_line_last(capsys, tmp_path):
    assert bench_reduce.main(["--sessions", "16", "--dir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    goals = re.findall(r"^GOAL (\w+): ([\d.]+)x \(goal (>=) ([\d.]+)x\) (PASS|MISS)$", out, re.M)
    assert [g[0] for g in goals] == ["reduce_vs_jsonl_lists_speedup"], out
    assert out.rstrip().splitlines()[-1].startswith("GOAL reduce_vs_jsonl_lists_speedup: "), out
    speedup = float(goals[0][1])
    assert math.isfinite(speedup) and speedup > 0, out  # a timing: PASS or MISS depends on the machine
    # The generator is seeded: the same sessions, events and samples on every machine.
    assert re.search(r"^generated 16 sessions, 192 events, 0\.6M tokens,", out, re.M), out
    assert re.search(r"^raw read \(frames, no decode\) .* 192 records$", out, re.M), out
    assert re.search(r"^read \(decode envelopes\) .* 192 envelopes$", out, re.M), out
    assert re.search(r"^Reducer \(read \+ reduce\) .* 23 samples, 2 groups$", out, re.M), out
    assert re.search(r"^baseline JSONL \+ lists .* 23 samples$", out, re.M), out
    # The digest it prints is the one reducer's of the log it wrote, reduced whole.
    whole = reduce_log(read_log(tmp_path / "work" / "log"), ReduceConfig())
    assert len(whole.samples) == 23 and f"sample digest {whole.digest}\n" in out, out
