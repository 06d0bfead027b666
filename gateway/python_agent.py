"""The built-in Python tool-calling agent: the ``openai`` client, a ``bash`` tool, a loop.

It is what a user's own Python agent looks like: an ``AsyncOpenAI`` client
pointed at the gateway (``base_url = <gateway>/v1``, ``api_key = <the
session's key>``) that sends the task's messages with one function tool,
``bash``; runs each tool call the model makes in the session's sandbox
through ``SessionHandle.run_command`` (so every command is recorded as a
``command_ran`` event, as the CLI harnesses' runs are); appends the result
as a ``tool`` message; and asks again, until the model answers without a
tool call or a cap is reached. Every model call arrives at the gateway as a
recorded turn; the agent itself records nothing else.

How an episode ends (:attr:`AgentResult.stop_reason`):

* ``answered``: the model answered without a tool call;
* ``max_tool_calls``: ``max_tool_calls`` commands ran (a further call is not run);
* ``max_turns``: ``max_turns`` model calls were made;
* ``turn_cap``: the gateway refused the next turn with 429 (its per-session cap);
* ``context_exhausted``: the conversation no longer fits the model's
  context (the gateway's 400 ``context_length_exceeded``).

Malformed tool calls. When the model's text holds a tool call the gateway's
parser cannot read (bad JSON, an undeclared tool, an unterminated block), the
gateway records the turn with ``ill_formed`` and answers the text as plain
content with no tool call: for this agent that is a final answer, so the
episode ends (``answered``) and the verifier scores what is in the sandbox.
A call the parser accepts but that is not a usable ``bash`` call (arguments
without a string ``command``) is answered with an error ``tool`` message
naming what was expected, and the episode goes on; it counts against
``max_tool_calls``. Any other failure (the gateway unreachable, a 5xx, a 409
because the session ended) raises: the rollout aborts the session with
``agent_crashed:<exception type>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agentlog.engine import harness

from .api import ChatCompletionsAPI

#: The one tool the agent offers (OpenAI Chat Completions tools schema).
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the working directory; returns its exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the bash command to run"}},
            "required": ["command"],
        },
    },
}

STOP_REASONS = ("answered", "max_tool_calls", "max_turns", "turn_cap", "context_exhausted")


@dataclass
class AgentResult:
    """How a Python-agent episode ended."""

    #: One of :data:`STOP_REASONS`.
    stop_reason: str
    #: Model calls made (each one a recorded turn).
    turns: int
    #: Tool calls answered (commands run, plus malformed calls answered with an error).
    tool_calls: int
    #: The conversation as the agent holds it at the end (OpenAI message dicts).
    messages: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        """What the rollout records in the session's finish metadata."""
        return {"stop_reason": self.stop_reason, "turns": self.turns, "tool_calls": self.tool_calls}


def as_messages(prompt_or_messages: Any) -> list[dict[str, Any]]:
    """The conversation to start from: a list of chat messages as given, or
    one user message for a prompt string; anything else raises naming it."""
    if isinstance(prompt_or_messages, str):
        if not prompt_or_messages.strip():
            raise ValueError("python-agent prompt: expected a non-empty str or a list of chat messages, found an empty str")
        return [{"role": "user", "content": prompt_or_messages}]
    if isinstance(prompt_or_messages, list) and prompt_or_messages:
        out = []
        for i, m in enumerate(prompt_or_messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"python-agent messages[{i}]: expected a chat message dict with a 'role', found {m!r:.80}")
            out.append(dict(m))
        return out
    raise ValueError(f"python-agent prompt: expected a non-empty str or list of chat messages, found {prompt_or_messages!r:.80}")


def bash_command(name: str, arguments: str | None) -> tuple[str | None, str]:
    """``(command, "")`` for a usable ``bash`` call, else ``(None, why)``."""
    if name != "bash":
        return None, f"unknown tool {name!r}; the only tool is 'bash'"
    try:
        args = json.loads(arguments or "{}")
    except ValueError as exc:
        return None, f"bash arguments: expected a JSON object, found {arguments!r:.80} ({exc})"
    command = args.get("command") if isinstance(args, dict) else None
    if not isinstance(command, str) or not command.strip():
        return None, f'bash arguments: expected {{"command": "<non-empty string>"}}, found {arguments!r:.80}'
    return command, ""


def format_result(result: Any, limit: int) -> str:
    """A CommandResult as the tool message the model reads (output capped at ``limit`` characters, keeping the end)."""
    if result.budget_exceeded:
        head = f"timed out after {result.duration_s:.1f}s (killed)"
    elif result.exit_code is None:
        head = "no exit code reported"
    else:
        head = f"exit code {result.exit_code}"
    out = result.output_tail
    if len(out) > limit:
        out = "..." + out[-limit:]
    return f"{head}\n{out}" if out else head


def _openai() -> Any:
    """The openai module, or ImportError naming the extra that installs it."""
    try:
        import openai
    except ImportError:
        raise ImportError("harness 'python-agent' needs the openai client: pip install 'agentlog[agent]' (or openai>=1.40)") from None
    return openai


class PythonAgent:
    """The built-in tool-calling agent, talking to the gateway at ``gateway_url``."""

    name = "python-agent"

    def __init__(
        self,
        gateway_url: str,
        *,
        max_turns: int = 8,
        max_tool_calls: int = 16,
        max_tokens: int = 256,
        command_budget_s: float = 60.0,
        max_tool_output_chars: int = 2000,
        model: str = "agentlog",
        timeout_s: float = 600.0,
        budget_s: float = 300.0,
    ) -> None:
        for name, v in (("max_turns", max_turns), ("max_tool_calls", max_tool_calls), ("max_tokens", max_tokens),
                        ("max_tool_output_chars", max_tool_output_chars)):
            if type(v) is not int or v < 1:
                raise ValueError(f"harness 'python-agent': {name}: expected an int >= 1, found {v!r}")
        self.gateway_url = gateway_url.rstrip("/")
        self.max_turns = max_turns
        self.max_tool_calls = max_tool_calls
        self.max_tokens = max_tokens
        self.command_budget_s = command_budget_s
        self.max_tool_output_chars = max_tool_output_chars
        self.model = model
        self.timeout_s = timeout_s
        #: The session's wall-clock budget is the rollout's to enforce; kept for the common factory signature.
        self.budget_s = budget_s
        # One client (one connection pool) for every session this agent plays:
        # building an AsyncOpenAI costs tens of ms of CPU (its HTTP client's TLS
        # context), which 32 concurrent sessions would pay one after another.
        # Each session gets a copy with its own key that shares the pool.
        self._client: Any = None

    def check_ready(self) -> None:
        """Raise ImportError naming the extra to install when the openai client is missing
        (a run checks this once at start-up, not by aborting every session)."""
        _openai()

    async def run(self, handle: Any, sandbox: Any, prompt_or_messages: Any, api_key: str) -> AgentResult:
        """Start the session if it is open, then play the episode (see the
        module docstring); returns how it ended. Raises on any failure the
        episode cannot go on from."""
        openai = _openai()
        messages = as_messages(prompt_or_messages)
        if str(handle.state) == "open":
            await handle.start(harness=self.name, sandbox=getattr(sandbox, "name", ""), details={"gateway": self.gateway_url})
        client = self._client_for(openai, api_key)
        return await self._play(client, openai, handle, sandbox, messages, 0, 0)

    async def resume(self, handle: Any, sandbox: Any, messages: list[dict[str, Any]], api_key: str) -> AgentResult:
        """Continue a session a killed worker left running (the harness is registered
        resumable): ``messages`` is the conversation rebuilt from the log, ending with the
        last durable turn's answer, and ``sandbox`` was restored to the state that turn's
        request found. The answer's tool calls run again (their results before the crash
        were never sent to the model), then the episode goes on as :meth:`run` does. The
        caps count the model calls and tool calls the conversation already holds."""
        openai = _openai()
        # Recorded in the gateway's canonical form; sent again as this client sent them.
        messages = ChatCompletionsAPI.client_messages(as_messages(messages))
        last = messages[-1]
        if last.get("role") != "assistant":
            raise ValueError(f"harness {self.name!r}: resume: expected the conversation to end with the last durable turn's "
                             f"assistant answer, found a {last.get('role')!r} message")
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        tool_calls = sum(1 for m in messages if m.get("role") == "tool")
        client = self._client_for(openai, api_key)
        return await self._play(client, openai, handle, sandbox, messages, turns, tool_calls, answered=True)

    def _client_for(self, openai: Any, api_key: str) -> Any:
        """A client with the session's key, sharing one connection pool (made on first use)."""
        if not isinstance(api_key, str) or not api_key:
            raise ValueError(f"harness {self.name!r}: api_key: expected the session's key from the gateway, found {type(api_key).__name__}")
        if self._client is None:
            self._client = openai.AsyncOpenAI(base_url=self.gateway_url + "/v1", api_key=api_key, max_retries=0, timeout=self.timeout_s)
        return self._client.with_options(api_key=api_key)

    async def _play(self, client: Any, openai: Any, handle: Any, sandbox: Any, messages: list[dict[str, Any]], turns: int,
                    tool_calls: int, *, answered: bool = False) -> AgentResult:
        """The agent loop from ``turns`` model calls and ``tool_calls`` tool calls on.
        ``answered``: the last message is the model's answer, its tool calls still to run (a resume)."""
        while True:
            if not answered:
                if turns >= self.max_turns:
                    return AgentResult("max_turns", turns, tool_calls, messages)
                try:
                    resp = await client.chat.completions.create(
                        model=self.model, messages=messages, tools=[BASH_TOOL], max_tokens=self.max_tokens,
                    )
                except openai.RateLimitError:
                    return AgentResult("turn_cap", turns, tool_calls, messages)
                except openai.BadRequestError as exc:
                    if getattr(exc, "code", None) == "context_length_exceeded":
                        return AgentResult("context_exhausted", turns, tool_calls, messages)
                    raise
                turns += 1
                msg = resp.choices[0].message
                assistant: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
                if msg.tool_calls:
                    assistant["tool_calls"] = [
                        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                        for c in msg.tool_calls
                    ]
                messages.append(assistant)
            answered = False
            calls = messages[-1].get("tool_calls") or []
            if not calls:
                return AgentResult("answered", turns, tool_calls, messages)
            for call in calls:
                if tool_calls >= self.max_tool_calls:
                    return AgentResult("max_tool_calls", turns, tool_calls, messages)
                command, why = bash_command(call["function"]["name"], call["function"]["arguments"])
                if command is None:
                    content = f"error: {why}"
                else:
                    res = await handle.run_command(sandbox, command, self.command_budget_s)
                    content = format_result(res, self.max_tool_output_chars)
                tool_calls += 1
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})

    async def close(self) -> None:
        """Close the HTTP client shared by this agent's sessions (a later run opens a new one)."""
        if self._client is not None:
            await self._client.close()
            self._client = None


@harness.register("python-agent", resumable=True)
def python_agent(gateway_url: str, **kw: Any) -> PythonAgent:
    """Harness factory: the built-in Python tool-calling agent pointed at the gateway."""
    return PythonAgent(gateway_url, **kw)


__all__ = ["AgentResult", "BASH_TOOL", "PythonAgent", "STOP_REASONS", "as_messages", "python_agent"]
