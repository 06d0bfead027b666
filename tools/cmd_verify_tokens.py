"""`agentlog verify-tokens RUN [--server URL --engine sglang|vllm | --model DIR] [--sessions N]
[--version V] [--tolerance X] [--corrupt K] [--json]`: re-feed recorded turns to an inference
engine and prove their tokens (:mod:`agentlog.loop.token_check`).

Engines:

* none named: the run folder's own policy, in process, loaded at each turn's recorded
  version from the run's checkpoints (a turn whose version was pruned is skipped and
  counted); retokenization uses the run's chat template;
* ``--model DIR``: a Hugging Face model directory, in process, and its tokenizer's chat template;
* ``--server URL --engine sglang``: SGLang's ``/generate`` (input log-probs); ``--engine vllm``:
  vLLM's ``/v1/completions`` (prompt log-probs) and ``/tokenize``.

A model or server holds one version: with ``--model`` or ``--server`` only the turns recorded
at ``--version`` are checked (default: the newest version any selected turn was recorded at).

Exit codes: 0 every check passed; 1 a log-prob past the tolerance, a retokenization or a
greedy reproduction that differs (the first one named), or, with ``--corrupt K``, a negative
control that was not caught at position K (0 when it was); 2 usage or I/O (an engine that
cannot be reached or answers out of shape).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentlog.tools.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, CliError
from agentlog.tools.cli_common import add_quiet, check_log_path, json_text, nonneg_int, positive_float, positive_int, read_tagged

ENGINES = ("sglang", "vllm")


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("verify-tokens", help="re-feed recorded turns to an engine: retokenization, log-probs, greedy reproduction")
    p.add_argument("log", metavar="RUN", help="a run folder (its checkpoints are the in-process engine), or a log")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="URL", help="an inference server's base URL (with --engine)")
    where.add_argument("--model", metavar="DIR", help="a local Hugging Face model directory, scored in process")
    p.add_argument("--engine", choices=ENGINES, default="sglang", help="what --server speaks (default: sglang)")
    p.add_argument("--served-model", default="", metavar="NAME", help="vLLM: the served model's name (default: its only one)")
    p.add_argument("--sessions", type=positive_int, default=None, metavar="N", help="check the first N sessions only")
    p.add_argument("--version", type=nonneg_int, default=None, metavar="V",
                   help="check the turns recorded at policy version V only (--server/--model: default the newest)")
    p.add_argument("--tolerance", type=positive_float, default=None, metavar="X",
                   help="largest |engine - recorded| log-prob per token that passes (default 0.01)")
    p.add_argument("--corrupt", type=nonneg_int, default=None, metavar="K",
                   help="negative control: flip output token K (over the checked turns) and expect it caught there")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (every turn included)")
    add_quiet(p)
    p.set_defaults(func=run)


def _token_level(run) -> str:
    """Why not to retokenize: "" for a text task or a bare log, a reason for a run of a token-level task."""
    if run is None:
        return ""
    from agentlog.loop.model_scorer import is_text_task

    return "" if is_text_task(run.config) else "a token-level task (its prompts are ids; its messages are for display)"


def _scorers(args, run) -> tuple[Any, str, Any]:
    """``(scorer_at(version), engine name, the one scorer)`` for the chosen engine; the one scorer
    (a server's, or a model directory's) holds one version, and is None for a run's checkpoints."""
    if args.server is not None:
        from agentlog.gateway.scoring import SGLangScorer, VLLMScorer

        scorer = SGLangScorer(args.server) if args.engine == "sglang" else VLLMScorer(args.server, model=args.served_model)
        return (lambda _version: scorer), f"{args.engine} at {args.server}", scorer
    from agentlog.loop.model_scorer import ModelScorer, run_template, versioned_scorers

    if args.model is not None:
        try:
            from agentlog.learner.hf_model import HFCausalLM

            model_scorer = ModelScorer(HFCausalLM(args.model), run_template(None, None, args.model))
        except ImportError:
            raise CliError("verify-tokens --model needs transformers: pip install 'agentlog[hf]'", EXIT_USAGE) from None
        except (OSError, ValueError) as exc:
            raise CliError(f"verify-tokens --model {args.model}: {exc}", EXIT_USAGE) from None
        return (lambda _version: model_scorer), f"in-process {args.model}", model_scorer
    if run is None:
        raise CliError(f"verify-tokens: {args.log} is not a run folder, so it has no checkpoints to score with; "
                       "pass --server URL or --model DIR", EXIT_USAGE)
    return versioned_scorers(run.dir, run.config, run_template(run.dir, run.config)), "in-process (the run's checkpoints)", None


def _run_of(source) -> Any:
    """The run folder ``source`` belongs to (its config loaded), or None for a bare log."""
    if source.run_dir is None:
        return None
    from agentlog.loop.config import ConfigError
    from agentlog.loop.run_folder import Run

    try:
        return Run.at(source.run_dir)
    except ConfigError as exc:
        raise CliError(f"verify-tokens: {exc}", EXIT_USAGE) from None


def run(args) -> int:
    """Verify, print the report; exit 1 on a mismatch (see the module docstring)."""
    from agentlog.events.schema.turn_delta import TurnDeltaError
    from agentlog.gateway.backends import BackendError
    from agentlog.loop.token_check import DEFAULT_TOLERANCE, collect_turns, corruptible_tokens
    from agentlog.tools.progress import new_bar

    source = check_log_path(args.log)
    run = _run_of(source)  # None for a bare log
    scorer_at, engine, closing = _scorers(args, run)
    envelopes = (env for _pid, env in read_tagged(source, quiet=args.quiet, desc="verify-tokens: read"))
    try:
        turns = collect_turns(envelopes, sessions=args.sessions, version=args.version)
    except TurnDeltaError as exc:
        raise CliError(f"verify-tokens: {args.log}: {exc}", EXIT_DATA) from None
    only_version = args.version
    if closing is not None and only_version is None and turns:
        # A server or a model directory holds one version: the newest any turn was made by.
        only_version = max(v for t in turns for _, _, v in t.parts())
        turns = [t for t in turns if any(v == only_version for _, _, v in t.parts())]
    if not turns:
        raise CliError(f"verify-tokens: {args.log} holds no recorded turn to check"
                       + (f" at version {args.version}" if args.version is not None else ""), EXIT_DATA)
    total = corruptible_tokens(turns, only_version)
    if args.corrupt is not None and args.corrupt >= total:
        raise CliError(f"verify-tokens: --corrupt {args.corrupt}: the checked turns hold {total} output tokens with "
                       f"recorded log-probs (positions 0..{total - 1})", EXIT_USAGE)
    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    bar = new_bar(sum(len(t.parts()) for t in turns), "verify-tokens", unit="part", disable=True if args.quiet else None)
    try:
        report = asyncio.run(_verify(turns, scorer_at, closing, engine=engine, tolerance=tolerance, corrupt=args.corrupt,
                                     skip_retokenization=_token_level(run), only_version=only_version,
                                     progress=bar.update))
    except BackendError as exc:
        raise CliError(f"verify-tokens: {exc}", EXIT_USAGE) from None
    finally:
        bar.close()
    if not report.turns_checked:
        why = "; ".join(sorted({t.skipped for t in report.turns if t.skipped}))
        raise CliError(f"verify-tokens: {args.log}: none of its {len(turns)} turn(s) could be checked ({why}): "
                       "their versions' checkpoints were pruned or never written", EXIT_DATA)
    if args.json:
        import msgspec

        data = msgspec.to_builtins(report)
        data["ok"] = report.ok
        print(json_text(data))  # an engine that scored NaN makes inf diffs: strict JSON all the same
    else:
        print("\n".join(format_report(report)))
    return EXIT_OK if report.ok else EXIT_DATA


async def _verify(turns, scorer_at, closing, **options):
    """:func:`~agentlog.loop.token_check.verify_turns`, closing the server's connections after."""
    from agentlog.loop.token_check import verify_turns

    try:
        return await verify_turns(turns, scorer_at, **options)
    finally:
        if closing is not None:
            await closing.close()


def format_report(report: Any) -> list[str]:
    """The report as text lines: totals per check, then the verdict naming the first mismatch."""
    versions = sorted({t.policy_version for t in report.turns})
    span = f"version {versions[0]}" if len(versions) == 1 else f"versions {versions[0]}-{versions[-1]}"
    sessions = len({t.session_id for t in report.turns})
    lines = [
        f"verify-tokens: {report.turns_checked} turn(s) of {sessions} session(s) at {span} against {report.engine}"
        f" ({report.turns_skipped} skipped; {report.seconds:.2f} s)",
        f"  log-probs: {report.tokens:,} tokens, max |diff| {report.lp_max_abs_diff:.3g}, mean {report.lp_mean_abs_diff:.3g}"
        f" (tolerance {report.tolerance:g}); {report.lp_mismatched_turns} turn(s) past it"
        + (f"; {report.unchecked_tokens:,} not compared (no recorded log-probs, or another version's part)"
           if report.unchecked_tokens else ""),
        f"  retokenization: {report.retok_checked} turn(s) checked, {report.retok_mismatched} differ",
        f"  reproduction: {report.greedy_checked} greedy turn(s), {report.greedy_mismatched} differ",
    ]
    skipped = sorted({t.skipped for t in report.turns if t.skipped})
    if skipped:
        lines.append(f"  skipped: {'; '.join(skipped)}")
    untried = sorted({t.retokenization for t in report.turns if t.retokenization not in ("", "ok", "mismatch")})
    if untried:
        lines.append(f"  retokenization not checked: {'; '.join(untried)}")
    first = report.first_mismatch
    if first is not None:
        if first["check"] == "retokenization":
            what = (f"prompt token {first['position']} differs from the engine's tokenization of the messages "
                    f"(in message {first['message']}; a request that declared tools rendered them, which the log does not record)")
        elif first["check"] == "log_prob":
            what = f"output token {first['position']} (position {first['global_position']} overall) has a log-prob past the tolerance"
        else:
            what = f"greedy reproduction differs at output token {first['position']}"
        lines.append(f"first mismatch: session {first['session']!r} turn {first['turn']} (lsn {first['lsn']}): {what}")
    if report.corrupt is not None:
        c = report.corrupt
        verdict = "caught there" if c["caught"] else "NOT caught there"
        lines.append(f"negative control: output token {c['position']} (session {c['session']!r} turn {c['turn']}, "
                     f"offset {c['offset']}) changed {c['from']} -> {c['to']}: {verdict}")
    lines.append("OK" if report.ok else "MISMATCH")
    return lines
