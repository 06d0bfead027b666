"""The report page: plotly figures (plotly.js inlined once) and plain HTML.

Sections: outcome counts, outcomes with reward and solve rate over time
and per policy version, turns and tokens per session, the learner's curves
(for a run folder), latency and size distributions (histograms and
quantiles), abort and drop reasons, staleness, the health flags, and the
bounded sessions table (each row with its flags) whose drill-down highlights
response tokens by loss mask, a session with subagents' rows in one column per
lineage with its lineage tree (:mod:`tools.lineage_view`). Every chart
draws fixed-size aggregates, so the page's size does not grow with the
number of sessions. The page loads nothing from the network.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from typing import Any

from .data import ReportData
from .session_table import DrillSample, SessionRow

OUTCOMES = ("finished", "aborted", "dropped", "running", "open")
COLOURS = {
    "finished": "#2e9d4f",
    "aborted": "#d62728",
    "dropped": "#8c8c8c",
    "running": "#1f77b4",
    "open": "#9ecae1",
}
#: Height of one chart: the page never grows with the data.
FIGURE_HEIGHT = 340
#: Policy versions drawn as bars; beyond it, versions are summed in ranges.
MAX_VERSION_BARS = 200
#: Learner steps drawn per curve; beyond it, every k-th step.
MAX_LEARNER_POINTS = 2000

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table.outcomes td, table.outcomes th { padding: 0.2em 0.8em; text-align: right; border-bottom: 1px solid #ddd; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; border-radius: 2px; vertical-align: middle; }
.meta { color: #555; font-size: 0.9em; }
pre.why { font-size: 0.85em; white-space: pre-wrap; background: #f6f6f6; padding: 4px 6px; }
.warn { background: #fff3cd; padding: 0.5em; border: 1px solid #e0c36a; }
details.session { border: 1px solid #ddd; border-left-width: 6px; margin: 0.3em 0; padding: 0.3em 0.6em; }
details.session summary { cursor: pointer; }
.tokens { font-family: ui-monospace, monospace; font-size: 0.85em; line-height: 1.7; word-break: break-all; }
.t { padding: 0 2px; margin: 0 1px; border-radius: 2px; }
.t.p { color: #777; }
.t.m0 { background: #eee; color: #444; }
.t.m1 { background: #b9f0c6; color: #0b4a1c; font-weight: 600; }
table.lineages td, table.lineages th { padding: 0.1em 0.6em; text-align: left; border-bottom: 1px solid #eee; font-size: 0.9em; }
.lineage-cols { display: grid; gap: 0.8em; overflow-x: auto; }
.lineage-col { min-width: 0; border: 1px solid #ddd; padding: 0.2em 0.5em; }
"""


def _iso(ns: int) -> str:
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _figure_html(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(
        fig, full_html=False, include_plotlyjs=False, div_id=div_id,
        config={"displaylogo": False, "responsive": True},
    )


def _layout(fig: Any, height: int = FIGURE_HEIGHT, **kw: Any) -> Any:
    fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": 30, "b": 50},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"}, **kw)
    return fig


def _empty(fig: Any, text: str) -> Any:
    """A figure with nothing to plot says so (an empty plot is a blank area)."""
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 14, "color": "#777"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _outcomes_and_rates(fig: Any, bar_x: list, line_x: list, totals: list[Any], bar: dict[str, Any]) -> None:
    """Stacked bars of ended sessions by outcome at ``bar_x``; reward mean and
    solve rate of the finished ones as lines at ``line_x`` on a second axis."""
    import plotly.graph_objects as go

    for outcome in ("finished", "aborted", "dropped"):
        ys = [getattr(t, outcome) for t in totals]
        if any(ys):
            fig.add_trace(go.Bar(name=outcome, x=bar_x, y=ys, marker_color=COLOURS[outcome], **bar))
    for name, attr, colour in (("reward mean", "reward_mean", "#ff7f0e"), ("solve rate", "solve_rate", "#9467bd")):
        ys = [_finite(getattr(t, attr)) for t in totals]
        if any(y is not None for y in ys):
            fig.add_trace(go.Scatter(name=name, x=line_x, y=ys, yaxis="y2", mode="lines+markers",
                                     line={"color": colour}, connectgaps=True))


_RATE_AXIS = {"overlaying": "y", "side": "right", "title": "reward / solve rate"}


def outcomes_over_time_figure(data: ReportData) -> Any:
    """Sessions ended per time bin, stacked by outcome; reward mean and solve rate on a second axis."""
    import plotly.graph_objects as go

    fig = go.Figure()
    if not data.over_time:
        return _layout(_empty(fig, "no session has ended yet"))
    xs = [t for t, _ in data.over_time]
    _outcomes_and_rates(fig, xs, [x + data.time_bin_s / 2 for x in xs], [b for _, b in data.over_time],
                        {"offset": 0, "width": data.time_bin_s})
    return _layout(fig, barmode="stack", xaxis_title=f"seconds since the first event (bins of {data.time_bin_s:g} s)",
                   yaxis_title="sessions ended", yaxis2=_RATE_AXIS)


def by_version_figure(data: ReportData) -> Any:
    """Per policy version (the oldest that generated each session): outcomes stacked, reward and solve rate."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = _bucketed_versions(data.by_version)
    if not rows:
        return _layout(_empty(fig, "no session has ended yet"))
    xs = [label for label, _ in rows]
    _outcomes_and_rates(fig, xs, xs, [t for _, t in rows], {})
    return _layout(fig, barmode="stack", xaxis={"type": "category", "title": "policy version"}, yaxis_title="sessions",
                   yaxis2=_RATE_AXIS)


def per_session_figure(data: ReportData) -> Any:
    """Turns and tokens per session by policy version (means)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = _bucketed_versions(data.by_version)
    if not rows:
        return _layout(_empty(fig, "no session has ended yet"))
    xs = [label for label, _ in rows]
    fig.add_trace(go.Scatter(name="turns / session", x=xs, y=[t.turns / t.sessions for _, t in rows], mode="lines+markers"))
    fig.add_trace(go.Scatter(name="output tokens / session", x=xs, y=[t.tokens_out / t.sessions for _, t in rows],
                             mode="lines+markers", yaxis="y2"))
    fig.add_trace(go.Scatter(name="prompt tokens / session", x=xs, y=[t.tokens_in / t.sessions for _, t in rows],
                             mode="lines+markers", yaxis="y2"))
    return _layout(fig, xaxis={"type": "category", "title": "policy version"}, yaxis_title="turns",
                   yaxis2={"overlaying": "y", "side": "right", "title": "tokens", "type": "log"})


def _bucketed_versions(rows: list[tuple[int, Any]]) -> list[tuple[str, Any]]:
    """Versions as category labels; more than MAX_VERSION_BARS are summed in equal ranges."""
    from .aggregates import Totals

    if len(rows) <= MAX_VERSION_BARS:
        return [(str(v), t) for v, t in rows]
    per = math.ceil(len(rows) / MAX_VERSION_BARS)
    out = []
    for k in range(0, len(rows), per):
        chunk = rows[k : k + per]
        total = Totals()
        for _, t in chunk:
            total.merge(t)
        out.append((f"{chunk[0][0]}-{chunk[-1][0]}", total))
    return out


def _histogram_trace(h: Any, name: str, colour: str, unit: str = "") -> Any:
    """A log-bucketed histogram as a stepped line over the bucket midpoints
    (bars of log-spaced widths draw badly on a log axis)."""
    import plotly.graph_objects as go

    b = h.buckets()
    return go.Scatter(
        name=name, x=[math.sqrt(lo * hi) if lo > 0 else hi / 2 for lo, hi, _ in b], y=[c for _, _, c in b],
        mode="lines+markers", line={"shape": "hvh", "color": colour}, fill="tozeroy",
        customdata=[[lo, hi] for lo, hi, _ in b], hovertemplate=f"%{{customdata[0]:.4g}}-%{{customdata[1]:.4g}}{unit}: %{{y}}<extra></extra>",
    )


def latency_figure(data: ReportData) -> Any:
    """Histograms (log-spaced buckets) of generation and command latency and session duration."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for key, name, colour in (("generate_s", "generation", "#1f77b4"), ("command_s", "command", "#ff7f0e"),
                              ("session_s", "session", "#2ca02c")):
        h = data.histograms[key]
        if h.n:
            label = f"{name} (n {h.n}, p50 {_fmt(h.quantile(0.5))} s, p99 {_fmt(h.quantile(0.99))} s)"
            fig.add_trace(_histogram_trace(h, label, colour, " s"))
    if not fig.data:
        return _layout(_empty(fig, "no turn, command or ended session recorded"))
    return _layout(fig, xaxis={"type": "log", "title": "seconds"}, yaxis_title="count")


def sizes_figure(data: ReportData) -> Any:
    """Histograms of turns and tokens per ended session."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("turns / session", "output tokens / session", "prompt tokens / session"))
    for col, key in enumerate(("turns", "tokens_out", "tokens_in"), start=1):
        trace = _histogram_trace(data.histograms[key], key, "#1f77b4")
        trace.showlegend = False
        fig.add_trace(trace, row=1, col=col)
        fig.update_xaxes(type="log", row=1, col=col)
    return _layout(fig)


def reasons_figure(data: ReportData) -> Any:
    """Abort and drop reasons, counted (the most common first)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for outcome, counts in (("aborted", data.abort_reasons), ("dropped", data.drop_reasons)):
        if counts:
            items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
            # Escaped: plotly reads a category label as its own markup (<a href>, <span style>, <br>), and a
            # reason is recorded text; it decodes the entities back, so the reason shows as written.
            fig.add_trace(go.Bar(name=outcome, x=[html.escape(k, quote=False) for k, _ in items], y=[v for _, v in items],
                                 marker_color=COLOURS[outcome]))
    if not fig.data:
        return _layout(_empty(fig, "no session aborted or dropped"))
    return _layout(fig, yaxis_title="sessions", barmode="group")


def token_versions_figure(data: ReportData) -> Any:
    """Trained tokens by the policy version that generated each (a partial rollout's turn counts under each of its versions)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    if not data.trained_tokens_by_version:
        return _layout(_empty(fig, "no trained token yet"))
    tv = data.trained_tokens_by_version
    fig.add_trace(go.Bar(x=list(tv), y=list(tv.values()), marker_color="#17becf", name="trained tokens"))
    return _layout(fig, xaxis={"title": "policy version", "dtick": 1}, yaxis_title="trained tokens")


def staleness_figure(data: ReportData) -> Any:
    """Sessions by staleness when they ended: the newest version the log had shown minus the session's oldest."""
    import plotly.graph_objects as go

    fig = go.Figure()
    if not data.staleness:
        return _layout(_empty(fig, "no session has ended yet"))
    fig.add_trace(go.Bar(x=list(data.staleness), y=list(data.staleness.values()), marker_color="#8c564b", name="sessions"))
    return _layout(fig, xaxis={"title": "versions behind at the session's end", "dtick": 1}, yaxis_title="sessions")


#: Learner curves: (title, metric keys tried in order; the first present is drawn).
LEARNER_CURVES = (
    ("reward mean", ("rollout/reward_mean",)),
    ("solve rate", ("rollout/solve_rate",)),
    ("policy loss", ("loss/policy",)),
    ("KL", ("loss/kl", "stats/approx_kl")),
    ("entropy", ("stats/entropy", "loss/entropy")),
    ("gradient norm", ("stats/grad_norm",)),
    ("clip fraction", ("stats/clip_frac",)),
    # Learner vs rollout log-probs at the learner's version; a learner log from before it has the all-token mean.
    ("train-rollout |Δ log-prob|", ("stats/train_rollout_logprob_abs_diff", "stats/rollout_logprob_abs_diff")),
    ("train-rollout |Δ log-prob| max", ("stats/train_rollout_logprob_abs_diff_max",)),
)


def learner_figure(data: ReportData) -> Any | None:
    """The learner's curves per policy version (PolicyUpdated.metrics), one small panel each; None without a learner log."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = data.learner
    if not rows:
        return None
    if len(rows) > MAX_LEARNER_POINTS:  # every k-th step, the last one kept
        k = math.ceil(len(rows) / MAX_LEARNER_POINTS)
        rows = rows[::k] + ([rows[-1]] if (len(rows) - 1) % k else [])
    curves = []
    for title, keys in LEARNER_CURVES:
        key = next((k for k in keys if any(k in m for _, _, m in rows)), None)
        if key is not None:
            curves.append((title, key))
    if not curves:
        return None
    cols = 4
    nrows = math.ceil(len(curves) / cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=[f"{t} ({k})" for t, k in curves])
    for i, (title, key) in enumerate(curves):
        pts = [(v, _finite(m.get(key, math.nan))) for v, _, m in rows]
        fig.add_trace(go.Scatter(x=[v for v, _ in pts], y=[y for _, y in pts], name=title, mode="lines+markers",
                                 showlegend=False, connectgaps=True), row=i // cols + 1, col=i % cols + 1)
    fig.update_xaxes(title_text="policy version")
    return _layout(fig, height=260 * nrows + 40)


def _finite(x: float) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _fmt(x: float) -> str:
    return "-" if x != x else f"{x:.3g}"


def _lp_title(d: DrillSample, i: int) -> str:
    """The hover text of response token ``i``: its rollout log-prob and, when a teacher scored it, the teacher's."""
    if i >= len(d.rollout_lp) or not d.mask[i]:
        return ""
    teacher = d.teacher_lp[i] if i < len(d.teacher_lp) else None
    extra = f" / teacher {teacher:.3f}" if teacher is not None else ""
    return f' title="rollout {d.rollout_lp[i]:.3f}{extra}"'


def _tokens_html(d: DrillSample) -> str:
    parts = [" ".join(f'<span class="t p">{t}</span>' for t in d.prompt_head)]
    if d.prompt_tail:
        hidden = d.prompt_length - len(d.prompt_head) - len(d.prompt_tail)
        parts.append(f'<span class="meta"> … {hidden} prompt tokens … </span>')
        parts.append(" ".join(f'<span class="t p">{t}</span>' for t in d.prompt_tail))
    parts.append('<span class="meta"> ▸ </span>')
    parts.append(" ".join(f'<span class="t m{m}"{_lp_title(d, i)}>{t}</span>' for i, (t, m) in enumerate(zip(d.response, d.mask))))
    if d.response_length > len(d.response):
        parts.append(f'<span class="meta"> … {d.response_length - len(d.response)} more response tokens</span>')
    return "".join(parts)


WHY = {"worst": "lowest reward", "aborted": "aborted, by reason", "sample": "random sample"}


def _session_html(s: SessionRow, data: ReportData) -> str:
    e = html.escape
    dur = ((s.ended_ns if s.ended_ns is not None else data.last_ns) - s.opened_ns) / 1e9
    reward = "" if s.status != "finished" else f", reward {e(str(s.reward))}"
    reason = f" ({e(s.reason)})" if s.reason else ""
    head = (
        f'<details class="session" data-session="{e(s.session_id)}" data-status="{s.status}" data-why="{s.why}" '
        f'style="border-left-color:{COLOURS.get(s.status, "#999")}">'
        f"<summary><b>{e(s.session_id)}</b>" + (f" · {e(s.partition)}" if s.partition else "") + f" · group {e(s.group_id)} [{s.sample_index}] · "
        f'<span class="status">{s.status}</span>{reason}{reward} · {s.turns} turns · '
        f"{s.tokens_in} in / {s.tokens_out} out tokens · version {s.policy_version} · {dur:.3f} s"
        + (f' · <span class="resumed" data-resumes="{s.resumes}">resumed {s.resumes}x</span>' if s.resumes else "") +
        f' · <span class="flags" data-flags="{e(" ".join(s.flags))}">flags {e(", ".join(s.flags) or "none")}</span>'
        f' · <span class="meta">{WHY.get(s.why, s.why)}</span></summary>'
    )
    body = []
    if s.error:
        body.append(f'<p class="meta">error: {e(s.error[:2000])}</p>')
    if s.explain:  # label, reward and its source, verifier detail, test output, traceback: as `agentlog show`
        body.append('<pre class="why">' + e("\n".join(s.explain)) + "</pre>")
    if not s.samples:
        body.append('<p class="meta">no samples' + (" (dropped sessions yield none)" if s.status == "dropped" else "") + "</p>")
    if s.lineages:
        body.append(_lineages_html(s))
    else:
        body.extend(_sample_html(smp) for smp in s.samples)
    return head + "".join(body) + "</details>"


def _sample_html(smp: DrillSample) -> str:
    """One row of the drill-down: its outcome line and its tokens by loss mask."""
    flag = " · remove_sample" if smp.remove_sample else ""
    return (
        f'<p class="meta">row {smp.row_index} · {smp.status}{flag} · reward {smp.reward:g} · '
        f"{smp.response_length} response tokens, {smp.trained} trained</p>"
        f'<div class="tokens" data-row="{smp.row_index}">{_tokens_html(smp)}</div>'
    )


def _lineages_html(s: SessionRow) -> str:
    """A session with subagents: its lineage tree as a table (each lineage under its parent, the
    spawning call), then one column per lineage with its rows, side by side."""
    e = html.escape
    table = ['<table class="lineages"><tr><th>lineage</th><th>turns</th><th>rows</th><th>spawned by</th></tr>']
    cols = []
    for ln in s.lineages:
        rows = [smp for smp in s.samples if smp.lineage == ln["id"]]
        pad = "&nbsp;&nbsp;" * ln["depth"] + ("↳ " if ln["depth"] else "")
        table.append(f'<tr data-lineage="{e(ln["id"])}"><td>{pad}<b>{e(ln["id"])}</b></td><td>{len(ln["turns"])}</td>'
                     f'<td>{e(", ".join(map(str, ln["rows"])) or "none")}</td><td>{e(ln["spawned_by"] or "(root)")}</td></tr>')
        cols.append(f'<div class="lineage-col" data-lineage="{e(ln["id"])}"><p><b>{e(ln["id"])}</b>'
                    + (f' <span class="meta">&larr; {e(ln["parent"])} turn {ln["parent_turn"]}</span>' if ln["parent"] else "")
                    + "</p>" + ("".join(_sample_html(smp) for smp in rows) or '<p class="meta">no row</p>') + "</div>")
    rest = [smp for smp in s.samples if not any(smp.lineage == ln["id"] for ln in s.lineages)]
    return ("".join(table) + "</table>"
            + f'<div class="lineage-cols" style="grid-template-columns: repeat({len(cols)}, minmax(16em, 1fr))">' + "".join(cols) + "</div>"
            + "".join(_sample_html(smp) for smp in rest))


def _partitions_html(data: ReportData) -> str:
    """A partitioned log's per-partition table (events, sessions, outcomes,
    sample digest); "" for one log."""
    if not data.partitions:
        return ""
    e = html.escape
    head = "<tr><th>partition</th><th>events</th><th>sessions</th>" + "".join(f"<th>{o}</th>" for o in OUTCOMES) + "<th>samples digest</th></tr>"
    rows = "".join(
        f"<tr data-partition='{e(name)}' data-events='{p['events']}' data-sessions='{p['sessions']}' "
        + " ".join(f"data-{o}='{p[o]}'" for o in OUTCOMES)
        + f"><th>{e(name)}</th><td>{p['events']}</td><td>{p['sessions']}</td>"
        + "".join(f"<td>{p[o]}</td>" for o in OUTCOMES)
        + f"<td><code>{e(p['digest'] or '-')}</code></td></tr>"
        for name, p in data.partitions.items()
    )
    return (f"<h2>Partitions</h2><p class='meta'>{len(data.partitions)} partitions, read merged by time; everything above and "
            "below is over all of them. A partition's digest is the one <code>agentlog reconstruct</code> gives for it alone.</p>"
            f"<table class='outcomes' id='partitions'>{head}{rows}</table>")


def _flags_html(data: ReportData) -> str:
    """Ended sessions per health flag (:mod:`reducers.health`), the ones the run makes untrainable marked."""
    e = html.escape
    rows = "".join(
        f"<tr data-flag='{e(name)}' data-count='{n}'><th>{e(name)}"
        + (" (untrainable)" if name in data.untrainable_flags else "") + f"</th><td>{n}</td></tr>"
        for name, n in data.flags.items()
    )
    return ("<h2>Health flags</h2><p class='meta'>Ended sessions carrying each flag (a session may carry several; "
            "<code>agentlog replay LOG --flag NAME</code> lists them).</p>"
            f"<table class='outcomes' id='flags'>{rows}</table>")


def _stat_table(data: ReportData) -> str:
    """Quantiles of every distribution, as a table."""
    names = {"generate_s": "generation latency (s)", "command_s": "command latency (s)", "session_s": "session duration (s)",
             "turns": "turns / session", "tokens_out": "output tokens / session", "tokens_in": "prompt tokens / session"}
    rows = []
    for key, name in names.items():
        h = data.histograms[key]
        cells = [str(h.n), _fmt(h.mean())] + [_fmt(h.quantile(q)) for q in (0.5, 0.9, 0.99)] + [_fmt(h.max if h.n else math.nan)]
        rows.append(f"<tr data-stat='{key}'><th>{name}</th>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<table class='outcomes' id='distributions'><tr><th></th><th>n</th><th>mean</th><th>p50</th><th>p90</th><th>p99</th>"
            "<th>max</th></tr>" + "".join(rows) + "</table>")


#: Shown in the page if a chart fails to draw: a console error must not pass unseen.
_ERROR_SINK = """<div id='page-errors' class='warn' style='display:none'></div><script>
window.addEventListener('error', function (e) {
  var d = document.getElementById('page-errors'); d.style.display = 'block';
  d.textContent += 'page error: ' + e.message + '\\n';
});
</script>"""


def render(data: ReportData) -> str:
    """The whole page as one HTML string; its size does not grow with the number of sessions."""
    from plotly.offline import get_plotlyjs

    e = html.escape
    counts = data.outcomes
    rows = "".join(
        f'<tr data-status="{o}" data-count="{counts.get(o, 0)}"><th><span class="swatch" style="background:{COLOURS[o]}"></span> {o}</th>'
        f"<td>{counts.get(o, 0)}</td></tr>"
        for o in OUTCOMES
    )
    notes = []
    if data.violation_count:
        notes.append(f"{data.violation_count} lifecycle violation(s): " + "; ".join(data.violations[:5]))
    if data.reduce_problem:
        notes.append(f"The sample reducer stopped: {data.reduce_problem}")
    warn = "".join(f'<p class="warn">{e(n)}</p>' for n in notes)
    sessions_html = "".join(_session_html(s, data) for s in data.table)
    span = (data.last_ns - data.first_ns) / 1e9 if data.events else 0.0
    r = data.reward
    g = data.groups
    lim = data.table_limits
    learner = learner_figure(data)
    learner_html = (
        f"<h2>Learner</h2><p class='meta'>From the learner log <code>{e(data.learner_log)}</code>: "
        f"{len(data.learner)} policy updates.</p>" + _figure_html(learner, "learner")
        if learner is not None else ""
    )
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>agentlog report: {e(data.log)}</title><style>{_CSS}</style>",
        _ERROR_SINK,
        # plotly.js inlined: the page opens with no network access.
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
        f"<h1>agentlog report</h1><p class='meta'>log <code>{e(data.log)}</code> · {data.events} events · "
        + (f"{_iso(data.first_ns)} → {_iso(data.last_ns)} ({span:.1f} s)" if data.events else "empty")
        + (f" · samples digest <code>{e(data.sample_digest)}</code>" if data.sample_digest else "")
        + "</p>",
        warn,
        "<h2>Outcomes</h2>",
        f"<table class='outcomes' id='outcomes'><tr><th>sessions</th><td id='sessions-total'>{data.sessions}</td></tr>{rows}</table>",
        f"<p class='meta'>groups released {g['released']} (skipped {g['skipped']}) · pending {g['pending']} · "
        + (f"<span id='refills'>members refilled {g.get('refilled', 0)} · aborts counted as failures {g.get('failures', 0)}</span> · "
           if g.get("refilled") or g.get("failures") else "")
        + (f"<span id='resumed'>sessions resumed {data.resumed['sessions']} ({data.resumed['resumes']} resumes)</span> · "
           if data.resumed.get("resumes") else "")
        + f"reward mean {_fmt(r['mean'])} (min {_fmt(r['min'])}, max {_fmt(r['max'])}) over {r['count']} finished sessions</p>",
        _partitions_html(data),
        _flags_html(data),
        "<h2>Over time</h2><p class='meta'>Sessions by the time they ended, stacked by outcome; "
        "reward mean and solve rate of the finished ones.</p>",
        _figure_html(outcomes_over_time_figure(data), "over-time"),
        "<h2>By policy version</h2><p class='meta'>Sessions by the oldest policy version that generated them.</p>",
        _figure_html(by_version_figure(data), "by-version"),
        "<p class='meta'>Trained tokens by the policy version that generated each token.</p>",
        _figure_html(token_versions_figure(data), "token-versions"),
        _figure_html(per_session_figure(data), "per-session"),
        learner_html,
        "<h2>Latency</h2>",
        _figure_html(latency_figure(data), "latency"),
        "<h2>Distributions</h2>",
        _stat_table(data),
        _figure_html(sizes_figure(data), "sizes"),
        "<h2>Abort and drop reasons</h2>",
        _figure_html(reasons_figure(data), "reasons"),
        "<h2>Staleness</h2>",
        _figure_html(staleness_figure(data), "staleness"),
        f"<h2>Sessions</h2><p class='meta'>{len(data.table)} of {data.sessions} sessions: the {lim['worst']} with the lowest "
        f"reward, the first {lim['per_reason']} aborted of each reason, and a random sample of {lim['sample']} "
        f"(seed {lim['seed']}) of the rest. The full per-session timeline: <code>agentlog trace</code>. "
        "Response tokens: <span class='t m1'>trained</span> (loss mask 1), "
        "<span class='t m0'>context</span> (mask 0); <span class='t p'>prompt</span>.</p>",
        f"<section id='sessions'>{sessions_html}</section>",
        "</body></html>",
    ]
    return "".join(parts)
