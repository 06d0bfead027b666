"""The capture benchmark's CPU arms at a tiny size (``tools/bench/capture_cpu.py``): each records
its turns through the engine and a FileLog, measures them, and counts the garbage collector's
share without leaving its callback behind."""

from __future__ import annotations

import argparse
import asyncio
import gc

from agentlog.tools.bench import capture_cpu


def test_the_capture_cpu_arms_record_their_turns_and_count_the_collector():
    args = argparse.Namespace(cpu_turns=2)
    (one,) = asyncio.run(capture_cpu.cpu_per_turn(args, [600]))
    assert one["tokens"] >= 600 and one["capture"] > 0 and one["hf_full"] > 0 and one["byte_inc"] > 0
    many = asyncio.run(capture_cpu.cpu_concurrent(args, 600, 4))
    assert many["tokens"] >= 600 and many["turns"] == 2 * 4 and many["capture"] > 0 and many["main"] > 0
    assert 0 <= many["gc"] <= many["gc_round"] + 1e-9
    assert len(many["collections"].split("/")) == 3
    assert not [cb for cb in gc.callbacks if isinstance(cb, capture_cpu._GcClock)], "the collector's clock was left registered"
