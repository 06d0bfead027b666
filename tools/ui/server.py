"""The `agentlog ui` web server (aiohttp): JSON API, SSE stream, static files.

Read-only: GET and HEAD only (anything else 405). Bound to 127.0.0.1 unless
told otherwise; another host needs a token, and with a token every request
(API, SSE, static) must carry ``Authorization: Bearer <token>`` or
``?token=<token>`` (else 401). Without a token only requests whose ``Host``
is a loopback name are answered (else 403): a web page elsewhere cannot
read the run through a DNS name rebound to 127.0.0.1. Errors are JSON
``{"error": ...}`` naming what was wrong; an unexpected one is a JSON 500
(logged with its traceback, the token never). An SSE client that falls
:data:`SSE_QUEUE_MAX` events behind is dropped (EventSource reconnects). The routes and their JSON are the contract in the module
docstrings of :mod:`.views`, :mod:`.index` and :mod:`.trainer` (``/api/session/{id}/trainer``:
the trainer's per-token log-probs, scored on demand in a thread of its own; 409 for a source
without a run folder's checkpoints, 413 for a session past the bounds).

One follower task keeps the index up to date: every :data:`POLL_S` it reads
what the log(s) gained (in a worker thread; the first pass builds or resumes
the index, with a progress bar unless quiet), then pushes the changed
sessions, new learner steps and the index position to every SSE client. A
follower that crashes is logged (``ui.follower.crashed``, with the
traceback) and ``/api/run`` then says ``"live": false`` with the error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hmac
import json
import math
from pathlib import Path
from typing import Any

from aiohttp import web

from agentlog._logging import get_logger
from agentlog.events.errors import AgentlogError
from agentlog.tools.cli_common import json_text

from .index import MAX_SQL_INT

log = get_logger("agentlog.tools.ui.server")

STATIC_DIR = Path(__file__).resolve().parent / "static"
#: How often the follower reads what the log gained (seconds).
POLL_S = 0.25
#: The most rows one page of /api/sessions may ask for.
MAX_LIMIT = 1000
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: The Host header names (port aside) a tokenless server answers.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
#: Events queued for one SSE client before it counts as stuck and is dropped.
SSE_QUEUE_MAX = 1000
_SESSION_PARAMS = ("offset", "limit", "sort", "status", "reason", "flag", "version", "partition", "group", "q",
                   "min_reward", "max_reward", "since", "until", "token")


class BadRequest(AgentlogError, ValueError):
    """A request the API refuses (400)."""


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json_text(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


class UiServer:
    """The app over one source: ``source`` as typed on the command line (run folder, log
    directory or ``nats://`` URL). ``index_path``: the index file (default: see
    :func:`.index.default_index_path`). Raises ``tools.cli.CliError`` for a source that
    does not open, or a non-loopback ``host`` without a ``token``."""

    def __init__(self, source: str, *, token: str | None = None, index_path: str | None = None,
                 host: str = "127.0.0.1", quiet: bool = True) -> None:
        from agentlog.tools.cli import EXIT_USAGE, CliError
        from agentlog.tools.cli_common import check_log_path, check_output_path, learner_log_of, reduce_config_of

        from .index import IndexLockedError, IndexUnusableError, SessionIndex, default_index_path
        from .trainer import TrainerScores
        from .views import RunViews

        if host not in LOOPBACK and not token:
            raise CliError(f"ui: --host {host} is not a loopback address: anyone who can reach it could read the run;"
                           " give --token T (every request must then carry it)", EXIT_USAGE)
        self.arg, self.token, self.host, self.quiet = source, token, host, quiet
        self.source = check_log_path(source, allow_empty=True)
        self.learner = learner_log_of(self.source)
        config = reduce_config_of(self.source)
        path = Path(index_path) if index_path else default_index_path(self.source, source)
        try:
            check_output_path(self.source, str(path), "--index")  # never a file inside the log it indexes
            self.index = SessionIndex(self.source, path, config, owned=not index_path)
        except BaseException as exc:
            self.source.close()
            if isinstance(exc, (IndexLockedError, IndexUnusableError)):
                raise CliError(f"ui: {exc}", EXIT_USAGE) from None
            if isinstance(exc, OSError):  # a folder it may not create, a file it may not write
                raise CliError(f"ui: {path}: cannot open the index: {exc.strerror or exc}", EXIT_USAGE) from None
            raise
        self.views = RunViews(self.source, self.learner, config, self.source.run_dir)
        self.trainer = TrainerScores(self.source.run_dir, config)
        # Its own thread: scoring is serialised and may take long, and requests waiting on it in the
        # default executor would hold every worker thread the other routes and the follower need.
        self._trainer_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentlog-ui-trainer")
        self.runner: web.AppRunner | None = None
        self.follower: asyncio.Task | None = None
        self.follow_error: str | None = None
        self._clients: set[asyncio.Queue] = set()
        self._ready = asyncio.Event()
        self._steps_seen = 0
        self._learner_end: int | None = None  # the learner log's next LSN when its steps were last read

    # ------------------------------------------------------------------ lifetime

    async def start(self, port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port) and start following the log; returns the base URL."""
        self.runner = web.AppRunner(self.build_app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{bound}"
        self.follower = asyncio.ensure_future(self._follow())
        self.follower.add_done_callback(self._follower_done)
        log.info("ui.started", url=self.url, source=self.arg, index=str(self.index.path))
        return self.url

    async def caught_up(self, timeout_s: float = 60.0) -> None:
        """Return once the index holds every record present at start (raises the follower's error)."""
        waiter = asyncio.ensure_future(self._ready.wait())
        assert self.follower is not None, "start() first"
        done, _ = await asyncio.wait({waiter, self.follower}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            if self.follower in done:
                self.follower.result()  # raises the follower's error
            raise TimeoutError(f"{self.arg}: the index did not catch up within {timeout_s} s")

    async def stop(self) -> None:
        """Stop following and serving; close the index (waiting for a catch-up in progress, which
        stops at its next record and keeps what it read)."""
        if self.follower is not None and not self.follower.done():
            self.follower.cancel()
            try:
                await self.follower
            except asyncio.CancelledError:
                pass
        for q in list(self._clients):
            self._end_stream(q)
        if self.runner is not None:
            await self.runner.cleanup()
        self._trainer_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.index.close)
        # The source owns its connection (a JetStream stream's client and bridge thread):
        # left open, it would keep reconnecting to a server long gone.
        await asyncio.to_thread(self.source.close)

    # ------------------------------------------------------------------ following

    async def _follow(self) -> None:
        from agentlog.tools.cli_common import PROGRESS_MIN_BYTES
        from agentlog.tools.progress import new_bar

        size = self.source.byte_size()
        bar = None if self.quiet or size < PROGRESS_MIN_BYTES else new_bar(size, "index", unit="B", unit_scale=True)
        try:
            await asyncio.to_thread(self.index.catch_up, bar)
        finally:
            if bar is not None:
                bar.close()
        log.info("ui.index.ready", sessions=self.index.count(), built_to=self.index.built_to,
                 resumed=self.index.resumed, rebuilt_why=self.index.rebuilt_why,
                 records_read=self.index.records_read, build_s=round(self.index.build_s, 3))
        self._steps_seen = len(await asyncio.to_thread(self.views.records))
        self._ready.set()
        while True:
            await asyncio.sleep(POLL_S)
            changed = await asyncio.to_thread(self.index.catch_up)
            for sid in sorted(changed):
                row = self.index.row(sid)
                if row is not None:
                    self._push("session", row)
            if changed:
                self._push("index", {"sessions": self.index.count(), "built_to": self.index.built_to})
            learner_end = None if self.learner is None else await asyncio.to_thread(self.learner.next_lsn)
            if learner_end is not None and learner_end != self._learner_end:  # read the learner log only when it grew
                self._learner_end = learner_end
                steps = await asyncio.to_thread(self.views.step_summaries)
                for step in steps[self._steps_seen:]:
                    self._push("step", step)
                self._steps_seen = len(steps)

    def _follower_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.follow_error = f"{type(exc).__name__}: {exc}"
            log.error("ui.follower.crashed", source=self.arg, error=self.follow_error, exc_info=exc)

    def _push(self, event: str, data: Any) -> None:
        for q in list(self._clients):
            try:
                q.put_nowait((event, data))
            except asyncio.QueueFull:
                log.warning("ui.stream.dropped", why=f"the client fell {SSE_QUEUE_MAX} events behind", kind=event)
                self._end_stream(q)

    def _end_stream(self, q: asyncio.Queue) -> None:
        """End one SSE client's stream: whatever it has not been sent is dropped, then the end mark."""
        self._clients.discard(q)
        while not q.empty():
            q.get_nowait()
        q.put_nowait(None)

    # ------------------------------------------------------------------ the app

    def build_app(self) -> web.Application:
        """The aiohttp application (routes per the contract)."""
        app = web.Application(middlewares=[self._guard])
        r = app.router
        r.add_get("/", self._page)
        r.add_get("/api/run", self._api_run)
        r.add_get("/api/sessions", self._api_sessions)
        r.add_get("/api/session/{id}", self._api_session)
        r.add_get("/api/session/{id}/trainer", self._api_trainer)
        r.add_get("/api/group/{id}", self._api_group)
        r.add_get("/api/step/{n}", self._api_step)
        r.add_get("/api/step/{n}/reconstruct", self._api_reconstruct)
        r.add_get("/api/stream", self._api_stream)
        r.add_get("/static/{name:.+}", self._static)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"{request.method} {request.path}: this server is read-only (GET and HEAD only)")
        if self.token is None and not _loopback_host(request.headers.get("Host", "")):
            return _error(403, f"{request.path}: Host {request.headers.get('Host', '')!r} is not a loopback name"
                          f" ({', '.join(LOOPBACK_HOSTS)}); a server without --token answers only those")
        if self.token is not None and not self._authorized(request):
            return _error(401, f"{request.path}: a token is required (Authorization: Bearer <token> or ?token=<token>)")
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, f"{request.path}: {exc}")
        except web.HTTPException as exc:
            if exc.status == 405:
                return _error(405, f"{request.method} {request.path}: this server is read-only (GET and HEAD only)")
            return _error(exc.status, f"{request.path}: {exc.reason}")
        except Exception as exc:
            query = {k: ("<hidden>" if k == "token" else v) for k, v in request.query.items()}
            log.error("ui.request.failed", path=request.path, query=query, exc_info=exc)
            return _error(500, f"{request.path}: internal error ({type(exc).__name__}); see the server log")

    def _authorized(self, request: web.Request) -> bool:
        given = request.query.get("token")
        header = request.headers.get("Authorization", "")
        if header[:7].lower() == "bearer ":  # the scheme's name is case-insensitive (RFC 9110)
            given = header[7:]
        # surrogatepass: a header's bytes that are not UTF-8 (or a query's %ED%A0%80) decode to surrogates,
        # which a plain encode() refuses; this one encodes any str, one to one, so only the token matches.
        return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"), str(self.token).encode())

    async def _page(self, request: web.Request) -> web.StreamResponse:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            return _error(404, f"{page}: the frontend's page is missing")
        return web.FileResponse(page)

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        path = (STATIC_DIR / name).resolve()
        if STATIC_DIR.resolve() not in path.parents or not path.is_file():
            return _error(404, f"/static/{name}: no such file")
        return web.FileResponse(path)

    async def _api_run(self, request: web.Request) -> web.Response:
        ix = self.index
        summary = ix.summary()
        steps = await asyncio.to_thread(self.views.step_summaries)
        live = self.follower is not None and not self.follower.done()
        out = {"source": self.arg, "live": live,
               "index": {"sessions": summary["sessions"]["total"], "built_to": ix.built_to, "build_s": round(ix.build_s, 4),
                         "path": str(ix.path), "resumed": ix.resumed, "rebuilt_why": ix.rebuilt_why,
                         "records_read": ix.records_read, "ready": self._ready.is_set()},
               **summary, "steps": steps, "aborts_over_time": ix.aborts_over_time()}
        if self.follow_error is not None:
            out["error"] = f"the log follower stopped: {self.follow_error}"
        return _json(out)

    async def _api_sessions(self, request: web.Request) -> web.Response:
        from agentlog.reducers.health import ALL_FLAGS

        from .index import QueryError

        q = request.query
        for name in q:
            if name not in _SESSION_PARAMS:
                raise BadRequest(f"unknown query parameter {name!r} (expected one of {', '.join(_SESSION_PARAMS)})")
        flag = q.get("flag") or None
        if flag is not None and flag not in ALL_FLAGS:
            raise BadRequest(f"flag: expected one of {', '.join(ALL_FLAGS)}, found {flag!r}")
        kw = {"offset": _int(q, "offset", 0, 0), "limit": _int(q, "limit", 50, 1, MAX_LIMIT),
              "sort": q.get("sort") or "first_ts", "status": q.get("status") or None, "reason": q.get("reason") or None,
              "flag": flag, "version": _int(q, "version", None, 0), "partition": q.get("partition") or None,
              "group": q.get("group") or None, "q": q.get("q") or None,
              "min_reward": _float(q, "min_reward"), "max_reward": _float(q, "max_reward"),
              "since": _float(q, "since"), "until": _float(q, "until")}
        try:
            total, rows = self.index.query(**kw)
        except QueryError as exc:
            raise BadRequest(str(exc)) from None
        return _json({"total": total, "offset": kw["offset"], "limit": kw["limit"], "rows": rows})

    async def _api_session(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        row = self.index.row(sid)
        where = self.index.locate(sid)
        if row is None or where is None:
            return _error(404, f"session {sid!r}: not in the index of {self.arg} (built to {self.index.built_to})")

        def build() -> dict:
            envs = self.views.session_envelopes(sid, *where)
            return self.views.session(row, envs)

        view = await asyncio.to_thread(build)
        if view.get("rows"):
            adv = await asyncio.to_thread(self._advantage_of, row)
            for r in view["rows"]:
                r["advantage"] = adv if r["trained"] else None
        why = await asyncio.to_thread(self.trainer.unavailable)
        view["trainer_scoring"] = {"available": why is None, "why": why}
        return _json(view)

    async def _api_trainer(self, request: web.Request) -> web.Response:
        """The session's trainer log-probs, scored on demand in the trainer's own thread (:mod:`.trainer`):
        409 when the source cannot be scored, 413 past the per-session bounds, 422 naming the
        turns a version's policy cannot take (longer than its context)."""
        from agentlog.events.errors import ConfigError

        from .trainer import ScoringUnavailable, TooMuchToScore, TurnNotScorable

        sid = request.match_info["id"]
        where = self.index.locate(sid)
        if where is None:
            return _error(404, f"session {sid!r}: not in the index of {self.arg} (built to {self.index.built_to})")

        def build() -> dict:
            return self.trainer.session(sid, self.views.session_envelopes(sid, *where))

        try:
            scored = await asyncio.get_running_loop().run_in_executor(self._trainer_pool, contextvars.copy_context().run, build)
            return _json(scored)
        except (ScoringUnavailable, ConfigError) as exc:
            return _error(409, f"{request.path}: {exc}")
        except TooMuchToScore as exc:
            return _error(413, f"{request.path}: {exc}")
        except TurnNotScorable as exc:
            return _error(422, f"{request.path}: session {sid!r}: {exc}")

    def _advantage_of(self, row: dict) -> float | None:
        if self.learner is None or not row.get("group_id"):
            return None
        group = self.views.group(row["group_id"], self.index.built_to)
        if group is None:
            return None
        return next((m["advantage"] for m in group["members"] if m["session_id"] == row["session_id"]), None)

    async def _api_group(self, request: web.Request) -> web.Response:
        gid = request.match_info["id"]
        view = await asyncio.to_thread(self.views.group, gid, self.index.built_to)
        if view is None:
            return _error(404, f"group {gid!r}: not released in {self.arg} (built to {self.index.built_to})")
        return _json(view)

    async def _api_step(self, request: web.Request) -> web.Response:
        n = _path_int(request, "n")
        view = await asyncio.to_thread(self.views.step, n, self.index.built_to)
        if view is None:
            return _error(404, f"step {n}: the learner log of {self.arg} has no such step" if self.learner is not None
                          else f"step {n}: {self.arg} has no learner log (a bare rollout log)")
        return _json(view)

    async def _api_reconstruct(self, request: web.Request) -> web.Response:
        n = _path_int(request, "n")
        view = await asyncio.to_thread(self.views.reconstruct, n, self.index.built_to)
        if view is None:
            return _error(404, f"step {n}: the learner log of {self.arg} has no such step")
        return _json(view)

    async def _api_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue = asyncio.Queue(maxsize=SSE_QUEUE_MAX)
        self._clients.add(queue)
        try:
            await resp.write(f"event: index\ndata: {json.dumps({'sessions': self.index.count(), 'built_to': self.index.built_to})}\n\n".encode())
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=15.0)
                except asyncio.TimeoutError:
                    await resp.write(b": keep-alive\n\n")
                    continue
                if item is None:
                    break
                event, data = item
                await resp.write(f"event: {event}\ndata: {json_text(data)}\n\n".encode())
        except ConnectionResetError:
            pass  # the client went away: nothing more to send it
        finally:
            self._clients.discard(queue)
        return resp


def _int(q: Any, name: str, default: int | None, low: int, high: int | None = None) -> Any:
    """``q[name]`` as an integer in [low, high] (high: SQLite's largest), ``default`` when absent or empty."""
    text = q.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"{name}: expected an integer, found {text!r:.60}") from None
    high = MAX_SQL_INT if high is None else high
    if value < low or value > high:
        raise BadRequest(f"{name}: expected an integer in [{low}, {high}], found {text:.60}")
    return value


def _float(q: Any, name: str) -> float | None:
    text = q.get(name)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"{name}: expected a number, found {text!r}") from None
    if not math.isfinite(value):
        raise BadRequest(f"{name}: expected a finite number, found {text!r}")
    return value


def _path_int(request: web.Request, name: str) -> int:
    """The path's integer ``name`` (any sign: a step number that cannot exist is a 404, not a 400)."""
    return _int(request.match_info, name, None, -MAX_SQL_INT)


def _loopback_host(host: str) -> bool:
    """Whether a Host header names a loopback host (any port)."""
    name = host.rpartition("]")[0] + "]" if host.startswith("[") else host.partition(":")[0]
    return name.lower() in LOOPBACK_HOSTS
