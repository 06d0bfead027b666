"""Helpers for the file-log tests: building logs and poking their bytes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from agentlog.events import FileLog, read_log
from agentlog.events.log.format import DURABLE_NAME, INDEX_NAME, list_segments, segment_name
from agentlog.events.schema.types import SessionOpened, SessionStarted
from event_samples import small_event


def seg_path(d: Path, k: int = -1) -> Path:
    """Path of the k-th segment of log directory ``d``."""
    return d / segment_name(list_segments(d)[k])


def write_small_log(d: Path, n: int, **open_kw) -> list:
    """n small records over n // 4 sessions, each a legal lifecycle (opened,
    started, commands) so ``agentlog verify`` finds them sound; returns their envelopes."""
    lg = FileLog.open(d, **open_kw)
    envs = []
    for i in range(n):
        sid = f"s{i // 4}"
        body = SessionOpened(group_id="g", group_size=1) if i % 4 == 0 else SessionStarted() if i % 4 == 1 else small_event(i)
        envs += lg.append_batch([(sid, i % 4, body)])
    lg.close()
    return envs


def frame_offsets(d: Path, k: int = -1) -> list[tuple[int, int]]:
    """(start, end) byte offsets of every frame in the k-th segment, via the raw reader."""
    from agentlog.events.log.format import SEG_HDR_SIZE
    from agentlog.events.log.scan import SegmentScanner

    p = seg_path(d, k)
    fd = os.open(p, os.O_RDONLY)
    try:
        sc = SegmentScanner(fd, p.name, SEG_HDR_SIZE, list_segments(d)[k], 1 << 20)
        return [(f.offset, f.end) for f in sc.frames()]
    finally:
        os.close(fd)


def copy_log(src: Path, dst: Path, *, tail: bytes | None = None, cut: int | None = None, skip=(INDEX_NAME,)) -> Path:
    """Copy a log directory; optionally cut the last segment at ``cut`` and append ``tail``."""
    dst.mkdir(parents=True)
    last = seg_path(src).name
    for name in os.listdir(src):
        if name in skip or name == "LOCK":
            continue
        data = (src / name).read_bytes()
        if name == last and cut is not None:
            data = data[:cut] + (tail or b"")
        (dst / name).write_bytes(data)
    return dst


def flip_bit(path: Path, bit: int) -> None:
    """Flip one bit of a file in place."""
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


def drop_watermark(d: Path) -> None:
    """Remove DURABLE and the INDEX checkpoint (which describes synced
    records too): only the frames themselves then say what is valid."""
    (d / DURABLE_NAME).unlink()
    (d / INDEX_NAME).unlink(missing_ok=True)


def records(d: Path) -> list:
    """Every valid record, ignoring the watermark."""
    return list(read_log(d, durable_only=False))


def rng(seed: int) -> random.Random:
    """A seeded Random whose repr shows the seed, for reproducible failures."""

    class _R(random.Random):
        def __repr__(self) -> str:
            return f"Random(seed={seed})"

    return _R(seed)


def with_pure_switch(code: str, value: str | None) -> subprocess.CompletedProcess:
    """Run ``python -c code`` with ``AGENTLOG_PURE_PYTHON`` set to ``value`` (None: unset), as
    the compiled accelerators' switch (agentlog._compiled) reads it at import."""
    from agentlog._compiled import ENV_VAR

    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if value is not None:
        env[ENV_VAR] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
