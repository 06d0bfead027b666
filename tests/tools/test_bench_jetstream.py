"""The JetStream log's benchmark at a tiny size: every measurement (single, batched and asyncio appends, 2048-token
turns, follow latency) on FileLog and on JetStream R1 and R3 (the suite's server and 3-node cluster); its table and
its six GOAL lines."""

from __future__ import annotations

import math
import re

from agentlog.tools.bench import bench_jetstream

TURNS, FOLLOW = 8, 5
BACKENDS = ["FileLog fsync=batch", "FileLog fsync=always", "JetStream R1", "JetStream R3"]
GOAL_RE = re.compile(r"^GOAL (\w+): ([\d,.]+)(?:x| ev/s| MB/s| ms) \(goal (>=|<=) ([\d,.]+)\S* ?\S*\) (PASS|MISS)$", re.M)


def test_the_benchmark_measures_every_backend_and_prints_its_six_goal_lines_last(capsys, tmp_path, nats_server, nats_cluster):
    argv = ["--single", "5", "--batched", "100", "--sessions", "4", "--per-session", "3", "--turns", str(TURNS),
            "--follow", str(FOLLOW), "--r1-server", nats_server.url, "--r3-cluster", ",".join(nats_cluster.urls),
            "--dir", str(tmp_path)]
    assert bench_jetstream.main(argv) == 0
    out = capsys.readouterr().out
    goals = GOAL_RE.findall(out)
    assert [g[0] for g in goals] == [
        "jetstream_r3_single_appends_vs_filelog_fsync_always", "jetstream_r3_batch100_vs_filelog_fsync_always",
        "jetstream_r3_asyncio_appends", "jetstream_r3_turns_mb_s", "jetstream_r1_batch100_small_events",
        "jetstream_r3_follow_p99_ms"], out
    assert out.rstrip().splitlines()[-6:] == [line for line in out.splitlines() if line.startswith("GOAL ")], out
    measured = {name: float(value.replace(",", "")) for name, value, *_ in goals}
    assert all(math.isfinite(v) and v > 0 for v in measured.values()), out

    assert f"{TURNS} x 2048-token turns in batches of 8, follow of {FOLLOW} events 5 ms apart" in out, out
    rows = {m[1].strip(): [float(x.replace(",", "")) for x in m[2].split()]
            for m in re.finditer(r"^((?:FileLog|JetStream) \S+)\s+((?:[\d,.]+\s*){7})$", out, re.M)}
    assert list(rows) == BACKENDS, out
    # The GOAL lines judge the table's figures (as rounded where they are printed).
    single, batch100, asyncio_rate, _turns, turn_mb, _p50, p99 = rows["JetStream R3"]
    assert measured["jetstream_r3_asyncio_appends"] == round(asyncio_rate), out
    assert abs(measured["jetstream_r3_turns_mb_s"] - turn_mb) <= 0.55, out
    assert measured["jetstream_r1_batch100_small_events"] == round(rows["JetStream R1"][1]), out
    assert measured["jetstream_r3_follow_p99_ms"] == p99, out
    assert math.isclose(measured["jetstream_r3_single_appends_vs_filelog_fsync_always"],
                        single / rows["FileLog fsync=always"][0], rel_tol=0.02, abs_tol=0.01), out
    assert math.isclose(measured["jetstream_r3_batch100_vs_filelog_fsync_always"],
                        batch100 / rows["FileLog fsync=always"][1], rel_tol=0.02, abs_tol=0.01), out
