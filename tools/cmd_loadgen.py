"""`agentlog loadgen RUN --target URL [--api generate|completions|chat] [--speed X] [--sessions N]
[--time-limit S] [--max-requests N] [--routing-header NAME] [--model NAME] [--ignore-eos]
[--allow-remote] [--json]`: replay a run's recorded sessions against an inference server or
router, with their prompts, inter-turn timing and concurrency, and report throughput,
latency percentiles and cached tokens (:mod:`agentlog.tools.loadgen`).

Exit codes: 0 the replay ran (failed requests are counted in the report, the first one's
text shown); 1 the log holds no turn to replay, or one that cannot be expanded; 2 usage or
I/O: a target refused (not loopback without ``--allow-remote``), a turn the API cannot send
as recorded, or requests failed and none was answered (the report is printed first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import add_quiet, check_log_path, positive_float, positive_int, read_tagged


DESCRIPTION = """\
Replay the recorded sessions of RUN against an inference server or router.

Each request is the turn's recorded prompt byte for byte: --api generate (SGLang /generate)
sends input_ids = the recorded prompt token ids, --api completions (OpenAI-compatible
/v1/completions, vLLM) sends them as the prompt, --api chat (/v1/chat/completions) sends
the recorded messages exactly. Sampling is the turn's recorded temperature, top_p, top_k,
seed and stop ids; the output budget (max_new_tokens / max_tokens) is the turn's recorded
output length (at least 1), so the load matches the recording (--ignore-eos: exactly that
length). Every request carries the session id in the routing header.

Timing: a session starts at its first request's recorded offset from the first request of
the replay, divided by --speed; its turns stay sequential, each sent its recorded gap after
the previous turn's answer (divided by --speed). Sessions that overlapped in the recording
overlap in the replay.
"""


def _header_name(text: str) -> str:
    from agentlog.gateway.backends import HEADER_NAME

    if text and not HEADER_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected an HTTP header name (letters, digits, '-', ...) or \"\", found {text!r}")
    return text


def register(sub) -> None:
    """Add the subcommand."""
    from agentlog.tools.loadgen import APIS, DEFAULT_MAX_REQUESTS, DEFAULT_ROUTING_HEADER, DEFAULT_TIME_LIMIT_S

    p = sub.add_parser("loadgen", help="replay a run's recorded sessions against an inference server: throughput, "
                                       "latency percentiles, cached tokens",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", metavar="RUN", help="a run folder, or a log")
    p.add_argument("--target", required=True, metavar="URL",
                   help="the server's or router's base URL, e.g. http://127.0.0.1:30000 (loopback unless --allow-remote)")
    p.add_argument("--api", choices=list(APIS), default="generate",
                   help="generate: SGLang /generate; completions: /v1/completions (vLLM); chat: /v1/chat/completions "
                        "(default: generate)")
    p.add_argument("--speed", type=positive_float, default=1.0, metavar="X",
                   help="replay X times faster than recorded: offsets and gaps divided by X (default 1)")
    p.add_argument("--sessions", type=positive_int, default=None, metavar="N",
                   help="replay the first N sessions (by their first turn in the log) only")
    p.add_argument("--time-limit", type=positive_float, default=DEFAULT_TIME_LIMIT_S, metavar="S",
                   help=f"stop after S seconds, cancelling the requests in flight (default {DEFAULT_TIME_LIMIT_S:g})")
    p.add_argument("--max-requests", type=positive_int, default=DEFAULT_MAX_REQUESTS, metavar="N",
                   help=f"send at most N requests (default {DEFAULT_MAX_REQUESTS})")
    p.add_argument("--routing-header", type=_header_name, default=DEFAULT_ROUTING_HEADER, metavar="NAME",
                   help=f"the header carrying the session id (default {DEFAULT_ROUTING_HEADER}; \"\" sends none)")
    p.add_argument("--model", default="", metavar="NAME",
                   help="completions/chat: the served model's name (default: none sent, the server's own)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly the recorded output length (sends ignore_eos, and no stop ids)")
    p.add_argument("--allow-remote", action="store_true", help="allow a target that is not loopback")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_quiet(p)
    p.set_defaults(func=run)


def run(args) -> int:
    """Replay, print the report (see the module docstring for the exit codes)."""
    from agentlog.events.schema.turn_delta import TurnDeltaError
    from agentlog.tools.loadgen import LoadgenError, ReplayOptions, check_target, collect_sessions, replay
    from agentlog.tools.progress import new_bar

    try:
        target = check_target(args.target, allow_remote=args.allow_remote)
    except LoadgenError as exc:
        raise CliError(f"loadgen: {exc}", EXIT_USAGE) from None
    source = check_log_path(args.log)
    envelopes = (env for _pid, env in read_tagged(source, quiet=args.quiet, desc="loadgen: read"))
    try:
        sessions = collect_sessions(envelopes, sessions=args.sessions)
    except TurnDeltaError as exc:
        raise CliError(f"loadgen: {args.log}: {exc}", EXIT_DATA) from None
    if not sessions:
        raise CliError(f"loadgen: {args.log} holds no recorded turn to replay", EXIT_DATA)
    options = ReplayOptions(target=target, api=args.api, speed=args.speed, time_limit_s=args.time_limit,
                            max_requests=args.max_requests, routing_header=args.routing_header, model=args.model,
                            ignore_eos=args.ignore_eos)
    planned = min(sum(len(s.turns) for s in sessions), args.max_requests)
    bar = new_bar(planned, "loadgen", unit="req", disable=True if args.quiet else None)
    try:
        report = asyncio.run(replay(sessions, options, progress=bar.update))
    except LoadgenError as exc:
        raise CliError(f"loadgen: {args.log}: {exc}", EXIT_USAGE) from None
    finally:
        bar.close()
    if args.json:
        import msgspec

        print(json.dumps(msgspec.to_builtins(report)))
    else:
        print("\n".join(format_report(report)))
    if report.requests_failed and not report.requests_ok:
        raise CliError(f"loadgen: no request was answered ({report.requests_failed} failed); the first failure: "
                       f"{report.first_error}", EXIT_USAGE)
    return EXIT_OK


#: How each stop reason reads in the report.
_STOPPED = {"done": "every recorded turn replayed", "max_requests": "--max-requests reached",
            "time_limit": "--time-limit reached", "all_failed": "every request failed"}


def format_report(report: Any) -> list[str]:
    """The report as an aligned table of text lines."""
    lat = report.latency_s
    if report.cached_tokens is None:
        cached = "not reported by the server"
    else:
        share = report.cached_tokens / report.cached_of_prompt_tokens if report.cached_of_prompt_tokens else 0.0
        cached = (f"{report.cached_tokens:,} of {report.cached_of_prompt_tokens:,} prompt tokens ({share:.1%}), "
                  f"in {report.cached_answers} answer(s) that reported it")
    rows = [
        ("target", f"{report.target} (api {report.api}, speed {report.speed:g}x)"),
        ("sessions", f"{report.sessions} ({report.turns_recorded} recorded turn(s))"),
        ("stopped", f"{_STOPPED.get(report.stopped_by, report.stopped_by)} after {report.seconds:.2f} s"),
        ("requests", f"{report.requests_sent} sent: {report.requests_ok} answered, {report.requests_failed} failed, "
                     f"{report.requests_cancelled} cancelled at the time limit"),
        ("throughput", f"{report.requests_per_s:.2f} req/s, prompt {report.prompt_tokens_per_s:,.1f} tok/s, "
                       f"output {report.output_tokens_per_s:,.1f} tok/s"),
        ("tokens", f"prompt {report.prompt_tokens:,}, output {report.output_tokens:,}"
                   + (f" ({report.usage_missing} answer(s) gave no usage counts)" if report.usage_missing else "")),
        ("latency", f"p50 {lat.p50:.3f} s, p90 {lat.p90:.3f} s, p99 {lat.p99:.3f} s (mean {lat.mean:.3f}, max {lat.max:.3f})"),
        ("cached", cached),
    ]
    if report.requests_failed:
        by_status = ", ".join(f"HTTP {s}: {n}" if s != "0" else f"no answer: {n}"
                              for s, n in sorted(report.errors_by_status.items()))
        rows.append(("errors", by_status))
        rows.append(("first error", report.first_error))
    width = max(len(name) for name, _ in rows)
    return ["loadgen"] + [f"  {name:<{width}}  {value}" for name, value in rows]
