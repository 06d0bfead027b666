"""Harnesses that run a real agent CLI in a sandbox, pointed at the gateway.

``claude-code`` runs Anthropic's Claude Code (``claude -p``) and ``codex``
runs OpenAI's Codex CLI (``codex exec``). Each is registered in the engine's
harness registry; the factory takes the gateway's base URL and returns a
:class:`CLIAgent` whose :meth:`CLIAgent.run` launches the CLI in the session's
sandbox through ``SessionHandle.run_command`` (so the run itself is recorded
as a ``command_ran`` event, with its exit code and output tail) while every
model call the CLI makes arrives at the gateway as a recorded turn.

The CLIs are installed from npm once per machine into a cache folder outside
the repository (``tools/gateway_clis.sh``); :func:`find_cli` looks there,
then on ``PATH``.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any

from engine import harness

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
        self.cli = cli or find_cli(self.binary)
        self.budget_s = budget_s
        self.model = model

    def command(self, session_id: str, workdir: Path, prompt: str) -> str:
        """The shell command that runs the CLI once on ``prompt`` (stdin from /dev/null)."""
        raise NotImplementedError

    async def run(self, handle: Any, sandbox: Any, prompt: str) -> Any:
        """Start the session if it is open, run the CLI in ``sandbox`` under the
        budget, and return the engine's CommandResult (recorded as command_ran).

        Raises FileNotFoundError naming the install script when the CLI is missing.
        """
        if not self.cli:
            raise FileNotFoundError(f"harness {self.name!r}: {self.binary!r} not found in {DEFAULT_CLI_DIR} or on PATH; run tools/gateway_clis.sh")
        workdir = Path(getattr(sandbox, "workdir", "."))
        if str(handle.state) == "open":
            await handle.start(harness=self.name, sandbox=getattr(sandbox, "name", ""), details={"gateway": self.gateway_url, "cli": self.cli})
        return await handle.run_command(sandbox, self.command(handle.session_id, workdir, prompt), self.budget_s)


class ClaudeCodeAgent(CLIAgent):
    """Claude Code in print mode: Anthropic Messages (always streaming) with ``x-api-key``."""

    name = "claude-code"
    binary = "claude"

    def command(self, session_id: str, workdir: Path, prompt: str) -> str:
        home = workdir / ".agentlog-home"
        env = {
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": self.gateway_url,
            "ANTHROPIC_API_KEY": session_id,  # arrives as x-api-key: the session id
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
            "DISABLE_AUTOUPDATER": "1",
            **_no_proxy(self.gateway_url),
        }
        args = [self.cli, "-p", prompt, "--output-format", "json", "--allowedTools", "Bash"]
        if self.model:
            args += ["--model", self.model]
        return _env_command(env, args, home)


class CodexAgent(CLIAgent):
    """Codex ``exec`` with a custom Responses-API provider (it ignores OPENAI_BASE_URL)."""

    name = "codex"
    binary = "codex"

    def __init__(self, gateway_url: str, **kw: Any) -> None:
        kw.setdefault("model", "gpt-4.1")  # a model family that gets the plain function-tool set
        super().__init__(gateway_url, **kw)

    def command(self, session_id: str, workdir: Path, prompt: str) -> str:
        home = workdir / ".agentlog-codex-home"
        provider = (
            f'model_providers.gw={{name="gw", base_url="{self.gateway_url}/v1", env_key="OPENAI_API_KEY",'
            ' wire_api="responses", request_max_retries=0, stream_max_retries=0}'
        )
        env = {"CODEX_HOME": str(home), "HOME": str(home), "OPENAI_API_KEY": session_id, **_no_proxy(self.gateway_url)}
        args = [
            self.cli, "exec", "--skip-git-repo-check", "-m", self.model,
            "-c", "model_provider=gw", "-c", provider, "-c", "analytics.enabled=false",
            "--disable", "plugins", "--dangerously-bypass-approvals-and-sandbox", prompt,
        ]
        return _env_command(env, args, home)


def _no_proxy(gateway_url: str) -> dict[str, str]:
    """NO_PROXY / no_proxy extended with the gateway's host. A sandbox that
    reaches the internet through HTTP(S)_PROXY (a CI runner, a locked-down
    cluster) must still reach the gateway directly: the proxy cannot reach
    a loopback gateway, and the turns are the gateway's to see."""
    host = urlsplit(gateway_url).hostname or ""
    held = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    value = ",".join(x for x in (held, host) if x)
    return {"NO_PROXY": value, "no_proxy": value}


def _env_command(env: dict[str, str], args: list[str], home: Path) -> str:
    assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"mkdir -p {shlex.quote(str(home))} && env {assigns} {' '.join(shlex.quote(a) for a in args)} < /dev/null"


@harness.register("claude-code")
def claude_code(gateway_url: str, **kw: Any) -> ClaudeCodeAgent:
    """Harness factory: Claude Code pointed at the gateway."""
    return ClaudeCodeAgent(gateway_url, **kw)


@harness.register("codex")
def codex(gateway_url: str, **kw: Any) -> CodexAgent:
    """Harness factory: the Codex CLI pointed at the gateway."""
    return CodexAgent(gateway_url, **kw)
