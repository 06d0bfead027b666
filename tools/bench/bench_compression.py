"""Benchmark: compressed record batches of the file log (``FileLog.open(compression="zstd")``),
each figure against its anchor in the same run:

1. bytes on disk of a 100-turn session (bench_growth's SWE-agent shape, recorded
   through the engine as ``turn_delta`` events, every event kept) vs the final
   trajectory's bytes (token ids + log-probs + each message's text once);
2. full replay (``read_log``, bodies decoded) of 2048-token ``turn_recorded``
   events (bench_log's) from a compressed log vs the same events uncompressed;
3. durable append (batch fsync) of those events compressed vs a raw sequential
   write + fdatasync of the *uncompressed* log's bytes in the same batches.

    .venv/bin/python tools/bench/bench_compression.py [--quick] [--dir DIR]

Ends with one GOAL line per goal; exits 0 even on a MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

import structlog  # noqa: E402

from agentlog.engine import SessionEngine  # noqa: E402
from agentlog.events import FileLog, read_log  # noqa: E402
from bench_growth import session_turns, trajectory_bytes  # noqa: E402
from bench_log import best, dir_bytes, drop_dir, goal, turn_events  # noqa: E402


def session_bytes(root: Path, n_turns: int, compression: str) -> tuple[int, int]:
    """(segment bytes on disk, records) of one n-turn session recorded through the engine."""
    d = root / f"session-{compression}"
    drop_dir(d)

    async def go() -> None:
        lg = FileLog.open(d, compression=compression, fsync="never")
        eng = await SessionEngine.open(lg)
        h = await eng.open_session("s", group_id="g", group_size=1)
        await h.start()
        for kw in session_turns(n_turns):
            await h.record_turn(**kw)
        await h.finish(reward=1.0)
        await eng.close()
        lg.close()

    asyncio.run(go())
    seg_bytes = sum(p.stat().st_size for p in d.glob("*.seg"))
    return seg_bytes, sum(1 for _ in read_log(d))


def bench_tokens(root: Path, n: int, batch: int, reps: int) -> dict:
    events = turn_events(n)
    recs = [(f"s{i % 64}", i // 64, ev) for i, ev in enumerate(events)]
    batches = [recs[i : i + batch] for i in range(0, n, batch)]
    dirs = {c: root / f"tok-{c}" for c in ("zstd", "none")}

    def append(compression: str):
        def run() -> None:
            d = dirs[compression]
            drop_dir(d)
            lg = FileLog.open(d, fsync="batch", compression=compression)
            for b in batches:
                lg.append_batch(b)
            lg.close()
        return run

    t_append = {c: best(append(c), reps) for c in ("none", "zstd")}
    plain = dir_bytes(dirs["none"])
    per_batch = [plain * len(b) // n for b in batches]

    def raw_write() -> None:
        p = root / "raw.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        blob = os.urandom(max(per_batch))
        try:
            for nb in per_batch:
                view = memoryview(blob)[:nb]
                while view:
                    view = view[os.write(fd, view) :]
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.unlink(p)

    t_raw = best(raw_write, reps)

    def replay(compression: str):
        def run() -> None:
            for _ in read_log(dirs[compression]):
                pass
        return run

    t_replay = {"none": float("inf"), "zstd": float("inf")}
    for _ in range(max(reps, 2)):  # alternated, so both see the same machine
        for c in ("none", "zstd"):
            t_replay[c] = min(t_replay[c], best(replay(c), 1))
    kept = [[(r.lsn, r.session_id, r.session_seq, bytes(r.payload)) for r in read_log(dirs[c], raw=True)] for c in ("zstd", "none")]
    assert kept[0] == kept[1], "the compressed log holds other records than the uncompressed one"
    return dict(n=n, batch=batch, plain=plain, zstd=dir_bytes(dirs["zstd"]), t_append=t_append, t_raw=t_raw, t_replay=t_replay)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run (seconds)")
    ap.add_argument("--dir", help="where to write (default: a temp dir on the default disk)")
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    root = Path(tempfile.mkdtemp(prefix="bench_compression-", dir=args.dir))
    try:
        traj = trajectory_bytes(session_turns(100))
        (z_bytes, z_records), (p_bytes, p_records) = session_bytes(root, 100, "zstd"), session_bytes(root, 100, "none")
        assert z_records == p_records, (z_records, p_records)
        tok = bench_tokens(root, n=256, batch=32, reps=1) if args.quick else bench_tokens(root, n=2048, batch=64, reps=3)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"100-turn session: trajectory {traj:,} B; log on disk {p_bytes:,} B uncompressed ({p_bytes / traj:.2f}x), "
          f"{z_bytes:,} B zstd ({z_bytes / traj:.2f}x); {z_records} events kept")
    print(f"token events: {tok['n']} x 2048 tokens in batches of {tok['batch']}: {tok['plain']:,} B uncompressed, "
          f"{tok['zstd']:,} B zstd ({tok['zstd'] / tok['plain']:.2f}x)")
    ta, tr = tok["t_append"], tok["t_replay"]
    print(f"append s: none {ta['none']:.4f}, zstd {ta['zstd']:.4f}, raw write+fdatasync of the uncompressed bytes {tok['t_raw']:.4f}")
    print(f"replay s: none {tr['none']:.4f}, zstd {tr['zstd']:.4f}")
    print(goal("log_bytes_vs_final_trajectory_100_turns_compressed", z_bytes / traj, "<=", 0.6))
    print(goal("replay_compressed_vs_uncompressed", tr["none"] / tr["zstd"], ">=", 0.8))
    print(goal("durable_append_compressed_vs_raw_fdatasync_of_uncompressed_bytes", tok["t_raw"] / ta["zstd"], ">=", 1.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
