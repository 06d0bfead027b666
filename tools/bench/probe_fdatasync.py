"""Probe: what an fdatasync per batch costs on this disk, appending to a growing file against
overwriting space already allocated (``posix_fallocate``) or already written with zeros and
synced (what PostgreSQL does to its WAL segments before use).

The anchor of ``bench_log``'s durable-append goal appends to a growing file, so each fdatasync
also commits the file's new size; a log that wrote its segments' zeros ahead of time would sync
data only. This measures the difference on the disk at hand, for the log's design (information:
no GOAL line).

    .venv/bin/python tools/bench/probe_fdatasync.py [--dir DIR] [--batches N] [--batch-bytes B]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def write_synced(fd: int, chunks: list) -> float:
    """Seconds to write each chunk in turn to ``fd`` (completing short writes), each followed by
    fdatasync: the raw anchor of the log's durable-append goals."""
    t0 = time.perf_counter()
    for chunk in chunks:
        while chunk:
            chunk = chunk[os.write(fd, chunk):]
        os.fdatasync(fd)
    return time.perf_counter() - t0


def run(path: Path, blob: bytes, batches: int, prepare: str) -> float:
    """Seconds for ``batches`` writes of ``blob``, each followed by fdatasync, into ``path``
    prepared as ``prepare``: "grow" (empty), "fallocate" or "zeros" (written and synced)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        total = batches * len(blob)
        if prepare == "fallocate":
            os.posix_fallocate(fd, 0, total)
        elif prepare == "zeros":
            zeros = bytes(1 << 20)
            for _ in range(-(-total // len(zeros))):
                os.write(fd, zeros)
        os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_SET)
        return write_synced(fd, [memoryview(blob)] * batches)
    finally:
        os.close(fd)
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    """Print the best of three runs of each way, alternated."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir on the default disk)")
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--batch-bytes", type=int, default=1_587_267, help="default: one bench_log batch (64 x 2048-token turns)")
    args = p.parse_args(argv)
    blob = os.urandom(args.batch_bytes)
    best = {k: float("inf") for k in ("grow", "fallocate", "zeros")}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for _ in range(3):
            for k in best:
                best[k] = min(best[k], run(Path(d) / "probe.bin", blob, args.batches, k))
    mb = args.batches * args.batch_bytes / 1e6
    print(f"{args.batches} batches of {args.batch_bytes:,} B ({mb:.1f} MB), write + fdatasync each, best of 3:")
    for k, t in best.items():
        print(f"  {k:<10} {t * 1e3:8.1f} ms  {mb / t:7.0f} MB/s  {best['grow'] / t:5.2f}x growing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
