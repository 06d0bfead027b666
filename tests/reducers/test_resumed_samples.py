"""A resumed session is one session: its sample is built from all its durable turns, as if it never crashed.

The sessions are written by the real engine (tests/resume_log.py): killed after a random durable turn, at a
random point past it, adopted and resumed by a new engine, maybe more than once.
"""

from __future__ import annotations

import asyncio
import functools

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.reducers.pipeline import Reducer, reduce_log
from agentlog.reducers.runstats import RunStats
from resume_log import COMMANDED, IN_FLIGHT, RECORDED, SESSION, write_session

#: Sample fields that name where in the log the session lies (a resumed log holds more records), not what it trains.
_WHERE = ("lsn_first", "lsn_last")


def _trained(sample) -> dict:
    """What a sample trains: every field but its place in the log."""
    return {k: v for k, v in msgspec.structs.asdict(sample).items() if k not in _WHERE}


@functools.lru_cache(maxsize=None)
def _reference(turns: int) -> dict:
    """The sample of the same session recorded without a crash."""
    (sample,) = reduce_log(asyncio.run(write_session(None, turns))).samples
    return _trained(sample)


@st.composite
def crashed_sessions(draw):
    """(turns, crashes): 1..6 turns, one or two crashes after random durable turns, each at a random point past it."""
    turns = draw(st.integers(1, 6))
    durable = sorted(draw(st.lists(st.integers(0, turns), min_size=1, max_size=2)))
    return turns, [(n, draw(st.sampled_from((RECORDED, COMMANDED, IN_FLIGHT)))) for n in durable]


@settings(max_examples=25, deadline=None)
@given(crashed_sessions(), st.data())
def test_a_resumed_session_reduces_to_the_uninterrupted_sessions_sample(session, data):
    turns, crashes = session
    log = asyncio.run(write_session(None, turns, crashes))
    envs = list(log.read(0))
    whole = reduce_log(envs)
    (sample,) = whole.samples
    assert sample.session_id == SESSION and sample.turns == turns
    got, want = _trained(sample), _reference(turns)
    for name in ("tokens", "loss_mask", "rollout_log_probs"):
        assert got[name] == want[name], f"{name} differs across the resume point(s) {crashes}"
    assert got == want
    # Fed in any split, the reducer gives the same samples and digest as the whole log at once.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(envs)), max_size=4)))
    reducer = Reducer()
    pieces = []
    for lo, hi in zip([0, *cuts], [*cuts, len(envs)]):
        pieces += reducer.feed_many(envs[lo:hi]).samples
    assert [_trained(s) for s in pieces] == [got] and reducer.digest.hexdigest() == whole.digest
    # The statistics count it once, with its resumes beside it.
    stats = RunStats()
    for env in envs:
        stats.feed(env)
    snap = stats.snapshot()
    assert (snap["sessions"]["total"], snap["sessions"]["finished"], snap["turns"]["total"]) == (1, 1, turns)
    assert (snap["sessions"]["resumed"], snap["sessions"]["resumes"]) == (1, len(crashes))
