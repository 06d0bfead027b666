"""Harnesses that run a real agent CLI in a sandbox, pointed at the gateway.

``claude-code`` runs Anthropic's Claude Code (``claude -p``) and ``codex``
runs OpenAI's Codex CLI (``codex exec``). Each is registered in the engine's
harness registry; the factory takes the gateway's base URL and returns a
:class:`CLIAgent` whose :meth:`CLIAgent.run` launches the CLI in the session's
sandbox through ``SessionHandle.run_command`` (so the run itself is recorded
as a ``command_ran`` event, with its exit code and output tail) while every
model call the CLI makes arrives at the gateway as a recorded turn.

The CLI's API key is the session's key from the gateway (the admin API's
``api_key``, or :meth:`gateway.Gateway.session_key`). It is a
credential, so it never appears in the command line (which ``command_ran``
records): it is written to a file only the user can read in the CLI's home
folder, and the command reads it from there.

The CLIs are installed from npm once per machine into a cache folder outside
the repository (``tools/gateway_clis.sh``); :func:`find_cli` looks there,
then on ``PATH``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import uuid
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any, Sequence

from agentlog.engine import harness

#: Where tools/gateway_clis.sh installs the CLIs (override: $AGENTLOG_CLI_DIR).
DEFAULT_CLI_DIR = Path(os.environ.get("AGENTLOG_CLI_DIR", Path.home() / ".cache" / "agentlog-clis"))


def find_cli(name: str) -> str | None:
    """Path of an agent CLI executable (``claude``, ``codex``), or None."""
    cached = DEFAULT_CLI_DIR / "node_modules" / ".bin" / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    return shutil.which(name)


class CLIAgent:
    """One agent CLI, configured to talk to the gateway at ``gateway_url``."""

    name = ""
    binary = ""

    def __init__(self, gateway_url: str, *, cli: str | None = None, budget_s: float = 300.0, model: str = "") -> None:
        self.gateway_url = gateway_url.rstrip("/")
        # Absolute: the CLI runs from the sandbox's workdir, not from where check_ready looked.
        self.cli = (os.path.abspath(cli) if os.path.isfile(cli) else shutil.which(cli) or cli) if cli else find_cli(self.binary)
        self.budget_s = budget_s
        self.model = model

    #: The CLI's home folder, under the sandbox's workdir.
    home_dir = ""

    def command(self, key_file: Path, workdir: Path, prompt: str, *, run_tag: str = "") -> str:
        """The shell command that runs the CLI once on ``prompt`` (stdin from
        /dev/null), its API key read from ``key_file``; ``run_tag`` marks every
        process of the run (see :func:`_kill_tagged`)."""
        raise NotImplementedError

    def check_ready(self) -> None:
        """Raise FileNotFoundError naming the install script when the CLI is missing or
        not executable (a run checks this once at start-up, not by aborting every session)."""
        if not self.cli:
            raise FileNotFoundError(f"harness {self.name!r}: {self.binary!r} not found in {DEFAULT_CLI_DIR} or on PATH; run tools/gateway_clis.sh")
        if not (os.path.isfile(self.cli) and os.access(self.cli, os.X_OK)):
            raise FileNotFoundError(f"harness {self.name!r}: the CLI {self.cli!r} is not an executable file; "
                                    f"expected {self.binary!r} as tools/gateway_clis.sh installs it")

    async def run(self, handle: Any, sandbox: Any, prompt_or_messages: Any, api_key: str) -> Any:
        """Start the session if it is open, run the CLI in ``sandbox`` under the
        budget with ``api_key`` (the session's key from the gateway), and
        return the engine's CommandResult (recorded as command_ran, without
        the key). ``prompt_or_messages`` is the prompt, or the task's chat
        messages (:func:`prompt_text` makes the CLI's one prompt of them).

        Raises FileNotFoundError naming the install script when the CLI is missing.
        """
        prompt = prompt_text(prompt_or_messages)
        self.check_ready()
        if not isinstance(api_key, str) or not api_key:
            raise ValueError(f"harness {self.name!r}: api_key: expected the session's key from the gateway, found {type(api_key).__name__}")
        workdir = Path(getattr(sandbox, "workdir", "."))
        key_file = _write_key(workdir / self.home_dir, api_key)
        tag = uuid.uuid4().hex
        try:
            if str(handle.state) == "open":
                await handle.start(harness=self.name, sandbox=getattr(sandbox, "name", ""), details={"gateway": self.gateway_url, "cli": self.cli})
            return await handle.run_command(sandbox, self.command(key_file, workdir, prompt, run_tag=tag), self.budget_s)
        finally:
            key_file.unlink(missing_ok=True)  # read once by the shell at the CLI's start
            # The sandbox killed the run's process group; the CLIs start their tools' shells in
            # sessions of their own, which only the run's tag in their environment still finds.
            _kill_tagged(tag)


    def model_stopped(self, result: Any) -> str | None:
        """Why a CLI that exited non-zero ended its run on the model's own
        outputs (the policy's doing, judged by the verifier like any answer;
        e.g. ``max_output_tokens``), or None when it crashed."""
        return None

    async def close(self) -> None:
        """Nothing to release (each run is its own process); here for the harnesses' common shape."""


#: The only built-in tools Claude Code 2.x offers in ``--bare`` mode (it sets CLAUDE_CODE_SIMPLE=1):
#: any other name in ``--tools`` is dropped without a word, the subagent tool ``Agent`` among them.
BARE_TOOLS = frozenset({"Bash", "Edit", "Read"})


class ClaudeCodeAgent(CLIAgent):
    """Claude Code in print mode: Anthropic Messages (always streaming) with ``x-api-key``.

    It runs ``--bare``: no CLAUDE.md discovery (which would read the folders
    above the sandbox), hooks, plugins or background prefetches, so a
    rollout's prompt depends on the task and these options only. Bare mode
    offers only :data:`BARE_TOOLS` and silently drops any other tool named;
    ``tools`` beyond them (``Agent``, its subagent tool, ``Write``, ``Grep``...)
    run ``--safe-mode`` instead, which also skips CLAUDE.md, skills, plugins,
    hooks, MCP servers and custom agents but keeps every built-in tool. ``tools``
    (``--tools``) limits the built-in tools it offers the model and
    ``system_prompt`` (``--system-prompt``) replaces its own: both are part of
    every model call (Claude Code's full default is ~76k characters per call).
    ``max_output_tokens`` (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``) is the output
    allowance it asks for (by default 64000)."""

    name = "claude-code"
    binary = "claude"
    home_dir = ".agentlog-home"

    def __init__(self, gateway_url: str, *, tools: Sequence[str] = (), system_prompt: str = "", max_output_tokens: int | None = None,
                 **kw: Any) -> None:
        super().__init__(gateway_url, **kw)
        bad = [t for t in tools if not isinstance(t, str) or not t.strip() or "," in t]
        if isinstance(tools, str) or bad:
            raise ValueError(f"harness 'claude-code': tools: expected a list of tool names such as ['Bash'], found {tools!r}")
        if max_output_tokens is not None and (type(max_output_tokens) is not int or max_output_tokens < 1):
            raise ValueError(f"harness 'claude-code': max_output_tokens: expected an int >= 1, found {max_output_tokens!r}")
        self.tools = list(tools)
        self.system_prompt = system_prompt
        self.max_output_tokens = max_output_tokens

    def command(self, key_file: Path, workdir: Path, prompt: str, *, run_tag: str = "") -> str:
        home = workdir / self.home_dir
        env = {
            "HOME": str(home),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),  # else a user's $CLAUDE_CONFIG_DIR gets the config and transcripts
            "ANTHROPIC_BASE_URL": self.gateway_url,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
            "DISABLE_AUTOUPDATER": "1",
            **_no_proxy(self.gateway_url),
        }
        if self.max_output_tokens is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_output_tokens)
        # Without a permission prompt in print mode, only the allowed tools run.
        allowed = ",".join(self.tools) if self.tools else "Bash"
        # Each of these options takes one argument (names joined by commas): a
        # variadic option followed by the prompt would swallow it.
        mode = "--bare" if set(self.tools) <= BARE_TOOLS else "--safe-mode"
        args = [self.cli, "-p", prompt, "--output-format", "json", mode, "--allowedTools", allowed]
        if self.tools:
            args += ["--tools", ",".join(self.tools)]
        if self.system_prompt:
            args += ["--system-prompt", self.system_prompt]
        if self.model:
            args += ["--model", self.model]
        return _env_command(env, {"ANTHROPIC_API_KEY": key_file}, args, home, run_tag)  # arrives as x-api-key

    def model_stopped(self, result: Any) -> str | None:
        """``max_output_tokens`` when Claude Code gave up on the model's over-long answers (see :func:`_claude_stopped`)."""
        return _claude_stopped(getattr(result, "output_tail", "") or "")


class CodexAgent(CLIAgent):
    """Codex ``exec`` with a custom Responses-API provider (it ignores OPENAI_BASE_URL)."""

    name = "codex"
    binary = "codex"
    home_dir = ".agentlog-codex-home"

    def __init__(self, gateway_url: str, **kw: Any) -> None:
        kw.setdefault("model", "gpt-4.1")  # a model family that gets the plain function-tool set
        super().__init__(gateway_url, **kw)

    def command(self, key_file: Path, workdir: Path, prompt: str, *, run_tag: str = "") -> str:
        home = workdir / self.home_dir
        provider = (
            f'model_providers.gw={{name="gw", base_url="{self.gateway_url}/v1", env_key="OPENAI_API_KEY",'
            ' wire_api="responses", request_max_retries=0, stream_max_retries=0}'
        )
        env = {"CODEX_HOME": str(home), "HOME": str(home), **_no_proxy(self.gateway_url)}
        args = [
            self.cli, "exec", "--skip-git-repo-check", "-m", self.model,
            "-c", "model_provider=gw", "-c", provider, "-c", "analytics.enabled=false",
            "--disable", "plugins", "--dangerously-bypass-approvals-and-sandbox", prompt,
        ]
        return _env_command(env, {"OPENAI_API_KEY": key_file}, args, home, run_tag)  # arrives as Authorization: Bearer


#: Claude Code's final message when the model's outputs kept hitting its output allowance.
_CLAUDE_OUTPUT_LIMIT = "output token maximum"


def _claude_stopped(output_tail: str) -> str | None:
    """``max_output_tokens`` when Claude Code's JSON result (the last line of
    its output) says the model's answers kept running past the output
    allowance: it retries with "continue" requests, then gives up with exit
    1. Any other end (an HTTP error, no result at all) is None."""
    lines = [ln for ln in output_tail.strip().splitlines() if ln.startswith("{")]
    if not lines:
        return None
    try:
        res = json.loads(lines[-1])
    except (ValueError, RecursionError):  # garbage, or JSON nested past the decoder's stack
        return None
    if (isinstance(res, dict) and res.get("type") == "result" and res.get("is_error") and res.get("api_error_status") is None
            and _CLAUDE_OUTPUT_LIMIT in str(res.get("result", ""))):
        return "max_output_tokens"
    return None


def prompt_text(prompt_or_messages: Any) -> str:
    """The one prompt a CLI agent takes: a str as it is, or the contents of
    chat messages (system and user ones; the CLI brings its own system
    prompt, so a task's system message becomes part of the prompt) joined by
    blank lines. Anything else raises naming what was found."""
    if isinstance(prompt_or_messages, str):
        return prompt_or_messages
    if isinstance(prompt_or_messages, list):
        parts = []
        for i, m in enumerate(prompt_or_messages):
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                raise ValueError(f"agent prompt messages[{i}]: expected a chat message with str content, found {m!r:.80}")
            if m.get("role") in ("system", "user") and m.get("content"):
                parts.append(m["content"])
        if parts:
            return "\n\n".join(parts)
    raise ValueError(f"agent prompt: expected a str or chat messages with system/user content, found {prompt_or_messages!r:.80}")


def _no_proxy(gateway_url: str) -> dict[str, str]:
    """NO_PROXY / no_proxy extended with the gateway's host. A sandbox that
    reaches the internet through HTTP(S)_PROXY (a CI runner, a locked-down
    cluster) must still reach the gateway directly: the proxy cannot reach
    a loopback gateway, and the turns are the gateway's to see."""
    host = urlsplit(gateway_url).hostname or ""
    held = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    value = ",".join(x for x in (held, host) if x)
    return {"NO_PROXY": value, "no_proxy": value}


def _write_key(home: Path, api_key: str) -> Path:
    """Write the session's key to ``home/.agentlog-api-key``, readable by the
    user only (created with mode 0600, never group- or world-readable)."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / ".agentlog-api-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(api_key)
    return path


#: What a CLI keeps of the sandbox's environment (``env -i`` drops the rest): the user's
#: credentials, config folders (CLAUDE_CONFIG_DIR) and provider switches never reach it.
PASSED_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL",
              "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy",
              "SSL_CERT_FILE", "SSL_CERT_DIR", "NODE_EXTRA_CA_CERTS")

#: The variable that tags every process of one CLI run (:func:`_kill_tagged`).
RUN_TAG_VAR = "AGENTLOG_AGENT_RUN"


def _env_command(env: dict[str, str], secrets: dict[str, Path], args: list[str], home: Path, run_tag: str = "") -> str:
    """A clean environment (:data:`PASSED_ENV` of the sandbox's, a temp folder in
    ``home``), ``env`` assignments, then each of ``secrets`` read from its file by
    the shell, so the command text (recorded) holds only the file's path."""
    tmp = home / "tmp"
    env = {"TMPDIR": str(tmp), **env, **({RUN_TAG_VAR: run_tag} if run_tag else {})}
    assigns = " ".join(f'${{{k}+{k}="${k}"}}' for k in PASSED_ENV)
    assigns += "".join(f" {k}={shlex.quote(v)}" for k, v in env.items())
    assigns += "".join(f' {k}="$(cat {shlex.quote(str(path))})"' for k, path in secrets.items())
    return f"mkdir -p {shlex.quote(str(tmp))} && env -i {assigns} {' '.join(shlex.quote(a) for a in args)} < /dev/null"


def _kill_tagged(tag: str, rounds: int = 50) -> None:
    """SIGKILL every process whose environment carries ``RUN_TAG_VAR=tag`` (Linux'
    /proc; elsewhere nothing), again while a round finds one not killed yet (a
    process may fork between the read and the kill)."""
    if not tag or not os.path.isdir("/proc"):
        return
    needle = f"\0{RUN_TAG_VAR}={tag}\0".encode()
    killed: set[int] = set()
    for _ in range(rounds):
        new = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in killed:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    environ = f.read()
            except OSError:  # gone, or not ours to read
                continue
            if needle in b"\0" + environ + b"\0":
                try:
                    os.kill(int(name), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue
                killed.add(int(name))
                new = True
        if not new:
            return


@harness.register("claude-code")
def claude_code(gateway_url: str, **kw: Any) -> ClaudeCodeAgent:
    """Harness factory: Claude Code pointed at the gateway."""
    return ClaudeCodeAgent(gateway_url, **kw)


@harness.register("codex")
def codex(gateway_url: str, **kw: Any) -> CodexAgent:
    """Harness factory: the Codex CLI pointed at the gateway."""
    return CodexAgent(gateway_url, **kw)
