"""The recording gateway: OpenAI- and Anthropic-compatible endpoints whose every turn is an event.

Agent CLIs (Claude Code, Codex, anything speaking Chat Completions, the
Responses API or Anthropic Messages) point at the gateway with their API key
set to their session's key (``Gateway.session_key(id)``, or the admin API's
``api_key``); each request becomes one ``turn_recorded`` event through the
engine, made durable before the response is sent.

Public API::

    from agentlog.gateway import Gateway, GatewayConfig, TorchBackend, SGLangBackend, OpenAICompletionsBackend
    gw = Gateway(engine, TorchBackend(model))   # model: e.g. learner.model.GPT, built by the caller
    url = await gw.start("127.0.0.1", 0)
"""

from .api import APIS, ChatCompletionsAPI, MessagesAPI, ResponsesAPI, TurnRequest, TurnResult
from .backends import Backend, BackendError, Generation, OpenAICompletionsBackend, SamplingParams, SGLangBackend, TorchBackend
from .chat import (
    ByteChatTemplate,
    ChatTemplate,
    HermesToolParser,
    HFChatTemplate,
    NoToolParser,
    ParsedOutput,
    RequestError,
    ToolCallParser,
    ToolSpec,
    tool_parser,
)
from .server import Gateway, GatewayConfig
from . import agents  # noqa: F401,E402  (registers the claude-code and codex harnesses)
from . import python_agent  # noqa: F401,E402  (registers the python-agent harness)

__all__ = [
    "APIS", "Backend", "BackendError", "ByteChatTemplate", "ChatCompletionsAPI", "ChatTemplate", "Gateway",
    "GatewayConfig", "Generation", "HFChatTemplate", "HermesToolParser", "MessagesAPI", "NoToolParser",
    "OpenAICompletionsBackend", "ParsedOutput", "RequestError", "ResponsesAPI", "SGLangBackend", "SamplingParams",
    "ToolCallParser", "ToolSpec", "TorchBackend", "TurnRequest", "TurnResult", "tool_parser",
]
