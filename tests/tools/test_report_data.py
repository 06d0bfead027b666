"""The report's bounded aggregates: histogram quantiles, the doubling time
series and the bounded sessions table, against exact answers."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from agentlog.tools.report.aggregates import TIME_BINS, LogHistogram, TimeSeries
from agentlog.tools.report.session_table import MAX_REASONS, SessionRow, SessionTable

positive = st.floats(min_value=1e-6, max_value=1e7, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(positive, min_size=1, max_size=300), st.sampled_from([0.0, 0.1, 0.5, 0.9, 0.99, 1.0]))
def test_histogram_quantile_is_within_one_bucket_of_the_exact_one(values, q):
    h = LogHistogram(1e-4, 1e4)
    for v in values:
        h.add(v)
    assert sum(h.counts) == h.n == len(values)
    assert math.isclose(h.mean(), sum(values) / len(values), rel_tol=1e-9)
    exact = sorted(values)[int(q * (len(values) - 1))]
    got = h.quantile(q)
    assert min(values) <= got <= max(values)
    if 1e-4 <= exact < 1e4:  # inside the buckets: within one bucket's ratio
        step = 10 ** (1 / h.per_decade)
        assert exact / step <= got <= exact * step, (exact, got)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**15), min_size=1, max_size=400))
def test_time_series_keeps_every_session_in_its_bin_within_a_fixed_number_of_bins(offsets):
    ts = TimeSeries(0, bins=TIME_BINS, width_ns=1_000_000)
    for t in sorted(offsets):  # sessions end in log order
        ts.at(t).add("finished", 1.0, 1, 2, 3)
    assert len(ts.bins) == TIME_BINS
    assert sum(b.sessions for b in ts.bins) == len(offsets)
    assert sum(b.tokens_out for b in ts.bins) == 3 * len(offsets)
    # Every time still maps to the bin that counted it: bin i covers [i*width, (i+1)*width).
    for t in offsets:
        assert t // ts.width < TIME_BINS
    counted = [0] * TIME_BINS
    for t in offsets:
        counted[t // ts.width] += 1
    assert counted == [b.sessions for b in ts.bins]


ending = st.tuples(
    st.sampled_from(["finished", "finished", "aborted", "dropped"]),
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    st.sampled_from(["timeout", "crash", "oom"]),
)


def _fill(endings, seed=0, worst=3, per_reason=2, sample=4) -> SessionTable:
    table = SessionTable(worst=worst, per_reason=per_reason, sample=sample, seed=seed)
    for i, (status, reward, reason) in enumerate(endings):
        r = reward if status == "finished" else None
        table.wants(status, r, reason)
        table.add(SessionRow(f"s{i}", "g", 0, status, "", reason if status != "finished" else "", opened_ns=i, reward=r), r)
    return table


@settings(max_examples=300, deadline=None)
@given(st.lists(ending, max_size=80), st.integers(0, 5))
def test_table_keeps_the_worst_the_first_aborted_of_each_reason_and_a_bounded_sample(endings, seed):
    rows = _fill(endings, seed).rows()
    worst = [r for r in rows if r.why == "worst"]
    finished = [(reward, i) for i, (s, reward, _) in enumerate(endings) if s == "finished"]
    assert [r.session_id for r in worst] == [f"s{i}" for _, i in sorted(finished)[:3]]
    aborted = [r for r in rows if r.why == "aborted"]
    want = []
    for reason in sorted({why for s, _, why in endings if s == "aborted"}):
        want += [f"s{i}" for i, (s, _, why) in enumerate(endings) if s == "aborted" and why == reason][:2]
    assert [r.session_id for r in aborted] == want
    sample = [r for r in rows if r.why == "sample"]
    assert len(sample) == min(4, len(endings) - len(worst) - len(aborted))
    assert len({r.session_id for r in rows}) == len(rows)  # no session twice
    # The same seed gives the same table.
    assert [r.session_id for r in _fill(endings, seed).rows()] == [r.session_id for r in rows]


def test_table_counts_at_most_max_reasons_abort_reasons():
    endings = [("aborted", 0.0, f"r{i}") for i in range(MAX_REASONS + 10)]
    rows = _fill(endings, sample=0).rows()
    assert len([r for r in rows if r.why == "aborted"]) == MAX_REASONS


def _held_by_the_report(log) -> tuple[int, object]:
    """Bytes that the report's own code (tools/report/: the pass, its aggregates, its table) allocated and
    still holds when the pass reaches the end of ``log``, with the data it
    returns. What the log reader and the reducers allocate is left out: each
    bounds its own (the reader's id cache, the folds' windows of recently
    ended ids)."""
    import tracemalloc

    from agentlog.events import read_log
    from agentlog.tools.report.data import collect

    held: list[int] = []

    def envelopes():
        yield from read_log(log, 0)
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/tools/report/*.py")])
        held.append(sum(st.size for st in snap.statistics("filename")))

    tracemalloc.start(1)  # the innermost frame: what the report's own lines allocate
    try:
        data = collect(envelopes(), str(log))
    finally:
        tracemalloc.stop()
    return held[0], data


def test_collect_memory_does_not_grow_with_the_number_of_sessions(tmp_path):
    """Bounded memory: four times the sessions, about the same memory held by
    the report's fold (the sessions in flight, the table and the aggregates;
    no per-session list)."""
    from cli_helpers import write_many_sessions

    small, big = tmp_path / "small.log", tmp_path / "big.log"
    write_many_sessions(small, 400, seed=1)
    write_many_sessions(big, 1600, seed=1)
    held_small, data_small = _held_by_the_report(small)
    held_big, data_big = _held_by_the_report(big)
    assert data_big.sessions == 1600 and data_small.sessions == 400
    assert len(data_big.table) == len(data_small.table)
    assert held_big < 1.2 * held_small, (held_small, held_big)
