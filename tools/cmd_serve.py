"""`agentlog serve`: run the recording gateway over a log.

Sessions are opened (and later finished) by the rollout through the admin
API, authenticated with ``X-Admin-Token``; the open answers the session's
``api_key``, a random token, and the agent CLI points at the printed URL
with that as its API key (the session id is no credential)::

    POST /admin/sessions                {"session_id", "group_id", "group_size", "sample_index", "agent", "prompt",
                                         "label", "metadata", "sampling", "max_turns"}
                                        -> {"session_id", "state", "group_id", "sample_index", "api_key"}
    POST /admin/sessions/ID/finish      {"reward": 1.0, "metadata": {...}}
    POST /admin/sessions/ID/abort       {"reason": "...", "error": "..."}
    POST /admin/sessions/ID/drop        {"reason": "..."}
    GET  /admin/sessions/ID

Every field is checked before anything is appended (gateway.admin):
a bad one is answered 400 naming it, a duplicate id or a group conflict 409.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys

from agentlog.events.log.format import COMPRESSIONS
from agentlog.tools.cli import EXIT_DATA, CliError
from agentlog.tools.cli_common import http_base_url, nonneg_int, positive_float, positive_int, tcp_port
from agentlog.tools.progress import ProgressBar


def register(sub) -> None:
    """Add the subcommand."""
    p = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible recording gateway")
    p.add_argument("--log", required=True, help="log directory (created if missing)")
    p.add_argument("--backend", choices=["torch", "sglang", "vllm"], default="torch", help="inference backend (default: the built-in torch policy)")
    p.add_argument("--backend-url", type=http_base_url, default="", help="base URL of the SGLang / vLLM server")
    p.add_argument("--context-length", type=nonneg_int, default=0, help="SGLang / vLLM: the model's context (turns that would overflow it finish 'length')")
    p.add_argument("--model", default="", help="torch backend: a local Hugging Face model directory to serve (with its tokenizer and chat template; needs the hf extra); SGLang/vLLM: the model name sent to the server and reported by /v1/models")
    p.add_argument("--tokenizer", default="", help="Hugging Face tokenizer (name or path) for the chat template; needs transformers (default for SGLang/vLLM: --model when transformers is installed)")
    p.add_argument("--checkpoint", default="", help="torch backend: the built-in GPT's weights: a learner checkpoint (policy-vNNNNN.pt), a weights file or a bare state_dict (loaded with weights_only=True)")
    p.add_argument("--tool-parser", default="hermes", help="how tool calls are parsed from model text (hermes, none)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=tcp_port, default=8000, help="port (0: any free port)")
    p.add_argument("--fsync", choices=["always", "batch", "interval", "never"], default="batch", help="log fsync policy (default batch)")
    p.add_argument("--compression", choices=COMPRESSIONS, default=None,
                   help="the log's record batches: zstd (each flush's records in compressed batches) or none "
                        "(default: what an existing log's last segment records; a new log: none)")
    p.add_argument("--max-turns", type=positive_int, default=256, help="turn cap per session (answered 429 beyond it)")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="default output allowance per turn")
    p.add_argument("--header-timeout", type=positive_float, default=10.0, metavar="S", help="seconds a request's head may take, from accept (or a kept-alive connection's next first byte); slower connections are closed (default 10)")
    p.add_argument("--body-timeout", type=positive_float, default=60.0, metavar="S", help="seconds a request's body may take to arrive; slower ones are answered 408 (default 60)")
    p.add_argument("--idle-timeout", type=positive_float, default=75.0, metavar="S", help="seconds an idle keep-alive connection is kept (default 75)")
    p.add_argument("--max-connections", type=positive_int, default=0, metavar="N", help="open connections at most; at the cap a new one closes the longest-waiting one without a request in progress, or is answered 503 when all have one; an eighth (1 to 8) is kept for the admin API (default: half the open-file limit, at most 4096)")
    p.add_argument("--drain", type=positive_float, default=5.0, metavar="S", help="on SIGTERM/SIGINT, seconds to let in-flight turns finish before their sessions are dropped with reason 'shutdown' (default 5)")
    p.add_argument("--admin-token", default=os.environ.get("AGENTLOG_ADMIN_TOKEN", ""), help="admin API token (default: $AGENTLOG_ADMIN_TOKEN, else generated and printed)")
    p.set_defaults(func=run)


def default_gateway_model(seed: int = 0):
    """The built-in GPT sized for the gateway's byte-level chat template
    (random weights: for wiring, tests and benchmarks, not for quality)."""
    import torch

    from agentlog.gateway import ByteChatTemplate
    from agentlog.learner.model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=ByteChatTemplate.VOCAB_SIZE, max_seq_len=4096, d_model=64, n_layer=2, n_head=4))


def _build(args):
    from agentlog.gateway import (Backend, ByteChatTemplate, ChatTemplate, HFChatTemplate, OpenAICompletionsBackend, SGLangBackend,
                                  TorchBackend, tool_parser)

    try:
        parser = tool_parser(args.tool_parser)
    except ValueError as exc:
        raise CliError(f"--tool-parser: {exc}") from None
    hf_model = None
    backend: Backend
    template: ChatTemplate
    if args.backend == "torch":
        if args.model and args.checkpoint:
            raise CliError("--model and --checkpoint both name the weights to serve; give one")
        if args.model:
            hf_model = _load_hf_model(args.model)
            model = hf_model
        elif args.checkpoint:
            model = _load_gpt_checkpoint(args.checkpoint)
        else:
            model = default_gateway_model()
        backend = TorchBackend(model)
    else:
        if not args.backend_url:
            raise CliError(f"--backend {args.backend} needs --backend-url (the inference server's base URL)")
        ctx = args.context_length or None
        if args.backend == "sglang":
            backend = SGLangBackend(args.backend_url, context_length=ctx)
        else:
            backend = OpenAICompletionsBackend(args.backend_url, args.model, context_length=ctx)
    name = args.tokenizer or (args.model if args.backend != "torch" and _has_transformers() else "")
    if hf_model is not None and not args.tokenizer:
        if hf_model.tokenizer is None:
            raise CliError(f"--model {args.model}: no tokenizer files in the directory; pass --tokenizer DIR")
        template = HFChatTemplate(hf_model.tokenizer, parser)
    elif name:
        try:
            template = HFChatTemplate.from_pretrained(name, parser)
        except ImportError:
            raise CliError("--tokenizer needs transformers: pip install transformers") from None
        except (OSError, ValueError) as exc:
            raise CliError(f"tokenizer {name!r}: {exc}") from None
    else:
        if args.backend != "torch":
            print("agentlog serve: no --tokenizer: using the built-in ASCII template (right only for the built-in model)", file=sys.stderr)
        template = ByteChatTemplate(parser)
    return backend, template, parser


def _load_hf_model(path: str):
    """``--model DIR``: the HF model of a local directory (nothing is downloaded)."""
    try:
        from agentlog.learner.hf_model import HFCausalLM

        return HFCausalLM(path)
    except ImportError:
        raise CliError("--model needs transformers: pip install 'agentlog[hf]'") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"--model {path}: {exc}") from None


def _load_gpt_checkpoint(path: str):
    """``--checkpoint FILE``: the built-in GPT from a learner checkpoint, a weights file or a bare state_dict."""
    from agentlog.learner.learner import read_policy
    from agentlog.learner.model import GPT

    try:
        state, config = read_policy(path)
    except FileNotFoundError:
        raise CliError(f"--checkpoint {path}: No such file or directory") from None
    except (OSError, ValueError) as exc:
        # torch's unpickling messages run over several lines; the first says what was wrong.
        why = (str(exc).strip().splitlines() or [""])[0]
        raise CliError(f"--checkpoint {why}; expected a learner checkpoint, a weights file or a state_dict of the built-in GPT") from None
    if config is None:
        config = _run_folder_gpt_config(path)
    try:
        return GPT.from_state_dict(state, config)
    except Exception as exc:  # load_state_dict and GPTConfig raise several types for weights that are not ours
        # Their messages run over several lines; the first says what was wrong.
        why = (str(exc).strip().splitlines() or [""])[0]
        raise CliError(
            f"--checkpoint {path}: expected the built-in GPT's weights, found something else ({type(exc).__name__}: {why})"
        ) from None


def _run_folder_gpt_config(path: str) -> dict | None:
    """The GPT shape from the config of the run folder a checkpoint sits in
    (``<run>/checkpoints/policy-vNNNNN.pt``), for checkpoints that did not record it;
    None when there is none, or it does not load (the shape is then read from the weights)."""
    from agentlog.loop.config import ConfigError
    from agentlog.loop.run_folder import Run

    run_dir = Run.folder_of_checkpoint(path)
    if run_dir is None or not Run.has_config(run_dir):
        return None
    try:
        return {"n_head": Run.load_config(run_dir).n_head}
    except ConfigError:
        return None


def default_max_connections() -> int:
    """Half the process's open-file limit, at most 4096: the other half stays
    for the log's segments, the backend's connections and the interpreter."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 2))


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


async def _serve(args) -> int:
    from agentlog.engine import SessionEngine
    from agentlog.gateway import Gateway, GatewayConfig
    from agentlog.events import FileLog
    from agentlog.events.log.api import LogCorruption, LogError

    backend, template, parser = _build(args)
    token = args.admin_token or secrets.token_urlsafe(18)
    try:
        log = FileLog.open(args.log, fsync=args.fsync, compression=args.compression)
    except LogCorruption as exc:  # damage that recovery must not cut away: acknowledged records
        await backend.close()
        raise CliError(f"--log {args.log}: cannot serve this log: {exc} (see agentlog verify {args.log})") from None
    except (OSError, ValueError, LogError) as exc:  # LogError: not a log, or locked by another writer
        await backend.close()
        raise CliError(f"--log {args.log}: {exc}") from None
    try:
        # The restart fold of a long log (over 200,000 events since the checkpoint) shows a bar on a terminal.
        with ProgressBar("engine: folding log", unit="ev", min_total=200_001) as bar:
            engine = await SessionEngine.open(log, progress=bar)
    except (LogError, ValueError) as exc:  # damage mid-log: the engine's restart fold reads every record
        _close_quietly(log)
        await backend.close()
        raise CliError(f"--log {args.log}: cannot serve this log: {exc} (see agentlog verify {args.log})") from None
    except OSError as exc:  # the disk refused a read or write the open needs
        _close_quietly(log)
        await backend.close()
        raise CliError(f"--log {args.log}: cannot serve this log: {type(exc).__name__}: {exc}") from None
    if engine.checkpoint_problem is not None:
        # A cache the engine can do without, but a disk that refuses it now (full, or
        # something in its place) would fail the log's next appends: refuse to start.
        from pathlib import Path

        from agentlog.engine.restart import CHECKPOINT_NAME

        problem = engine.checkpoint_problem
        await engine.close()
        _close_quietly(log)
        await backend.close()
        path = Path(args.log) / CHECKPOINT_NAME
        hint = f"remove what is at {path} (the checkpoint is a file the engine rewrites)" if path.is_dir() else "free disk space"
        raise CliError(f"--log {args.log}: not serving: {problem}; {hint}")
    config = GatewayConfig(
        max_turns=args.max_turns, default_max_tokens=args.max_tokens, model_name=args.model or "agentlog",
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections or default_max_connections(),
    )
    gw = Gateway(engine, backend, template=template, parser=parser, config=config, admin_token=token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            url = await gw.start(args.host, args.port)
        except OSError as exc:
            raise CliError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
        print(f"agentlog gateway listening on {url} (backend {backend.name}, log {args.log})", flush=True)
        if not args.admin_token:
            print(f"admin token: {token}", flush=True)
        await stop.wait()
    finally:
        failures = await _shut_down(gw, engine, backend, log, args.drain)
    if failures:
        raise CliError("stopped with errors: " + "; ".join(failures), EXIT_DATA)
    print("agentlog gateway stopped", flush=True)
    return 0


def _close_quietly(log) -> None:
    """Close a log that serve will not use; a failure to close it is logged
    (``serve.log_close_failed``), as the one-line error that follows names what
    stopped serve."""
    import structlog

    try:
        log.close()
    except Exception as exc:  # noqa: BLE001 - logged; the caller raises the error that matters
        structlog.get_logger("agentlog.serve").error("serve.log_close_failed", error=f"{type(exc).__name__}: {exc}")


async def _shut_down(gw, engine, backend, log, drain_s: float) -> list[str]:
    """Stop in order, each step whatever the one before it did: let in-flight
    turns finish for up to ``drain_s``; drop the sessions still live (reason
    ``shutdown``, which cancels their turns); stop listening; close the
    backend and the log. Returns the one-line failures (a failed log, say),
    each also logged; a step that fails never skips the ones after it."""
    import structlog

    log_ = structlog.get_logger("agentlog.serve")
    failures: list[str] = []

    async def step(name: str, action) -> None:
        try:
            result = action()
            if asyncio.iscoroutine(result):
                await result
        except Exception as exc:  # noqa: BLE001 - each failure is logged and reported; later steps still run
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            log_.error("serve.shutdown_step_failed", step=name, error=f"{type(exc).__name__}: {exc}")

    await step("drain", lambda: gw.drain(drain_s))
    await step("drop live sessions", engine.close)
    await step("stop listening", gw.stop)
    await step("close backend", backend.close)
    await step("close log", log.close)
    return failures


def run(args) -> int:
    """Serve until SIGINT/SIGTERM."""
    return asyncio.run(_serve(args))
