"""The event log's benchmark at a tiny size: sixteen 2048-token turn events appended durably, written and read
as JSONL, replayed; small events through the batch and the asyncio APIs; under each frame codec the build has,
in a temp dir under tmp_path that it removes; its table and its seven GOAL lines."""

from __future__ import annotations

import math
import re

from agentlog.events.log import framecodec
from agentlog.tools.bench import bench_log

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d,.]+)(x| ev/s) \(goal (>=|<=) ([\d,.]+)\3\) (PASS|MISS)$", re.M)
GOAL_NAMES = ["durable_append_vs_raw_fdatasync", "jsonl_write_speedup", "jsonl_read_speedup", "size_vs_jsonl",
              "small_events_sync_batch", "small_events_asyncio", "replay_vs_raw_read"]


def test_the_benchmark_measures_both_codecs_and_prints_its_seven_goal_lines_last(capsys, tmp_path):
    codec_before = framecodec.native
    argv = ["--turn-events", "16", "--batch", "8", "--reps", "2", "--small-events", "300", "--async-events", "60",
            "--small-batch", "100", "--sessions", "12", "--dir", str(tmp_path)]
    assert bench_log.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == GOAL_NAMES, out
    assert out.rstrip().splitlines()[-7:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    measured = {g[0]: float(g[1].replace(",", "")) for g in goals}
    assert all(math.isfinite(v) and v > 0 for v in measured.values()), out

    header = re.search(r"^bench_log: 16 x 2048-token turn events in batches of 8; log ([\d,]+) B, JSONL ([\d,]+) B$", out, re.M)
    assert header, out
    log_bytes, jsonl_bytes = (int(b.replace(",", "")) for b in header.groups())
    # The size goal is the two printed sizes' ratio, and it does not depend on the machine: judged here.
    assert measured["size_vs_jsonl"] == round(log_bytes / jsonl_bytes, 2) and goals[3][5] == "PASS", out
    assert "small events: asyncio append, 12 sessions" in out, out

    codecs = ["compiled", "pure"] if framecodec.available() else ["pure"]
    assert re.search(rf"^codecs: {', '.join(codecs)} \(compiled: ", out, re.M), out
    # Every measure has a row with one figure per codec; the codecs not judged have their goals beside.
    rows = re.findall(r"^(token events|small events)\b.*?((?: +[\d.]+){%d})  \S" % len(codecs), out, re.M)
    assert len(rows) == 11, out
    not_judged = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("   ")]
    assert not_judged == GOAL_NAMES * (len(codecs) - 1), out

    assert framecodec.native is codec_before, "the codec the process had is restored"
    assert list(tmp_path.iterdir()) == [], "the benchmark removes what it wrote"
