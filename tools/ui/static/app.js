// agentlog ui: the single-page app of `agentlog ui SOURCE`.
//
// Plain browser JavaScript, no build step, no external asset: the page must open on a laptop with no network.
// The server (tools/ui/server.py) answers JSON per view (the contract: /tmp/agentlog_ui/contract.md, summarised in
// docs/design.md); this file only draws it. Sections, in order:
//   1. helpers: DOM building (text always through textContent: transcripts hold arbitrary model output), formatting,
//      the API client (every request carries the page's ?token=)
//   2. charts: small inline-SVG line and bar charts whose points are links
//   3. views: run, sessions, session (transcript + token view), group, step
//   4. router (URL hash) and live updates (EventSource on /api/stream)
"use strict";

/* ============================================================ 1. helpers */

const SVG_NS = "http://www.w3.org/2000/svg";
// The server refuses requests without the token it was started with; the page URL carries it once (/?token=T).
const TOKEN = new URLSearchParams(location.search).get("token");
const KINDS = ["prompt", "trained", "generated_untrained", "tool", "given"];
const KIND_LABEL = {
  prompt: "prompt (mask 0)", trained: "trained (mask 1)", generated_untrained: "generated, not trained (mask 0)",
  tool: "tool output (mask 0)", given: "given (mask 0)",
};
const STATUSES = ["finished", "aborted", "dropped", "running", "open"];  // replay --status: open = opened, not started
// Distinct colours for categories (abort reasons, chart series), colour-blind-friendly first.
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#9333ea", "#475569"];

/** el("div", {class: "x", onclick: f}, child, "text", [more]): an element. Strings become text nodes, so log data
 *  inserted this way can never become markup. Attributes with null/undefined/false values are left out. */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  appendAll(node, children);
  return node;
}

/** The same for SVG elements (charts). */
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  appendAll(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else if (k === "text") node.textContent = String(v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
}

function appendAll(node, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** A link to a view of this app (hash routes keep the page, so its ?token= stays in the URL). */
function link(href, ...children) {
  return el("a", { href }, ...children);
}

function sessionHref(id) { return "#/session/" + encodeURIComponent(id); }
function groupHref(id) { return "#/group/" + encodeURIComponent(id); }
function stepHref(n) { return "#/step/" + encodeURIComponent(n); }
function sessionsHref(filters) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  const s = q.toString();
  return "#/sessions" + (s ? "?" + s : "");
}

function fmtNum(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return x.toFixed(digits);
}

function fmtTime(ts) {
  if (ts === null || ts === undefined) return "—";
  const d = new Date(ts * 1000);
  return d.toLocaleTimeString([], { hour12: false });
}

function fmtDateTime(ts) {
  if (ts === null || ts === undefined) return "";
  return new Date(ts * 1000).toISOString().replace("T", " ").replace("Z", " UTC");
}

function statusBadge(status) {
  return el("span", { class: "badge st-" + String(status) }, String(status));
}

function yesNo(flag, yes = "yes", no = "no") {
  return el("span", { class: "badge " + (flag ? "yes" : "no") }, flag ? yes : no);
}

/** A long text shown as its head with a button that reveals the rest (the DOM stays small for huge outputs). */
function longText(text, limit = 2000, cls = "") {
  const s = text === null || text === undefined ? "" : String(text);
  if (s.length <= limit) return el("pre", { class: cls }, s);
  const pre = el("pre", { class: cls }, s.slice(0, limit));
  const more = el("button", { class: "more" }, `show all (${s.length - limit} more characters)`);
  more.addEventListener("click", () => { pre.textContent = s; more.remove(); });
  return el("div", {}, pre, more);
}

/** An API error: the server's {"error": ...} text, or what else went wrong, naming the URL. */
class ApiError extends Error {}

function apiUrl(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  if (TOKEN) q.set("token", TOKEN);
  const s = q.toString();
  return path + (s ? "?" + s : "");
}

async function api(path, params) {
  const url = apiUrl(path, params);
  let resp;
  try {
    resp = await fetch(url, { headers: { Accept: "application/json" } });
  } catch (e) {
    throw new ApiError(`${path}: the server did not answer (${e.message}); is agentlog ui still running?`);
  }
  let body;
  try {
    body = await resp.json();
  } catch (e) {
    throw new ApiError(`${path}: HTTP ${resp.status}, expected a JSON answer (${e.message})`);
  }
  if (!resp.ok) throw new ApiError(`${path}: HTTP ${resp.status}: ${body && body.error ? body.error : JSON.stringify(body)}`);
  return body;
}

function errorBox(err) {
  return el("div", { class: "error", role: "alert" }, err instanceof Error ? err.message : String(err));
}

/* ============================================================ 2. charts */

/** About five round tick values covering [lo, hi]. */
function ticks(lo, hi, n = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / n;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => raw <= s) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

/** A [lo, hi] domain with a little room, never empty (a single value gets +-1 or +-10%). */
function domain(values) {
  const vs = values.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  if (!vs.length) return [0, 1];
  let lo = Math.min(...vs), hi = Math.max(...vs);
  if (lo === hi) {
    const pad = lo === 0 ? 1 : Math.abs(lo) * 0.1;
    return [lo - pad, hi + pad];
  }
  const pad = (hi - lo) * 0.05;
  return [lo - pad, hi + pad];
}

const CHART = { w: 640, h: 220, left: 52, right: 12, top: 12, bottom: 28 };

/** The frame of a chart: an <svg> with axes, grid lines and tick labels; returns {root, x, y} scale functions. */
function chartFrame(xdom, ydom, { xTickFormat = fmtNum, yTickFormat = fmtNum, xLabel = "", yLabel = "", integerX = false } = {}) {
  const { w, h, left, right, top, bottom } = CHART;
  const x = (v) => left + ((v - xdom[0]) / (xdom[1] - xdom[0] || 1)) * (w - left - right);
  const y = (v) => h - bottom - ((v - ydom[0]) / (ydom[1] - ydom[0] || 1)) * (h - top - bottom);
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${w} ${h}`, role: "img" });
  for (const t of ticks(ydom[0], ydom[1], 4)) {
    root.appendChild(svg("line", { class: "gridline", x1: left, x2: w - right, y1: y(t), y2: y(t) }));
    root.appendChild(svg("text", { x: left - 6, y: y(t) + 4, "text-anchor": "end" }, yTickFormat(t)));
  }
  // Steps are whole numbers: no tick at step 1.5.
  for (const t of ticks(xdom[0], xdom[1], 6).filter((v) => !integerX || Number.isInteger(v))) {
    root.appendChild(svg("text", { x: x(t), y: h - bottom + 16, "text-anchor": "middle" }, xTickFormat(t)));
  }
  root.appendChild(svg("line", { class: "axis", x1: left, x2: w - right, y1: h - bottom, y2: h - bottom }));
  root.appendChild(svg("line", { class: "axis", x1: left, x2: left, y1: top, y2: h - bottom }));
  if (xLabel) root.appendChild(svg("text", { x: w - right, y: h - 2, "text-anchor": "end" }, xLabel));
  if (yLabel) root.appendChild(svg("text", { x: left + 4, y: top + 8 }, yLabel));
  return { root, x, y };
}

/** A line chart. series: [{name, color, points: [{x, y, href, tip}]}]; a null y breaks the line. Each point is a
 *  link (an <a> around its circle) to the sessions or step it summarises, with a <title> tooltip. */
function lineChart(series, opts = {}) {
  const all = series.flatMap((s) => s.points);
  const xdom = domain(all.map((p) => p.x));
  const ydom = domain(all.map((p) => p.y));
  if (opts.integerX && all.length) { xdom[0] = Math.min(...all.map((p) => p.x)) - 0.5; xdom[1] = Math.max(...all.map((p) => p.x)) + 0.5; }
  const { root, x, y } = chartFrame(xdom, ydom, opts);
  for (const s of series) {
    // Path segments between nulls; a step chart (versions) holds each value until the next point.
    let d = "", pen = false;
    for (const p of s.points) {
      if (p.y === null || p.y === undefined || !Number.isFinite(p.y)) { pen = false; continue; }
      if (!pen) d += `M${x(p.x)},${y(p.y)}`;
      else if (opts.stepped) d += `H${x(p.x)}V${y(p.y)}`;
      else d += `L${x(p.x)},${y(p.y)}`;
      pen = true;
    }
    root.appendChild(svg("path", { class: "series", d, stroke: s.color }));
    for (const p of s.points) {
      if (p.y === null || p.y === undefined || !Number.isFinite(p.y)) continue;
      const dot = svg("circle", { cx: x(p.x), cy: y(p.y), r: all.length > 200 ? 2 : 3.2, fill: s.color }, svg("title", {}, p.tip || `${s.name}: ${fmtNum(p.y)}`));
      root.appendChild(p.href ? svg("a", { href: p.href }, dot) : dot);
    }
  }
  return root;
}

/** A stacked bar chart. bars: [{x, label, parts: [{key, value, href}]}]; colours by key (colorOf). */
function stackedBars(bars, colorOf, opts = {}) {
  const totals = bars.map((b) => b.parts.reduce((a, p) => a + p.value, 0));
  const ymax = Math.max(1, ...totals);
  const n = bars.length;
  const { root, y } = chartFrame([0, Math.max(n, 1)], [0, ymax * 1.05], { ...opts, xTickFormat: () => "" });
  const { w, left, right, h, bottom } = CHART;
  const band = (w - left - right) / Math.max(n, 1);
  const labelEvery = Math.max(1, Math.ceil(n / 8));
  bars.forEach((b, i) => {
    let base = 0;
    const x0 = left + i * band + band * 0.1;
    for (const p of b.parts) {
      if (!p.value) continue;
      const rect = svg("rect", { x: x0, width: Math.max(1, band * 0.8), y: y(base + p.value), height: Math.max(0.5, y(base) - y(base + p.value)), fill: colorOf(p.key) },
        svg("title", {}, `${b.label}  ${p.key}: ${p.value}`));
      root.appendChild(p.href ? svg("a", { href: p.href }, rect) : rect);
      base += p.value;
    }
    if (i % labelEvery === 0) root.appendChild(svg("text", { x: x0 + band * 0.4, y: h - bottom + 16, "text-anchor": "middle" }, b.label));
  });
  return root;
}

/** Horizontal bars as an HTML grid (labels stay readable and selectable): rows [{label, value, href}]. */
function hbars(rows, cls = "") {
  const max = Math.max(1, ...rows.map((r) => r.value));
  const grid = el("div", { class: "hbars" });
  for (const r of rows) {
    grid.appendChild(r.href ? link(r.href, r.label) : el("span", {}, r.label));
    grid.appendChild(el("div", {}, el("div", { class: "bar " + cls, style: `width:${(100 * r.value) / max}%` })));
    grid.appendChild(el("span", { class: "mono" }, String(r.value)));
  }
  return grid;
}

function legend(items) {
  return el("div", { class: "legend" }, items.map(([color, label]) => el("span", {}, el("span", { class: "sw", style: `background:${color}` }), label)));
}

/* ============================================================ 3. views */

// Shared between views: the latest /api/run (the sessions filters offer its reasons and flags).
const state = { run: null, route: null, refreshTimer: null };

async function loadRun() {
  state.run = await api("/api/run");
  updateHeader(state.run);
  return state.run;
}

function updateHeader(run) {
  document.getElementById("source").textContent = run.source || "";
  const idx = run.index || {};
  document.getElementById("index-info").textContent = idx.sessions !== undefined ? `${idx.sessions} sessions indexed` : "";
}

/* ---------------- Run view: curves over steps, throughput, versions, aborts over time, flags */

const RunView = {
  async render(root) {
    const run = await loadRun();
    const s = run.sessions || {};
    root.appendChild(el("h1", {}, "Run"));
    // The server's follower died (it logs the traceback too): say so first, the figures below stop moving.
    if (run.error) root.appendChild(errorBox(`live updates stopped: ${run.error}`));
    // Each count links to the sessions table filtered to what it counts.
    root.appendChild(el("div", { class: "stats" },
      el("a", { class: "stat", href: sessionsHref({}) }, el("b", {}, fmtNum(s.total)), el("span", {}, "sessions")),
      STATUSES.map((st) => el("a", { class: "stat", href: sessionsHref({ status: st }), "data-status": st },
        el("b", {}, fmtNum(s[st] || 0)), el("span", {}, st))),
      run.sessions_resumed ? el("a", { class: "stat", id: "stat-resumed", href: sessionsHref({ sort: "-resumes" }), title: "sessions a new incarnation took over (most resumed first)" },
        el("b", {}, fmtNum(run.sessions_resumed)), el("span", {}, "resumed")) : null,
      el("div", { class: "stat" }, el("b", {}, fmtNum((run.steps || []).length)), el("span", {}, "learner steps")),
      el("div", { class: "stat", title: `index built to ${run.index ? run.index.built_to : "?"} in ${fmtNum(run.index ? run.index.build_s : null, 2)} s` },
        el("b", {}, run.live ? "live" : "done"), el("span", {}, run.live ? "log still written" : "log complete"))));

    const steps = run.steps || [];
    const grid = el("div", { class: "grid" });
    root.appendChild(grid);
    const stepPoints = (field, name) => steps.map((st) => ({
      x: st.step, y: st[field], href: stepHref(st.step),
      tip: `step ${st.step} (policy v${st.policy_version}): ${name} ${fmtNum(st[field])}; ${st.trained_groups} groups trained, ${st.skipped_groups} skipped`,
    }));
    if (steps.length) {
      grid.appendChild(el("div", { class: "card", id: "chart-reward" }, el("h3", {}, "Reward (mean of trained groups) per step"),
        lineChart([{ name: "reward", color: PALETTE[2], points: stepPoints("reward_mean", "reward") }], { integerX: true, xLabel: "step" })));
      grid.appendChild(el("div", { class: "card", id: "chart-loss" }, el("h3", {}, "Loss per step"),
        lineChart([{ name: "loss", color: PALETTE[1], points: stepPoints("loss", "loss") }], { integerX: true, xLabel: "step" })));
      grid.appendChild(el("div", { class: "card", id: "chart-throughput" }, el("h3", {}, "Throughput (tokens/s) per step"),
        lineChart([{ name: "tokens/s", color: PALETTE[0], points: stepPoints("tokens_per_s", "tokens/s") }], { integerX: true, xLabel: "step" })));
      grid.appendChild(el("div", { class: "card", id: "chart-groups" }, el("h3", {}, "Groups trained / skipped per step"),
        legend([[PALETTE[2], "trained"], [PALETTE[3], "skipped"]]),
        stackedBars(steps.map((st) => ({ label: String(st.step), parts: [
          { key: "trained", value: st.trained_groups || 0, href: stepHref(st.step) },
          { key: "skipped", value: st.skipped_groups || 0, href: stepHref(st.step) }] })),
        (k) => (k === "trained" ? PALETTE[2] : PALETTE[3]))));
      grid.appendChild(el("div", { class: "card", id: "chart-versions" }, el("h3", {}, "Policy version per step"),
        lineChart([{ name: "version", color: PALETTE[4], points: steps.map((st) => ({
          x: st.step, y: st.policy_version, href: sessionsHref({ version: st.policy_version }),
          tip: `step ${st.step}: policy v${st.policy_version} (click: sessions generated by v${st.policy_version})` })) }],
        { integerX: true, stepped: true, xLabel: "step" })));
    } else {
      grid.appendChild(el("div", { class: "card muted" }, "No learner steps in this log (a rollout-only log, or the learner has not stepped yet)."));
    }

    // Aborts over time, stacked by reason; each bar part opens exactly the sessions it counts: that reason,
    // opened in [bucket_ts, bucket_end) (reason only: the chart counts drops too, which status=aborted would hide).
    const aborts = run.aborts_over_time || [];
    const reasons = [...new Set(aborts.map((a) => a.reason))].sort();
    const colorOf = (r) => PALETTE[reasons.indexOf(r) % PALETTE.length];
    const abortCard = el("div", { class: "card", id: "chart-aborts" }, el("h3", {}, "Aborts over time, by reason"));
    if (aborts.length) {
      const buckets = [...new Set(aborts.map((a) => a.bucket_ts))].sort((a, b) => a - b);
      abortCard.appendChild(legend(reasons.map((r) => [colorOf(r), r])));
      abortCard.appendChild(stackedBars(buckets.map((b) => ({
        label: fmtTime(b),
        parts: aborts.filter((a) => a.bucket_ts === b).map((a) => ({ key: a.reason, value: a.count, href: sessionsHref({ reason: a.reason, since: a.bucket_ts, until: a.bucket_end }) })),
      })), colorOf));
    } else {
      abortCard.appendChild(el("p", { class: "muted" }, "No aborted session."));
    }
    grid.appendChild(abortCard);

    const reasonRows = Object.entries(run.reasons || {}).sort((a, b) => b[1] - a[1]).map(([r, n]) => ({ label: r, value: n, href: sessionsHref({ reason: r }) }));
    grid.appendChild(el("div", { class: "card", id: "reasons" }, el("h3", {}, "Abort and drop reasons"),
      reasonRows.length ? hbars(reasonRows, "bad") : el("p", { class: "muted" }, "None.")));
    const flagRows = Object.entries(run.flags || {}).sort((a, b) => b[1] - a[1]).map(([f, n]) => ({ label: f, value: n, href: sessionsHref({ flag: f }) }));
    grid.appendChild(el("div", { class: "card", id: "flags" }, el("h3", {}, "Health flags"),
      flagRows.length ? hbars(flagRows, "warnc") : el("p", { class: "muted" }, "No session carries a health flag.")));
  },
  // Live: the whole view is redrawn from one /api/run, at most once a second however busy the run is.
  onLive(kind) { return kind === "session" || kind === "step"; },
  liveDebounceMs: 1000,
};

/* ---------------- Sessions view: server-side paging, sorting and filtering */

const SORTABLE = [
  ["session_id", "session"], ["group_id", "group"], ["partition", "partition"], ["status", "status"], ["reason", "reason"],
  ["reward", "reward", true], ["turns", "turns", true], ["version_min", "versions", true], [null, "flags"], ["first_ts", "started"],
  ["resumes", "resumed", true],
];
const TEXT_FILTERS = [["version", "version", true], ["partition", "partition"], ["group", "group"], ["q", "transcript text"],
  ["min_reward", "reward ≥", true], ["max_reward", "reward ≤", true],
  ["since", "opened ≥ (unix s)", true], ["until", "opened < (unix s)", true]];

const SessionsView = {
  params: null,
  seen: null, // session ids the table showed last time: rows new since then flash
  async render(root, params) {
    this.params = params;
    this.seen = null;
    const run = state.run || await loadRun();
    root.appendChild(el("h1", {}, "Sessions"));
    root.appendChild(this.filterForm(run, params));
    root.appendChild(el("div", { id: "sessions-body" }));
    await this.refresh(root);
  },

  /** Writes the filters into the hash: the URL is the state (back/forward and copy-paste work), offset back to 0. */
  go(changes) {
    const q = new URLSearchParams(this.params);
    for (const [k, v] of Object.entries(changes)) {
      if (v === null || v === undefined || v === "") q.delete(k); else q.set(k, String(v));
    }
    if (!("offset" in changes)) q.delete("offset");
    const s = q.toString();
    location.hash = "#/sessions" + (s ? "?" + s : "");
  },

  filterForm(run, params) {
    const select = (name, values, label) => {
      const current = params.get(name) || "";
      const opts = [...values];
      if (current && !opts.includes(current)) opts.push(current); // a value from a link the summary has not caught up with
      return el("label", {}, label, el("select", { name, onchange: (e) => this.go({ [name]: e.target.value }) },
        el("option", { value: "" }, "any"),
        opts.map((v) => el("option", { value: v, selected: v === current }, v))));
    };
    const form = el("form", { class: "filters", id: "sessions-filters" },
      select("status", STATUSES, "status"),
      select("reason", Object.keys(run.reasons || {}).sort(), "reason"),
      select("flag", Object.keys(run.flags || {}).sort(), "health flag"),
      TEXT_FILTERS.map(([name, label, narrow]) => el("label", {}, label,
        el("input", { name, value: params.get(name) || "", class: narrow ? "narrow" : null, type: name === "q" ? "search" : "text" }))),
      el("button", { type: "submit" }, "Apply"),
      link("#/sessions", "clear"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const changes = {};
      for (const [name] of TEXT_FILTERS) changes[name] = form.elements[name].value.trim();
      this.go(changes);
    });
    return form;
  },

  /** Fetches the page the hash names and redraws the table under the form (the form keeps focus and typing). */
  async refresh(root) {
    const params = this.params;
    const query = {};
    for (const [k, v] of params) query[k] = v;
    query.offset = query.offset || 0;
    query.limit = query.limit || 50;
    const page = await api("/api/sessions", query);
    if (this.params !== params) return; // the user moved on while this was in flight
    const body = root.querySelector("#sessions-body");
    body.replaceChildren(this.table(page, params), this.pager(page));
  },

  table(page, params) {
    const sort = params.get("sort") || "";
    const head = el("tr", {}, SORTABLE.map(([field, label, num]) => {
      if (!field) return el("th", {}, label);
      const mark = sort === field ? " ▲" : sort === "-" + field ? " ▼" : "";
      return el("th", { class: "sortable" + (num ? " num" : ""), "data-sort": field, title: "sort by " + label,
        onclick: () => this.go({ sort: sort === field ? "-" + field : field }) }, label + mark);
    }));
    const seen = this.seen;
    this.seen = new Set(page.rows.map((r) => r.session_id));
    const rows = page.rows.map((r) => {
      const tr = el("tr", { "data-session": r.session_id, class: seen && !seen.has(r.session_id) ? "new" : null },
        el("td", {}, link(sessionHref(r.session_id), r.session_id)),
        el("td", {}, r.group_id ? link(groupHref(r.group_id), r.group_id) : "—"),
        el("td", {}, r.partition === null || r.partition === undefined ? "—" : r.partition),
        el("td", {}, statusBadge(r.status)),
        el("td", {}, r.reason ? link(sessionsHref({ reason: r.reason }), r.reason) : ""),
        el("td", { class: "num" }, fmtNum(r.reward)),
        el("td", { class: "num" }, String(r.turns)),
        el("td", { class: "num" }, r.version_min === null || r.version_min === undefined ? "—"
          : r.version_min === r.version_max ? `v${r.version_min}` : `v${r.version_min}–v${r.version_max}`),
        el("td", {}, (r.flags || []).map((f) => el("a", { class: "badge flag", href: sessionsHref({ flag: f }) }, f))),
        el("td", { title: fmtDateTime(r.first_ts) }, fmtTime(r.first_ts)),
        el("td", { class: "num", title: r.resumes ? "new incarnations took it over from its last durable turn" : null },
          r.resumes ? `${r.resumes}x` : ""));
      // The whole row opens the session; its inner links (group, reason, flag) keep their own targets.
      tr.addEventListener("click", (e) => { if (!e.target.closest("a")) location.hash = sessionHref(r.session_id); });
      return tr;
    });
    const q = new URLSearchParams(params).toString();
    return el("table", { id: "sessions-table", class: "data", "data-total": page.total, "data-query": q },
      el("thead", {}, head),
      el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: SORTABLE.length, class: "muted" }, "No session matches these filters."))));
  },

  pager(page) {
    const first = page.total ? page.offset + 1 : 0;
    const last = page.offset + page.rows.length;
    return el("div", { class: "pager" },
      el("button", { disabled: page.offset <= 0, onclick: () => this.go({ offset: Math.max(0, page.offset - page.limit) }) }, "← previous"),
      el("span", { id: "sessions-count" }, `${first}–${last} of ${page.total}`),
      el("button", { disabled: last >= page.total, onclick: () => this.go({ offset: page.offset + page.limit }) }, "next →"),
      el("label", { class: "muted" }, " rows per page ",
        el("select", { onchange: (e) => this.go({ limit: e.target.value }) },
          [50, 100, 200, 500].map((n) => el("option", { value: n, selected: n === page.limit }, String(n))))));
  },

  // Live: re-ask the server for the current page (it filters and sorts; new rows flash).
  onLive(kind) { return kind === "session"; },
  live(root) { return this.refresh(root); },
};

/* ---------------- Session view: why, transcript, token view with the loss mask and log-prob ribbons, forks */

/** A message's content as DOM: a string, or a list of parts (OpenAI text/image parts, Anthropic blocks). */
function messageContent(content) {
  if (content === null || content === undefined) return [];
  if (typeof content === "string") return [longText(content)];
  if (!Array.isArray(content)) return [longText(JSON.stringify(content, null, 2))];
  return content.map((part) => {
    if (part && typeof part === "object") {
      if (typeof part.text === "string") return longText(part.text);
      if (part.type === "tool_use") return el("div", { class: "toolcall mono" }, `→ ${part.name}(`, longText(JSON.stringify(part.input, null, 2)), ")");
      if (part.type === "tool_result") return el("div", { class: "toolcall" }, el("span", { class: "muted" }, "tool result"), messageContent(part.content));
    }
    return longText(JSON.stringify(part, null, 2));
  });
}

function messageBox(msg, extra) {
  if (!msg || typeof msg !== "object") return el("div", { class: "msg" }, el("div", { class: "body" }, longText(JSON.stringify(msg))));
  const role = String(msg.role || "?");
  const calls = Array.isArray(msg.tool_calls) ? msg.tool_calls : [];
  return el("div", { class: "msg role-" + role.replace(/[^a-z_]/gi, "") },
    el("div", { class: "role" }, role, msg.name ? ` (${msg.name})` : "", msg.tool_call_id ? ` ← ${msg.tool_call_id}` : "", extra || ""),
    el("div", { class: "body" }, messageContent(msg.content),
      msg.reasoning_content ? el("details", {}, el("summary", { class: "muted" }, "reasoning"), longText(msg.reasoning_content)) : null,
      calls.map((c) => {
        // OpenAI's form nests the call under "function" (arguments as JSON text); the gateway's is flat (an object).
        const fn = c.function || c;
        const args = fn.arguments ?? c.input;
        return el("div", { class: "toolcall mono" }, `→ ${fn.name || "?"}`,
          longText(typeof args === "string" ? args : JSON.stringify(args === undefined ? c : args)));
      })));
}

function commandBox(cmd) {
  const code = cmd.exit_code;
  return el("div", { class: "cmd" + (cmd.undone ? " undone" : ""), "data-lsn": cmd.lsn },
    el("div", { class: "cmdline" }, "$ ", cmd.command, "  ",
      el("span", { class: code === 0 ? "exit-ok" : "exit-bad" }, code === null || code === undefined ? "(no exit code)" : `exit ${code}`),
      undoneBadge(cmd.undone)),
    cmd.output ? longText(cmd.output, 4000) : null);
}

/** The mark of a record a resume made void: its (dead) incarnation ran it in a sandbox the restore discarded. */
function undoneBadge(undone) {
  if (!undone) return null;
  return el("span", { class: "badge undone-badge", title: `incarnation ${undone.incarnation} ran this in the sandbox that the resume at lsn ${undone.resume_lsn} discarded` },
    `undone: incarnation ${undone.incarnation}'s`);
}

/** One sandbox snapshot: the sandbox as the next turn's request found it. */
function snapshotBox(snap) {
  return el("div", { class: "snapshot" + (snap.undone ? " undone" : ""), "data-lsn": snap.lsn, title: snap.digest },
    `snapshot before turn ${snap.turn_index}: ${snap.digest.slice(0, 12)}… ${snap.files} files, ${snap.bytes} bytes (${snap.new_bytes} new) in ${fmtNum(snap.seconds, 2)} s`,
    undoneBadge(snap.undone));
}

/** Where a new incarnation took the session over (the line `agentlog show` prints there). */
function resumeMarker(r) {
  return el("div", { class: "resume-marker", "data-lsn": r.lsn, "data-incarnation": r.incarnation },
    el("b", {}, `resumed: incarnation ${r.incarnation}`), el("span", { class: "muted" }, `  lsn ${r.lsn}`),
    el("div", {}, r.line.replace(/^-- | --$/g, "")));
}

/** The colour of a log-prob on the ribbon: probability 1 pale green, 0.5 amber, near 0 red. */
function heat(lp) {
  const p = Math.exp(Math.min(0, lp));
  const hue = 140 * p;
  const light = 45 + 43 * p;
  return `hsl(${hue.toFixed(0)} ${p > 0.8 ? 40 : 85}% ${light.toFixed(0)}%)`;
}

/** The colour of |trainer - rollout| (the off-policy mismatch): 0 white, >= 0.5 nats deep red. */
function mismatchHeat(d) {
  const t = Math.min(1, Math.abs(d) / 0.5);
  return `hsl(0 85% ${(97 - 50 * t).toFixed(0)}%)`;
}

const RIBBONS = [
  ["rollout", "rollout_logprob", "rollout log-prob (the inference server's)"],
  ["trainer", "trainer_logprob", "trainer log-prob"],
  ["teacher", "teacher_logprob", "teacher log-prob"],
];

function present(arr) { return Array.isArray(arr) && arr.some((v) => v !== null && v !== undefined); }

/** The token view of one training row: one <span class="tok kind-K" data-mask="M"> per token (the contract's
 *  selector), its text, and under it one thin ribbon per log-prob source the row has. Hover: the tooltip. */
function tokenView(row, divergeFrom = null) {
  const box = el("div", { class: "tokens", "data-row": row.row });
  const ribbons = RIBBONS.filter(([, field]) => present(row[field]));
  const withDelta = present(row.rollout_logprob) && present(row.trainer_logprob);
  const frag = document.createDocumentFragment();
  const n = row.tokens.length;
  for (let i = 0; i < n; i++) {
    const kind = row.kinds[i];
    const text = row.text[i] ?? "";
    // Whitespace made visible: a newline shows as ↵ (and breaks the line after the token), a tab as →.
    const shown = text.replace(/\n/g, "↵").replace(/\t/g, "→") || "∅";
    const span = document.createElement("span");
    span.className = "tok kind-" + String(kind).replace(/[^a-z_]/g, "") + (divergeFrom !== null && i >= divergeFrom ? " diverged" : "");
    span.dataset.mask = String(row.mask[i]);
    span.dataset.i = String(i);
    span.appendChild(document.createTextNode(shown));
    for (const [name, field] of ribbons) {
      const lp = row[field][i];
      const r = document.createElement("i");
      r.className = "rib rib-" + name;
      if (lp !== null && lp !== undefined) r.style.background = heat(lp);
      span.appendChild(r);
    }
    if (withDelta) {
      const a = row.rollout_logprob[i], b = row.trainer_logprob[i];
      const r = document.createElement("i");
      r.className = "rib rib-delta";
      if (a !== null && a !== undefined && b !== null && b !== undefined) r.style.background = mismatchHeat(b - a);
      span.appendChild(r);
    }
    frag.appendChild(span);
    if (text.endsWith("\n")) frag.appendChild(document.createElement("br"));
  }
  box.appendChild(frag);
  // One listener per row (not per token): the tooltip names everything the log holds about the token.
  box.addEventListener("mousemove", (e) => {
    const span = e.target.closest(".tok");
    if (!span) { hideTip(); return; }
    const i = Number(span.dataset.i);
    const lines = [
      `token ${i}  id ${row.tokens[i]}  ${JSON.stringify(row.text[i] ?? "")}`,
      `kind ${row.kinds[i]}  mask ${row.mask[i]}` + (row.version && row.version[i] !== null && row.version[i] !== undefined ? `  policy v${row.version[i]}` : ""),
    ];
    for (const [name, field] of RIBBONS) {
      const lp = row[field] ? row[field][i] : null;
      if (lp !== null && lp !== undefined) lines.push(`${name.padEnd(8)} log-prob ${lp.toFixed(4)}  (p ${Math.exp(lp).toFixed(3)})`);
    }
    const v = row.version ? row.version[i] : null;
    if (row.trainer_missing && v !== null && v !== undefined && row.trainer_missing[v]) lines.push(`trainer  none: ${row.trainer_missing[v]}`);
    if (withDelta && row.rollout_logprob[i] != null && row.trainer_logprob[i] != null) {
      lines.push(`trainer − rollout ${(row.trainer_logprob[i] - row.rollout_logprob[i]).toFixed(4)}`);
    }
    showTip(lines.join("\n"), e.clientX, e.clientY);
  });
  box.addEventListener("mouseleave", hideTip);
  return box;
}

function showTip(text, x, y) {
  const tip = document.getElementById("tok-tip");
  tip.textContent = text;
  tip.style.display = "block";
  const w = tip.offsetWidth, h = tip.offsetHeight;
  tip.style.left = Math.min(x + 14, window.innerWidth - w - 8) + "px";
  tip.style.top = (y + 18 + h > window.innerHeight ? y - h - 10 : y + 18) + "px";
}

function hideTip() { document.getElementById("tok-tip").style.display = "none"; }

function kindLegend(rows) {
  const counts = Object.fromEntries(KINDS.map((k) => [k, 0]));
  for (const r of rows) for (const k of r.kinds) counts[k] = (counts[k] || 0) + 1;
  return el("div", { class: "legend", id: "kind-legend" },
    KINDS.map((k) => el("span", {}, el("span", { class: "sw", style: `background: var(--kind-${k})` }), `${KIND_LABEL[k]}: ${counts[k]}`)));
}

function ribbonControls(root, rows) {
  const have = RIBBONS.filter(([, field]) => rows.some((r) => present(r[field])));
  const delta = rows.some((r) => present(r.rollout_logprob) && present(r.trainer_logprob));
  if (!have.length) return el("p", { class: "muted" }, "No per-token log-probs in this session's rows.");
  // ``root`` may be the detached box a view is drawn into before it is shown (route()): a toggle acts on the view
  // on screen that holds it. Checked as that view shows it: a redraw (the trainer ribbon loaded) keeps what was hidden.
  const toggle = (name, label) => el("label", {}, el("input", { type: "checkbox", checked: !root.classList.contains("hide-rib-" + name),
    onchange: (e) => (e.target.closest("#app > div") || root).classList.toggle("hide-rib-" + name, !e.target.checked) }), " " + label);
  return el("div", { class: "ribbon-toggles" },
    el("span", { class: "muted" }, "ribbons under each token, top to bottom: "),
    have.map(([name, , label]) => toggle(name, label)),
    delta ? toggle("delta", "|trainer − rollout| (white 0, red ≥ 0.5)") : null,
    el("span", { class: "muted" }, " colour: p(token) "), el("span", { class: "ribbon-scale", title: "left: p near 0, right: p = 1" }), el("span", { class: "muted" }, " 0 → 1"));
}

/** The trainer ribbon, on demand: a button asking the server to score the session's turns with the run's own
 *  policy at the versions that generated them (GET /api/session/{id}/trainer), then ``onLoaded(answer)``; or, for a
 *  source the server cannot score (a bare log: no run folder with checkpoints), why not instead of a button. */
function trainerControl(s, onLoaded) {
  const status = el("span", { id: "trainer-status", class: "muted", "data-state": "idle" });
  const box = (...children) => el("div", { class: "trainer-control" }, children);
  const scoring = s.trainer_scoring || { available: true, why: null };
  if (s.trainer) {
    status.dataset.state = "loaded";
    status.textContent = trainerSummary(s.trainer);
    return box(status);
  }
  if (!scoring.available) {
    status.dataset.state = "unavailable";
    status.textContent = `no trainer log-probs: ${scoring.why}`;
    return box(status);
  }
  const button = el("button", { type: "button", id: "trainer-load",
    title: "score each turn with the run's checkpoint of the version that generated it (the learner's computation)" },
  "trainer log-probs");
  button.addEventListener("click", async () => {
    button.disabled = true;
    status.dataset.state = "loading";
    status.textContent = "scoring the turns with the run's policy at their versions…";
    try {
      onLoaded(await api("/api/session/" + encodeURIComponent(s.session_id) + "/trainer"));
    } catch (e) {
      status.dataset.state = "error";
      status.className = "error";
      status.textContent = e.message;
      button.disabled = false;
    }
  });
  return box(button, " ", status);
}

/** One line on what the trainer ribbon holds: tokens scored, and each version left blank and why. */
function trainerSummary(t) {
  const parts = [`trainer log-probs: ${t.scored_tokens} tokens scored ${t.engine} in ${fmtNum(t.seconds)} s` + (t.cached ? " (cached)" : "")];
  for (const m of t.missing || []) parts.push(`policy v${m.version} (${m.tokens} tokens of turns ${m.turns.join(", ")}) left blank: ${m.why}`);
  if (t.problem) parts.push(`no training rows: ${t.problem}`);
  return parts.join("; ");
}

/** ``divergeFrom``: for a fork branch, the first token where it differs from the other branches (marked diverged). */
function rowBlock(row, divergeFrom = null) {
  const trained = row.mask.reduce((a, m) => a + m, 0);
  return el("div", { class: "row-block", "data-row-block": row.row },
    el("div", { class: "rowhead" }, el("b", {}, `row ${row.row}`), yesNo(row.trained, "trained", "not trained"),
      el("span", {}, `advantage ${fmtNum(row.advantage)}`), el("span", { class: "muted" }, `${row.tokens.length} tokens, ${trained} in the loss`)),
    tokenView(row, divergeFrom));
}

/** How many leading tokens all the rows share (the fork's common prefix). */
function commonPrefix(rows) {
  if (!rows.length) return 0;
  let n = Math.min(...rows.map((r) => r.tokens.length));
  for (const r of rows.slice(1)) {
    let i = 0;
    while (i < n && r.tokens[i] === rows[0].tokens[i]) i++;
    n = i;
  }
  return n;
}

/** A button, drawn as a link, that scrolls the element ``selector`` names into view (the hash is the route). */
function jumpTo(selector, label) {
  return el("button", { type: "button", class: "jump-link", "data-target": selector, onclick: () => {
    const target = document.querySelector(selector);
    if (target) target.scrollIntoView({ block: "nearest", inline: "nearest" });
  } }, label);
}

/** A session with subagents: the lineage tree, then one column per lineage (side by side, in tree order) with
 *  where it came from (the parent turn and the spawning tool call), its turns and its training rows; a lineage's
 *  fork branches marked where they diverge. */
function lineageColumns(s, turnBox) {
  const lineages = s.lineages || [];
  const rows = s.rows || [];
  const tree = el("ul", { class: "lineage-tree", id: "lineage-tree" }, lineages.map((l) =>
    el("li", { style: `margin-left: ${1.2 * l.depth}em`, "data-lineage": l.id },
      jumpTo(`[data-lineage-col="${CSS.escape(l.id)}"]`, l.id), ` — ${l.turns.length} turns, rows ${l.rows.join(", ") || "none"}`,
      l.spawned_by ? el("span", { class: "muted" }, ` — spawned by ${l.spawned_by}`) : el("span", { class: "muted" }, " — root"))));
  const columns = lineages.map((l) => {
    const mine = rows.filter((r) => r.lineage === l.id);
    const shared = mine.length > 1 ? commonPrefix(mine) : null;
    const call = l.spawn && l.spawn.name ? `${l.spawn.name}(${(l.spawn.arguments || "").slice(0, 160)}${(l.spawn.arguments || "").length > 160 ? "…" : ""})` : null;
    return el("div", { class: "lineage-col", "data-lineage-col": l.id, "data-parent": l.parent || "" },
      el("div", { class: "lineage-head" },
        el("b", {}, "↳ ".repeat(l.depth), `lineage ${l.id}`), " ",
        el("span", { class: "badge" }, l.parent === null ? "root" : "subagent"),
        l.parent !== null ? el("div", { class: "spawn", "data-spawn-call": l.spawn_call || "" }, "spawned by ",
          jumpTo(`[data-lineage-col="${CSS.escape(l.parent)}"] [data-turn="${l.parent_turn}"]`, `${l.parent} turn ${l.parent_turn}`),
          l.spawn_call ? `, call ${l.spawn_call}` : ", no tool call named",
          call ? el("div", { class: "toolcall mono" }, `→ ${call}`) : null,
          el("div", { class: "muted how" }, l.matched || "")) : null,
        el("div", { class: "muted" }, `${l.turns.length} turns · ${mine.length} training row${mine.length === 1 ? "" : "s"}`)),
      (s.turns || []).filter((t) => t.lineage === l.id).map(turnBox),
      el("h4", {}, "Training rows"),
      mine.length ? mine.map((r) => rowBlock(r, shared)) : el("p", { class: "muted" }, "This lineage makes no training row."));
  });
  const orphans = rows.filter((r) => !lineages.some((l) => l.id === r.lineage));
  return el("div", { id: "lineages" },
    el("h3", {}, `Lineages (${lineages.length}): the agent's conversation and its subagents', side by side`), tree,
    el("div", { class: "lineages", style: `grid-template-columns: repeat(${lineages.length}, minmax(22em, 1fr))` }, columns),
    orphans.length ? el("div", {}, el("h4", {}, "Rows of no lineage"), orphans.map((r) => rowBlock(r))) : null);
}

const SessionView = {
  id: null,
  async render(root, params, id) {
    this.id = id;
    const s = await api("/api/session/" + encodeURIComponent(id));
    root.appendChild(el("h1", {}, "Session ", el("span", { class: "mono" }, s.session_id), " ", statusBadge(s.status)));
    root.appendChild(el("dl", { class: "kv card" },
      el("dt", {}, "group"), el("dd", {}, s.group_id ? link(groupHref(s.group_id), s.group_id) : "—"),
      el("dt", {}, "partition"), el("dd", {}, s.partition ?? "—"),
      el("dt", {}, "reward"), el("dd", {}, fmtNum(s.reward)),
      el("dt", {}, "reason"), el("dd", {}, s.reason ? link(sessionsHref({ reason: s.reason }), s.reason) : "—")));
    // The "why" first: it is what one opens a session for.
    root.appendChild(el("div", { class: "why", id: "why" }, el("h3", {}, "Why it scored so"),
      s.why && s.why.length ? el("ul", {}, s.why.map((line) => el("li", {}, line))) : el("p", { class: "muted" }, "(no explanation recorded)")));
    const jump = (sel, label) => el("button", { onclick: () => root.querySelector(sel).scrollIntoView() }, label);
    root.appendChild(el("div", { class: "jumps" }, "jump to: ",
      jump("#transcript", `transcript (${(s.turns || []).length} turns, ${(s.commands || []).length} commands`
        + ((s.resumes || []).length ? `, resumed ${s.resumes.length}x` : "") + ")"), " ",
      jump("#token-view", `token view (${(s.rows || []).length} training rows)`)));
    if (s.verdict) root.appendChild(el("div", { class: "card" }, el("h3", {}, "Verdict"), longText(JSON.stringify(s.verdict, null, 2))));
    if (s.error || s.traceback) {
      root.appendChild(el("div", { class: "card", id: "abort" }, el("h3", {}, "Abort"),
        s.error ? el("div", { class: "error" }, s.error) : null,
        s.traceback ? longText(s.traceback, 8000, "traceback") : null));
    }
    root.appendChild(this.transcript(s));
    root.appendChild(this.tokens(root, s));
  },

  transcript(s) {
    const box = el("section", { id: "transcript" }, el("h2", {}, "Transcript"));
    // What followed each turn (null: before the first), in log order: commands, the snapshot before the next
    // turn, and a resume's marker between the dead incarnation's records and the new one's.
    const byTurn = new Map();
    const add = (turn, lsn, node) => {
      const key = turn === undefined ? null : turn;
      (byTurn.get(key) || byTurn.set(key, []).get(key)).push({ lsn: Number(lsn), node });
    };
    for (const c of s.commands || []) add(c.turn, c.lsn, commandBox(c));
    for (const p of s.snapshots || []) add(p.turn, p.lsn, snapshotBox(p));
    for (const r of s.resumes || []) add(r.turn, r.lsn, resumeMarker(r));
    const after = (turn) => (byTurn.get(turn) || []).sort((a, b) => a.lsn - b.lsn).map((x) => x.node);
    const before = after(null);
    if (before.length) box.appendChild(el("div", { class: "pre-turns" }, el("h3", {}, "Before the first turn"), before));
    if (!(s.turns || []).length) box.appendChild(el("p", { class: "muted" }, "No turn recorded."));
    const lineages = s.lineages || [];
    const turnBox = (t) => {
      const spans = (t.version_spans || []).map(([first, v]) => `v${v} from token ${first}`).join(", ");
      return el("div", { class: "turn", "data-turn": t.turn },
        el("div", { class: "turn-head" },
          el("b", {}, `turn ${t.turn}`), el("span", {}, `lsn ${t.lsn}`), el("span", {}, `policy v${t.policy_version}`),
          spans && (t.version_spans || []).length > 1 ? el("span", { class: "badge flag", title: "a weight update interrupted this turn" }, spans) : null,
          t.server ? el("span", {}, `server ${t.server}` + (t.server_moved_from ? ` (moved from ${t.server_moved_from})` : "")) : null,
          t.finish_reason ? el("span", {}, `finish: ${t.finish_reason}`) : null,
          t.undelivered ? el("span", { class: "badge no", title: "the response never reached the agent" }, "undelivered") : null),
        (t.new_messages || []).map((m) => messageBox(m)),
        t.response ? messageBox(t.response, "  (response)") : null,
        // The subagents this turn's tool calls spawned: each a link to its lineage's column.
        lineages.filter((l) => l.parent !== null && l.parent === t.lineage && l.parent_turn === t.turn).map((l) =>
          el("div", { class: "spawned-link", "data-spawned": l.id }, "spawned ", jumpTo(`[data-lineage-col="${CSS.escape(l.id)}"]`, `lineage ${l.id}`),
            l.spawn_call ? ` by call ${l.spawn_call}` : "")),
        after(t.turn));
    };
    if (lineages.length > 1) {
      box.appendChild(lineageColumns(s, turnBox));
      return box;
    }
    for (const t of s.turns || []) box.appendChild(turnBox(t));
    return box;
  },

  tokens(root, s) {
    const rows = s.rows || [];
    const box = el("section", { id: "token-view" }, el("h2", {}, "Training rows (token view)"));
    if (!rows.length) { box.appendChild(el("p", { class: "muted" }, "This session makes no training row.")); return box; }
    box.appendChild(kindLegend(rows));
    box.appendChild(ribbonControls(root, rows));
    box.appendChild(trainerControl(s, (t) => this.withTrainer(root, s, t)));
    if ((s.lineages || []).length > 1) {
      // A session with subagents: each row sits in its lineage's column (above), beside the turns it is made of.
      const check = (s.forks || {}).train_once || {};
      box.appendChild(el("p", { id: "lineage-rows-note" }, `${rows.length} rows, one or more per lineage, in the lineage columns above. `,
        el("span", { class: check.ok ? "check-ok" : "check-bad", id: "train-once" }, check.ok ? "train-once check: OK" : "train-once check: FAILED"),
        " ", check.detail || ""));
      return box;
    }
    const forks = s.forks || { branches: [] };
    const branchRows = new Set((forks.branches || []).map((b) => b.row));
    if ((forks.branches || []).length > 1) {
      // Forked branches side by side: the shared prefix must be trained once only (the train-once check).
      const check = forks.train_once || {};
      const branchRowList = forks.branches.map((b) => rows.find((r) => r.row === b.row)).filter(Boolean);
      const shared = commonPrefix(branchRowList);
      box.appendChild(el("div", { class: "card", id: "forks" },
        el("h3", {}, "Fork branches ", el("span", { class: check.ok ? "check-ok" : "check-bad", id: "train-once" },
          check.ok ? "train-once check: OK" : "train-once check: FAILED")),
        el("p", {}, check.detail || ""),
        el("p", { id: "fork-diverge", "data-shared": shared }, `branches share ${shared} tokens, differ from token ${shared}`),
        el("div", { class: "forks", style: `grid-template-columns: repeat(${forks.branches.length}, minmax(0, 1fr))` },
          forks.branches.map((b) => {
            const row = rows.find((r) => r.row === b.row);
            return el("div", {}, el("div", { class: "muted" }, `branch: row ${b.row}, turns ${(b.turns || []).join(", ")}`),
              row ? rowBlock(row, shared) : el("p", { class: "error" }, `row ${b.row} is not among this session's rows`));
          }))));
    }
    for (const row of rows) if (!branchRows.has(row.row) || (forks.branches || []).length <= 1) box.appendChild(rowBlock(row));
    return box;
  },

  /** The trainer's answer merged into the rows, then the rows drawn again where they are (the reader's scroll kept). */
  withTrainer(root, s, t) {
    const byRow = new Map((t.rows || []).map((r) => [r.row, r.trainer_logprob]));
    const missing = Object.fromEntries((t.missing || []).map((m) => [m.version, m.why]));
    for (const r of s.rows || []) {
      if (byRow.has(r.row)) r.trainer_logprob = byRow.get(r.row);
      r.trainer_missing = missing;
    }
    s.trainer = t;
    // ``root`` was the box the view was drawn into; the view on screen now holds its nodes.
    const view = document.getElementById("token-view").closest("#app > div") || root;
    const x = window.scrollX, y = window.scrollY;
    // A session with subagents draws its rows in the lineage columns of the transcript.
    if ((s.lineages || []).length > 1) view.querySelector("#transcript").replaceWith(this.transcript(s));
    view.querySelector("#token-view").replaceWith(this.tokens(view, s));
    window.scrollTo(x, y);
  },

  // Live: a change to the session on screen offers a reload instead of redrawing under the reader's eyes.
  onLive(kind, data) { return kind === "session" && data && data.session_id === this.id; },
  live(root) {
    if (root.querySelector("#session-changed")) return;
    root.prepend(el("div", { class: "error", id: "session-changed" }, "This session changed in the log since it was drawn. ",
      el("button", { onclick: () => route() }, "reload it")));
  },
};

/* ---------------- Group view: members, rewards, advantages, baseline membership, refills */

function advBar(a, scale) {
  if (a === null || a === undefined) return null;
  const w = Math.min(60, (60 * Math.abs(a)) / (scale || 1));
  return el("span", { class: "advbar " + (a >= 0 ? "pos" : "neg"), style: `width:${w.toFixed(1)}px` });
}

const GroupView = {
  async render(root, params, id) {
    const g = await api("/api/group/" + encodeURIComponent(id));
    root.appendChild(el("h1", {}, "Group ", el("span", { class: "mono" }, g.group_id)));
    root.appendChild(el("dl", { class: "kv card" },
      el("dt", {}, "trained at step"), el("dd", {}, g.step === null || g.step === undefined ? "— (not trained yet)" : link(stepHref(g.step), String(g.step))),
      el("dt", {}, "skipped"), el("dd", {}, g.skip_reason ? el("span", { class: "badge no" }, g.skip_reason) : "no"),
      el("dt", {}, "members"), el("dd", {}, link(sessionsHref({ group: g.group_id }), `${g.members.length} sessions (in the table)`))));
    const scale = Math.max(1e-9, ...g.members.map((m) => Math.abs(m.advantage || 0)));
    root.appendChild(el("table", { class: "data", id: "group-members" },
      el("thead", {}, el("tr", {}, ["session", "status", "reason", "reward", "advantage", "in baseline", "why not", "refill of", "refilled by"]
        .map((h) => el("th", { class: h === "reward" || h === "advantage" ? "num" : null }, h)))),
      el("tbody", {}, g.members.map((m) => el("tr", { "data-session": m.session_id },
        el("td", {}, link(sessionHref(m.session_id), m.session_id)),
        el("td", {}, statusBadge(m.status)),
        el("td", {}, m.reason || ""),
        el("td", { class: "num" }, fmtNum(m.reward)),
        el("td", { class: "num" }, fmtNum(m.advantage), advBar(m.advantage, scale)),
        el("td", {}, yesNo(m.in_baseline)),
        el("td", {}, m.excluded_why || ""),
        el("td", {}, m.refill_of ? link(sessionHref(m.refill_of), m.refill_of) : ""),
        el("td", {}, m.refilled_by ? link(sessionHref(m.refilled_by), m.refilled_by) : ""))))));
  },
};

/* ---------------- Learner step view: groups trained and skipped, staleness, metrics, reconstruction check */

const StepView = {
  async render(root, params, n) {
    const st = await api("/api/step/" + encodeURIComponent(n));
    const num = Number(st.step);
    root.appendChild(el("h1", {}, `Learner step ${st.step}`, " ",
      el("span", { class: "h1-links" }, link(stepHref(num - 1), "← step " + (num - 1)), " · ", link(stepHref(num + 1), "step " + (num + 1) + " →"))));
    const result = el("span", { id: "reconstruct-result" });
    const detail = el("pre", { id: "reconstruct-detail", class: "muted" });
    const button = el("button", { id: "reconstruct" }, "Reconstruct this step offline and compare");
    button.addEventListener("click", async () => {
      // Rebuilding a step re-reduces the log up to it: it can take a while, so it runs only when asked.
      button.disabled = true;
      result.className = "";
      result.textContent = "reconstructing…";
      detail.textContent = "";
      try {
        const r = await api(`/api/step/${encodeURIComponent(n)}/reconstruct`);
        result.textContent = r.equal ? "EQUAL" : "DIFFERENT";
        result.className = r.equal ? "equal" : "different";
        detail.textContent = `online  ${r.online_digest}\noffline ${r.offline_digest}\n${r.detail || ""}`;
      } catch (e) {
        result.textContent = "";
        detail.replaceChildren(errorBox(e));
      } finally {
        button.disabled = false;
      }
    });
    root.appendChild(el("div", { class: "card" },
      el("dl", { class: "kv" }, el("dt", {}, "policy version"), el("dd", {}, link(sessionsHref({ version: st.policy_version }), `v${st.policy_version}`))),
      el("div", { style: "margin-top:8px" }, button, result), detail));
    const groups = st.groups || [];
    root.appendChild(el("h2", {}, `Groups (${groups.filter((g) => g.trained).length} trained, ${groups.filter((g) => !g.trained).length} skipped)`));
    root.appendChild(el("table", { class: "data", id: "step-groups" },
      el("thead", {}, el("tr", {}, ["group", "trained", "skip reason", "staleness", "members (advantage)"].map((h) => el("th", {}, h)))),
      el("tbody", {}, groups.map((g) => el("tr", { "data-group": g.group_id },
        el("td", {}, link(groupHref(g.group_id), g.group_id)),
        el("td", {}, yesNo(g.trained)),
        el("td", {}, g.skip_reason || ""),
        el("td", { class: "num", title: "policy versions between generation and this step" }, g.staleness === null || g.staleness === undefined ? "—" : String(g.staleness)),
        el("td", {}, (g.members || []).map((m) => el("span", { style: "margin-right:10px; white-space:nowrap" },
          link(sessionHref(m.session_id), m.session_id), ` ${fmtNum(m.advantage)}`, m.trained ? "" : el("span", { class: "badge no" }, "not trained")))))))));
    // The learner's metrics after its decisions: many (30+), so in columns.
    const metrics = Object.entries(st.metrics || {});
    root.appendChild(el("div", { class: "card" }, el("h3", {}, "Metrics"),
      metrics.length ? el("div", { class: "metrics", id: "step-metrics" }, metrics.map(([k, v]) =>
        el("div", {}, el("span", { class: "muted" }, k), " ", el("span", { class: "mono" }, typeof v === "number" ? fmtNum(v, 5) : JSON.stringify(v)))))
        : el("p", { class: "muted" }, "No metric recorded.")));
  },
};

/* ============================================================ 4. router and live updates */

const ROUTES = { run: RunView, sessions: SessionsView, session: SessionView, group: GroupView, step: StepView };

/** "#/session/abc?x=1" -> {name: "session", arg: "abc", params}. Unknown -> the run view. */
function parseHash() {
  const h = location.hash.replace(/^#\/?/, "");
  const qi = h.indexOf("?");
  const path = qi < 0 ? h : h.slice(0, qi);
  const params = new URLSearchParams(qi < 0 ? "" : h.slice(qi + 1));
  const slash = path.indexOf("/");
  const name = slash < 0 ? path : path.slice(0, slash);
  const arg = slash < 0 ? null : decodeURIComponent(path.slice(slash + 1));
  return ROUTES[name] ? { name, arg, params } : { name: "run", arg: null, params };
}

let routeSeq = 0;

/** Draws the view the hash names into a fresh root (id view-<name>); data-ready="1" once drawn, for tests and
 *  for the reader (a failed load shows its error in place and is marked data-ready="error"). */
async function route() {
  const seq = ++routeSeq;
  const r = parseHash();
  state.route = r;
  hideTip();
  for (const a of document.querySelectorAll("#top nav a")) a.classList.toggle("active", a.dataset.nav === r.name);
  const root = el("div", { id: "view-" + r.name, "data-ready": "0" }, el("div", { class: "loading" }, "Loading…"));
  const app = document.getElementById("app");
  app.replaceChildren(root);
  const body = el("div", {});
  try {
    await ROUTES[r.name].render(body, r.params, r.arg);
    if (seq !== routeSeq) return;
    root.replaceChildren(...body.childNodes);
    root.dataset.ready = "1";
    document.title = `agentlog · ${r.name}${r.arg ? " " + r.arg : ""}`;
  } catch (e) {
    if (seq !== routeSeq) return;
    root.replaceChildren(errorBox(e));
    root.dataset.ready = "error";
  }
}

/** Live updates: one EventSource for the page. Events are coalesced (a busy run sends many) into at most one
 *  refresh of the view on screen per LIVE_DEBOUNCE_MS (or the view's liveDebounceMs), well inside the 2 s a new
 *  session may take to show. */
const LIVE_DEBOUNCE_MS = 300;
let pendingLive = null;

function onLiveEvent(kind, data) {
  if (kind === "index" && data) {
    document.getElementById("index-info").textContent = `${data.sessions} sessions indexed`;
  }
  if (kind !== "index") state.run = null; // the run summary (filter options, counts) is stale now
  const r = state.route;
  if (!r) return;
  const view = ROUTES[r.name];
  if (!view.onLive || !view.onLive(kind, data)) return;
  if (pendingLive) return;
  pendingLive = setTimeout(async () => {
    pendingLive = null;
    const root = document.getElementById("view-" + r.name);
    if (!root || state.route !== r || root.dataset.ready !== "1") return;
    try {
      if (view.live) {
        await view.live(root);
      } else {
        // Redrawn off-screen and swapped in whole: the reader's scroll position stays where it was.
        const body = el("div", {});
        await view.render(body, r.params, r.arg);
        if (state.route === r) root.replaceChildren(...body.childNodes);
      }
    } catch (e) {
      root.prepend(errorBox(e));
    }
  }, view.liveDebounceMs || LIVE_DEBOUNCE_MS);
}

function startLive() {
  const badge = document.getElementById("live");
  const es = new EventSource(apiUrl("/api/stream"));
  es.addEventListener("open", () => { badge.textContent = "● live"; badge.className = "on"; badge.title = "following the log"; });
  // EventSource reconnects by itself after an error; the badge says so meanwhile.
  es.addEventListener("error", () => { badge.textContent = "○ reconnecting"; badge.className = "off"; badge.title = "the event stream dropped; retrying"; });
  for (const kind of ["session", "step", "index"]) {
    es.addEventListener(kind, (e) => {
      let data = null;
      try { data = JSON.parse(e.data); } catch (err) { badge.title = `bad ${kind} event from /api/stream: ${err.message}`; return; }
      onLiveEvent(kind, data);
    });
  }
}

function start() {
  window.addEventListener("hashchange", route);
  document.getElementById("jump").addEventListener("submit", (e) => {
    e.preventDefault();
    const id = document.getElementById("jump-input").value.trim();
    if (id) location.hash = sessionHref(id);
  });
  if (!location.hash) history.replaceState(null, "", location.pathname + location.search + "#/run");
  route();
  startLive();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
