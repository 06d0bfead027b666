"""The commands' benchmark at a tiny size: a log of two groups of four SWE-agent-like sessions generated in
tmp_path, then the raw read, the log reader, `agentlog stats`, `replay --json` and `reconstruct` run on it
in-process under each frame codec the build has (a command's failure stops the run); its table and its GOAL line."""

from __future__ import annotations

import math
import re

from agentlog.events import read_log
from agentlog.events.log import framecodec
from agentlog.events.schema.types import SessionOpened
from agentlog.tools.bench import bench_cli

GOAL_RE = re.compile(r"^GOAL (\w+): ([\d.]+)x \(goal (>=) ([\d.]+)x\) (PASS|MISS)$", re.M)
ROW_RE = re.compile(r"^(.+?) +([\d.]+) +([\d.]+) +(\d+) +([\d.]+) +([\d.]+)$", re.M)


def test_the_benchmark_runs_every_command_under_each_codec_and_prints_its_goal_line_last(capsys, tmp_path):
    codec_before = framecodec.native
    assert bench_cli.main(["--groups", "2", "--reps", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == ["stats_vs_raw_read"], out
    assert out.rstrip().splitlines()[-1:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    ratio = float(goals[0][1])
    assert math.isfinite(ratio) and ratio > 0, out

    # Two groups of four: far under a 64 MB segment, so one segment; each repeated measure run twice.
    assert re.search(r"^log: \d+ MB in 1 segments; min of 2 runs \(1 for replay/reconstruct\)$", out, re.M), out
    codecs = ["compiled", "pure"] if framecodec.available() else ["pure"]
    rows = {m[0]: [float(x) for x in m[1:]] for m in ROW_RE.findall(out)}
    commands = ["log reader alone (read_log raw=True)", "agentlog stats", "agentlog replay --json > /dev/null",
                "agentlog reconstruct --format msgpack"]
    assert list(rows) == ["raw read (anchor)"] + [f"[{c}] {what}" for c in codecs for what in commands], out
    # The goal is the judged codec's stats row against the anchor: its "x raw" column, printed to three places.
    assert abs(rows[f"[{codecs[0]}] agentlog stats"][3] - ratio) <= 0.0051, out
    assert rows["raw read (anchor)"][3:] == [1.0, 1.0], out

    log = tmp_path / "log"
    opened = {rec.session_id for rec in read_log(log) if isinstance(rec.body, SessionOpened)}
    assert len(opened) == 2 * bench_cli.GROUP, "the log holds the groups asked for"
    assert (tmp_path / "samples.msgpack").stat().st_size > 0, "reconstruct wrote its samples"
    assert framecodec.native is codec_before, "the codec the process had is restored"
