"""``agentlog loadgen``: replay a run's recorded sessions against an inference server or router.

Real agent traffic for inference teams: every recorded turn of the chosen sessions is sent
again, with its own prompt, at the moment the recording says, and what the server did with
it is measured (throughput, latency percentiles, cached prompt tokens).

**What is sent.** A turn's request is its recorded prompt, byte for byte:

* ``generate`` (SGLang's ``/generate``): ``input_ids`` = the recorded prompt token ids;
* ``completions`` (an OpenAI-compatible ``/v1/completions``, vLLM): ``prompt`` = those ids;
* ``chat`` (``/v1/chat/completions``): ``messages`` = the recorded messages, as recorded.

Sampling is the turn's recorded temperature, top_p, top_k, seed and stop ids (each sent only
when recorded), and the output budget is the turn's recorded output length (at least 1), so
the server does about the work the recording did; ``ignore_eos`` asks it for exactly that
length. Every request carries the session's routing key (its recorded session id) in a header,
:data:`DEFAULT_ROUTING_HEADER` unless told otherwise, so a router can keep a session's turns on
the replica that caches its prefix.

**When it is sent.** The envelope of a turn records when it was appended (``ts_ns``, just
after the answer) and how long the generation took (``generate_s``), so the turn's request left
at ``ts_ns - generate_s``. Replay time 0 is the earliest such moment among the chosen sessions.
A session starts at its first request's recorded offset from there, divided by ``speed``;
its turns stay sequential: turn k+1 is sent its recorded gap (its request time minus turn k's
answer time, never below 0) divided by ``speed`` after turn k's answer came back in the
replay. Sessions that overlapped in the recording therefore overlap in the replay.

**Bounds.** At ``time_limit_s`` the requests in flight are cancelled (counted as such) and
the replay ends; after ``max_requests`` requests no more are sent (those in flight finish).
A failed request (an HTTP error, no answer, an answer that is not JSON) is counted with its
HTTP status, the first one's text is kept, and the session goes on with its next turn; only
when the first :data:`FAIL_FAST_AFTER` requests all fail does the replay stop early (the
server is not serving).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import msgspec
import numpy as np

from agentlog._logging import get_logger
from agentlog.events.errors import AgentlogError
from agentlog.events.schema.turn_delta import full_turns
from agentlog.events.schema.types import Envelope, TurnRecorded
from agentlog.gateway.http_json import HTTPJSONError, JSONClient
from agentlog.gateway.backends import ROUTING_HEADER_DEFAULT

__all__ = ["APIS", "DEFAULT_MAX_REQUESTS", "DEFAULT_ROUTING_HEADER", "DEFAULT_TIME_LIMIT_S", "LoadReport",
           "LoadgenError", "RecordedSession", "RecordedTurn", "ReplayOptions", "check_target", "collect_sessions",
           "replay", "request_body"]

_log = get_logger("agentlog.tools.loadgen")

#: The APIs a replay speaks, and the route each posts to.
APIS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: The header that carries a session's routing key (its session id); the gateway's fleet routing reads the same.
#: The gateway backends' routing header: the one sglang-router's consistent hashing reads.
DEFAULT_ROUTING_HEADER = ROUTING_HEADER_DEFAULT
#: Defaults that end a runaway replay: wall seconds, and requests sent.
DEFAULT_TIME_LIMIT_S = 600.0
DEFAULT_MAX_REQUESTS = 10_000
#: The replay stops when this many first requests (or all of them, when fewer) failed, none answered.
FAIL_FAST_AFTER = 16
#: The largest answer read: the replay asks for no log-probs, so answers are small.
ANSWER_LIMIT_BYTES = 64 << 20
#: Why a replay ended (``LoadReport.stopped_by``).
STOP_REASONS = ("done", "max_requests", "time_limit", "all_failed")


class LoadgenError(AgentlogError, ValueError):
    """A replay that cannot start: a target refused, a turn the chosen API cannot send."""


@dataclass(frozen=True)
class RecordedTurn:
    """One recorded turn, as the replay sends it."""

    turn_index: int
    lsn: int
    prompt_ids: np.ndarray  # int32, the whole prompt (a delta-encoded turn expanded)
    messages: list[dict[str, Any]]
    output_tokens: int
    sampling: dict[str, Any]
    #: When the request left (the envelope's time minus the generation's), and when its answer came (the envelope's).
    sent_ns: int
    answered_ns: int


@dataclass
class RecordedSession:
    """A session's recorded turns, in order."""

    session_id: str
    turns: list[RecordedTurn] = field(default_factory=list)

    @property
    def start_ns(self) -> int:
        """When its first request left."""
        return self.turns[0].sent_ns

    def gap_s(self, k: int) -> float:
        """The recorded seconds between turn ``k - 1``'s answer and turn ``k``'s request (>= 0)."""
        return max(0.0, (self.turns[k].sent_ns - self.turns[k - 1].answered_ns) / 1e9)


def collect_sessions(envelopes: Iterable[Envelope], *, sessions: int | None = None) -> list[RecordedSession]:
    """The recorded sessions in the order their first turn appears in the log: the first
    ``sessions`` of them (all with None). Delta-encoded turns are expanded to their whole
    prompt (TurnDeltaError naming the LSN when one cannot be). Every turn of them is held:
    which ones a request count lets through depends on the replay's own order."""
    chosen: dict[str, RecordedSession] = {}
    for env in full_turns(envelopes):
        body = env.body
        if type(body) is not TurnRecorded:
            continue
        session = chosen.get(env.session_id)
        if session is None:
            if sessions is not None and len(chosen) >= sessions:
                continue
            session = chosen[env.session_id] = RecordedSession(env.session_id)
        generate_ns = int(body.generate_s * 1e9) if math.isfinite(body.generate_s) and body.generate_s > 0 else 0
        session.turns.append(RecordedTurn(
            turn_index=body.turn_index, lsn=env.lsn, prompt_ids=body.prompt_tokens, messages=list(body.messages),
            output_tokens=len(body.output_tokens), sampling=dict(body.sampling or {}),
            sent_ns=env.ts_ns - generate_ns, answered_ns=env.ts_ns,
        ))
    return list(chosen.values())


def check_target(url: str, *, allow_remote: bool = False) -> str:
    """``url`` (an ``http(s)://host[:port]`` base URL) without a trailing slash; LoadgenError
    for another scheme, no host, or a host that is not loopback (``localhost``, 127.0.0.0/8,
    ``::1``) unless ``allow_remote``: a replay is heavy load, so it goes elsewhere only on purpose."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadgenError(f"--target {url!r}: expected an http:// or https:// base URL with a host, "
                           "such as http://127.0.0.1:30000")
    host = parts.hostname
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: not known to be this machine
        loopback = False
    if not loopback and not allow_remote:
        raise LoadgenError(f"--target {url}: host {host!r} is not loopback (localhost, 127.0.0.0/8, ::1); a replay "
                           "sends real load, so a remote target needs --allow-remote")
    return url.rstrip("/")


def _sampling_fields(api: str, turn: RecordedTurn, ignore_eos: bool) -> dict[str, Any]:
    """The turn's recorded sampling in the API's names, and its output budget."""
    rec = turn.sampling
    out: dict[str, Any] = {"max_new_tokens" if api == "generate" else "max_tokens": max(1, turn.output_tokens)}
    for key in ("temperature", "top_p"):
        if isinstance(rec.get(key), (int, float)):
            out[key] = rec[key]
    top_k = rec.get("top_k")
    if isinstance(top_k, int) and top_k > 0:  # -1 and 0 are "off" in the gateway's rules
        out["top_k"] = top_k
    if isinstance(rec.get("seed"), int):
        out["sampling_seed" if api == "generate" else "seed"] = rec["seed"]
    stops = rec.get("stop_ids")
    if ignore_eos:
        out["ignore_eos"] = True  # exactly the recorded length: no stop id may end it early
    elif stops:
        out["stop_token_ids"] = [int(s) for s in stops]
    return out


def request_body(api: str, turn: RecordedTurn, *, model: str = "", ignore_eos: bool = False) -> dict[str, Any]:
    """The JSON body that replays ``turn`` on ``api`` (see the module docstring)."""
    sampling = _sampling_fields(api, turn, ignore_eos)
    if api == "generate":
        return {"input_ids": turn.prompt_ids.tolist(), "sampling_params": sampling, "stream": False}
    named = {"model": model} if model else {}
    if api == "completions":
        return {**named, "prompt": turn.prompt_ids.tolist(), **sampling}
    if api == "chat":
        return {**named, "messages": turn.messages, **sampling}
    raise LoadgenError(f"api {api!r}: expected one of {', '.join(APIS)}")


def check_replayable(sessions: list[RecordedSession], api: str) -> None:
    """LoadgenError naming the first turn ``api`` cannot send as recorded: no messages for
    ``chat`` (a token-level turn), no prompt ids for the others."""
    for s in sessions:
        for t in s.turns:
            if api == "chat" and not t.messages:
                raise LoadgenError(f"session {s.session_id!r} turn {t.turn_index} (lsn {t.lsn}) recorded no messages, "
                                   "so --api chat cannot send it as recorded; use --api generate or completions")
            if api != "chat" and not len(t.prompt_ids):
                raise LoadgenError(f"session {s.session_id!r} turn {t.turn_index} (lsn {t.lsn}) recorded no prompt "
                                   f"token ids, so --api {api} cannot send it as recorded; use --api chat")


@dataclass(frozen=True)
class ReplayOptions:
    """How to replay (see the module docstring)."""

    target: str
    api: str = "generate"
    speed: float = 1.0
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    max_requests: int = DEFAULT_MAX_REQUESTS
    #: The header carrying the session id; "" sends none.
    routing_header: str = DEFAULT_ROUTING_HEADER
    #: The served model's name for the OpenAI APIs ("" sends none: the server's default).
    model: str = ""
    ignore_eos: bool = False


class Latency(msgspec.Struct):
    """Seconds from sending a request to its whole answer, over the answered requests."""

    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    mean: float = 0.0
    max: float = 0.0


class LoadReport(msgspec.Struct):
    """What a replay did and measured (``--json`` prints it)."""

    target: str
    api: str
    speed: float
    sessions: int = 0
    #: The recorded turns of the chosen sessions (what a whole replay sends).
    turns_recorded: int = 0
    requests_sent: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    #: In flight when the time limit struck.
    requests_cancelled: int = 0
    #: One of :data:`STOP_REASONS`.
    stopped_by: str = "done"
    seconds: float = 0.0
    requests_per_s: float = 0.0
    #: Tokens of the answered requests, as the server counted them (the request's own prompt
    #: length where an answer gave no count; ``usage_missing`` counts those answers).
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_tokens_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    usage_missing: int = 0
    latency_s: Latency = msgspec.field(default_factory=Latency)
    #: Prompt tokens the server reported served from its cache (None: no answer reported it),
    #: over the prompt tokens of the answers that reported it.
    cached_tokens: int | None = None
    cached_of_prompt_tokens: int = 0
    cached_answers: int = 0
    #: Failed requests by HTTP status ("0": no answer; "200": an answer out of shape).
    errors_by_status: dict[str, int] = {}
    #: "session S turn K: <the error>" of the first failure, "" when none.
    first_error: str = ""


@dataclass
class _Answer:
    prompt_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def answer_usage(api: str, answer: Any) -> _Answer:
    """The token counts an answer reports: SGLang's ``meta_info`` (``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens``), or the OpenAI ``usage`` (with
    ``prompt_tokens_details.cached_tokens``). ValueError for an answer that is not an object."""
    if not isinstance(answer, dict):
        raise ValueError(f"expected a JSON object, found {type(answer).__name__}")
    if api == "generate":
        meta = answer.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        return _Answer(_count(meta.get("prompt_tokens")), _count(meta.get("completion_tokens")),
                       _count(meta.get("cached_tokens")))
    usage = answer.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return _Answer(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), cached)


class _Replay:
    """One replay in progress: the session tasks share its counters and its stop signal."""

    def __init__(self, sessions: list[RecordedSession], options: ReplayOptions,
                 progress: Callable[[int], None] | None) -> None:
        self.sessions = sessions
        self.options = options
        self.url = options.target + APIS[options.api]
        self.progress = progress
        self.report = LoadReport(target=self.url, api=options.api, speed=options.speed, sessions=len(sessions),
                                 turns_recorded=sum(len(s.turns) for s in sessions))
        self.latencies: list[float] = []
        self.stop = asyncio.Event()
        #: Set when the time limit cancels what is in flight (those requests are counted as cancelled).
        self.cut_at_limit = False
        self.zero_ns = min(s.start_ns for s in sessions)
        self.t0 = 0.0

    def _halt(self, reason: str) -> None:
        if not self.stop.is_set():
            self.report.stopped_by = reason
            _log.info("loadgen.stopping", reason=reason, sent=self.report.requests_sent)
            self.stop.set()

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``; False when the replay was stopped meanwhile."""
        if seconds > 0:
            try:
                await asyncio.wait_for(self.stop.wait(), timeout=seconds)
            except asyncio.TimeoutError:
                pass
        return not self.stop.is_set()

    async def run_session(self, session: RecordedSession) -> None:
        """Send the session's turns in order, each after its recorded gap (scaled)."""
        speed = self.options.speed
        headers = {self.options.routing_header: session.session_id} if self.options.routing_header else {}
        client = JSONClient(timeout_s=self.options.time_limit_s + 1.0, headers=headers, connection_limit=1)
        try:
            start_in = (session.start_ns - self.zero_ns) / 1e9 / speed - (time.perf_counter() - self.t0)
            for k, turn in enumerate(session.turns):
                if not await self._pause(start_in if k == 0 else session.gap_s(k) / speed):
                    return
                if self.report.requests_sent >= self.options.max_requests:
                    self._halt("max_requests")
                    return
                await self._send(client, session, turn)
        finally:
            await client.close()

    async def _send(self, client: JSONClient, session: RecordedSession, turn: RecordedTurn) -> None:
        report = self.report
        body = request_body(self.options.api, turn, model=self.options.model, ignore_eos=self.options.ignore_eos)
        report.requests_sent += 1
        sent = time.perf_counter()
        try:
            try:
                answer = await client.request("POST", self.url, body, limit=ANSWER_LIMIT_BYTES)
                usage = answer_usage(self.options.api, answer)
            except HTTPJSONError as exc:
                self._failed(session, turn, exc.status, str(exc))
                return
            except ValueError as exc:  # answer_usage: an answer out of shape
                self._failed(session, turn, 200, f"POST {self.url}: the answer is out of shape: {exc}")
                return
        except asyncio.CancelledError:
            if self.cut_at_limit:
                report.requests_cancelled += 1
            raise
        self.latencies.append(time.perf_counter() - sent)
        report.requests_ok += 1
        prompt = usage.prompt_tokens
        if prompt is None or usage.output_tokens is None:
            report.usage_missing += 1
        if prompt is None:
            prompt = len(turn.prompt_ids)
        report.prompt_tokens += prompt
        report.output_tokens += usage.output_tokens or 0
        if usage.cached_tokens is not None:
            report.cached_tokens = (report.cached_tokens or 0) + usage.cached_tokens
            report.cached_of_prompt_tokens += prompt
            report.cached_answers += 1
        if self.progress is not None:
            self.progress(1)

    def _failed(self, session: RecordedSession, turn: RecordedTurn, status: int, text: str) -> None:
        report = self.report
        report.requests_failed += 1
        report.errors_by_status[str(status)] = report.errors_by_status.get(str(status), 0) + 1
        if not report.first_error:
            report.first_error = f"session {session.session_id!r} turn {turn.turn_index}: {text}"
            _log.warning("loadgen.request_failed", session_id=session.session_id, turn=turn.turn_index,
                         status=status, error=text, note="the first failure; later ones are counted")
        else:
            _log.debug("loadgen.request_failed", session_id=session.session_id, turn=turn.turn_index,
                       status=status, error=text)
        if self.progress is not None:
            self.progress(1)
        planned = min(FAIL_FAST_AFTER, report.turns_recorded, self.options.max_requests)
        if report.requests_ok == 0 and report.requests_failed >= planned:
            self._halt("all_failed")

    async def run(self) -> LoadReport:
        """Replay every session; the report, once every task has ended."""
        self.t0 = time.perf_counter()
        tasks = [asyncio.create_task(self.run_session(s), name=f"loadgen.session.{s.session_id}")
                 for s in self.sessions]
        try:
            _done, pending = await asyncio.wait(tasks, timeout=self.options.time_limit_s)
            if pending:
                self._halt("time_limit")  # unless a request count or failures stopped it first
                self.cut_at_limit = True
                for task in pending:
                    task.cancel()
            # Every session's own failure surfaces here (a cancelled one ended at the limit).
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                    raise outcome
        finally:
            for task in tasks:
                task.cancel()
        return self._finish(time.perf_counter() - self.t0)

    def _finish(self, seconds: float) -> LoadReport:
        report = self.report
        report.seconds = seconds
        if seconds > 0:
            report.requests_per_s = report.requests_ok / seconds
            report.prompt_tokens_per_s = report.prompt_tokens / seconds
            report.output_tokens_per_s = report.output_tokens / seconds
        if self.latencies:
            lat = np.asarray(self.latencies)
            p50, p90, p99 = np.percentile(lat, [50, 90, 99])
            report.latency_s = Latency(float(p50), float(p90), float(p99), float(lat.mean()), float(lat.max()))
        return report


async def replay(sessions: list[RecordedSession], options: ReplayOptions, *,
                 progress: Callable[[int], None] | None = None) -> LoadReport:
    """Replay ``sessions`` against ``options.target`` (checked with :func:`check_target` by
    the caller) and measure it; ``progress(1)`` after each request ends. LoadgenError when
    there is nothing to replay or ``api`` cannot send a turn as recorded."""
    if options.api not in APIS:
        raise LoadgenError(f"api {options.api!r}: expected one of {', '.join(APIS)}")
    if not (options.speed > 0 and math.isfinite(options.speed)):
        raise LoadgenError(f"speed: expected a finite number > 0, found {options.speed!r}")
    sessions = [s for s in sessions if s.turns]
    if not sessions:
        raise LoadgenError("no recorded turn to replay")
    check_replayable(sessions, options.api)
    _log.info("loadgen.started", target=options.target, api=options.api, sessions=len(sessions),
              turns=sum(len(s.turns) for s in sessions), speed=options.speed,
              time_limit_s=options.time_limit_s, max_requests=options.max_requests)
    report = await _Replay(sessions, options, progress).run()
    _log.info("loadgen.finished", stopped_by=report.stopped_by, sent=report.requests_sent, ok=report.requests_ok,
              failed=report.requests_failed, seconds=round(report.seconds, 3))
    return report
