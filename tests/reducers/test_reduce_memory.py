"""Incremental reduction keeps bounded memory: sessions are evicted when they
end and groups once released."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Iterator

import pytest

from agentlog.events.schema.types import Envelope, SessionAborted, SessionFinished, SessionOpened, SessionStarted, TurnRecorded
from agentlog.reducers.config import ReduceConfig
from agentlog.reducers.pipeline import Reducer

GROUP = 4
# Bodies are immutable and the reducer never keeps one past its session's
# end, so the generator reuses them and allocates only envelopes.
_START = SessionStarted()
_TURN = TurnRecorded(
    turn_index=0,
    messages=[{"role": "user", "content": "task"}],
    prompt_ids=list(range(16)),
    output_ids=list(range(100, 108)),
    output_log_probs=[-0.5] * 8,
    response_message={"role": "assistant", "content": "a"},
)
_FINISH = SessionFinished(reward=1.0)
_ABORT = SessionAborted(reason="timeout")


def sequential_sessions(n: int) -> Iterator[Envelope]:
    """n sessions one after another in groups of GROUP, generated lazily;
    every fourth session aborts."""
    lsn = 0
    opened = [SessionOpened(group_id="g", group_size=GROUP, sample_index=i) for i in range(GROUP)]
    for k in range(n):
        sid = f"s{k}"
        opened_body = opened[k % GROUP]
        if k % GROUP == 0:
            group = f"g{k // GROUP}"
            opened = [SessionOpened(group_id=group, group_size=GROUP, sample_index=i) for i in range(GROUP)]
            opened_body = opened[0]
        end = _ABORT if k % GROUP == 3 else _FINISH
        for seq, body in enumerate((opened_body, _START, _TURN, end)):
            yield Envelope(lsn=lsn, session_id=sid, session_seq=seq, ts_ns=0, body=body)
            lsn += 1


def peak_bytes(n: int) -> tuple[int, int, int]:
    """Peak traced memory while reducing n sessions (outputs discarded).

    The cyclic collector is off meanwhile: an evicted session must be freed
    by reference counting alone. Garbage in cycles would otherwise wait for
    a collection whose timing depends on what ran before in the process, and
    the peak would measure that timing, not the reducer."""
    gc.collect()
    reducer = Reducer(ReduceConfig())
    gc.disable()
    tracemalloc.start()
    try:
        samples = groups = 0
        for env in sequential_sessions(n):
            out = reducer.feed(env)
            samples += len(out.samples)
            groups += len(out.groups)
        _, peak = tracemalloc.get_traced_memory()
        print(f"{n} sessions: peak {peak} B")
    finally:
        tracemalloc.stop()
        gc.enable()
    assert reducer.open_sessions() == {} and reducer.pending_groups() == {}
    return peak, samples, groups


def _check_ratio(small_n: int, large_n: int) -> None:
    small, small_samples, small_groups = peak_bytes(small_n)
    large, large_samples, large_groups = peak_bytes(large_n)
    assert (small_samples, small_groups) == (small_n, small_n // GROUP)
    assert (large_samples, large_groups) == (large_n, large_n // GROUP)
    assert large <= 2 * small, f"peak {large} B for {large_n} sessions vs {small} B for {small_n}"


def test_reducing_10x_more_sessions_keeps_peak_memory_within_2x():
    """CI-sized: 20,000 sequential sessions against 2,000 (tracemalloc is slow)."""
    _check_ratio(2_000, 20_000)


def test_an_ended_session_leaves_no_reference_cycle_behind():
    """A session's message tree points only down, so eviction frees it at
    once: reducing sessions with the collector off leaves nothing for it."""
    gc.collect()
    reducer = Reducer(ReduceConfig())
    gc.disable()
    try:
        for env in sequential_sessions(200):
            reducer.feed(env)
        del env
        reducer.feed(Envelope(lsn=800, session_id="last", session_seq=0, ts_ns=0, body=SessionOpened(group_id="h", group_size=1)))
        collected = gc.collect()
    finally:
        gc.enable()
    assert collected == 0, f"{collected} objects of 200 ended sessions were freed only by the cyclic collector"


@pytest.mark.slow
def test_reducing_100k_sessions_keeps_peak_memory_within_2x_of_10k():
    _check_ratio(10_000, 100_000)
