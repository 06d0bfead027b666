"""`agentlog ui` in a real browser: the page (tools/ui/static/) against the real server (tools/ui/server.py).

Playwright's Python client drives the SYSTEM Chromium (``executable_path``; never ``playwright install``: no browser
download), headless, with every host name unresolvable: the page must work with no network. One browser serves the
module and one page serves each server (pages are reused); every test fails on any console error or page error the
page logged, and on any request that left the server under test.

Checks: each view renders (run, sessions, session, group, step; the reconstruct button shows what the API says); the
sessions table filtered in the UI (status, reason, health flag) shows exactly the sessions ``agentlog replay LOG
--status X --json`` prints; the token view has one span per token whose data-mask is the row's mask; the "trainer
log-probs" button draws the trainer ribbon where the API scored a token (a bare log shows why not instead); a live log's new
session shows within 2 s, through a server started with --token (the page passes ?token= on every request), with its
hostile transcript text drawn as text.

``AGENTLOG_UI_SCREENSHOTS=1`` also writes docs/ui/<view>.png (1280x800) for the README; a default run writes nothing
into the repository.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import ROOT, agentlog
from ui_helpers import start_ui, ui_run  # noqa: F401  (ui_run is a fixture)

pytestmark = pytest.mark.required

SCREENSHOTS = os.environ.get("AGENTLOG_UI_SCREENSHOTS") == "1"
SHOT_DIR = ROOT / "docs" / "ui"
VIEWPORT = {"width": 1280, "height": 800}
#: How long a view may take to draw (ms) before the test fails naming it.
VIEW_TIMEOUT_MS = 15_000
#: The live goal: a session appended to the log shows in the open sessions table within this many seconds.
LIVE_GOAL_S = 2.0
#: Markup a model could write into a transcript: it must show as text and never run.
HOSTILE = "<img src=x onerror=\"window.__pwned=1\"><script>window.__pwned=2</script> & </pre>"


# ---------------------------------------------------------------- browser, pages, servers


@pytest.fixture(scope="module")
def browser():
    """One headless system Chromium for the module, or skip (required: a skip fails under CI=true)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium not installed (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
    pw = sync_api.sync_playwright().start()
    try:
        # Every host but the loopback server fails to resolve: no asset may come from the network.
        args = ["--no-sandbox", "--headless=new", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
        b = pw.chromium.launch(executable_path=binary, args=args)
    except Exception as e:  # noqa: BLE001 - any launch failure means "cannot run here", reported as the skip reason
        pw.stop()
        pytest.skip(f"Playwright cannot drive {binary} here: {e}")
    yield b
    b.close()
    pw.stop()


class Tab:
    """One page of the browser on one server, reused across tests, with what went wrong in it: console errors,
    page errors (uncaught exceptions) and requests to anything but the server under test."""

    def __init__(self, browser: Any, base: str, token: str | None = None) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.page = browser.new_page(viewport=VIEWPORT)
        self.problems: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.problems.append(f"console error: {m.text} at {m.location}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("request", lambda r: r.url.startswith(self.base) or r.url.startswith("data:")
                     or self.problems.append(f"request outside the server: {r.url}"))

    def open(self, route: str, view: str) -> Any:
        """Show ``#/route`` and wait until the view ``view`` is drawn (its root has data-ready="1"); fail with the
        page's error box when it drew an error instead."""
        page = self.page
        # The view's root is made anew per navigation: mark the old one so a stale "ready" never counts.
        page.evaluate("document.querySelectorAll('#app > div').forEach((e) => e.setAttribute('data-stale', '1'))")
        if page.url.startswith(self.base + "/") and "#" in page.url:
            page.evaluate("(h) => { location.hash = h; }", "#/" + route)
        else:
            query = f"?token={urllib.parse.quote(self.token)}" if self.token else ""
            page.goto(f"{self.base}/{query}#/{route}")
        return self.wait_view(view)

    def wait_view(self, view: str) -> Any:
        """Wait for a fresh root of ``view`` to be drawn (after a navigation the page made itself)."""
        root = f"#view-{view}:not([data-stale])"
        self.page.wait_for_selector(f"{root}[data-ready='1'], {root}[data-ready='error']", timeout=VIEW_TIMEOUT_MS)
        if self.page.get_attribute(root, "data-ready") == "error":
            pytest.fail(f"view {view} ({self.page.url}) drew an error: {self.page.text_content(root)}")
        return self.page.locator(root)

    def mark_stale(self) -> None:
        """Mark the view on screen stale before an action of the page itself navigates (a filter, a link)."""
        self.page.evaluate("document.querySelectorAll('#app > div').forEach((e) => e.setAttribute('data-stale', '1'))")

    def shot(self, name: str) -> None:
        """docs/ui/<name>.png, only when AGENTLOG_UI_SCREENSHOTS=1."""
        if SCREENSHOTS:
            SHOT_DIR.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(SHOT_DIR / f"{name}.png"))

    def assert_clean(self) -> None:
        assert not self.problems, "\n".join(self.problems)

    def row_ids(self) -> list[str]:
        return self.page.eval_on_selector_all("#sessions-table tbody tr[data-session]", "rs => rs.map(r => r.dataset.session)")


def get_json(base: str, path: str, token: str | None = None) -> Any:
    """GET an API path of the server under test (what the page shows is checked against it)."""
    url = base.rstrip("/") + path + (("&" if "?" in path else "?") + "token=" + token if token else "")
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def demo_tab(browser, ui_run, tmp_path_factory):  # noqa: F811
    """A page on the server of the short demo's run folder (rollout + learner: steps, groups, reconstruct);
    its index in a temporary file, not in the run folder other modules share."""
    url, stop = start_ui(ui_run.demo, index_path=tmp_path_factory.mktemp("ui-browser") / "demo.sqlite")
    tab = Tab(browser, url)
    yield tab
    tab.page.close()
    stop()


@pytest.fixture(scope="module")
def log_tab(browser, ui_run, tmp_path_factory):  # noqa: F811
    """A page on the server of the CLI tests' log (finished, aborted, dropped, forked, running sessions)."""
    url, stop = start_ui(ui_run.log, index_path=tmp_path_factory.mktemp("ui-browser") / "log.sqlite")
    tab = Tab(browser, url)
    yield tab
    tab.page.close()
    stop()


# ---------------------------------------------------------------- views


def test_every_view_renders_what_the_api_says_without_console_errors(demo_tab):
    tab, page, base = demo_tab, demo_tab.page, demo_tab.base
    run = get_json(base, "/api/run")

    tab.open("run", "run")
    tab.shot("run")
    for status in ("finished", "aborted", "dropped", "running"):
        assert page.text_content(f"a.stat[data-status='{status}'] b") == str(run["sessions"][status]), status
    steps = [s for s in run["steps"] if s["reward_mean"] is not None]
    assert steps, "the demo run has learner steps with a reward"
    # One linked point per step with a reward, each opening that step.
    hrefs = page.eval_on_selector_all("#chart-reward svg a", "as => as.map(a => a.getAttribute('href'))")
    assert hrefs == [f"#/step/{s['step']}" for s in steps]
    # The loss and throughput curves likewise; the version curve opens the sessions of each version.
    for chart, field in (("loss", "loss"), ("throughput", "tokens_per_s")):
        hrefs = page.eval_on_selector_all(f"#chart-{chart} svg a", "as => as.map(a => a.getAttribute('href'))")
        assert hrefs == [f"#/step/{s['step']}" for s in run["steps"] if s[field] is not None], chart
    hrefs = page.eval_on_selector_all("#chart-versions svg a", "as => as.map(a => a.getAttribute('href'))")
    assert hrefs == [f"#/sessions?version={s['policy_version']}" for s in run["steps"]]
    # Health-flag and reason counts: each its count, each opening the sessions it counts.
    for card, param, counts in (("flags", "flag", run["flags"]), ("reasons", "reason", run["reasons"])):
        shown = page.eval_on_selector_all(f"#{card} .hbars > a", "as => as.map(a => [a.getAttribute('href'),"
                                          " a.nextElementSibling.nextElementSibling.textContent])")
        assert counts and sorted(shown) == sorted([f"#/sessions?{urllib.parse.urlencode({param: k})}", str(n)]
                                                  for k, n in counts.items()), (card, shown)

    # Sessions: the first page as the API gives it, then sorted by reward through a header click.
    table = tab.open("sessions", "sessions")
    page_json = get_json(base, "/api/sessions?offset=0&limit=50")
    assert table.locator("#sessions-table").get_attribute("data-total") == str(page_json["total"])
    assert tab.row_ids() == [r["session_id"] for r in page_json["rows"]]
    tab.shot("sessions")
    tab.mark_stale()
    page.click("#sessions-table th[data-sort='reward']")
    tab.wait_view("sessions")
    assert "sort=reward" in page.url
    assert tab.row_ids() == [r["session_id"] for r in get_json(base, "/api/sessions?offset=0&limit=50&sort=reward")["rows"]]

    # A finished session with training rows, opened by clicking its row; then its group.
    finished = get_json(base, "/api/sessions?status=finished&limit=50")["rows"]
    sid = next(r["session_id"] for r in finished if r["reward"] is not None)
    tab.open("sessions?status=finished&limit=50", "sessions")
    tab.mark_stale()
    page.click(f"#sessions-table tr[data-session='{sid}'] td:nth-child(4)")  # the row, not its link
    tab.wait_view("session")
    session = get_json(base, f"/api/session/{urllib.parse.quote(sid)}")
    assert page.locator("#why li").count() == len(session["why"])
    assert page.locator("#transcript .turn").count() == len(session["turns"])
    assert page.locator(".tokens").count() == len(session["rows"])
    tab.shot("session")
    if SCREENSHOTS:  # the token view too, with a token's tooltip open
        page.evaluate("document.querySelector('#token-view').scrollIntoView()")
        page.hover("#token-view span.tok.kind-trained >> nth=0")
        tab.shot("session-tokens")

    group = get_json(base, f"/api/group/{urllib.parse.quote(session['group_id'])}")
    tab.open(f"group/{urllib.parse.quote(session['group_id'])}", "group")
    assert page.eval_on_selector_all("#group-members tr[data-session]", "rs => rs.map(r => r.dataset.session)") == [
        m["session_id"] for m in group["members"]]
    tab.shot("group")

    # A learner step: its groups, then the offline reconstruction the button asks for.
    n = steps[0]["step"]
    step = get_json(base, f"/api/step/{n}")
    tab.open(f"step/{n}", "step")
    assert page.eval_on_selector_all("#step-groups tr[data-group]", "rs => rs.map(r => r.dataset.group)") == [g["group_id"] for g in step["groups"]]
    page.click("#reconstruct")
    page.wait_for_function("() => ['EQUAL', 'DIFFERENT'].includes(document.querySelector('#reconstruct-result').textContent)",
                           timeout=60_000)
    expected = get_json(base, f"/api/step/{n}/reconstruct")
    assert page.text_content("#reconstruct-result") == ("EQUAL" if expected["equal"] else "DIFFERENT")
    assert expected["online_digest"] in page.text_content("#reconstruct-detail")
    tab.shot("step")
    tab.assert_clean()


def test_an_unknown_session_shows_the_servers_error_in_the_page(log_tab):
    tab, page = log_tab, log_tab.page
    tab.open("run", "run")
    tab.mark_stale()
    page.evaluate("() => { location.hash = '#/session/no-such-session'; }")
    page.wait_for_selector("#view-session:not([data-stale])[data-ready='error']", timeout=VIEW_TIMEOUT_MS)
    assert "no-such-session" in page.text_content("#view-session .error")
    # The browser logs the 404 itself ("Failed to load resource"); that one is expected, anything else is not.
    tab.problems[:] = [p for p in tab.problems if "404" not in p]
    tab.assert_clean()


# ---------------------------------------------------------------- filters match `agentlog replay`


def replay_ids(log: Path, *args: str) -> set[str]:
    """The sessions `agentlog replay LOG ARGS --json` prints events of."""
    res = agentlog("replay", str(log), *args, "--json", "-q")
    assert res.returncode == 0, res.stderr
    return {json.loads(line)["session_id"] for line in res.stdout.splitlines() if line.strip()}


def test_sessions_filtered_in_the_ui_are_the_sessions_replay_selects(log_tab, ui_run):  # noqa: F811
    tab, page = log_tab, log_tab.page
    run = get_json(tab.base, "/api/run")
    filters = [("status", s) for s in ("finished", "aborted", "dropped", "running") if run["sessions"][s]]
    filters += [("reason", r) for r in sorted(run["reasons"])]
    filters += [("flag", f) for f in sorted(run["flags"])]
    assert {"status", "reason"} <= {k for k, _ in filters}, run
    # The CLI runs (a Python start each) in parallel while the browser works.
    with ThreadPoolExecutor(len(filters)) as pool:
        expected = {kv: pool.submit(replay_ids, ui_run.log, f"--{kv[0]}", kv[1]) for kv in filters}
        shown = {}
        for name, value in filters:
            tab.open("sessions?limit=500", "sessions")
            tab.mark_stale()
            page.select_option(f"#sessions-filters select[name='{name}']", value)
            tab.wait_view("sessions")
            assert f"{name}={urllib.parse.quote(value)}" in page.url
            shown[(name, value)] = tab.row_ids()
        for kv in filters:
            assert sorted(shown[kv]) == sorted(expected[kv].result()), kv
            assert len(set(shown[kv])) == len(shown[kv]), kv
    tab.assert_clean()


def test_each_abort_bar_opens_the_sessions_it_counts(log_tab):
    tab, page = log_tab, log_tab.page
    buckets = get_json(tab.base, "/api/run")["aborts_over_time"]
    tab.open("run", "run")
    hrefs = page.eval_on_selector_all("#chart-aborts svg a", "as => as.map(a => a.getAttribute('href'))")
    assert len(hrefs) == len(buckets) >= 3, (hrefs, buckets)
    for href, bucket in zip(hrefs, buckets):
        query = urllib.parse.parse_qs(href.split("?", 1)[1])
        assert (query["reason"], float(query["since"][0]), float(query["until"][0])) == (
            [bucket["reason"]], bucket["bucket_ts"], bucket["bucket_end"]), href
        tab.open(href.removeprefix("#/") + "&limit=500", "sessions")
        assert len(tab.row_ids()) == bucket["count"], (href, bucket)
    tab.assert_clean()


# ---------------------------------------------------------------- the token view


def test_the_token_view_has_one_span_per_token_carrying_the_rows_mask(log_tab):
    tab, page = log_tab, log_tab.page
    checked = forked = 0
    for sid in ("fin-0", "fork-2", "abort-0"):
        session = get_json(tab.base, f"/api/session/{sid}")
        tab.open(f"session/{sid}", "session")
        for row in session["rows"]:
            spans = page.eval_on_selector_all(
                f".tokens[data-row='{row['row']}'] span.tok",
                "ss => ss.map(s => [s.dataset.mask, [...s.classList].find(c => c.startsWith('kind-')).slice(5)])")
            assert len(spans) == len(row["tokens"]), (sid, row["row"])
            assert [int(m) for m, _ in spans] == row["mask"], (sid, row["row"])
            assert [k for _, k in spans] == row["kinds"], (sid, row["row"])
            assert [m == "1" for m, _ in spans] == [k == "trained" for _, k in spans], (sid, row["row"])
            checked += 1
        if len(session["forks"]["branches"]) > 1:
            # Fork branches side by side, under the train-once check the API states.
            assert page.locator("#forks .forks > div").count() == len(session["forks"]["branches"])
            ok = session["forks"]["train_once"]["ok"]
            assert page.text_content("#train-once") == ("train-once check: OK" if ok else "train-once check: FAILED")
            # Where the branches part: every branch's tokens from the common prefix on are marked diverged.
            branch_rows = [r for b in session["forks"]["branches"] for r in session["rows"] if r["row"] == b["row"]]
            shared = len(os.path.commonprefix([r["tokens"] for r in branch_rows]))
            assert shared < min(len(r["tokens"]) for r in branch_rows), (sid, shared)  # fork-2's branches share 0
            assert page.text_content("#fork-diverge") == f"branches share {shared} tokens, differ from token {shared}"
            for r in branch_rows:
                diverged = page.eval_on_selector_all(
                    f"#forks .tokens[data-row='{r['row']}'] span.tok.diverged", "ss => ss.map(s => Number(s.dataset.i))")
                assert diverged == list(range(shared, len(r["tokens"]))), (sid, r["row"])
            forked += 1
    assert checked >= 3 and forked == 1
    # A shared prefix the log's fork lacks (its second branch rewrote the first prompt): the page's own measure.
    prefix = "rs => commonPrefix(rs.map(t => ({tokens: t})))"
    assert page.evaluate(prefix, [[1, 2, 3, 4], [1, 2, 9], [1, 2, 3]]) == 2
    assert page.evaluate(prefix, [[5, 6], [5, 6, 7]]) == 2 and page.evaluate(prefix, [[1], [2]]) == 0
    # The tooltip of a generated token names its mask and its rollout log-prob.
    tab.open("session/fin-0", "session")
    page.hover(".tokens span.tok.kind-trained >> nth=0")
    tip = page.text_content("#tok-tip")
    assert "mask 1" in tip and "rollout" in tip, tip
    tab.assert_clean()


def test_the_trainer_log_probs_button_draws_the_trainer_ribbon_and_a_bare_log_says_why_not(demo_tab, log_tab):
    # A run folder: the button scores the session's turns with the run's checkpoints, then the rows are drawn again
    # with a trainer ribbon under each token the API gave a log-prob (and the |trainer - rollout| ribbon).
    tab, page = demo_tab, demo_tab.page
    sid = get_json(tab.base, "/api/sessions?status=finished&limit=1&sort=session_id")["rows"][0]["session_id"]
    tab.open("run", "run")  # a hash change (the tab may already show this session: the same hash draws nothing)
    tab.open(f"session/{urllib.parse.quote(sid)}", "session")
    assert page.locator("#token-view .rib-trainer").count() == 0
    page.click("#trainer-load")
    page.wait_for_selector("#trainer-status[data-state='loaded'], #trainer-status[data-state='error']", timeout=60_000)
    assert page.get_attribute("#trainer-status", "data-state") == "loaded", page.text_content("#trainer-status")
    trainer = get_json(tab.base, f"/api/session/{urllib.parse.quote(sid)}/trainer")
    assert trainer["cached"] is True  # the page's request scored it; this one reads the server's cache
    for row in trainer["rows"]:
        drawn = page.eval_on_selector_all(f".tokens[data-row='{row['row']}'] span.tok",
                                          "ss => ss.map(s => { const r = s.querySelector('.rib-trainer');"
                                          " return r === null ? 'none' : r.style.background !== ''; })")
        assert drawn == [lp is not None for lp in row["trainer_logprob"]], (sid, row["row"])
        assert any(drawn)
    assert page.locator("#token-view .rib-delta").count() > 0
    # Its toggle hides it (on the view on screen), and a ribbon hidden stays hidden when the rows are drawn again.
    toggle = page.locator(".ribbon-toggles label", has_text="trainer log-prob").locator("input")
    toggle.uncheck()
    assert page.eval_on_selector("#token-view .rib-trainer", "r => getComputedStyle(r).display") == "none"
    toggle.check()
    assert page.eval_on_selector("#token-view .rib-trainer", "r => getComputedStyle(r).display") == "block"
    assert f"{trainer['scored_tokens']} tokens scored" in page.text_content("#trainer-status")
    tab.shot("session-trainer")
    tab.assert_clean()

    # A bare log: no button, the server's reason in its place (and no request that would fail).
    tab, page = log_tab, log_tab.page
    why = get_json(tab.base, "/api/session/fin-0")["trainer_scoring"]["why"]
    tab.open("run", "run")
    tab.open("session/fin-0", "session")
    assert page.locator("#trainer-load").count() == 0
    assert page.get_attribute("#trainer-status", "data-state") == "unavailable"
    assert why in page.text_content("#trainer-status")
    tab.assert_clean()


# ---------------------------------------------------------------- a session with subagents


def test_a_session_with_subagents_shows_one_column_per_lineage_side_by_side(browser, tmp_path):
    from lineage_helpers import LINEAGE_SESSION, write_lineage_log

    with ThreadPoolExecutor(1) as pool:  # its own thread and event loop: Playwright's sync API owns this thread's loop
        log = pool.submit(write_lineage_log, tmp_path / "lin.log").result(60)
    url, stop = start_ui(log, index_path=tmp_path / "lin.sqlite")
    tab = Tab(browser, url)
    try:
        page = tab.page
        session = get_json(url, f"/api/session/{LINEAGE_SESSION}")
        tab.open(f"session/{LINEAGE_SESSION}", "session")
        # One column per lineage, in the API's (tree) order, each with its turns and its rows' token views.
        cols = page.eval_on_selector_all("#lineages .lineage-col", "cs => cs.map(c => [c.dataset.lineageCol, c.dataset.parent,"
                                         " [...c.querySelectorAll('.turn')].map(t => Number(t.dataset.turn)),"
                                         " [...c.querySelectorAll('.tokens')].map(t => Number(t.dataset.row))])")
        assert cols == [[lin["id"], lin["parent"] or "", lin["turns"], lin["rows"]] for lin in session["lineages"]]
        assert len(cols) == 4 and page.locator("#transcript .turn").count() == len(session["turns"])
        # Side by side: the columns start at one height, left to right.
        boxes = page.eval_on_selector_all("#lineages .lineage-col", "cs => cs.map(c => [c.offsetLeft, c.offsetTop])")
        assert len({top for _, top in boxes}) == 1 and [left for left, _ in boxes] == sorted({left for left, _ in boxes})
        # Each subagent names its parent turn and spawning call; the parent turn links to the subagents it spawned.
        for lin in session["lineages"][1:]:
            spawn = page.text_content(f"[data-lineage-col='{lin['id']}'] .spawn")
            assert f"{lin['parent']} turn {lin['parent_turn']}" in spawn and f"call {lin['spawn_call']}" in spawn and "→ Task(" in spawn
        assert page.eval_on_selector_all("[data-lineage-col='main'] [data-turn='4'] .spawned-link",
                                         "ls => ls.map(l => l.dataset.spawned)") == ["sub-2", "sub-3"]
        page.click("[data-lineage-col='sub-3'] .spawn .jump-link")  # to the parent turn: no error
        assert page.text_content("#train-once") == "train-once check: OK"
        tab.assert_clean()
    finally:
        tab.page.close()
        stop()


# ---------------------------------------------------------------- live, with a token


def _append_session(log: Path, session_id: str, text: str) -> None:
    """Append one finished session whose transcript holds ``text`` (the real engine on the FileLog)."""

    async def write() -> None:
        from agentlog.engine import SessionEngine
        from agentlog.events import FileLog

        log_ = FileLog.open(log, fsync="batch")
        try:
            eng = await SessionEngine.open(log_, drain_s=0.1)
            h = await eng.open_session(session_id, group_id="g-ui", group_size=1, sample_index=0)
            await h.start()
            await h.record_turn(messages=[{"role": "user", "content": text}], prompt_ids=[1, 2, 3], output_ids=[5, 6],
                                output_log_probs=[-0.1, -0.2], response_message={"role": "assistant", "content": text})
            await h.finish(reward=1.0)
        finally:
            log_.close()

    errors: list[BaseException] = []
    # Its own thread and event loop: Playwright's sync API owns this thread's loop.
    t = threading.Thread(target=lambda: _run_catching(write, errors))
    t.start()
    t.join(60)
    assert not t.is_alive(), "appending a session took over 60 s"
    if errors:
        raise errors[0]


def _run_catching(coro_fn: Any, errors: list[BaseException]) -> None:
    try:
        asyncio.run(coro_fn())
    except BaseException as e:  # noqa: BLE001 - handed to the test thread, which raises it
        errors.append(e)


def test_a_live_log_shows_a_new_session_within_2_s_through_a_token_server(browser, ui_run, tmp_path):  # noqa: F811
    log = tmp_path / "live.log"
    shutil.copytree(ui_run.log, log, ignore=shutil.ignore_patterns("LOCK"))
    token = "t0k-en"
    url, stop = start_ui(log, token=token)
    tab = Tab(browser, url, token=token)
    try:
        page = tab.page
        tab.open("sessions?limit=500", "sessions")
        before = set(tab.row_ids())
        assert before and "ui-live-1" not in before
        page.wait_for_selector("#live.on", timeout=5000)  # the event stream is connected (with the token)
        _append_session(log, "ui-live-1", HOSTILE)
        written = time.monotonic()
        page.wait_for_selector("#sessions-table tr[data-session='ui-live-1']", timeout=LIVE_GOAL_S * 1000 + 3000)
        took = time.monotonic() - written
        assert took < LIVE_GOAL_S, f"the new session took {took:.2f} s to show (goal < {LIVE_GOAL_S} s)"
        assert before <= set(tab.row_ids())

        # The session's transcript holds markup: it is drawn as text and never runs.
        tab.mark_stale()
        page.click("#sessions-table tr[data-session='ui-live-1'] a")
        tab.wait_view("session")
        assert HOSTILE in page.text_content("#transcript")
        assert page.locator("#transcript img, #transcript script").count() == 0
        assert page.evaluate("() => window.__pwned === undefined")
        tab.assert_clean()
    finally:
        tab.page.close()
        stop()
