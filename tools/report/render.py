"""The report page: plotly figures (plotly.js inlined once) and plain HTML.

Sections: outcome counts (a table), the session timeline (one horizontal
bar per session from open to its terminal event, coloured by outcome, with a
tick per turn), reward distribution per group, abort and drop reasons, and
a per-session drill-down whose response tokens are highlighted by loss mask.
The page loads nothing from the network.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
from collections import Counter
from typing import Any

from .data import ReportData, SessionRecord

OUTCOMES = ("finished", "aborted", "dropped", "running", "open")
COLOURS = {
    "finished": "#2e9d4f",
    "aborted": "#d62728",
    "dropped": "#8c8c8c",
    "running": "#1f77b4",
    "open": "#9ecae1",
}
#: Beyond these the charts keep the first sessions / groups (the page says so).
MAX_TIMELINE = 5000
MAX_GROUPS = 300
#: Response tokens shown per drill-down row.
MAX_TOKENS_SHOWN = 4000

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table.outcomes td, table.outcomes th { padding: 0.2em 0.8em; text-align: right; border-bottom: 1px solid #ddd; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; border-radius: 2px; vertical-align: middle; }
.meta { color: #555; font-size: 0.9em; }
.warn { background: #fff3cd; padding: 0.5em; border: 1px solid #e0c36a; }
details.session { border: 1px solid #ddd; border-left-width: 6px; margin: 0.3em 0; padding: 0.3em 0.6em; }
details.session summary { cursor: pointer; }
.tokens { font-family: ui-monospace, monospace; font-size: 0.85em; line-height: 1.7; word-break: break-all; }
.t { padding: 0 2px; margin: 0 1px; border-radius: 2px; }
.t.p { color: #777; }
.t.m0 { background: #eee; color: #444; }
.t.m1 { background: #b9f0c6; color: #0b4a1c; font-weight: 600; }
"""


def _iso(ns: int) -> str:
    t = _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _reward_float(r: Any) -> float | None:
    from agentlog.reducers.samples import resolve_reward

    value, _ = resolve_reward(r)
    return value


def _figure_html(fig: Any, div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(
        fig, full_html=False, include_plotlyjs=False, div_id=div_id,
        config={"displaylogo": False, "responsive": True},
    )


def timeline_figure(data: ReportData) -> Any:
    """One horizontal bar per session (open -> terminal event), coloured by
    outcome, with a tick per recorded turn. Seconds since the first event."""
    import plotly.graph_objects as go

    sessions = data.sessions[:MAX_TIMELINE]
    t0 = data.first_ns
    span = max((data.last_ns - t0) / 1e9, 1e-6)
    min_width = span / 400  # a zero-length session still shows as a bar
    counts = Counter(s.status for s in data.sessions)
    fig = go.Figure()
    for outcome in OUTCOMES:
        rows = [s for s in sessions if s.status == outcome]
        if not rows:
            continue
        starts = [(s.opened_ns - t0) / 1e9 for s in rows]
        ends = [((s.ended_ns if s.ended_ns is not None else data.last_ns) - t0) / 1e9 for s in rows]
        fig.add_trace(
            go.Bar(
                name=f"{outcome} ({counts[outcome]})",
                orientation="h",
                y=[s.session_id for s in rows],
                base=starts,
                x=[max(e - b, min_width) for b, e in zip(starts, ends)],
                marker_color=COLOURS[outcome],
                customdata=[[s.group_id, s.reason or "-", s.turns] for s in rows],
                hovertemplate="%{y}<br>group %{customdata[0]}<br>" + outcome
                + " %{customdata[1]}<br>turns %{customdata[2]}<br>%{base:.3f}s + %{x:.3f}s<extra></extra>",
                legendgroup=outcome,
            )
        )
    tx, ty = [], []
    for s in sessions:
        for ns in s.turn_ns:
            tx.append((ns - t0) / 1e9)
            ty.append(s.session_id)
    if tx:
        fig.add_trace(
            go.Scatter(
                name="turn", x=tx, y=ty, mode="markers",
                marker={"symbol": "line-ns-open", "size": 12, "color": "#111", "line": {"width": 2}},
                hovertemplate="%{y}: turn at %{x:.3f}s<extra></extra>",
            )
        )
    order = [s.session_id for s in sessions]
    fig.update_layout(
        barmode="overlay",
        # 20 px a session, shrinking for big runs so the page stays usable.
        height=max(260, int(len(sessions) * max(4.0, min(20.0, 30000 / max(len(sessions), 1)))) + 140),
        xaxis_title="seconds since the first event",
        yaxis={"categoryorder": "array", "categoryarray": order[::-1], "type": "category"},
        margin={"l": 140, "r": 20, "t": 30, "b": 50},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
    )
    return fig


def rewards_figure(data: ReportData) -> Any:
    """Reward of each finished session, per group (box with every point)."""
    import plotly.graph_objects as go

    xs, ys, names = [], [], []
    groups_seen: list[str] = []
    for s in data.sessions:
        if s.status != "finished":
            continue
        r = _reward_float(s.reward)
        if r is None:
            continue
        if s.group_id not in groups_seen:
            if len(groups_seen) >= MAX_GROUPS:
                continue
            groups_seen.append(s.group_id)
        xs.append(s.group_id)
        ys.append(r)
        names.append(s.session_id)
    fig = go.Figure(
        go.Box(x=xs, y=ys, boxpoints="all", jitter=0.3, pointpos=0, text=names, name="reward",
               marker_color=COLOURS["finished"], hovertemplate="%{text}: %{y}<extra></extra>")
    )
    fig.update_layout(
        height=360, xaxis_title="group", yaxis_title="reward (finished sessions)",
        xaxis={"type": "category"}, margin={"t": 30, "b": 50}, showlegend=False,
    )
    return fig


def reasons_figure(data: ReportData) -> Any:
    """Abort and drop reasons, counted."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for outcome in ("aborted", "dropped"):
        c = Counter(s.reason for s in data.sessions if s.status == outcome)
        if c:
            items = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))
            fig.add_trace(go.Bar(name=outcome, x=[k for k, _ in items], y=[v for _, v in items], marker_color=COLOURS[outcome]))
    fig.update_layout(height=320, yaxis_title="sessions", barmode="group", margin={"t": 30, "b": 80})
    return fig


def _tokens_html(sample: Any) -> str:
    toks = sample.token_ids
    n_prompt = sample.prompt_length
    mask = sample.mask.tolist()
    prompt = toks[:n_prompt].tolist()
    resp = toks[n_prompt:].tolist()
    parts = []
    if len(prompt) > 64:
        parts.append(" ".join(f'<span class="t p">{t}</span>' for t in prompt[:32]))
        parts.append(f'<span class="meta"> … {len(prompt) - 48} prompt tokens … </span>')
        parts.append(" ".join(f'<span class="t p">{t}</span>' for t in prompt[-16:]))
    else:
        parts.append(" ".join(f'<span class="t p">{t}</span>' for t in prompt))
    parts.append('<span class="meta"> ▸ </span>')
    shown = resp[:MAX_TOKENS_SHOWN]
    parts.append(" ".join(f'<span class="t m{m}">{t}</span>' for t, m in zip(shown, mask)))
    if len(resp) > len(shown):
        parts.append(f'<span class="meta"> … {len(resp) - len(shown)} more response tokens</span>')
    return "".join(parts)


def _session_html(s: SessionRecord, data: ReportData, drilled: bool) -> str:
    e = html.escape
    dur = ((s.ended_ns if s.ended_ns is not None else data.last_ns) - s.opened_ns) / 1e9
    reward = "" if s.status != "finished" else f", reward {e(str(s.reward))}"
    reason = f" ({e(s.reason)})" if s.reason else ""
    head = (
        f'<details class="session" data-session="{e(s.session_id)}" data-status="{s.status}" '
        f'style="border-left-color:{COLOURS.get(s.status, "#999")}">'
        f"<summary><b>{e(s.session_id)}</b> · group {e(s.group_id)} [{s.sample_index}] · "
        f'<span class="status">{s.status}</span>{reason}{reward} · {s.turns} turns · '
        f"{s.tokens_in} in / {s.tokens_out} out tokens · {dur:.3f} s</summary>"
    )
    body = []
    if s.error:
        body.append(f'<p class="meta">error: {e(s.error)}</p>')
    if not drilled:
        body.append('<p class="meta">samples not kept (beyond the drill-down limit)</p>')
    elif not s.samples:
        body.append('<p class="meta">no samples' + (" (dropped sessions yield none)" if s.status == "dropped" else "") + "</p>")
    for smp in s.samples:
        trained = int(smp.mask.sum())
        flag = " · remove_sample" if smp.remove_sample else ""
        body.append(
            f'<p class="meta">row {smp.row_index} · {smp.status}{flag} · reward {smp.reward:g} · '
            f"{smp.response_length} response tokens, {trained} trained</p>"
            f'<div class="tokens" data-row="{smp.row_index}">{_tokens_html(smp)}</div>'
        )
    return head + "".join(body) + "</details>"


def render(data: ReportData) -> str:
    """The whole page as one HTML string."""
    from plotly.offline import get_plotlyjs

    e = html.escape
    counts = Counter(s.status for s in data.sessions)
    n_groups = len(data.groups)
    released = sum(1 for g in data.groups.values() if g.get("released"))
    skipped = sum(1 for g in data.groups.values() if g.get("skipped"))
    rows = "".join(
        f'<tr data-status="{o}" data-count="{counts.get(o, 0)}"><th><span class="swatch" style="background:{COLOURS[o]}"></span> {o}</th>'
        f"<td>{counts.get(o, 0)}</td></tr>"
        for o in OUTCOMES
    )
    rewards = [r for r in (_reward_float(s.reward) for s in data.sessions if s.status == "finished") if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    notes = []
    if len(data.sessions) > MAX_TIMELINE:
        notes.append(f"The timeline shows the first {MAX_TIMELINE} of {len(data.sessions)} sessions.")
    if data.violations:
        notes.append(f"{len(data.violations)} lifecycle violation(s): " + "; ".join(data.violations[:5]))
    if data.reduce_problem:
        notes.append(f"The sample reducer stopped: {data.reduce_problem}")
    warn = "".join(f'<p class="warn">{e(n)}</p>' for n in notes)
    drilled = set(s.session_id for s in data.sessions[: data.drill_limit])
    sessions_html = "".join(_session_html(s, data, s.session_id in drilled) for s in data.sessions)
    span = (data.last_ns - data.first_ns) / 1e9 if data.events else 0.0
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>agentlog report: {e(data.log)}</title><style>{_CSS}</style>",
        # plotly.js inlined: the page opens with no network access.
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
        f"<h1>agentlog report</h1><p class='meta'>log <code>{e(data.log)}</code> · {data.events} events · "
        + (f"{_iso(data.first_ns)} → {_iso(data.last_ns)} ({span:.1f} s)" if data.events else "empty")
        + (f" · samples digest <code>{e(data.sample_digest)}</code>" if data.sample_digest else "")
        + "</p>",
        warn,
        "<h2>Outcomes</h2>",
        f"<table class='outcomes' id='outcomes'><tr><th>sessions</th><td id='sessions-total'>{len(data.sessions)}</td></tr>{rows}</table>",
        f"<p class='meta'>groups: {n_groups} · released {released} (skipped {skipped}) · pending {n_groups - released} · "
        f"reward mean {'-' if mean != mean else f'{mean:.3f}'} over {len(rewards)} finished sessions</p>",
        "<h2>Session timeline</h2><p class='meta'>One bar per session, from session_opened to its terminal event "
        "(to the end of the log while in flight); ticks mark turns.</p>",
        _figure_html(timeline_figure(data), "timeline"),
        "<h2>Reward per group</h2>",
        _figure_html(rewards_figure(data), "rewards"),
        "<h2>Abort and drop reasons</h2>",
        _figure_html(reasons_figure(data), "reasons"),
        "<h2>Sessions</h2><p class='meta'>Response tokens: <span class='t m1'>trained</span> (loss mask 1), "
        "<span class='t m0'>context</span> (mask 0); <span class='t p'>prompt</span>.</p>",
        f"<section id='sessions'>{sessions_html}</section>",
        "</body></html>",
    ]
    return "".join(parts)
